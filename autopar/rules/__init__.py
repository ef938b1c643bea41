"""Op rules: a table from ATen ops to declarative einsum-style OpSpecs, and what follows from
them per mesh: layouts (layout.py), strategies (strategy.py), each node's candidates
(candidates.py), sequence letters and attention strategies (sequence.py), attention cores
(attention_core.py).

Importing this package registers every rule family (``ops_*`` modules) into ``RULES``.
"""
from autopar.rules import ops_cache, ops_kernels, ops_matmul, ops_moe, ops_nn, ops_pointwise, ops_shape  # noqa: F401 (registration)
from autopar.rules.spec import Comm, OpSpec, Saved
from autopar.rules.table import RULES, coverage, rule, spec_for, tensor_inputs

__all__ = ["RULES", "coverage", "rule", "spec_for", "tensor_inputs", "OpSpec", "Saved", "Comm"]
