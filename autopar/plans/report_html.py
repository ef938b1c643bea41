"""`autopar report`: one self-contained HTML page of a plan (or two side by side).

``render_report(entries) -> str`` takes one or two ``ReportEntry`` (a plan, the file it came
from, and for a pipelined plan its simulated schedule, which the caller computes: the simulation
lives in ``autopar/search/stage_plan.py``, a layer above this one) and returns the page:

- the summary: the rows ``autopar show`` prints (``report.summary_table``), plus devices and
  samples per step; with two plans, a table of the headline metrics side by side and the text of
  ``autopar diff``;
- memory per rank as stacked bars (params, grads, optimizer state, activations, any other part
  the plan's ``memory_breakdown`` names, offloaded bytes included) against the memory budget:
  one bar per pipeline stage's ranks, or one for every rank of an unpipelined plan (all its
  ranks hold the same shares; the plan records the most loaded one);
- the pipeline timeline (``timeline.timeline_figure``, the drawing ``autopar show --timeline``
  saves), embedded as SVG;
- communication per mesh axis (the bytes each device sends per step, ``predictions.comm_bytes``)
  and the time the plan prices for communication (``time_breakdown``; per rule when recorded);
- the per-op strategy table with a search box (a few lines of inline JS; ``#q=text`` in the
  address pre-fills it).

Everything is inline (CSS, JS, SVG from matplotlib's Agg backend): the page opens without a
network. Every text from the plan goes through ``html.escape``.
"""
from __future__ import annotations

import html
import io
from dataclasses import dataclass
from typing import Any

from autopar.plans.plan import Plan
from autopar.plans.report import diff, summary_table
from autopar.plans.timeline import pyplot, timeline_figure

# The memory parts in stacking order (bottom first), their labels and colours (Okabe-Ito).
MEMORY_PARTS = (("params", "params", "#0072B2"), ("grads", "grads", "#56B4E9"),
                ("optimizer", "optimizer state", "#009E73"), ("activations", "activations", "#E69F00"),
                ("offload", "offloaded", "#999999"), ("other", "other", "#CC79A7"))
EXTRA_COLOURS = ("#D55E00", "#F0E442", "#000000", "#882255")
STATIC_PARTS = ("params", "grads", "optimizer", "other")


@dataclass
class ReportEntry:
    plan: Plan
    source: str                # the file name shown in the page
    schedule: Any = None       # solver.pipeline_schedule.SimulatedSchedule of a pipelined plan


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _bytes_text(x: float) -> str:
    x = float(x)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def _secs_text(x: float) -> str:
    x = float(x)
    if abs(x) >= 1:
        return f"{x:.3f} s"
    if abs(x) >= 1e-3:
        return f"{x * 1e3:.3f} ms"
    return f"{x * 1e6:.1f} µs"


def _byte_unit(x: float) -> tuple[str, float]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return unit, float(size)
    return "B", 1.0


def _svg(fig, salt: str) -> str:
    """``fig`` as an inline ``<svg>`` element (no XML prolog), text kept as text; deterministic."""
    plt = pyplot()
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


# ---------------------------------------------------------------- data the charts draw

def memory_bars(plan: Plan) -> list[tuple[str, dict[str, float]]]:
    """[(label, {part: bytes})], one bar per kind of rank.

    Unpipelined: one bar, the plan's ``memory_breakdown`` (every rank holds the same shares).
    Pipelined: one bar per stage's ranks (virtual stages on the same ranks summed): activations
    are the stage's peak minus its static bytes, and the static bytes are split into params,
    grads, optimizer state and other in the proportions of the plan's ``memory_breakdown`` (a
    stage records only their sum)."""
    mb = {k: float(v) for k, v in plan.memory_breakdown.items()}
    stages = plan.data.get("stages") or []
    if plan.pp <= 1 or not all("static_memory" in s and "peak_memory" in s for s in stages):
        return [("every rank" if plan.pp <= 1 else "most loaded rank", mb)]
    static_total = sum(mb.get(k, 0.0) for k in STATIC_PARTS)
    groups: dict[tuple, list[dict]] = {}
    for s in stages:
        groups.setdefault(tuple(s["ranks"]), []).append(s)
    bars = []
    for ranks, group in groups.items():
        static = sum(float(s["static_memory"]) for s in group)
        peak = max(float(s.get("rank_peak_memory", s["peak_memory"])) for s in group)
        parts = {}
        for k in STATIC_PARTS:
            parts[k] = static * mb.get(k, 0.0) / static_total if static_total else 0.0
        if not static_total:
            parts["other"] = static
        parts["activations"] = max(peak - static, 0.0)
        for k, v in mb.items():   # parts a stage does not record (offloaded bytes): the plan's value
            if k not in parts:
                parts[k] = v
        a, b = ranks[0], ranks[-1]
        stage_ids = ",".join(str(s["index"]) for s in group)
        label = f"stage {stage_ids}\nrank {a}" if a == b else f"stage {stage_ids}\nranks {a}-{b}"
        bars.append((label, parts))
    return bars


def _part_order(bars) -> list[tuple[str, str, str]]:
    known = {k for k, _, _ in MEMORY_PARTS}
    seen = [k for _, parts in bars for k in parts]
    extra = sorted({k for k in seen if k not in known})
    order = [p for p in MEMORY_PARTS if p[0] in seen]
    order += [(k, k, EXTRA_COLOURS[i % len(EXTRA_COLOURS)]) for i, k in enumerate(extra)]
    return order


def memory_chart(plan: Plan, title: str, salt: str, ymax: float | None = None) -> str:
    """Stacked bars of ``memory_bars`` against the budget line, as SVG."""
    plt = pyplot()
    bars = memory_bars(plan)
    budget = float(plan.data["settings"]["memory_budget"])
    peak = max(sum(p.values()) for _, p in bars)
    top = max(ymax or 0.0, peak)
    show_budget = budget <= 4 * top   # a far-away budget would squash the bars: say it instead
    unit, size = _byte_unit(max(top, budget if show_budget else 0.0))
    fig, ax = plt.subplots(figsize=(max(4.5, 1.2 * len(bars) + 2.5), 3.6))
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for key, label, colour in _part_order(bars):
        vals = [parts.get(key, 0.0) / size for _, parts in bars]
        ax.bar(xs, vals, bottom=bottom, color=colour, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if show_budget:
        ax.axhline(budget / size, color="#D55E00", linestyle="--", linewidth=1.2,
                   label=f"budget {_bytes_text(budget)}")
    else:
        ax.text(0.99, 0.98, f"budget {_bytes_text(budget)} (off the chart)", transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="#D55E00")
    ax.set_xticks(list(xs), [lbl for lbl, _ in bars], fontsize=8)
    ax.set_ylabel(unit)
    if ymax:
        lim = max(ymax, budget if show_budget else 0.0) / size
        ax.set_ylim(0, lim * 1.08)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    return _svg(fig, salt)


def comm_chart(plan: Plan, salt: str) -> str | None:
    """Horizontal bars: bytes each device sends per step on each mesh axis (None: nothing sent)."""
    cb = {k: float(v) for k, v in plan.comm_bytes.items()}
    if not cb or not any(cb.values()):
        return None
    plt = pyplot()
    unit, size = _byte_unit(max(cb.values()))
    names = list(cb)
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(names) + 1.2))
    ax.barh(range(len(names)), [cb[n] / size for n in names], color="#0072B2", height=0.6)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} per device per step")
    ax.set_title("communication per mesh axis", fontsize=10)
    fig.tight_layout()
    return _svg(fig, salt)


# ---------------------------------------------------------------- HTML pieces

def _table(rows, header=None, cls="kv", attrs="") -> str:
    out = [f'<table class="{cls}"{attrs}>']
    if header:
        out.append("<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr></thead>")
    out.append("<tbody>")
    for r in rows:
        cells = "".join(f"<th>{_e(c)}</th>" if i == 0 and cls == "kv" else f"<td>{_e(c)}</td>"
                        for i, c in enumerate(r))
        out.append(f"<tr>{cells}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def summary_rows(plan: Plan) -> list[tuple[str, str]]:
    """The rows of ``autopar show``'s summary, plus devices, stages and samples per step."""
    t = summary_table(plan)
    rows = [(str(a), str(b)) for a, b in zip(t.columns[0].cells, t.columns[1].cells)]
    d = plan.degrees
    samples = d.get("micro_batch_size", 0) * d.get("num_micro_batches", 1) * d.get("dp", 1)
    rows.insert(1, ("devices", f"{plan.world_size} ({plan.pp} pipeline stage(s) × mesh of {plan.mesh.size})"))
    rows.append(("samples per step", f"{samples} (micro-batch {d.get('micro_batch_size')} × "
                                     f"{d.get('num_micro_batches')} micro-batches × dp {d.get('dp')})"))
    if d.get("pp", 1) > 1:
        rows.append(("schedule", f"{d.get('pp_schedule')}, {d.get('num_micro_batches')} micro-batches"))
    rows.append(("kernels", plan.kernels))
    return rows


def headline(plan: Plan) -> dict[str, float]:
    p = plan.predictions
    return {"step_time": float(p["step_time"]), "peak_memory": float(p["peak_memory"]),
            "comm_bytes": float(sum(p["comm_bytes"].values())), "mfu": float(p["mfu"])}


HEADLINE_FMT = {"step_time": _secs_text, "peak_memory": _bytes_text, "comm_bytes": _bytes_text,
                "mfu": lambda x: f"{x * 100:.1f}%"}


def _compare_table(a: ReportEntry, b: ReportEntry) -> str:
    ha, hb = headline(a.plan), headline(b.plan)
    rows = []
    for k, fmt in HEADLINE_FMT.items():
        x, y = ha[k], hb[k]
        rel = f"{(y - x) / x:+.1%}" if x else ("" if x == y else "new")
        rows.append((k, fmt(x), fmt(y), rel))
    for k in sorted(set(a.plan.degrees) | set(b.plan.degrees)):
        x, y = a.plan.degrees.get(k), b.plan.degrees.get(k)
        rows.append((f"degree {k}", x, y, "" if x == y else "changed"))
    return _table(rows, header=("", a.source, b.source, "change"), cls="grid cmp")


def _comm_section(plan: Plan, salt: str) -> str:
    out = []
    chart = comm_chart(plan, salt)
    out.append(chart if chart else "<p>No collective traffic: every mesh axis sends 0 bytes.</p>")
    rows = [(k, _bytes_text(v)) for k, v in plan.comm_bytes.items()]
    out.append(_table(rows, header=("mesh axis", "bytes per device per step"), cls="grid"))
    tb = plan.predictions["time_breakdown"]
    times = [(k, _secs_text(tb[k])) for k in ("op_comm", "reshard_comm", "grad_comm", "grad_comm_exposed")
             if k in tb]
    if plan.pp > 1:
        p2p = [(f"stage {s['index']} p2p", f"{_bytes_text(s.get('p2p_bytes', 0))}, {_secs_text(s.get('p2p_time', 0))}")
               for s in plan.data["stages"]]
        times += p2p
    out.append("<p>Communication time the plan prices (the plan records time per kind, not per axis):</p>")
    out.append(_table(times, header=("kind", "time per step"), cls="grid"))
    by_rule = plan.predictions.get("comm_by_rule") or {}
    if by_rule:
        rows = sorted(by_rule.items(), key=lambda kv: -kv[1])
        out.append("<details><summary>communication time per rule</summary>"
                   + _table([(k, _secs_text(v)) for k, v in rows], header=("rule", "time per step"), cls="grid")
                   + "</details>")
    return "".join(out)


def _ops_section(entries: list[ReportEntry], tid: str) -> str:
    if len(entries) == 1:
        header = ("node", "op", "module", "rule", "strategy")
        rows = [(o["node"], o.get("target", "").replace("aten.", ""), o.get("module", ""), o.get("rule", ""),
                 o["strategy"]) for o in entries[0].plan.ops]
    else:
        a, b = entries
        bops = {o["node"]: o for o in b.plan.ops}
        header = ("node", "op", "module", f"strategy ({a.source})", f"strategy ({b.source})", "changed")
        rows = []
        for o in a.plan.ops:
            other = bops.pop(o["node"], None)
            s2 = other["strategy"] if other else "(absent)"
            rows.append((o["node"], o.get("target", "").replace("aten.", ""), o.get("module", ""), o["strategy"],
                         s2, "yes" if s2 != o["strategy"] else ""))
        for n, o in bops.items():
            rows.append((n, o.get("target", "").replace("aten.", ""), o.get("module", ""), "(absent)",
                         o["strategy"], "yes"))
    search = (f'<p><input type="search" class="filter" placeholder="filter ops (any column)" '
              f'data-table="{tid}" aria-label="filter ops"> '
              f'<span id="{tid}-count">{len(rows)} of {len(rows)} ops</span></p>')
    return search + _table(rows, header=header, cls="grid ops", attrs=f' id="{tid}"')


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
table.kv th{background:#f4f6f8;white-space:nowrap}table.grid thead th{background:#e9eef3;position:sticky;top:0}
table.ops td:nth-child(1),table.ops td:nth-child(n+4){font-family:ui-monospace,Menlo,Consolas,monospace}
.cols{display:flex;flex-wrap:wrap;gap:1.5em}.col{flex:1 1 28em;min-width:0}
svg{max-width:100%;height:auto}pre{background:#f6f6f6;padding:0.6em;overflow-x:auto}
input.filter{font-size:1em;padding:3px 6px;width:24em}.note{color:#555;font-size:0.85em}
"""

JS = """
(function(){
  function apply(inp){
    var table=document.getElementById(inp.getAttribute('data-table'));
    var q=inp.value.toLowerCase(), rows=table.tBodies[0].rows, shown=0;
    for(var i=0;i<rows.length;i++){
      var hit=rows[i].textContent.toLowerCase().indexOf(q)>=0;
      rows[i].style.display=hit?'':'none'; if(hit){shown++;}
    }
    document.getElementById(table.id+'-count').textContent=shown+' of '+rows.length+' ops';
  }
  var q=decodeURIComponent((location.hash.match(/[#&]q=([^&]*)/)||[])[1]||'');
  var inputs=document.querySelectorAll('input.filter');
  for(var i=0;i<inputs.length;i++){
    inputs[i].addEventListener('input',function(ev){apply(ev.target);});
    if(q){inputs[i].value=q; apply(inputs[i]);}
  }
})();
"""


def _plan_column(entry: ReportEntry, idx: int, ymax: float | None) -> dict[str, str]:
    """The sections of one plan (summary, memory, timeline, communication)."""
    p = entry.plan
    sec = {}
    sec["summary"] = _table(summary_rows(p))
    bars = memory_bars(p)
    order = _part_order(bars)
    rows = [(lbl.replace("\n", ", "), *(_bytes_text(parts.get(k, 0.0)) for k, _, _ in order),
             _bytes_text(sum(parts.values()))) for lbl, parts in bars]
    sec["memory"] = (memory_chart(p, f"memory per rank: {entry.source}", salt=f"mem{idx}", ymax=ymax)
                     + _table(rows, header=("ranks", *(lab for _, lab, _ in order), "total"), cls="grid"))
    if p.pp > 1:
        sec["memory"] += ('<p class="note">Per stage, activations are its peak minus its static bytes; the '
                          "static bytes are split into params / grads / optimizer state in the proportions of "
                          "the plan's most loaded rank (a stage records only their sum).</p>")
    if p.pp > 1 and entry.schedule is not None:
        d = p.degrees
        fig = timeline_figure(entry.schedule, title=f"predicted {d['pp_schedule']} schedule: pp={d['pp']}, "
                                                    f"{d['num_micro_batches']} micro-batches")
        sec["timeline"] = _svg(fig, salt=f"tl{idx}")
    elif p.pp > 1:
        sec["timeline"] = "<p>(no simulated schedule was given)</p>"
    else:
        sec["timeline"] = "<p>Not pipelined (pp=1): no schedule to draw.</p>"
    sec["comm"] = _comm_section(p, salt=f"comm{idx}")
    return sec


def render_report(entries: list[ReportEntry]) -> str:
    """The HTML page of one plan, or of two side by side (the first is "old" in the diff)."""
    if len(entries) not in (1, 2):
        raise ValueError(f"render_report takes one or two plans, got {len(entries)}")
    ymax = max(max(sum(parts.values()) for _, parts in memory_bars(e.plan)) for e in entries) \
        if len(entries) == 2 else None
    cols = [_plan_column(e, i, ymax) for i, e in enumerate(entries)]
    title = "autopar plan report: " + " vs ".join(e.source for e in entries)
    body = [f"<h1>{_e(title)}</h1>"]
    first = entries[0].plan
    body.append(f'<p class="note">fingerprint {_e(first.fingerprint[:16])}, plan version '
                f'{_e(first.data.get("version"))}; predictions are the planner\'s cost model, not measurements.</p>')

    def side_by_side(key: str) -> str:
        if len(cols) == 1:
            return cols[0][key]
        return '<div class="cols">' + "".join(
            f'<div class="col"><h3>{_e(e.source)}</h3>{c[key]}</div>' for e, c in zip(entries, cols)) + "</div>"

    if len(entries) == 2:
        a, b = entries
        text, _ = diff(a.plan, b.plan)
        body.append("<h2>Comparison</h2>" + _compare_table(a, b)
                    + f"<details><summary>autopar diff {_e(a.source)} {_e(b.source)} "
                      f"({text.count(chr(10))} lines)</summary><pre>{_e(text)}</pre></details>")
    body.append("<h2>Summary</h2>" + side_by_side("summary"))
    body.append("<h2>Memory per rank</h2>" + side_by_side("memory"))
    if any(e.plan.pp > 1 for e in entries):
        body.append("<h2>Pipeline timeline</h2>" + side_by_side("timeline"))
    body.append("<h2>Communication</h2>" + side_by_side("comm"))
    body.append("<h2>Per-op strategies</h2>" + _ops_section(entries, "ops"))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + f"\n<script>{JS}</script>\n</body></html>\n")
