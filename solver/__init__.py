"""Torch-free solver: turns a Problem (arrays and dataclasses) into a Solution."""
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem, Solution

__all__ = ["Problem", "Edge", "MemoryConstraint", "CheckpointGroup", "Solution"]
