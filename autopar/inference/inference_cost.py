"""Seconds and bytes of generation under a (tp, pp, dp, batch) configuration, on the training
planner's cost model (autopar/pricing/cost.py: GEMMs at the profile's rate for their arithmetic
intensity, memory-bound kernels at its bandwidth, collectives at its bus bandwidth and latency).

What is priced is what the engine runs (autopar/inference/engine.py): Megatron tensor parallelism
of each decoder layer (q/k/v and the MLP's gate/up column-parallel, o and down row-parallel with
an all-reduce each, so 2 all-reduces a layer); embeddings whole on every rank; the LM head
vocabulary-parallel when it is not tied to the embeddings, else whole.

**The vocabulary-parallel head** (``Pricer.head``) is priced as both engines run it greedy (the
default): each rank's slice of the logits, then a distributed argmax whose all-gather carries 2
float64 numbers (value, index) per row per rank (autopar/inference/vocab_parallel.py). Sampling
runs otherwise and is not priced: the continuous-batching engine gathers 2 k numbers per row per
rank for top-k (the whole row for top_k 0), the static engine all-gathers the whole logits
[rows, V] for Hugging Face's warpers; ``Pricer(..., gathered_logits=True)`` prices that gather.

- **Prefill** (time to first token): the prompt's forward, one replica's batch B x S tokens. Per
  layer: the four projections and the MLP as GEMMs of [B S, H] by the rank's slice, causal
  attention (half of the S x S scores), ~10 memory-bound passes over [B S, H] (norms, residuals,
  rotary), two all-reduces of [B S, H]; then the LM head on the last position. Stages run one after
  the other for one batch, plus a hop of [B S, H] between stages.
- **Decode** (time per output token): one token per sequence. Memory-bound: each projection reads
  its weight slice (MoE: the experts the batch touches, E (1 - (1 - k/E)^B) under uniform routing), attention reads the
  rank's KV cache at the mean context S + T / 2, two latency-bound all-reduces of [B, H] per
  layer, the LM head reads its whole weight; every kernel pays the profile's launch overhead.
- **Memory per rank**: weights (layers / (tp pp) + the rest whole), the KV cache (``kv_bytes``),
  and the prefill's working set (the largest activations of one layer plus the logits in fp32).

**Stages.** A pipelined (pp > 1) configuration splits the layers over ``pp`` stages
(``stage_layers``); a stage's time for one batch is its layers, plus the LM head on the last stage
and the point-to-point send of the batch's hidden states on the others (``prefill_stages``,
``decode_stages``). ``prefill`` and ``decode`` are one batch's pass through all the stages, their
sum: what autopar's engine runs (one batch crosses the stages per step, autopar/inference/
pp_stages.py), and a request's own latency in any case.

**Stages in flight** (``prefill_in_flight``, ``decode_in_flight``): a server that keeps one
micro-batch per stage in flight (vLLM's pipeline-parallel virtual engines, Vidur's replica
scheduler) starts a micro-batch's iteration whenever the first stage is free. With ``pp``
micro-batches in flight the replica completes an iteration every slowest stage's time (its send
included), and each micro-batch's own iteration takes its pass through the stages, or ``pp`` turns
of the slowest stage when the stages are uneven: ``in_flight_cycle`` = max(sum of the stages, pp x
the slowest). With even stages that is the pass itself: a request's time per token is unchanged
and the replica serves pp times the micro-batches, so pp times the tokens per second of one batch
at a time. The continuous-batching simulation (autopar/inference/continuous.py) prices its
iterations this way.

**Mixed iterations** (``mixed``, ``mixed_stages``, ``mixed_in_flight``: chunked prefill,
``simulate_chunked`` of autopar/inference/continuous.py): one iteration runs prompt chunks (each
``tokens`` of a prompt whose first ``past`` tokens are already in the KV cache) and the decode step
of ``decodes`` running requests as one batch of T = chunk tokens + decodes rows, as Sarathi-Serve
and vLLM's chunked prefill run it. Per layer: the projections and the MLP are GEMMs of [T, H] by
the rank's slice, so the weights are read once for the whole iteration (a sum of a prefill price
and a decode price would read them twice: an upper bound); the chunks' attention is compute at
the prefill's rate, each chunk token against its prompt's past and the causal half of its own
chunk (``tokens x (past + tokens / 2)`` score pairs), reading the chunk's queries and outputs and
``past + tokens`` cached keys and values; the decodes' attention reads their KV cache at their
mean context, as ``decode`` prices it; the memory-bound passes and the two all-reduces are of
[T, H]; the LM head runs on one position per chunk and per decode; the stage hop sends [T, H]. A
single chunk of a whole prompt with no decodes is ``prefill(1, prompt)``, no chunk at all is
``decode(decodes, context)``: the same terms.

**Host overhead** (``Pricer.host``): each stage of each iteration (a prefill, a decode step, a
mixed iteration) is one forward of the model's modules, and the host runs Python for each of
them: ``host_layer_overhead`` x the stage's decoder layers + ``host_forward_overhead`` (the
device's figures, autopar/hardware.py). On a CPU (``host_synchronous``) one thread runs both the
Python and the kernels, so the host's time adds to the kernels'; on a GPU the kernels launch
asynchronously and the host runs ahead of them, so a stage takes max(host, kernels), the usual
model of launch-bound steps. The figures default to 0 (every preset's prices are what they
were: no source measured Hugging Face's modules' host time on the GPUs, and a cluster file does not
carry the fields yet); ``cluster_presets.cpu_host_device`` sets a CPU's, measured on this machine
by autopar/execution/calibrate_forward.py (a tiny Llama's decode steps as the iteration engine
runs them, where kernels cost ~nothing). With them it sets a floor under skinny GEMMs
(``skinny_gemm_bandwidth`` / ``skinny_gemm_flops``, ``Pricer.gemm``): a decode step's projections
read weights that are not in cache, at a few GB/s on this machine, where the memory-bound table
(an elementwise add over one hot buffer) says ~30.
"""
from __future__ import annotations

from autopar.cluster import Cluster
from autopar.inference.model_shape import ModelShape
from autopar.mesh import Mesh
from autopar.pricing.cost import Collectives, compute_time, gemm_intensity, profile_of
from autopar.pricing.pipeline_cost import boundary_p2p_time

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
SKINNY_ROWS = 256         # Pricer.gemm: below, a GEMM is priced at the roofline (decode's GEMV-like shapes)
ARGMAX_ITEMSIZE = 8       # the distributed argmax's (value, index) pairs cross the group as float64
ELEMENTWISE_PASSES = 10   # norms, residual adds, rotary, activations: reads + writes of [tokens, H] a layer


def kv_bytes(m: ModelShape, tp: int, layers: range, batch: int, context: int, dtype: str) -> int:
    """The KV cache one rank preallocates for its ``layers``: 2 (k, v) x batch x the positions each
    layer keeps (context, or its sliding window) x kv_heads / tp x head_dim x bytes."""
    positions = sum(m.cache_positions(i, context) for i in layers)
    return 2 * batch * positions * (m.kv_heads // tp) * m.head_dim * ITEMSIZE[dtype]


def stage_layers(layers: int, pp: int) -> list[list[int]]:
    """[first, end) decoder layers of each of ``pp`` stages: as even as can be, the first stages
    taking one more when ``pp`` does not divide ``layers``."""
    base, extra = divmod(layers, pp)
    out, start = [], 0
    for k in range(pp):
        end = start + base + (1 if k < extra else 0)
        out.append([start, end])
        start = end
    return out


def in_flight_cycle(stage_times) -> float:
    """One micro-batch's iteration when as many micro-batches as stages are in flight: its own pass
    (the sum of the stages' times), or, when the stages are uneven, as many turns of the slowest
    stage as there are stages (each micro-batch waits its turn there)."""
    return max(sum(stage_times), len(stage_times) * max(stage_times))


def experts_touched(m: ModelShape, tokens: float) -> float:
    """Experts a layer reads for ``tokens`` tokens routed uniformly at random, k each:
    E (1 - (1 - k/E)^tokens); 1 for a dense model."""
    if m.experts <= 1:
        return 1.0
    return m.experts * (1 - (1 - m.experts_per_token / m.experts) ** tokens)


def head_split(m: ModelShape, tp: int) -> bool:
    """Whether the engine splits the LM head over the vocabulary (untied, tp dividing the vocabulary)."""
    return tp > 1 and m.split_head > 0 and m.vocab % tp == 0


def weight_bytes(m: ModelShape, tp: int, pp: int, dtype: str) -> float:
    head = m.split_head * (1 - 1 / tp) if head_split(m, tp) else 0
    return (m.layer_params / (tp * pp) + m.other_params - head) * ITEMSIZE[dtype]


class Pricer:
    """Prices for one cluster and dtype; ``mesh(tp, dp)`` places tp inside a node."""

    def __init__(self, cluster: Cluster, m: ModelShape, dtype: str, gathered_logits: bool = False):
        self.cluster, self.m, self.dtype = cluster, m, dtype
        self.gathered_logits = gathered_logits   # the head's whole logits all-gathered (module doc)
        self.b = ITEMSIZE[dtype]
        self.cal = profile_of(cluster)
        self.device = cluster.device

    def gemm(self, rows: float, k: float, n: float) -> float:
        """A [rows, k] x [k, n] GEMM. Skinny ones (decode: rows < ``SKINNY_ROWS``) at the roofline:
        their weight's bytes at the memory-bound rate, or their FLOPs at the GEMM curve's best rate
        (the curve's low-intensity end was measured on small square GEMMs, which latency bounds, and
        prices a GEMV over a large weight several times slower than HBM streams it); at least
        bytes / ``skinny_gemm_bandwidth`` + FLOPs / ``skinny_gemm_flops`` where the device gives
        them (a CPU's measured pass over uncached weights, autopar/execution/calibrate_forward.py:
        the memory-bound table, timed on one hot buffer, prices it several times too fast)."""
        if rows <= 0 or k <= 0 or n <= 0:
            return 0.0
        flops = 2.0 * rows * k * n
        nbytes = self.b * (rows * k + k * n + rows * n)
        if rows < SKINNY_ROWS:
            best = max(r for _, r in self.cal.gemm) if self.cal is not None else self.device.peak(self.dtype)
            t = max(self.memory_bound(nbytes), flops / best + self.device.kernel_overhead)
            bw, rate = self.device.skinny_gemm_bandwidth, self.device.skinny_gemm_flops
            if bw > 0:   # the device's measured floor for skinny GEMMs over uncached weights
                t = max(t, nbytes / bw + (flops / rate if rate > 0 else 0.0))
            return t
        ai = gemm_intensity({"m": rows, "k": k, "n": n}, ["mk", "kn", "mn"], self.b)
        return compute_time(flops, nbytes, self.dtype, self.device, intensity=ai, calibration=self.cal)

    def memory_bound(self, nbytes: float, flops: float = 0.0) -> float:
        return compute_time(flops, nbytes, self.dtype, self.device, calibration=self.cal)

    def all_reduce(self, nbytes: float, tp: int) -> float:
        if tp <= 1:
            return 0.0
        mesh = Mesh((self.cluster.num_devices // tp, tp), ("dp", "tp"), self.cluster.devices_per_node)
        return Collectives(self.cluster, mesh)("all_reduce", nbytes, 1)

    def hop(self, nbytes: float, tp: int, pp: int) -> float:
        """One stage-to-stage send: stage k's first rank is k x (devices / pp)."""
        if pp <= 1:
            return 0.0
        return boundary_p2p_time(self.cluster, nbytes, 0, self.cluster.num_devices // pp)

    def head(self, rows: float, tp: int) -> float:
        """The LM head on ``rows`` positions, whole, or vocabulary-parallel followed by the
        distributed argmax's all-gather of 2 float64 numbers per row per rank (the whole logits,
        rows x V, with ``gathered_logits``: module doc)."""
        m = self.m
        if not head_split(m, tp):
            return self.gemm(rows, m.hidden, m.vocab)
        mesh = Mesh((self.cluster.num_devices // tp, tp), ("dp", "tp"), self.cluster.devices_per_node)
        gathered = rows * m.vocab * self.b if self.gathered_logits else rows * 2 * tp * ARGMAX_ITEMSIZE
        return self.gemm(rows, m.hidden, m.vocab / tp) + Collectives(self.cluster, mesh)("all_gather", gathered, 1)

    def layer_gemms(self, tokens: float, tp: int, experts_read: float) -> float:
        m = self.m
        qkv = self.gemm(tokens, m.hidden, (m.heads + 2 * m.kv_heads) * m.head_dim / tp)
        o = self.gemm(tokens, m.heads * m.head_dim / tp, m.hidden)
        if m.experts > 1:   # each token's k experts: the same FLOPs as k dense MLPs of its tokens
            mlp = experts_read * (self.gemm(tokens * m.experts_per_token / experts_read, m.hidden,
                                            2 * m.intermediate / tp)
                                  + self.gemm(tokens * m.experts_per_token / experts_read, m.intermediate / tp,
                                              m.hidden))
        else:
            mlp = self.gemm(tokens, m.hidden, 2 * m.intermediate / tp) + self.gemm(tokens, m.intermediate / tp,
                                                                                   m.hidden)
        return qkv + o + mlp

    def prefill(self, tp: int, pp: int, batch: int, prompt: int) -> float:
        """Time to first token of one batch of ``batch`` prompts of ``prompt`` tokens: its pass
        through every stage (module doc)."""
        return sum(self.prefill_stages(tp, pp, batch, prompt))

    def decode(self, tp: int, pp: int, batch: int, context: float) -> float:
        """One decode step of one batch (time per output token): its pass through every stage."""
        return sum(self.decode_stages(tp, pp, batch, context))

    def prefill_in_flight(self, tp: int, pp: int, batch: int, prompt: int) -> float:
        """A prefill's time when ``pp`` micro-batches are in flight (module doc, "Stages in flight")."""
        return in_flight_cycle(self.prefill_stages(tp, pp, batch, prompt))

    def decode_in_flight(self, tp: int, pp: int, batch: int, context: float) -> float:
        """A micro-batch's decode step when ``pp`` micro-batches are in flight (module doc)."""
        return in_flight_cycle(self.decode_stages(tp, pp, batch, context))

    def mixed(self, tp: int, pp: int, chunks: tuple, decodes: int, context: float) -> float:
        """One mixed iteration of chunked prefill (module doc, "Mixed iterations"): ``chunks``
        ((tokens, past) of each prompt chunk) and ``decodes`` decode steps at mean ``context``, its
        pass through every stage."""
        return sum(self.mixed_stages(tp, pp, chunks, decodes, context))

    def mixed_in_flight(self, tp: int, pp: int, chunks: tuple, decodes: int, context: float) -> float:
        """A micro-batch's mixed iteration when ``pp`` micro-batches are in flight (module doc)."""
        return in_flight_cycle(self.mixed_stages(tp, pp, chunks, decodes, context))

    def mixed_stages(self, tp: int, pp: int, chunks: tuple, decodes: int, context: float) -> list[float]:
        m, b = self.m, self.b
        chunk = sum(tokens for tokens, _ in chunks)
        rows = chunk + decodes
        memo = self.__dict__.setdefault("_mixed_memo", {})   # the terms of T rows, of a decode context
        key = ("rows", tp, pp, rows)
        if key not in memo:   # the GEMMs (the weights read once), memory-bound passes, all-reduces, hop
            memo[key] = (self.layer_gemms(rows, tp, experts_touched(m, rows))
                         + self.memory_bound(ELEMENTWISE_PASSES * rows * m.hidden * b)
                         + 2 * self.all_reduce(rows * m.hidden * b, tp), self.hop(rows * m.hidden * b, tp, pp))
        layer, hop = memo[key]
        heads = m.heads / tp
        if chunks:   # causal attention of each chunk over its prompt's past and itself
            pairs = sum(tokens * (past + tokens * 0.5) for tokens, past in chunks)
            keys = sum(past + tokens for tokens, past in chunks)
            flops = 2 * 2 * heads * pairs * m.head_dim
            nbytes = b * m.head_dim * (2 * heads * chunk + 2 * m.kv_heads / tp * keys)
            layer += compute_time(flops, nbytes, self.dtype, self.device, intensity=flops / max(nbytes, 1),
                                  calibration=self.cal)
        if decodes:   # the decodes read their KV cache, as decode_stages
            ckey = ("context", context)
            if ckey not in memo:
                memo[ckey] = sum(m.cache_positions(i, context) for i in range(m.layers)) / m.layers
            ctx = memo[ckey]
            layer += self.memory_bound(2 * decodes * ctx * (m.kv_heads / tp) * m.head_dim * b,
                                       flops=4 * decodes * heads * ctx * m.head_dim)
        hkey = ("head", tp, decodes + len(chunks))
        if hkey not in memo:
            memo[hkey] = self.head(decodes + len(chunks), tp)
        return self._stage_times(pp, layer, memo[hkey], hop)

    def host(self, layers: int) -> float:
        """Host (Python, dispatch) seconds of one stage's forward over ``layers`` decoder layers
        (module doc, "Host overhead"): the device's per-layer figure x layers + its per-forward one."""
        return layers * self.device.host_layer_overhead + self.device.host_forward_overhead

    def _stage_times(self, pp: int, layer: float, head: float, hop: float) -> list[float]:
        """Each stage's busy time for one batch: its layers, the LM head on the last stage, the
        send to the next stage on the others; their sum is the batch's pass. With the host's
        work of the stage's forward (``host``): added (a synchronous device), or the larger of
        the two (kernels launched asynchronously, the host running ahead)."""
        last = pp - 1
        out = []
        for k, (start, end) in enumerate(stage_layers(self.m.layers, pp)):
            kernels = (end - start) * layer + (head if k == last else hop)
            host = self.host(end - start)
            out.append(kernels + host if self.device.host_synchronous else max(kernels, host))
        return out

    def prefill_stages(self, tp: int, pp: int, batch: int, prompt: int) -> list[float]:
        m = self.m
        tokens = batch * prompt
        experts_read = experts_touched(m, tokens)
        heads = m.heads / tp
        attn_flops = 2 * 2 * batch * heads * prompt * prompt * m.head_dim * 0.5   # causal
        attn_bytes = self.b * batch * prompt * m.head_dim * (heads + 2 * m.kv_heads / tp + heads)
        layer = (self.layer_gemms(tokens, tp, experts_read)
                 + compute_time(attn_flops, attn_bytes, self.dtype, self.device,
                                intensity=attn_flops / max(attn_bytes, 1), calibration=self.cal)
                 + self.memory_bound(ELEMENTWISE_PASSES * tokens * m.hidden * self.b)
                 + 2 * self.all_reduce(tokens * m.hidden * self.b, tp))
        return self._stage_times(pp, layer, self.head(batch, tp), self.hop(tokens * m.hidden * self.b, tp, pp))

    def decode_stages(self, tp: int, pp: int, batch: int, context: float) -> list[float]:
        m = self.m
        experts_read = experts_touched(m, batch)
        context = sum(m.cache_positions(i, context) for i in range(m.layers)) / m.layers
        layer = (self.layer_gemms(batch, tp, experts_read)
                 + self.memory_bound(2 * batch * context * (m.kv_heads / tp) * m.head_dim * self.b,
                                     flops=4 * batch * (m.heads / tp) * context * m.head_dim)
                 + self.memory_bound(ELEMENTWISE_PASSES * batch * m.hidden * self.b)
                 + 2 * self.all_reduce(batch * m.hidden * self.b, tp))
        return self._stage_times(pp, layer, self.head(batch, tp), self.hop(batch * m.hidden * self.b, tp, pp))

    def workspace(self, tp: int, batch: int, prompt: int) -> float:
        m = self.m
        tokens = batch * prompt
        widest = max(3 * m.hidden, (m.heads + 2 * m.kv_heads) * m.head_dim / tp + m.hidden,
                     2 * m.intermediate * max(1, m.experts_per_token) / tp + m.hidden)
        return 2 * tokens * widest * self.b + batch * m.vocab * 4
