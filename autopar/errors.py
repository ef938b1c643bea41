"""Errors autopar raises to users. Every message says what is wrong and what to change."""


from solver.errors import PlanError  # noqa: F401  (defined below autopar/: the solver raises it too)


class ClusterError(PlanError):
    """A cluster description (preset, YAML file, arguments) is invalid."""


class TraceError(PlanError):
    """The model could not be traced; the message names the module and source line."""


class ConstraintError(PlanError):
    """A pinned constraint (``constraints=``) cannot be met."""


class MemoryBudgetError(PlanError):
    """No plan fits in the memory budget; the message states the smallest peak any plan reaches."""

    def __init__(self, message: str, min_peak_bytes: int | None = None, budget_bytes: int | None = None):
        super().__init__(message)
        self.min_peak_bytes = min_peak_bytes
        self.budget_bytes = budget_bytes


class ExecutionError(Exception):
    """Running a plan failed (wrong model, wrong world size, a rank died).

    ``collective``: every rank raises this same error (a check all ranks make alike: the plan, the
    batch, a checkpoint's metadata), so one rank reporting it is enough (autopar/execution/error_report.py)."""

    def __init__(self, message: str = "", collective: bool = False):
        super().__init__(message)
        self.collective = collective
