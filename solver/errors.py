"""The error the solver raises for a malformed Problem or an unusable backend.

It lives here, below autopar/, so solver/ imports nothing from autopar/ (arrows run one way);
``autopar.errors.PlanError`` IS this class, re-exported, so users catch one type.
"""


class PlanError(Exception):
    """Planning failed for a reason the user can act on."""
