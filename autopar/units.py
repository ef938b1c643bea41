"""Quantities users type: memory and time with units ("80GB", "40GiB", "10us", "2min"), the same
in the API, the CLI and cluster YAML files (``parse_quantity`` below parses them),
and a warning for a bare number that is implausible in its base unit (``latency: 10`` is ten
seconds, almost certainly meant as 10 µs).

``parse_bytes(value, what)`` / ``parse_seconds(value, what)`` -> float, or ``PlanError`` naming
``what`` (the argument or field) with an example of the accepted form.
"""
from __future__ import annotations

import re
import warnings
from decimal import Decimal, InvalidOperation

from autopar.errors import PlanError

# ---------------------------------------------------------------------------------------------
# Quantities with units (memory, FLOP/s, bandwidth, time)
# ---------------------------------------------------------------------------------------------

_DEC = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_TIME = {"s": 1, "min": 60, "h": 3600, "ms": Decimal("1e-3"), "us": Decimal("1e-6"), "µs": Decimal("1e-6"),
         "μs": Decimal("1e-6"), "ns": Decimal("1e-9")}
_NUM = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S*)\s*$")

# what each quantity's unit suffix may be (after the prefix); value = multiplier
_SUFFIX = {
    "bytes": {"B": 1},
    "flops": {"": 1, "FLOPS": 1, "FLOP/s": 1, "flops": 1, "FLOP/S": 1},
    "bandwidth": {"B/s": 1, "Bps": 1, "b/s": Decimal(1) / 8, "bps": Decimal(1) / 8, "bit/s": Decimal(1) / 8},
}
QUANTITY_EXAMPLES = {
    "bytes": 'bytes, e.g. 80GB, 80GiB, 512MB or an integer',
    "flops": 'FLOP/s, e.g. 312T, 312TFLOPS, 50G or a number',
    "bandwidth": 'bytes/s, e.g. 600GB/s, 200Gb/s (bits), 25e9',
    "time": 'seconds, e.g. 5us, 10ms, 1e-5',
}


def parse_quantity(value, kind: str) -> float:
    """Convert ``value`` (a number or a string with a unit) of ``kind`` ("bytes", "flops",
    "bandwidth", "time") to base units. Raises ValueError with the expected form."""
    expected = QUANTITY_EXAMPLES[kind]
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected {expected}")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected {expected}")
    m = _NUM.match(value)
    if not m:
        raise ValueError(f"expected {expected}")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"expected {expected}") from None
    unit = m.group(2)
    mult = _unit_multiplier(unit, kind)
    if mult is None:
        raise ValueError(f"unknown unit {unit!r}; expected {expected}")
    # Decimal arithmetic so "2.039TB/s" is exactly the float 2.039e12
    return float(number * mult)


def _unit_multiplier(unit: str, kind: str):
    if unit == "":
        return 1
    if kind == "time":
        return _TIME.get(unit)
    for prefixes in (_BIN, _DEC):
        for p, pm in prefixes.items():
            if unit.startswith(p):
                rest = unit[len(p):]
                if rest in _SUFFIX[kind]:
                    return Decimal(pm) * Decimal(_SUFFIX[kind][rest])
    return None


# Plausible ranges of a quantity in base units; outside them a BARE number (no unit) gets a warning
# that says which unit was probably meant. Wide on purpose: only typos of a unit should trip them.
_PLAUSIBLE = {
    "bytes": (2**20, 2**50, "bytes (e.g. 80GB or 80GiB)"),            # 1 MiB .. 1 PiB per device
    "bandwidth": (1e6, 1e13, "bytes/s (e.g. 600GB/s or 200Gb/s)"),     # 1 MB/s .. 10 TB/s
    "latency": (1e-8, 1e-2, "seconds (e.g. 5us)"),                       # 10 ns .. 10 ms
    "flops": (1e8, 1e17, "FLOP/s (e.g. 312T)"),
}


def _parse(value, kind: str, what: str) -> float:
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
