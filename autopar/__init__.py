"""autopar: an auto-parallel training compiler for PyTorch.

trace (torch.export) -> price every sharding of every op -> one ILP per configuration inside an
outer search -> a Plan (JSON) -> per-rank programs run with torch.distributed.
"""
from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.errors import ClusterError, ConstraintError, ExecutionError, MemoryBudgetError, PlanError, TraceError
from autopar.plans.plan import Plan
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.trace import RequestTrace, load_trace, synthetic_trace
from autopar.execution.live_stats import StepStats


def plan(*args, **kwargs):
    """See autopar.api.plan (imported lazily so `import autopar` stays light)."""
    from autopar.api import plan as _plan
    return _plan(*args, **kwargs)


def compile(*args, **kwargs):
    """See autopar.execution.compiled.compile."""
    from autopar.execution.compiled import compile as _compile
    return _compile(*args, **kwargs)


def plan_inference(*args, **kwargs):
    """See autopar.inference.planner.plan_inference: how to split a model for generation."""
    from autopar.inference.planner import plan_inference as _plan_inference
    return _plan_inference(*args, **kwargs)


def compile_inference(*args, **kwargs):
    """See autopar.inference.engine.compile_inference: the generation engine of an inference plan."""
    from autopar.inference.engine import compile_inference as _compile_inference
    return _compile_inference(*args, **kwargs)


__all__ = ["Cluster", "Constraints", "Plan", "plan", "compile", "plan_inference", "compile_inference",
           "PlanError", "ClusterError", "ConstraintError",
           "MemoryBudgetError", "TraceError", "ExecutionError",
           "StepStats", "InferencePlan", "RequestTrace", "load_trace", "synthetic_trace"]
