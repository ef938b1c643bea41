"""The declarative form of an op rule: an einsum-like annotation of one traced node.

Every tensor dimension gets a letter. A letter shared by an input and the output is a free
dimension: splitting it splits both, no communication. A letter on inputs only is contracted:
splitting it leaves the output a partial sum over that mesh axis (when ``reduce == "sum"``).
Letters in ``unsplittable`` are never split (the normalised dim of a layer norm, the softmax
dim, a view dim that is not the leading dim of its merged group). Letters in ``special`` may be
split only through a named algorithm that costs extra communication (vocab-parallel
cross-entropy); see ``extra_comm``.

Merged and split views use the leading-dim convention: a view ``b s h -> (b s) h`` is written
``bsh -> bh`` with ``s`` unsplittable: splitting ``b`` into n contiguous blocks splits the
merged dim into n contiguous blocks too.

Sizes are global sizes per letter. ``flops`` and ``bytes`` are for the unsplit forward op;
a split divides them by the number of ranks that share the work.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Saved:
    """A tensor autograd keeps for backward.

    kind "input"/"output": the op's index-th tensor input/output (aliases of the same storage
    are counted once by the memory model). kind "extra": a tensor the backward formula keeps
    that is not an fx value (e.g. layer norm's mean and rstd), with its letters and itemsize.
    ``for_grad_of``: when set, autograd saves the tensor only if one of these inputs needs a
    gradient (mul saves x only for the gradient of y: x * constant saves nothing of x).

    ``itemsize`` of an extra is fixed (fp32 statistics: 4, a bool mask: 1) unless ``act``: then
    it is the traced itemsize of a floating activation, which bf16 mixed precision makes 2 (a
    CPU dropout mask is ``x * mask`` in the working dtype). ``on`` names the devices that save
    the tensor, where CUDA and CPU kernels differ (autopar/pricing/saved_roots.py ``saved_applies``): ""
    every device, "cuda" / "cpu" one backend's devices (a cluster on NCCL runs CUDA kernels),
    "cpu16" / "cpu32" / "cuda16" / "cuda32" that device with a 16-bit / wider working dtype (the
    math SDPA upcasts 16-bit inputs to fp32 and saves fp32 copies; flash attention takes 16-bit
    inputs only).
    """
    kind: str
    index: int = 0
    letters: str = ""
    itemsize: int = 4
    for_grad_of: tuple = ()
    act: bool = False
    on: str = ""


@dataclass(frozen=True)
class Comm:
    """A collective a special algorithm needs: kind on the split axis, over a tensor with
    these letters (global sizes from the spec), of this itemsize; ``count`` times per forward
    (backward traffic is priced by the cost model from the kind)."""
    kind: str
    letters: str
    itemsize: int = 4
    count: int = 1


@dataclass(frozen=True)
class OpSpec:
    rule: str                                 # name of the rule that produced this spec
    inputs: tuple[str | None, ...]            # letters per tensor input (None: not a tensor / not splittable at all)
    outputs: tuple[str, ...]                  # letters per tensor output
    sizes: dict                               # letter -> global size
    unsplittable: frozenset = frozenset()
    # reduce: "sum": contracted split letters give a partial sum; "none": may not split them;
    # "ignore": the outputs do not depend on the inputs' values (``x.new_ones``): split, they stay whole
    reduce: str = "sum"
    special: dict = field(default_factory=dict)   # letter -> (algorithm name, tuple[Comm, ...])
    partial_inputs: tuple[int, ...] = ()      # inputs the op is linear in: a partial input gives a partial output
    flops: float = 0.0                        # forward FLOPs, unsplit
    bytes: float = 0.0                        # forward bytes read + written, unsplit (memory-bound ops)
    saved: tuple[Saved, ...] = ()
    replicate_only: bool = False              # fallback rule: only the fully replicated strategy
    # (device, letters of output 0 in memory order, or "=0": in input 0's memory order): where a
    # kernel lays its output out other than contiguously, e.g. memory-efficient attention's "bshe"
    # for a "bhse" output, so that the usual transpose + reshape after it is a view (same storage)
    # and not a copy. ``device`` as in ``Saved.on``; the memory model follows it
    # (autopar/pricing/saved_roots.py ``device_storage_roots``).
    storage_order: tuple = ()
    addend_inputs: tuple[int, ...] = ()       # inputs added into the result (a linear's bias): when a
                                              # contracted letter is split on an axis they are partial there too
                                              # (rank 0 of the axis keeps the value, the others zeros)
    # Input whose very tensor the op returns when it runs (an inactive dropout, p = 0 or eval:
    # ``aten.dropout`` returns its input on every device), or None. The trace's fake value of
    # such an op is a fresh storage, so without this a tensor saved through it (attention probs
    # saved by softmax and, after a p = 0 dropout, by the probs @ V matmul) is charged twice
    # (autopar/rules/candidates.py ``storage_roots``).
    returns_input: int | None = None
