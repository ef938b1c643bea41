"""How an autopar error that nobody catches is shown when several processes run one job.

Under torchrun (or ``autopar run``) every rank is its own Python process: an uncaught error would
print one traceback per rank, e.g. eight copies of "step() input 0 is ...". ``install()`` (called
by ``autopar.compile`` when the world has more than one rank) sets a ``sys.excepthook`` that prints
autopar's own errors (``PlanError``, ``ExecutionError``) as ONE line, ``autopar: error: ...``:

- an error every rank raises alike (``ExecutionError.collective``, and every ``PlanError``: planning
  happens on rank 0 and is broadcast) is printed by rank 0 only;
- an error of one rank (a peer died, a collective failed there) is printed by that rank, naming it.

Any other exception goes to the previous hook unchanged (a bug keeps its traceback), and
``AUTOPAR_VERBOSE=1`` restores tracebacks for autopar's errors too. The exit status is unchanged
(non-zero), so launchers still see the failure.
"""
from __future__ import annotations

import os
import sys
from autopar.errors import ExecutionError, PlanError

_installed = {"previous": None}


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
    except Exception:   # reporting must never fail
        return 0


def format_error(exc: BaseException, rank: int) -> str | None:
    """The line to print for ``exc`` on ``rank``, or None when another rank reports it."""

    collective = isinstance(exc, PlanError) or getattr(exc, "collective", False)
    if collective and rank != 0:
        return None
    where = "" if collective else f"(rank {rank}) "
    kind = type(exc).__name__ if not isinstance(exc, (PlanError, ExecutionError)) else type(exc).__name__
    return f"autopar: error: {where}{kind}: {exc}"


def _hook(exc_type, exc, tb):

    previous = _installed["previous"] or sys.__excepthook__
    if not isinstance(exc, (PlanError, ExecutionError)) or os.environ.get("AUTOPAR_VERBOSE"):
        return previous(exc_type, exc, tb)
    line = format_error(exc, _rank())
    if line is not None:
        print(line + "  (AUTOPAR_VERBOSE=1 shows the traceback)", file=sys.stderr, flush=True)


def install() -> None:
    """Idempotent: wraps whatever hook is set now."""
    if sys.excepthook is _hook:
        return
    _installed["previous"] = sys.excepthook
    sys.excepthook = _hook
