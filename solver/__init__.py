"""Torch-free solver: turns a Problem (arrays and dataclasses) into a Solution."""
from solver.bruteforce import brute_force, brute_force_min_peak
from solver.ilp import evaluate, fits, min_peak_memory, release_threads, solve, validate
from solver.pipeline import PipelinePlan, partition, pipeline_objective
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem, Solution

__all__ = ["Problem", "Edge", "MemoryConstraint", "CheckpointGroup", "Solution",
           "solve", "release_threads", "evaluate", "fits", "validate", "min_peak_memory", "brute_force",
           "brute_force_min_peak",
           "partition", "pipeline_objective", "PipelinePlan"]
