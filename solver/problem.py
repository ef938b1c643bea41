"""The torch-free description of one intra-stage sharding problem and its solution.

Units: every cost is seconds, every memory figure is bytes. Nothing here knows about torch;
a Problem can be pickled, saved and re-solved offline.

Costs already include multiplicity: when a repeated transformer block is represented once,
the builder multiplies that block's node and edge costs by the number of repeats, so the
ILP's size grows with distinct blocks, not layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Edge:
    """Resharding between producer ``src`` and consumer ``dst`` (node indices).

    ``cost[s, t]`` is the time to turn src's output under strategy s into the layout dst's
    strategy t needs. ``src == dst`` is allowed (a repeated block feeding its next repeat):
    then only the diagonal applies.
    """
    src: int
    dst: int
    cost: np.ndarray


@dataclass
class MemoryConstraint:
    """One liveness set: bytes alive on one device at one point of forward/backward.

    total = const + sum over (node, bytes_per_strategy) in terms of the chosen strategy's bytes
            + for each checkpoint group listed in ``groups``: its activation bytes under the
              chosen checkpoint decision (saved, or kept when checkpointed; see CheckpointGroup)
            + the largest recompute_memory among the listed groups that are checkpointed.
    The constraint is total <= budget.
    """
    name: str
    budget: float
    const: float = 0.0
    terms: list[tuple[int, np.ndarray]] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)


@dataclass
class CheckpointGroup:
    """A set of (repeated) blocks that are either all recomputed in backward or none.

    saved:    bytes the group's blocks keep for backward when NOT checkpointed (all repeats).
    kept:     bytes kept when checkpointed (the block inputs, all repeats).
    recompute_memory: bytes one block rematerialises during its backward when checkpointed
              (blocks are recomputed one at a time: a memory constraint counts the largest
              recompute_memory of its checkpointed groups, not their sum).
    recompute_time:   seconds of extra forward when checkpointed (all repeats).
    Each is a list of (node, per-strategy array) terms, linear in the node's strategy choice.
    """
    name: str
    saved: list[tuple[int, np.ndarray]] = field(default_factory=list)
    kept: list[tuple[int, np.ndarray]] = field(default_factory=list)
    recompute_memory: list[tuple[int, np.ndarray]] = field(default_factory=list)
    recompute_time: list[tuple[int, np.ndarray]] = field(default_factory=list)
    forced: bool | None = None   # pin the decision (True = checkpoint, False = never)
    # index of a group whose checkpointing implies this one's (c[implied_by] <= c[self]): a block
    # group's selective-recompute companion (its attention cores) is on whenever the whole block
    # is recomputed, so (off, off) = none, (off, on) = selective, (on, on) = full
    implied_by: int | None = None


@dataclass
class Problem:
    node_names: list[str]
    costs: list[np.ndarray]                       # per node: seconds per strategy
    edges: list[Edge] = field(default_factory=list)
    memory: list[MemoryConstraint] = field(default_factory=list)
    checkpoint_groups: list[CheckpointGroup] = field(default_factory=list)
    strategy_names: list[list[str]] | None = None  # for messages and debugging only
    kept: list | None = None   # per node: the caller's strategy index of each solver strategy (a subset)

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    def num_strategy_vars(self) -> int:
        return int(sum(len(c) for c in self.costs))


@dataclass
class Solution:
    choice: list[int]                 # strategy index per node
    checkpoint: list[bool]            # decision per checkpoint group
    objective: float                  # seconds
    status: str                       # "optimal" | "feasible" (time limit) | "infeasible"
    gap: float = 0.0                  # relative optimality gap (0 when optimal)
    solve_seconds: float = 0.0
    peak_memory: dict[str, float] = field(default_factory=dict)  # bytes per memory constraint
