"""Quantities users type: memory and time with units ("80GB", "40GiB", "10us", "2min"), the same
in the API, the CLI and cluster YAML files (autopar/cluster.py's ``parse_quantity`` parses them),
and a warning for a bare number that is implausible in its base unit (``latency: 10`` is ten
seconds, almost certainly meant as 10 µs).

``parse_bytes(value, what)`` / ``parse_seconds(value, what)`` -> float, or ``PlanError`` naming
``what`` (the argument or field) with an example of the accepted form.
"""
from __future__ import annotations

import warnings

from autopar.errors import PlanError

# Plausible ranges of a quantity in base units; outside them a BARE number (no unit) gets a warning
# that says which unit was probably meant. Wide on purpose: only typos of a unit should trip them.
_PLAUSIBLE = {
    "bytes": (2**20, 2**50, "bytes (e.g. 80GB or 80GiB)"),            # 1 MiB .. 1 PiB per device
    "bandwidth": (1e6, 1e13, "bytes/s (e.g. 600GB/s or 200Gb/s)"),     # 1 MB/s .. 10 TB/s
    "latency": (1e-8, 1e-2, "seconds (e.g. 5us)"),                       # 10 ns .. 10 ms
    "flops": (1e8, 1e17, "FLOP/s (e.g. 312T)"),
}


def _parse(value, kind: str, what: str) -> float:
    from autopar.cluster import parse_quantity

    try:
        v = parse_quantity(value, kind)
    except ValueError as e:
        raise PlanError(f"{what}: {e}, got {value!r}") from None
    if not v > 0:
        raise PlanError(f"{what} must be positive, got {value!r}")
    return v


def parse_bytes(value, what: str = "memory_budget") -> float:
    """Bytes from a number or a string with a unit: 80GB (10^9), 80GiB (2^30), 512MB."""
    return _parse(value, "bytes", what)


def parse_seconds(value, what: str = "time_limit") -> float:
    """Seconds from a number or a string with a unit: 30, 30s, 500ms, 2min."""
    return _parse(value, "time", what)


def warn_if_implausible(value, parsed: float, kind: str, what: str) -> None:
    """Warn when a bare number (no unit given) is far outside what ``kind`` plausibly is."""
    if isinstance(value, str) and not value.strip().replace(".", "", 1).replace("e", "", 1).replace(
            "-", "", 1).replace("+", "", 1).isdigit():
        return   # it carries a unit: the user said what they meant
    lo, hi, unit = _PLAUSIBLE[kind]
    if not lo <= parsed <= hi:
        warnings.warn(f"autopar: {what} = {value!r} is read in base units as {parsed:g} {unit.split(' ')[0]}, "
                      f"which is implausible; write the unit explicitly, in {unit}", UserWarning, stacklevel=3)
