"""Pictures of a pipeline plan: the simulated schedule as a timeline PNG, and the stage table.

``draw_timeline`` renders a ``solver.pipeline_schedule.SimulatedSchedule`` with matplotlib: one
row per rank, a box per action (forward, full backward, input-gradient and weight-gradient
backward in distinct colours) labelled with its micro-batch, the idle time of each row left as
a grey band so the bubble shows, and each point-to-point transfer as a thin line from the
sender's row to the receiver's. ``stage_table`` renders the per-stage summary ``autopar show``
prints. ``timeline_figure`` is the drawing itself (the HTML report embeds it as SVG,
autopar/plans/report_html.py). matplotlib is imported only when drawing (``pip install 'autopar[plot]'``).
"""
from __future__ import annotations

import os
from typing import Iterable, Mapping

from rich.table import Table

from autopar.errors import PlanError
from solver.pipeline_schedule import SimulatedSchedule

# Colour-blind-safe (Okabe-Ito) colours per action kind.
COLOURS = {"F": "#0072B2", "B": "#009E73", "I": "#E69F00", "W": "#CC79A7"}
NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "backward (weight grad)"}
IDLE = "#DDDDDD"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (never a window); a PlanError when missing."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise PlanError("drawing a timeline needs matplotlib: pip install 'autopar[plot]' "
                        "(or pip install matplotlib)") from e
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    return plt


def draw_timeline(sim: SimulatedSchedule, path: str | os.PathLike, title: str | None = None) -> str:
    """Draw ``sim`` to the image ``path`` (PNG, or SVG etc. by its suffix); returns the path. Times
    are shown in ms."""
    plt = pyplot()
    fig = timeline_figure(sim, title)
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
    return os.fspath(path)


def timeline_figure(sim: SimulatedSchedule, title: str | None = None):
    """The matplotlib Figure of ``sim`` (``draw_timeline`` saves it; the HTML report embeds it as
    SVG). The caller closes it."""
    plt = pyplot()
    from matplotlib.patches import Patch

    ranks = sim.ranks
    if not ranks or sim.step_time <= 0:
        raise PlanError("nothing to draw: the simulated schedule has no actions")
    scale = 1e3  # seconds -> ms on the axis
    step = sim.step_time * scale
    pp = len(ranks)
    chunks = max(sim.stage_rank) // pp + 1 if sim.stage_rank else 1
    fig_w = min(24.0, max(10.0, 0.35 * len(sim.intervals) / pp + 4))
    fig, ax = plt.subplots(figsize=(fig_w, 0.75 * pp + 1.6))
    row = {r: i for i, r in enumerate(ranks)}
    h = 0.7
    for r in ranks:  # the whole row in grey: whatever no box covers is idle time
        ax.barh(row[r], step, left=0, height=h, color=IDLE, edgecolor="none", zorder=0)
    min_label = step / 150  # boxes narrower than this get no text
    for iv in sim.intervals:
        x, w = iv.start * scale, (iv.end - iv.start) * scale
        if w <= 0:
            continue
        # Later model chunks of a rank (interleaving) are drawn lighter.
        alpha = 1.0 - 0.45 * (iv.stage // pp) / max(chunks - 1, 1)
        ax.barh(row[iv.rank], w, left=x, height=h, color=COLOURS[iv.kind], alpha=alpha,
                edgecolor="white", linewidth=0.6, zorder=2)
        if w >= min_label:
            label = str(iv.micro_batch) if chunks == 1 else f"{iv.micro_batch}.{iv.stage // pp}"
            ax.text(x + w / 2, row[iv.rank], label, ha="center", va="center", fontsize=7,
                    color="white" if iv.kind in ("F", "B") else "black", zorder=3)
    for t in sim.transfers:  # thin marks: from the sender's row edge to the receiver's
        y0, y1 = row[t.src_rank], row[t.dst_rank]
        sgn = 1 if y1 > y0 else -1
        ax.plot([t.start * scale, t.end * scale], [y0 + sgn * h / 2, y1 - sgn * h / 2],
                color="#555555", linewidth=0.6, alpha=0.7, zorder=1)
    for r in ranks:
        idle = sim.idle(r)
        ax.text(step * 1.005, row[r], f"idle {100 * idle / sim.step_time:.0f}%", va="center", fontsize=8)
    ax.set_yticks([row[r] for r in ranks], [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, step * 1.08)
    ax.set_xlabel("time (ms)")
    kinds = sorted({iv.kind for iv in sim.intervals}, key="FBIW".index)
    handles = [Patch(color=COLOURS[k], label=NAMES[k]) for k in kinds] + [Patch(color=IDLE, label="idle (bubble)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / pp),
              ncol=len(handles), fontsize=8, frameon=False)
    head = f"step {step:.3g} ms, bubble {100 * sim.bubble_fraction:.1f}%"
    head += "; boxes: micro-batch" + (".chunk (later chunks lighter)" if chunks > 1 else "")
    ax.set_title(f"{title}: {head}" if title else head, fontsize=10)
    fig.tight_layout()
    return fig


def _fmt_bytes(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _fmt_secs(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.2f} ms"


def _fmt_seq(v) -> str:
    if isinstance(v, str):
        return v
    v = list(v)
    if len(v) == 2 and all(isinstance(i, int) for i in v) and v[0] < v[1]:
        return f"{v[0]}-{v[1] - 1}" if v[1] - v[0] > 1 else str(v[0])
    return ", ".join(str(i) for i in v)


STAGE_KEYS = ("index", "ranks", "blocks", "time", "peak_memory")


def stage_table(stages: Iterable[Mapping], title: str = "pipeline stages") -> Table:
    """A rich Table with one row per stage dict ``{index, ranks, blocks, time, peak_memory}``.

    ``ranks``: the stage's ranks (a list, or text); ``blocks``: ``[first, end)`` block range (a
    pair, end exclusive) or text; ``time``: seconds per micro-batch (forward + backward);
    ``peak_memory``: bytes at the stage's peak, with the micro-batches its schedule keeps alive.
    """
    t = Table(title=title)
    for col, just in (("stage", "right"), ("ranks", "left"), ("blocks", "left"),
                      ("time / micro-batch", "right"), ("peak memory", "right")):
        t.add_column(col, justify=just)
    for i, s in enumerate(stages):
        missing = [k for k in STAGE_KEYS if k not in s]
        if missing:
            raise PlanError(f"stage entry {i} lacks {missing}; each needs {list(STAGE_KEYS)}")
        t.add_row(str(s["index"]), _fmt_seq(s["ranks"]), _fmt_seq(s["blocks"]),
                  _fmt_secs(float(s["time"])), _fmt_bytes(float(s["peak_memory"])))
    return t
