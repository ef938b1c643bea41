"""Turns (traced fx graph, Plan) into one GraphModule per rank (see codegen/per_rank.py)."""
from codegen.per_rank import generate, generate_step
from codegen.rank_program import RankProgram, StepProgram
from codegen.show_code import per_rank_code

__all__ = ["RankProgram", "StepProgram", "generate", "generate_step", "per_rank_code"]
