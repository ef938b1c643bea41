"""A 2D / 2.5D / 3D plan's per-rank program with the interface of codegen/rank_program.py's
RankProgram, so a grid plan is set up, stepped, clipped, checkpointed and optimized by the same
code as every other plan (autopar/execution/compiled_setup.py, compiled.py, compiled_state.py,
runtime/zero.py).

What differs from a RankProgram, behind the same names:
  * ``gm(*params, *batch, mb)``: the grid program (codegen/grid_ops.py) takes the WHOLE global
    batch and the micro-batch index and cuts its own rows (``takes_whole_batch``); it returns
    this rank's share of the loss, partial over ``loss_layout.partial`` (the dp axis and the
    token groups of a split cross-entropy; the dp axis alone for a loss computed whole);
  * parameter blocks are blocks of a *stored* form of the tensor (a linear's weight transposed,
    QKV columns head-grouped; codegen/grid_layout.py specs): ``block_of`` cuts this rank's block
    from the whole tensor, ``assemble`` puts every rank's blocks back; ``param_slices`` name the
    whole tensor (weight sources read it whole, then ``block_of`` cuts it);
  * every gradient block is exact for the grid: partial only over the dp replicas.

Parameter stored forms (runtime/grid.take with the rank's spec):
    weight  nn.Linear.weight.T [in, out] (QKV: columns in head-grouped order), weight spec
    conv    patch-embedding weight reshaped to [out, C*kh*kw], transposed, weight spec
    bias    [out] (QKV: same order), vector spec of the linear's layout
    norm    LayerNorm vector: vector spec of swap(layout) (3D), the plane's otherwise
    table   embedding table [V, h]: hidden piece of q^2 (q^3 in 3D)
    loose   hidden block of q on its hidden dim, replicated over the token groups
    whole   read by an op run replicated: the whole tensor on every rank
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from codegen.boxes import flat_boxes
from codegen.grid_layout import GRID_MODES, Geometry, geometry_of
from runtime.grid import take
from codegen.grid_ops import GridProgram


def is_grid_plan(plan) -> bool:
    return plan.degrees.get("tp_mode") in GRID_MODES


def plan_geometry(plan) -> Geometry:
    d = plan.degrees
    return geometry_of(d["tp_mode"], d["tp_shape"], int(d.get("dp", 1)), int(d.get("num_micro_batches", 1) or 1),
                       int(d.get("zero", 0) or 0))


def spec_of(geo: Geometry, use, coords: dict, shape) -> tuple:
    """The block (runtime/grid.take spec) of a parameter's stored form held at ``coords``."""
    if use.kind in ("weight", "conv"):
        return geo.weight_spec(use.L, coords)
    if use.kind == "bias":
        return geo.vector_spec(use.L, coords)
    if use.kind == "norm":
        return geo.vector_spec(geo.swap(use.L), coords)
    if use.kind == "table":
        return geo.table_spec(use.L, coords)
    spec = [None] * len(shape)
    if use.kind != "whole":
        spec[use.hdim] = geo.hid_block(use.L, coords)
    return tuple(spec)


def to_stored(use, t: torch.Tensor) -> torch.Tensor:
    """The global tensor the blocks are cut from."""
    if use.kind == "weight":
        t = t.t()
    elif use.kind == "conv":
        t = t.reshape(t.shape[0], -1).t()
    if use.perm is not None:
        t = t[..., list(use.perm)]
    return t.contiguous()


def from_stored(use, t: torch.Tensor, shape) -> torch.Tensor:
    if use.perm is not None:
        out = torch.empty_like(t)
        out[..., list(use.perm)] = t
        t = out
    if use.kind == "weight":
        t = t.t()
    elif use.kind == "conv":
        t = t.t().reshape(shape)
    return t.contiguous()


def stored_shape(use, shape) -> tuple[int, ...]:
    """The shape of ``to_stored(use, t)`` for a tensor ``t`` of ``shape``."""
    shape = tuple(shape)
    if use.kind == "weight":
        return (shape[1], shape[0])
    if use.kind == "conv":
        return (math.prod(shape[1:]), shape[0])
    return shape


def stored_to_full(use, shape, offsets, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """A box of the stored form (``to_stored(use, full)``, ``full`` of ``shape``) at ``offsets``,
    holding ``t``, as boxes of ``full``: (offsets in ``full``, a view of ``t`` shaped as that box,
    no copy). A transposed box is a box of the original with its dims swapped (``weight``); the
    QKV column order (``perm``) cuts it into runs of consecutive original columns; a ``conv``
    weight's rows are a flat range of its [C, kh, kw] dims (codegen/boxes.py)."""


    offsets = [int(o) for o in offsets]
    boxes = [(offsets, t)]
    if use.perm is not None and t.dim():
        perm, o, n = use.perm, offsets[-1], t.shape[-1]
        boxes, j = [], 0
        while j < n:
            k = j + 1
            while k < n and perm[o + k] == perm[o + k - 1] + 1:
                k += 1
            boxes.append((offsets[:-1] + [perm[o + j]], t[..., j:k]))
            j = k
    out = []
    for off, v in boxes:
        if use.kind == "weight":
            out.append(((off[1], off[0]), v.t()))
        elif use.kind == "conv":
            k0, nk = off[0], v.shape[0]
            for ioff, isize, start in flat_boxes(shape[1:], k0, k0 + nk):
                rows = v[start - k0:start - k0 + math.prod(isize)]
                out.append(((off[1], *ioff), rows.t().unflatten(1, isize)))
        else:
            out.append((tuple(off), v))
    return out


def _place(full: torch.Tensor, spec, block: torch.Tensor) -> None:
    idx = []
    for dim, s in enumerate(spec):
        if s is None:
            idx.append(slice(None))
        else:
            i, n = s
            size = full.shape[dim] // n
            idx.append(slice(i * size, (i + 1) * size))
    full[tuple(idx)] = block


@dataclass(frozen=True)
class LossLayout:
    partial: tuple[int, ...]     # mesh axes the loss share is summed over


@dataclass
class GridRankProgram:
    program: object              # codegen.grid_ops.GridProgram, analysed and bound
    geo: Geometry
    mesh_names: tuple[str, ...]
    param_names: list[str]
    param_fqn: dict[str, str]
    buffers: set[str]
    param_shapes: dict[str, tuple[int, ...]]     # FQN -> the model's tensor shape
    input_names: list[str]
    loss_layout: LossLayout
    data_axes: tuple[int, ...]
    grad_partial_axes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    count_gm: object = None
    mean_losses: list = field(default_factory=list)
    takes_whole_batch: bool = True

    def __post_init__(self):
        self.name_of = {f: n for n, f in self.param_fqn.items()}    # FQN -> placeholder name

    # ---- running
    def gm(self, *args):
        """This rank's loss share for micro-batch ``args[-1]`` of the whole batch."""
        k = len(self.param_names)
        prog = self.program
        prog.local = dict(zip(self.param_names, args[:k]))
        prog.coords["mb"] = int(args[-1])
        return prog.forward(dict(zip(self.input_names, args[k:-1])))

    def first_reads(self) -> list[str]:
        """Parameter names in the order the program first reads them."""
        return list(self.program.uses)

    # ---- parameter blocks
    @property
    def param_slices(self) -> dict[str, tuple[slice, ...]]:
        return {fqn: tuple(slice(0, s) for s in shape) for fqn, shape in self.param_shapes.items()}

    def _use(self, fqn):
        return self.program.uses[self.name_of[fqn]]

    def block_of(self, fqn: str, full: torch.Tensor, coords: dict | None = None) -> torch.Tensor:
        use = self._use(fqn)
        stored = to_stored(use, full)
        return take(stored, spec_of(self.geo, use, coords or self.program.coords, stored.shape))

    def read_block(self, source, fqn: str) -> torch.Tensor:
        """This rank's block from a weight source (autopar/execution/weights.py): read whole, cut."""
        return self.block_of(fqn, source(fqn, self.param_slices[fqn]))

    def assemble(self, fqn: str, parts: list[torch.Tensor], coords_of=None) -> torch.Tensor:
        """The whole tensor from every rank's block (``parts[r]``: rank r's; the grid's own
        coordinates, ``coords_of`` is the mesh's and not needed)."""
        use = self._use(fqn)
        shape = self.param_shapes[fqn]
        stored = to_stored(use, torch.zeros(shape, dtype=parts[0].dtype))
        full = torch.zeros_like(stored)
        for r, blk in enumerate(parts):
            _place(full, spec_of(self.geo, use, self.geo.coords_of(r), stored.shape), blk.to(full.device))
        return from_stored(use, full, shape)

    def block_offsets(self, fqn: str) -> list[int]:
        """Where this rank's block starts in the stored form of ``fqn`` (``stored_shape``)."""
        use = self._use(fqn)
        shape = stored_shape(use, self.param_shapes[fqn])
        spec = spec_of(self.geo, use, self.program.coords, shape)
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        return [0 if s is None else s[0] * (n // s[1]) for s, n in zip(spec, shape)]

    def full_pieces(self, fqn: str, offsets, t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """A box of ``fqn``'s stored form (at ``offsets`` there: inside this rank's block) as
        boxes of the full tensor, views of ``t`` (``stored_to_full``): what a checkpoint saves."""
        return stored_to_full(self._use(fqn), self.param_shapes[fqn], offsets, t)

    def replicas_of(self, fqn: str, model_axes) -> int:
        """Ranks of the grid holding the same block of ``fqn`` (1/r of its norm in clipping)."""
        use = self._use(fqn)
        stored = to_stored(use, torch.empty(self.param_shapes[fqn], device="meta"))
        blocks = math.prod(s[1] for s in spec_of(self.geo, use, self.program.coords, stored.shape) if s is not None)
        return self.geo.world // blocks

    def counts_norm(self, fqn: str, model_axes=None) -> bool:
        """Whether this rank is the first rank of its grid holding its block of ``fqn``, the one
        that counts the block in a per-tensor norm (LAMB, LARS)."""
        use = self._use(fqn)
        shape = to_stored(use, torch.empty(self.param_shapes[fqn], device="meta")).shape
        here = self.program.coords
        mine = spec_of(self.geo, use, here, shape)
        for r in range(self.geo.world):
            c = {**here, **self.geo.coords_of(r), "dp": here.get("dp", 0)}
            if spec_of(self.geo, use, c, shape) == mine:
                return all(c[n] == here[n] for n in self.geo.names)
        return True


def build(traced, plan, grid, coords: dict, batch: int, device=None) -> GridRankProgram:
    """The grid program of ``plan`` for the rank at ``coords``, analysed (on meta, as the planner
    did) and bound to ``grid`` (runtime/grid.py)."""

    geo = plan_geometry(plan)
    prog = GridProgram(traced, geo, batch).analyse()
    prog.bind(grid, coords, {}, device)
    names = list(plan.mesh.names)
    partial = tuple(names.index(label) for label in prog.loss_partial_labels() if label in names)
    data_axes = tuple(names.index("dp") for _ in [0] if "dp" in names)
    pnames = [n for n in prog.uses]
    shapes = {traced.param_fqn[n]: tuple(traced.gm.graph.find_nodes(op="placeholder", target=n)[0].meta["val"].shape)
              for n in pnames}
    grad_partial = {traced.param_fqn[n]: data_axes for n in pnames if n not in traced.buffers} if data_axes else {}
    return GridRankProgram(prog, geo, tuple(names), pnames, {n: traced.param_fqn[n] for n in pnames},
                           {n for n in pnames if n in traced.buffers}, shapes, list(traced.input_names),
                           LossLayout(partial), data_axes, grad_partial)
