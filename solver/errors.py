"""The errors the solver raises: a malformed Problem or an unusable backend (``PlanError``), and
a time limit reached before any solution (``SolverTimeout``).

They live here, below autopar/, so solver/ imports nothing from autopar/ (arrows run one way);
``autopar.errors.PlanError`` IS this class, re-exported, so users catch one type.
"""


class PlanError(Exception):
    """Planning failed for a reason the user can act on."""


class SolverTimeout(PlanError):
    """The solver reached its ``time_limit`` before it found any solution. The search catches
    this one alone (it skips that configuration, autopar/search/outer.py); every other PlanError
    propagates. A PlanError still, so a caller of ``solver.ilp.solve`` sees the message."""
