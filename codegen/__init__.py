"""Turns (traced fx graph, Plan) into one GraphModule per rank (see codegen/per_rank.py)."""
from codegen.per_rank import generate
from codegen.rank_program import RankProgram
from codegen.show_code import per_rank_code

__all__ = ["RankProgram", "generate", "per_rank_code"]
