"""Where a rank's parameter blocks come from at set-up (``compile(..., weights=...)``).

Every source answers one question: "this rank's block ``slices`` of the tensor at ``fqn``", as an
fp32 (or the tensor's own non-float dtype) CPU tensor holding only that block. The set-up never
needs a whole model in one process, which is what lets a model bigger than one machine compile:

- ``ModelWeights`` (``weights=None``, a materialized model): every rank built the same model, so
  each rank slices its own copy; a cheap per-tensor checksum, compared across ranks, replaces the
  old broadcast of every full tensor (on a mismatch the blocks come from rank 0 instead, with a
  warning naming the first differing tensor).
- ``init_weights`` (``weights="init"``, parameters on meta): replays the model's initialization
  module by module on small CPU scratch tensors, under the random stream rank 0 had when
  ``compile`` was called, keeping only this rank's blocks (see ``init_weights`` for the conventions).
- ``SafetensorsWeights`` (a Hugging Face checkpoint directory): ``safe_open(...).get_slice(name)``
  reads just the block from disk; names are mapped (a wrapper's ``model.`` prefix), tied aliases
  resolved, dtypes converted.
- ``DcpWeights`` (a ``compiled.save`` directory, its committed generation): ``torch.distributed.checkpoint``
  reads one block at a time (autopar/execution/checkpoint_io.py ``Pieces``), so the peak is one
  block plus one saved chunk.

Buffers on the meta device are recomputed by ``fill_meta_buffers`` (a module's ``reset_buffers()``
or, inside a Hugging Face model, its ``_init_weights``); anything else is an error naming them.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings

import torch
import torch.nn as nn

from autopar.errors import ExecutionError
from autopar.execution.checkpoint_atomic import POINTER, check_complete, committed_path
from autopar.execution.checkpoint_io import Pieces, read

OPTIONS = ('weights=None (a materialized model: its own tensors), weights="init" (run the model\'s '
           'initialization for each rank\'s shards), weights=PATH (a Hugging Face safetensors checkpoint '
           'directory or a compiled.save() directory)')


def is_meta_model(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters())


@contextlib.contextmanager
def all_on_meta(model: nn.Module, on: bool = True):
    """Real buffers of a meta model swapped for meta copies while it is traced, then put back."""
    if not on:
        yield
        return
    saved = []
    for mod in model.modules():
        for n, b in mod._buffers.items():
            if b is not None and not b.is_meta:
                saved.append((mod, n, b))
    try:
        for mod, n, b in saved:
            mod._buffers[n] = b.to("meta")
        yield
    finally:
        for mod, n, b in saved:
            mod._buffers[n] = b


def _fp(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


# ---------------------------------------------------------------- a materialized model

class ModelWeights:
    """Blocks sliced from this rank's own copy of the model (module doc)."""

    def __init__(self, traced, model, fqns: list[str]):
        import torch.distributed as dist

        self.traced, self.model = traced, model
        self.from_rank0 = False
        # Checksum: sum and position-weighted sum in float64 (a permutation or a different seed
        # changes the second), one pair per tensor; all-reduce max and min and compare.
        sums = []
        for fqn in fqns:
            t = traced.value_of(model, fqn).detach()
            if t.is_meta:
                raise ExecutionError(f"{fqn} is on the meta device: pass weights=... ({OPTIONS})")
            sums.append(_checksum(t))
        mine = torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.float64)
        hi, lo = mine.clone(), mine.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        differ = [fqns[i] for i in range(len(fqns)) if not torch.equal(hi[i], lo[i])]
        if differ:
            # Different copies (unseeded init, per-rank data): fall back to rank 0's values, the old
            # behaviour, tensor by tensor (peak: one full tensor).
            warnings.warn(f"the ranks' models differ ({differ[0]}"
                          f"{f' and {len(differ) - 1} more' if len(differ) > 1 else ''}): using rank 0's "
                          f"values (build the model with the same seed on every rank to skip the broadcast)")
            self.from_rank0 = True

    def block(self, fqn: str, slices, device) -> torch.Tensor:
        src = self.traced.value_of(self.model, fqn).detach()
        if not self.from_rank0:
            return _fp(src[slices]).to(device, copy=True).contiguous()
        import torch.distributed as dist
        full = _fp(src).to(device, copy=True)
        dist.broadcast(full, src=0)
        return full[slices].clone().contiguous()


_CHUNK = 1 << 20
_WEIGHTS = torch.arange(_CHUNK, dtype=torch.float64).remainder_(9973).add_(1)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """(sum, position-weighted sum) in float64, over 1M-element chunks so the transient memory
    stays small whatever the tensor's size."""
    f = t.reshape(-1)
    s = torch.zeros(2, dtype=torch.float64)
    for i in range(0, f.numel(), _CHUNK):
        c = f[i:i + _CHUNK].double()
        s[0] += c.sum()
        s[1] += (c * _WEIGHTS[:c.numel()]).sum()
    return s


# ---------------------------------------------------------------- meta buffers

def _hf_owner_map(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the innermost Hugging Face PreTrainedModel containing it (its init owner)."""
    owners = {}

    def walk(m, owner):
        if hasattr(m, "_init_weights") and hasattr(m, "config") and hasattr(m, "post_init"):
            owner = m
        if owner is not None:
            owners[id(m)] = owner
        for c in m.children():
            walk(c, owner)

    walk(model, None)
    return owners


def fill_meta_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> full CPU value of every buffer on the meta device (small: RoPE tables and the like),
    computed by the module's ``reset_buffers()`` or a Hugging Face owner's ``_init_weights``
    (RNG-free for parameter-less modules such as rotary embeddings)."""
    owners = _hf_owner_map(model)
    out = {}
    for mname, mod in model.named_modules():
        metas = [(n, b) for n, b in mod.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not metas:
            continue
        saved = dict(mod._buffers)
        for n, b in metas:
            mod._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        try:
            if hasattr(mod, "reset_buffers"):
                mod.reset_buffers()
            elif id(mod) in owners and not list(mod.parameters(recurse=False)):
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    owners[id(mod)]._init_weights(mod)
            else:
                names = ", ".join(f"{mname}.{n}" if mname else n for n, _ in metas)
                raise ExecutionError(f"buffer(s) {names} are on the meta device and the model gives no way to "
                                     f"compute them: keep buffers real (accelerate.init_empty_weights() does), or "
                                     f"give module {type(mod).__name__} a reset_buffers() method")
            for n, _ in metas:
                out[f"{mname}.{n}" if mname else n] = mod._buffers[n].detach().clone()
        finally:
            mod._buffers.clear()
            mod._buffers.update(saved)
    return out


# ---------------------------------------------------------------- weights="init"

class _NoMetaWrites(torch.utils._python_dispatch.TorchDispatchMode):
    """Raised on any op touching a meta tensor during a replayed init call: the call reached a
    tensor the replay did not materialize (e.g. a grandchild's weight), which would silently not be
    initialized."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
            raise ExecutionError(f'weights="init": the initialization of {self.where} touches a tensor of a module '
                                 f"below its children ({func}); autopar replays reset_parameters() per module and "
                                 f"_init_weights(module) reaching only the module's own and its children's tensors. "
                                 f"Load a checkpoint (weights=PATH) for this model instead")
        return func(*args, **kwargs)


def init_weights(model: nn.Module, want: dict[str, tuple], rng_state: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's blocks ``want`` (canonical FQN -> slices) of a one-process initialization of
    ``model`` that started with the CPU generator in ``rng_state``. Conventions replayed, in order:

    1. construction: ``reset_parameters()`` of every module with own parameters, in
       ``model.modules()`` order (construction order for ordinary models); a tied alias met after
       its owner draws into a scratch that is dropped (at construction it was a separate tensor);
    2. model-level init, if present: ``_init_weights(module)`` in ``nn.Module.apply`` order (children
       first), as Hugging Face's ``post_init`` does (the innermost PreTrainedModel's method), or the
       root model's own ``_init_weights`` method for plain models. Hugging Face ties after init, so
       writes through a tied alias are dropped there; a plain model tied in its constructor, so they
       land in the shared tensor.

    Each call runs on CPU scratch for just the tensors it can touch (the module's own, and its
    children's still held), under the generator state the one-process build had at that call, so
    every draw is the same. A tensor is sliced to this rank's block and freed once its parent's call
    is done. Peak: about one block's tensors plus the top level's."""
    names = {}   # id(tensor) -> canonical FQN (first FQN named_parameters/named_buffers report)
    for fqn, t in list(model.named_parameters()) + list(model.named_buffers()):
        names.setdefault(id(t), fqn)
    out: dict[str, torch.Tensor] = {}
    phase_a: dict[str, tuple] = {}   # canonical FQN -> (module, generator state before its reset_parameters)
    live: dict[str, torch.Tensor] = {}   # full values still held

    def own(mod):
        return [("p", n, t) for n, t in mod._parameters.items() if t is not None] + \
               [("b", n, t) for n, t in mod._buffers.items() if t is not None]

    def swap(mod, values):
        """Put ``values`` (slot name -> tensor) into the module; returns the undo."""
        saved_p, saved_b = dict(mod._parameters), dict(mod._buffers)
        for (kind, n), v in values.items():
            (mod._parameters if kind == "p" else mod._buffers)[n] = v
        return lambda: (mod._parameters.update(saved_p), mod._buffers.update(saved_b))

    def run_reset(mod):
        """mod.reset_parameters() on scratch; returns slot -> value."""
        vals = {("p", n): torch.full(t.shape, float("nan"), dtype=torch.float32) if t.is_floating_point()
                else torch.zeros(t.shape, dtype=t.dtype) for k, n, t in own(mod) if k == "p"}
        undo = swap(mod, vals)
        try:
            with torch.no_grad(), _NoMetaWrites(type(mod).__name__):
                mod.reset_parameters()
        finally:
            undo()
        return vals

    # The replay follows construction: a module's own reset_parameters(), then its children's, then,
    # for a module with an _init_weights method (an "owner": a Hugging Face PreTrainedModel's
    # post_init, or a plain model that applies it in its constructor), that method over its subtree
    # children first, skipping what an inner owner already initialized (HF's _is_hf_initialized).
    # Construction values are recomputed from the recorded generator state when needed, so
    # nothing is held for them.
    initialized: set[int] = set()
    seen: set[str] = set()
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)

        def phase_a_value(c, t):
            if c not in phase_a:   # no reset_parameters: unknown until a later init writes it
                return (torch.full(t.shape, float("nan")) if t.is_floating_point()
                        else torch.zeros(t.shape, dtype=t.dtype))
            mod, state, n = phase_a[c]
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(state)
                return run_reset(mod)[("p", n)]

        def finalize(c, v):
            if c in want:
                if v.is_floating_point() and torch.isnan(v).any():
                    raise ExecutionError(f'weights="init": nothing initializes {c} (its module has no '
                                         f"reset_parameters() and no _init_weights covers it): add one, or load "
                                         f"a checkpoint (weights=PATH)")
                out[c] = v[want[c]].clone()

        def visit(mod, fqn, fn, hf):
            if id(mod) in initialized:
                return
            for cname, child in mod.named_children():
                visit(child, f"{fqn}.{cname}" if fqn else cname, fn, hf)
            slots = {}
            for k, n, t in own(mod):
                c = names[id(t)]
                if k == "b" and t.is_meta:
                    slots[(k, n)] = torch.empty(t.shape, dtype=t.dtype)   # fill_meta_buffers computes it
                elif k == "b":
                    continue
                elif c in seen and c not in live:   # a tied alias of a finished tensor
                    slots[(k, n)] = torch.empty(t.shape, dtype=torch.float32)
                elif c in seen and hf:   # Hugging Face ties after init: this write is dropped
                    slots[(k, n)] = live[c].clone()
                else:
                    if c not in live:
                        live[c] = phase_a_value(c, t).float() if t.is_floating_point() else phase_a_value(c, t)
                    seen.add(c)
                    slots[(k, n)] = live[c]
            # children's tensors still held (their parent, this module, may write them: GPT-2's c_proj)
            undos = [swap(mod, slots)]
            for child in mod.children():
                cs = {(k, n): live[names[id(t)]] for k, n, t in own(child) if names.get(id(t)) in live}
                undos.append(swap(child, cs))
            try:
                with torch.no_grad(), _NoMetaWrites(f"{fqn or 'the model'} ({type(mod).__name__})"):
                    fn(mod)
            finally:
                for u in reversed(undos):
                    u()
            if hf:
                initialized.add(id(mod))
            # the children's tensors are final now (only their parent's call could still write them)
            for child in mod.children():
                for k, n, t in own(child):
                    c = names.get(id(t))
                    if c in live and not _is_own_of(mod, t):
                        finalize(c, live.pop(c))

        def construct(mod, fqn):
            params = [(n, t) for k, n, t in own(mod) if k == "p"]
            if params and hasattr(mod, "reset_parameters"):
                state = torch.get_rng_state()
                run_reset(mod)
                for n, t in params:
                    phase_a.setdefault(names[id(t)], (mod, state, n))
            for cname, child in mod.named_children():
                construct(child, f"{fqn}.{cname}" if fqn else cname)
            if callable(getattr(mod, "_init_weights", None)):
                visit(mod, fqn, mod._init_weights, hf=hasattr(mod, "post_init"))

        construct(model, "")
        for c, v in list(live.items()):
            finalize(c, live.pop(c))
        # tensors no phase-2 call reached (no model-level init): their construction values
        params = dict(model.named_parameters())
        for c in want:
            if c not in out and c in params:
                finalize(c, phase_a_value(c, params[c]).float())
    return out


def _is_own_of(mod, t) -> bool:
    return any(v is t for v in mod._parameters.values())


# ---------------------------------------------------------------- Hugging Face safetensors

class SafetensorsWeights:
    """Blocks read from ``model.safetensors`` or a sharded ``model.safetensors.index.json``."""

    def __init__(self, directory: str, traced, model):
        from safetensors import safe_open

        self.dir = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.file_of = {k: os.path.join(directory, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            with safe_open(single, framework="pt") as f:
                self.file_of = {k: single for k in f.keys()}
        shapes = {}
        for path in sorted(set(self.file_of.values())):
            with safe_open(path, framework="pt") as f:   # headers only
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        # What the model holds in a checkpoint: parameters and persistent buffers, every tied alias.
        persistent = set(model.state_dict(keep_vars=True).keys())
        shape_of = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
        self.prefix = _best_prefix(persistent, set(shapes))
        self.name_of = {}   # model FQN -> checkpoint name
        missing, bad = [], []
        groups = {}
        for fqn in persistent:
            groups.setdefault(tuple(traced.tied.get(fqn, [fqn])), []).append(fqn)
        for aliases in groups:
            hit = next((a for a in aliases if self._ckpt(a) in shapes), None)
            if hit is None:
                missing.append(self._ckpt(aliases[0]))
                continue
            for a in aliases:
                self.name_of[a] = self._ckpt(hit)
            if shapes[self._ckpt(hit)] != shape_of[hit]:
                bad.append(f"{self._ckpt(hit)} {shapes[self._ckpt(hit)]} (this model: {shape_of[hit]})")
        extra = sorted(set(shapes) - set(self.name_of.values())
                       - {self._ckpt(a) for a in persistent})
        if missing or extra or bad:
            show = lambda xs: ", ".join(sorted(xs)[:6]) + (f" and {len(xs) - 6} more" if len(xs) > 6 else "")  # noqa: E731
            parts = ([f"missing from the checkpoint: {show(missing)}"] if missing else []) + \
                    ([f"not in this model: {show(extra)}"] if extra else []) + \
                    ([f"shape differs: {show(bad)}"] if bad else [])
            raise ExecutionError(f"checkpoint {directory} does not match this model (" + "; ".join(parts) +
                                 "): nothing was loaded. Build the model from the checkpoint's config.json")

    def _ckpt(self, fqn):
        return fqn[len(self.prefix):] if self.prefix and fqn.startswith(self.prefix) else fqn

    def has(self, fqn) -> bool:
        return fqn in self.name_of

    def block(self, fqn: str, slices, device) -> torch.Tensor:
        from safetensors import safe_open

        name = self.name_of[fqn]
        # Opened per tensor: safetensors maps the file, and every page a read touches stays in this
        # process's resident set until the file is closed (a column block touches the whole tensor).
        with safe_open(self.file_of[name], framework="pt") as f:
            part = f.get_slice(name)[slices]   # reads only this block (copied out of the mapping)
            return _fp(part).to(device, copy=True).contiguous()


def _best_prefix(model_keys: set[str], ckpt_keys: set[str]) -> str:
    """The prefix to strip from model FQNs so most of them are checkpoint names ("" or e.g.
    "model." for the zoo's LossWrapper around a Hugging Face model)."""
    cands = {""}
    for k in model_keys:
        parts = k.split(".")
        for i in range(1, min(3, len(parts))):
            cands.add(".".join(parts[:i]) + ".")
    score = lambda p: sum((k[len(p):] if k.startswith(p) else k) in ckpt_keys for k in model_keys)  # noqa: E731
    return max(sorted(cands), key=lambda p: (score(p), -len(p)))


# ---------------------------------------------------------------- compiled.save directories

class DcpWeights:
    """Blocks from a ``compiled.save`` directory: only the block, through ``torch.distributed.checkpoint``
    (which reshards: any saving plan; autopar/execution/checkpoint_io.py ``Pieces``). Names are
    mapped as the checkpoint spells them: as is, or across a wrapper's prefix (a zoo ``LossWrapper``
    trained and saved, its Hugging Face model read for inference: ``model.`` added), tied aliases
    resolved (``traced.tied``)."""

    def __init__(self, directory: str, traced, model):
        import torch.distributed.checkpoint as dcp

        self.dir = directory
        meta = dcp.FileSystemReader(directory).read_metadata()
        self.saved = {k[len("model."):]: v for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
        persistent = model.state_dict(keep_vars=True)
        rename = _name_map(set(persistent), set(self.saved))
        tied = getattr(traced, "tied", {}) or {}
        self.name_of = {}   # model FQN -> checkpoint name
        for fqn in persistent:
            hit = next((rename(a) for a in tied.get(fqn, [fqn]) if rename(a) in self.saved), None)
            if hit is None and rename(fqn) in self.saved:
                hit = rename(fqn)
            if hit is not None:
                self.name_of[fqn] = hit
        missing = sorted(rename(k) for k in persistent if k not in self.name_of)
        extra = sorted(set(self.saved) - set(self.name_of.values()) - {rename(k) for k in persistent})
        bad = sorted(f"{self.name_of[k]} {tuple(self.saved[self.name_of[k]].size)} (this model: "
                     f"{tuple(persistent[k].shape)})"
                     for k in self.name_of if tuple(self.saved[self.name_of[k]].size) != tuple(persistent[k].shape))
        if missing or extra or bad:
            parts = ([f"missing from the checkpoint: {', '.join(missing[:6])}"] if missing else []) + \
                    ([f"not in this model: {', '.join(extra[:6])}"] if extra else []) + \
                    ([f"shape differs: {', '.join(bad[:6])}"] if bad else [])
            raise ExecutionError(f"checkpoint {directory} does not match this model (" + "; ".join(parts) +
                                 "): nothing was loaded")

    def has(self, fqn) -> bool:
        return fqn in self.name_of

    def block(self, fqn: str, slices, device) -> torch.Tensor:
        name = self.name_of[fqn]
        m = self.saved[name]
        size = tuple(m.size)
        start = [s.indices(n)[0] for s, n in zip(slices, size)]
        block = torch.empty([len(range(*s.indices(n))) for s, n in zip(slices, size)], dtype=m.properties.dtype)
        want = Pieces(size, m.properties.dtype)
        want.add(start, block)
        # no_dist: every rank reads on its own (no collective per tensor); only the block is read
        read({"model": {name: want}}, self.dir, no_dist=True)
        return _fp(block).to(device, copy=True).contiguous()


def _name_map(model_keys: set[str], ckpt_keys: set[str]):
    """model FQN -> checkpoint name, whichever matches most: as is, a wrapper's prefix stripped from
    the model's FQNs, or one added to them (the checkpoint saved from a wrapper of this model)."""
    strip, add = _best_prefix(model_keys, ckpt_keys), _best_prefix(ckpt_keys, model_keys)
    cands = [lambda k: k, lambda k: k[len(strip):] if strip and k.startswith(strip) else k, lambda k: add + k]
    return max(cands, key=lambda f: sum(f(k) in ckpt_keys for k in model_keys))   # the first best: as is


def open_weights(weights, traced, model, options: str = OPTIONS):
    """The source for a PATH: a compiled.save (dcp) directory or a Hugging Face checkpoint directory.
    ``options``: what the caller accepts, named in its errors (compile's by default)."""
    path = os.fspath(weights)
    if not os.path.isdir(path):
        raise ExecutionError(f"weights={path!r}: no such directory. Options: {options}")
    if os.path.exists(os.path.join(path, POINTER)):   # compiled.save(): its committed generation
        path = committed_path(path)
        check_complete(path)
        return DcpWeights(path, traced, model)
    if os.path.exists(os.path.join(path, ".metadata")):
        return DcpWeights(path, traced, model)
    if os.path.exists(os.path.join(path, "model.safetensors")) or \
            os.path.exists(os.path.join(path, "model.safetensors.index.json")):
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ExecutionError(f"weights={path!r} is a safetensors checkpoint: `pip install safetensors` "
                                 f"(or `pip install autopar[hf]`)") from None
        return SafetensorsWeights(path, traced, model)
    raise ExecutionError(f"weights={path!r}: neither a Hugging Face checkpoint (model.safetensors or "
                         f"model.safetensors.index.json) nor a compiled.save() directory (.metadata). "
                         f"Options: {options}")


def weight_source(model, traced, prog, choice, dev, init_rng_state=None, mine=None):
    """fqn, slices -> this rank's block (module doc of autopar/execution/weights.py). Lifted constants
    and real buffers come from the model; buffers on meta are recomputed; parameters from
    ``choice`` (compile's ``weights=``): None, "init" or a directory.
    ``init_rng_state``: the RNG state "init" replays (broadcast from rank 0 here)."""
    all_fqns = [prog.param_fqn[n] for n in prog.param_names]   # the checksum is collective: every rank's
    fqns = [prog.param_fqn[n] for n in prog.param_names if mine is None or n in mine]   # what this rank loads
    meta = is_meta_model(model)
    if choice is None and meta:
        raise ExecutionError(f"the model's parameters are on the meta device, so there are no values to train: "
                             f"pass {OPTIONS.split(', ', 1)[1]}")
    if choice is not None and not isinstance(choice, (str, bytes)) and not hasattr(choice, "__fspath__"):
        raise ExecutionError(f"weights={choice!r}: options are {OPTIONS}")
    meta_bufs = fill_meta_buffers(model) if any(b.is_meta for b in model.buffers()) else {}

    def own(fqn):   # a constant, a real buffer, or a real parameter of the model
        t = traced.value_of(model, fqn)
        return None if t.is_meta else t

    def fixed(fqn, slices):
        if fqn in meta_bufs:
            return _fp(meta_bufs[fqn][slices]).to(dev, copy=True).contiguous()
        return _fp(own(fqn).detach()[slices]).to(dev, copy=True).contiguous()

    if choice is None:
        src = ModelWeights(traced, model, [f for f in all_fqns if f not in meta_bufs])
        return lambda fqn, sl: fixed(fqn, sl) if fqn in meta_bufs else src.block(fqn, sl, dev)
    if choice == "init":
        params = dict(model.named_parameters())
        want = {f: prog.param_slices[f] for f in fqns if f in params}
        state = init_rng_state
        import torch.distributed as dist
        dist.broadcast(state, src=0)   # rank 0's stream, on every rank (5 KB)
        blocks = init_weights(model, want, state)
        return lambda fqn, sl: blocks[fqn].to(dev).contiguous() if fqn in blocks else fixed(fqn, sl)
    src = open_weights(choice, traced, model)

    def read(fqn, sl):
        if src.has(fqn):
            return src.block(fqn, sl, dev)
        if fqn in meta_bufs or own(fqn) is not None:   # non-persistent buffers, constants
            return fixed(fqn, sl)
        raise ExecutionError(f"{fqn} is neither in the checkpoint {choice} nor computable from the model")
    return read
