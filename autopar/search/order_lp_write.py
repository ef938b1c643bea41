"""Regenerating the stored order-LP table of autopar/search/order_lp_stored.py: ``solve_units``
solves the order LP at b = 0 for given (schedule, pp, m) keys (pipeline_bounds.solve_order_lp, no
stored value read) and ``write_table`` rewrites the table at the end of order_lp_stored.py
(``python -m autopar.search.order_lp_write``, about 30 CPU s)."""
from __future__ import annotations

from autopar.search import order_lp_stored
from autopar.search.order_lp_stored import TABLE_MARKER, format_table, table_keys
from autopar.search.pipeline_bounds import solve_order_lp


def solve_units(keys) -> dict:
    """{key: the order LP's optimum at b = 0}, solved now (no stored value read)."""
    return {k: solve_order_lp(k[0], k[1], k[2], 0.0) for k in keys}


def write_table(path: str = order_lp_stored.__file__) -> None:
    """Solve ``table_keys`` and rewrite the table at the end of order_lp_stored.py."""
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text[:text.index(TABLE_MARKER + "\n_ROWS")] + format_table(solve_units(table_keys())))


__all__ = ["solve_units", "write_table"]

if __name__ == "__main__":
    write_table()
