"""Human-readable views of a Plan: the summary, `autopar show` tables and `autopar diff`."""
from __future__ import annotations

import io

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autopar.plans.plan_schema import checkpoint_mode_of


def _gib(x: float) -> str:
    if x >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    if x >= 2**20:
        return f"{x / 2**20:.1f} MiB"
    return f"{x / 2**10:.1f} KiB"


def _secs(x: float) -> str:
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} µs"


def _render(*renderables) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=110, color_system=None, force_terminal=False)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def summary_table(plan) -> Table:
    d, p = plan.degrees, plan.predictions
    c = plan.data["cluster"]
    t = Table(title="autopar plan", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    t.add_row("cluster", f"{c['name']}: {c['nodes']} node(s) × {c['devices_per_node']} {c['device']['name']}")
    t.add_row("mesh", plan.mesh.describe())
    t.add_row("degrees", f"dp={d['dp']} tp={d['tp']} ({d['tp_mode']}) pp={d['pp']} sp={d['sp']}"
                         + (f" ({d['sp_mode']})" if d.get("sp_mode") else "")
                         + (" u×r={}×{}".format(*d["sp_shape"]) if d.get("sp_shape") else "") + f" zero={d['zero']} "
                         f"checkpoint={d['checkpoint']}")
    ck = checkpoint_text(plan)
    if ck:
        t.add_row("recompute", ck)
    split = split_text(plan)
    if split:
        t.add_row("work split", split)
    t.add_row("batching", f"micro-batch {d['micro_batch_size']} × {d['num_micro_batches']} micro-batches per "
                          f"data-parallel rank")
    tb = p["time_breakdown"]
    t.add_row("step time", f"{_secs(p['step_time'])}  (compute {_secs(tb['compute'])}, recompute "
                           f"{_secs(tb['recompute'])}, op comm {_secs(tb['op_comm'])}, reshard "
                           f"{_secs(tb['reshard_comm'])}, grad comm {_secs(tb['grad_comm'])} of which exposed "
                           f"{_secs(tb['grad_comm_exposed'])}{' (overlapped with backward)' if p['overlap_grad_comm'] else ''}, "
                           f"optimizer {_secs(tb['optimizer'])}{bubble_text(tb)})")
    mb = p["memory_breakdown"]
    t.add_row("peak memory", f"{_gib(p['peak_memory'])} of {_gib(plan.data['settings']['memory_budget'])}  "
                             + ", ".join(f"{k} {_gib(v)}" for k, v in mb.items()))
    t.add_row("communication", ", ".join(f"{k}: {_gib(v)}" for k, v in p["comm_bytes"].items()) + " per device per step")
    t.add_row("MFU", f"{p['mfu'] * 100:.1f}%  ({p['model_flops']:.3g} model FLOPs per step)")
    s = plan.data["solver"]
    t.add_row("solver", f"{s['status']} (gap {s['gap']:.2%}); {s['configs']} configurations, {s['pruned']} pruned; "
                        f"ILP {s['ilp_nodes']} nodes / {s['ilp_strategy_vars']} strategy variables")
    return t


def checkpoint_text(plan) -> str:
    """Per block group what backward recomputes: "blocks: selective (attention cores)" etc."""
    stages = plan.data.get("stages") or [{}]
    decided = stages[0].get("checkpoint") or {}
    what = {"none": "none", "selective": "selective (attention cores)", "full": "full (whole blocks)"}
    return ", ".join(f"{g}: {what[checkpoint_mode_of(v)]}" for g, v in decided.items())


def bubble_text(tb: dict) -> str:
    """The pipeline bubble part of the step-time breakdown (pipelined plans only)."""
    if "bubble" not in tb:
        return ""
    frac = tb.get("bubble_fraction")
    return f", pipeline bubble {_secs(tb['bubble'])}" + (f" ({frac:.1%} of all ranks' time)" if frac else "")


def pipeline_stage_table(plan) -> Table | None:
    """One row per (virtual) stage of a pipelined plan (autopar/plans/timeline.py's stage_table)."""
    from autopar.plans.timeline import stage_table

    d = plan.degrees
    if d.get("pp", 1) <= 1:
        return None
    rows = []
    for s in plan.data["stages"]:
        a, b = s["ranks"]
        i, j = s["blocks"]
        rows.append(dict(s, ranks=f"{a}-{b}" if b > a else str(a),
                         blocks=(f"{i}-{j - 1}" if j - i > 1 else str(i)) + f" ({s['alive_micro_batches']} alive)"))
    tb = plan.predictions["time_breakdown"]
    return stage_table(rows, title=f"pipeline stages: pp={d['pp']} {d['pp_schedule']}, {d['num_micro_batches']} "
                                   f"micro-batches, bubble {_secs(tb.get('bubble', 0.0))}")


def split_text(plan) -> str:
    """What each mesh axis of size > 1 really splits: the share of forward FLOPs whose op splits its
    work there. A degree alone over-states splitting: an axis nothing splits over only repeats work."""
    share = plan.predictions.get("split_share")
    if not share:
        return ""
    mesh = plan.mesh
    parts = []
    for a, name in enumerate(mesh.names):
        n = mesh.shape[a]
        if n <= 1:
            continue
        f = share.get(name, 0.0)
        if f <= 0.0:
            parts.append(f"{name}: nothing (its {n} devices repeat the same work)")
        else:
            parts.append(f"{name}: {f:.0%} of FLOPs")
    return ", ".join(parts)


def summary_text(plan) -> str:
    return _render(summary_table(plan))


def ops_table(plan, limit: int | None = None) -> Table:
    t = Table(title="per-op strategies")
    for col in ("node", "op", "module", "rule", "strategy"):
        t.add_column(col)
    rows = plan.ops if limit is None else plan.ops[:limit]
    for op in rows:
        # escaped: "[ring_attention]" in a strategy name is not rich markup
        t.add_row(op["node"], op["target"].replace("aten.", ""), op["module"], op["rule"], escape(op["strategy"]))
    if limit is not None and len(plan.ops) > limit:
        t.add_row("…", f"{len(plan.ops) - limit} more", "", "", "")
    return t


def memory_table(plan) -> Table:
    t = Table(title="memory on the most loaded device")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    t.add_column("GiB", justify="right")
    for k, v in plan.memory_breakdown.items():
        t.add_row(k, f"{v:,}", f"{v / 2**30:.3f}")
    t.add_row("peak", f"{plan.peak_memory:,}", f"{plan.peak_memory / 2**30:.3f}")
    return t


def show_text(plan, limit: int | None = 60) -> str:
    stages = pipeline_stage_table(plan)
    return _render(summary_table(plan), *([stages] if stages is not None else []), memory_table(plan),
                   ops_table(plan, limit))


def diff(old, new, threshold: float = 0.02) -> tuple[str, bool]:
    """What changed between two plans; returns (text, regressed). A regression is predicted step
    time or peak memory growing by more than ``threshold`` (relative)."""
    lines = []
    if old.fingerprint != new.fingerprint:
        lines.append("graph fingerprint differs: the plans are for different models/shapes")
    for k in sorted(set(old.degrees) | set(new.degrees)):
        if old.degrees.get(k) != new.degrees.get(k):
            lines.append(f"degree {k}: {old.degrees.get(k)} -> {new.degrees.get(k)}")
    old_ops = {o["node"]: o for o in old.ops}
    changed = [(n, old_ops[n]["strategy"], o["strategy"]) for o in new.ops
               for n in [o["node"]] if n in old_ops and old_ops[n]["strategy"] != o["strategy"]]
    for n, a, b in changed[:50]:
        lines.append(f"op {n}: {a} -> {b}")
    if len(changed) > 50:
        lines.append(f"... {len(changed) - 50} more changed ops")
    added = [o["node"] for o in new.ops if o["node"] not in old_ops]
    if added:
        lines.append(f"{len(added)} ops only in the new plan")
    regressed = False
    for key, fmt in (("step_time", _secs), ("peak_memory", _gib)):
        a, b = old.predictions[key], new.predictions[key]
        rel = (b - a) / a if a else 0.0
        mark = ""
        if rel > threshold:
            regressed = True
            mark = "  REGRESSION"
        if a != b:
            lines.append(f"{key}: {fmt(a)} -> {fmt(b)} ({rel:+.1%}){mark}")
    for k in sorted(set(old.comm_bytes) | set(new.comm_bytes)):
        a, b = old.comm_bytes.get(k, 0), new.comm_bytes.get(k, 0)
        if a != b:
            lines.append(f"comm bytes [{k}]: {_gib(a)} -> {_gib(b)}")
    if not lines:
        lines.append("plans are identical in degrees, strategies and predictions")
    return "\n".join(lines) + "\n", regressed
