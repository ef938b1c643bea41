"""What one rank's program is and where its blocks sit: ``RankProgram`` (the GraphModule with
its placeholders' names, layouts and blocks, returned by codegen/per_rank.py ``generate``) and the
layout helpers both codegen and execution use to place a rank's block of a tensor.

Layouts are normalised before comparing (``normalize``): an axis of size 1 splits nothing, so it
is dropped. ``block_slices`` is this rank's contiguous block of a tensor (first split axis outer);
``input_layout`` the layout of a user input (its batch dim split over the data axes);
``strategy_of`` a plan op's strategy as a ``Strategy``. ``StepProgram`` is an inference step's
program (every output returned with its layout, state inputs taken as blocks); ``block_shape``
the shape of a rank's block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.rules.layout import Layout
from autopar.rules.strategy import Strategy
from codegen.checkpoint import program_code


@dataclass
class RankProgram:
    gm: fx.GraphModule
    rank: int
    coords: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    param_names: list[str]                      # placeholder names of params/buffers, in graph order
    param_fqn: dict[str, str]                   # placeholder name -> FQN
    buffers: set[str]                           # placeholder names that are buffers
    param_layouts: dict[str, Layout]            # FQN -> layout (normalised)
    param_slices: dict[str, tuple[slice, ...]]  # FQN -> this rank's block of the full tensor
    input_names: list[str]
    input_layouts: list[Layout]
    grad_partial_axes: dict[str, tuple[int, ...]]   # FQN -> data axes its grad is left partial over
    loss_layout: Layout
    data_axes: tuple[int, ...]                   # data axes of size > 1
    zero3_chunks: dict[str, int] = field(default_factory=dict)
    checkpoint_regions: list[str] = field(default_factory=list)   # block instances run as checkpoint regions
    batch_dims: list = field(default_factory=list)   # per user input: its batch dim (or None)
    count_gm: fx.GraphModule | None = None           # this rank's share of the mean losses' denominators
    mean_losses: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)   # (loss node, target split axes)

    takes_whole_batch = False   # the program takes this rank's rows (codegen/grid_rank_program.py: the whole batch)

    def block_of(self, fqn: str, full):
        """This rank's block of parameter ``fqn`` from its whole tensor."""
        return full[self.param_slices[fqn]]

    def read_block(self, source, fqn: str):
        """This rank's block from a weight source (autopar/execution/weights.py): only the block is read."""
        return source(fqn, self.param_slices[fqn])

    def assemble(self, fqn: str, parts: list, coords_of):
        """The whole tensor from every rank's block (``parts[r]``: rank r's at mesh ``coords_of(r)``)."""
        import torch

        lay = self.param_layouts[fqn]
        full_shape = [(s.stop - s.start) * math.prod(self.mesh_shape[a] for a in lay.dims[d])
                      for d, s in enumerate(self.param_slices[fqn])]
        full = torch.empty(full_shape, dtype=parts[0].dtype)
        for r, blk in enumerate(parts):
            full[block_slices(lay, full_shape, self.mesh_shape, coords_of(r))] = blk
        return full

    def replicas_of(self, fqn: str, model_axes) -> int:
        """Ranks over ``model_axes`` holding the same block of ``fqn`` (1/r of its norm in clipping)."""
        used = self.param_layouts[fqn].axes_used()
        return math.prod(self.mesh_shape[a] for a in model_axes if a not in used)

    def counts_norm(self, fqn: str, model_axes) -> bool:
        """Whether this rank is the one of the ranks over ``model_axes`` holding the same block of
        ``fqn`` that counts it in a per-tensor norm (LAMB, LARS): coordinate 0 on every axis the
        parameter is replicated on."""
        used = self.param_layouts[fqn].axes_used()
        return all(self.coords[a] == 0 for a in model_axes if a not in used)

    def first_reads(self) -> list[str]:
        """Parameter placeholder names in the order the program first reads them."""
        first = {}
        for k, n in enumerate(self.gm.graph.nodes):
            for a in n.all_input_nodes:
                if a.op == "placeholder":
                    first.setdefault(a.name, k)
        return [name for _, _, name in sorted((first.get(name, len(first) + i), i, name)
                                               for i, name in enumerate(self.param_names))]

    @property
    def code(self) -> str:
        """The program, then the body of each checkpoint region."""
        return program_code(self.gm)


@dataclass
class StepProgram(RankProgram):
    """An inference step's program (codegen/per_rank.py ``generate_step``): ``gm`` returns every
    output of the traced step, ``output_layouts[i]`` saying how output i is held (this rank's
    block of it); the state inputs (``state``: input name -> the output it is returned as) are
    taken as this rank's blocks in ``input_layouts``. ``input_shapes``: each user input's global
    shape."""
    output_names: list[str] = field(default_factory=list)
    output_layouts: list[Layout] = field(default_factory=list)
    state: dict[str, str] = field(default_factory=dict)
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)

    def input_block_shape(self, name: str) -> tuple[int, ...]:
        """This rank's block shape of user input ``name``."""
        i = self.input_names.index(name)
        return block_shape(self.input_layouts[i], self.input_shapes[i], self.mesh_shape)


def block_shape(layout: Layout, shape, mesh_shape) -> tuple[int, ...]:
    """The shape of one rank's block of a tensor of global ``shape`` (every block has it)."""
    return tuple(size // layout.split_factor(d, mesh_shape) for d, size in enumerate(shape))


def normalize(layout: Layout, mesh_shape) -> Layout:
    """Drop mesh axes of size 1 (``Layout.normalized``)."""
    return layout.normalized(mesh_shape)


def block_slices(layout: Layout, shape, mesh_shape, coords) -> tuple[slice, ...]:
    """This rank's contiguous block of a tensor of global ``shape`` (first split axis outer)."""
    out = []
    for d, size in enumerate(shape):
        idx, n = 0, 1
        for a in layout.dims[d]:
            idx = idx * mesh_shape[a] + coords[a]
            n *= mesh_shape[a]
        step = size // n
        out.append(slice(idx * step, (idx + 1) * step))
    return tuple(out)


def input_layout(ndim: int, mesh, batch_dim: int | None = 0) -> Layout:
    """User inputs: the batch dim split over the data axes (mesh order), everything else
    replicated (an input without a batch dim: replicated whole)."""
    data = tuple(a for a in mesh.data_axes() if mesh.shape[a] > 1)
    return Layout(tuple(data if d == batch_dim else () for d in range(ndim))) if ndim else Layout(())


def strategy_of(op: dict) -> Strategy:
    lay = lambda j: None if j is None else Layout.from_json(j)  # noqa: E731
    return Strategy(op["strategy"], tuple(lay(j) for j in op["inputs"]), tuple(lay(j) for j in op["outputs"]),
                    tuple(op["splits"]), 1.0, (), tuple(op.get("special", ())))
