"""Human-readable views of a Plan: the summary, `autopar show` tables and `autopar diff` (with
``--fail-on`` limits: ``parse_fail_on``, ``check_limits``)."""
from __future__ import annotations

import io
import math
import re

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
                          f"data-parallel rank" + batch_text(plan))
    tb = p["time_breakdown"]
    t.add_row("step time", f"{_secs(p['step_time'])}  (compute {_secs(tb['compute'])}, recompute "
                           f"{_secs(tb['recompute'])}, op comm {_secs(tb['op_comm'])}, reshard "
                           f"{_secs(tb['reshard_comm'])}, grad comm {_secs(tb['grad_comm'])} of which exposed "
                           f"{_secs(tb['grad_comm_exposed'])}"
                           f"{' (overlapped with backward)' if p['overlap_grad_comm'] else ''}, "
                           f"optimizer {_secs(tb['optimizer'])}{bubble_text(tb)})")
    mb = p["memory_breakdown"]
    t.add_row("peak memory", f"{_gib(p['peak_memory'])} of {_gib(plan.data['settings']['memory_budget'])}  "
                             + ", ".join(f"{k} {_gib(v)}" for k, v in mb.items()))
    off = p.get("offload")
    if off:
        nvme = (f"; optimizer state {_gib(off['nvme_bytes'])} on NVMe (its share {_gib(off['nvme_budget'])}), "
                f"read and written each step") if "nvme_bytes" in off else ""
        t.add_row("offload", f"{off['mode']} to {off['target']} ({off.get('fraction', 1.0):.1%} of the parameters' "
                             f"elements): {_gib(off['host_bytes'])} of host memory per rank "
                             f"(its share {_gib(off['host_budget'])}); per step {_gib(off['d2h_bytes'])} to the host, "
                             f"{_gib(off['h2d_bytes'])} back{nvme}")
    t.add_row("communication",
              ", ".join(f"{k}: {_gib(v)}" for k, v in p["comm_bytes"].items()) + " per device per step")
    t.add_row("MFU", f"{p['mfu'] * 100:.1f}%  ({p['model_flops']:.3g} model FLOPs per step)")
    s = plan.data["solver"]
    t.add_row("solver", f"{s['status']} (gap {s['gap']:.2%}); {s['configs']} configurations, {s['pruned']} pruned; "
                        f"ILP {s['ilp_nodes']} nodes / {s['ilp_strategy_vars']} strategy variables")
    return t


def batch_text(plan) -> str:
    """"; global batch 512 (65,536 tokens) per step" from the plan's ``batch`` field (plans made
    before it: the global batch from the degrees, micro-batch x micro-batches x dp)."""
    gb, tokens = plan.global_batch, plan.tokens_per_step
    return f"; global batch {gb:,}" + (f" ({tokens:,} tokens)" if tokens else "") + " per step"


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


def _total_comm(plan) -> float:
    return float(sum(plan.comm_bytes.values()))


# --fail-on metrics: name -> (what it is, how to read it from a plan, +1 if growing is worse / -1 if falling is)
FAIL_ON_METRICS = {
    "step_time": ("predicted step time", lambda p: float(p.predictions["step_time"]), +1, _secs),
    "peak_memory": ("predicted peak memory per device", lambda p: float(p.predictions["peak_memory"]), +1, _gib),
    "comm_bytes": ("bytes each device sends per step, all mesh axes", _total_comm, +1, _gib),
    "mfu": ("predicted model FLOPs utilisation (a drop is the regression)", lambda p: float(p.predictions["mfu"]),
            -1, lambda x: f"{x * 100:.2f}%"),
}
FAIL_ON_SYNTAX = ("METRIC=LIMIT[,METRIC=LIMIT...], LIMIT a percentage the new plan may be worse by, e.g. "
                  "step_time=+2%,peak_memory=+5% (0% allows no change for the worse)")


def parse_fail_on(text: str) -> dict[str, float]:
    """``"step_time=+2%,peak_memory=5%"`` -> ``{"step_time": 0.02, "peak_memory": 0.05}``.

    Each item is ``METRIC=LIMIT``: METRIC one of ``FAIL_ON_METRICS`` (step_time, peak_memory,
    comm_bytes, mfu), LIMIT a non-negative percentage with an optional ``+`` (``+2%``, ``2%``,
    ``0.5%``, ``0%``): how much worse (relative to the old plan) the new plan may be. Anything
    else (an unknown metric, a number without ``%``, a negative limit, a metric given twice) is a
    PlanError that names the item and the syntax."""
    from autopar.errors import PlanError

    if not text or not text.strip():
        raise PlanError(f"--fail-on is empty: give {FAIL_ON_SYNTAX}")
    out: dict[str, float] = {}
    for item in text.split(","):
        item = item.strip()
        if "=" not in item:
            raise PlanError(f"--fail-on item {item!r} is not METRIC=LIMIT: give {FAIL_ON_SYNTAX}")
        name, limit = (x.strip() for x in item.split("=", 1))
        if name not in FAIL_ON_METRICS:
            raise PlanError(f"--fail-on: unknown metric {name!r}; the metrics are "
                            f"{', '.join(FAIL_ON_METRICS)}")
        if name in out:
            raise PlanError(f"--fail-on: {name} is given twice: give each metric once")
        m = re.fullmatch(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*%", limit)
        if m is None:
            raise PlanError(f"--fail-on {name}={limit}: the limit must be a percentage such as +2% or 0.5%")
        if m.group(1) == "-" and float(m.group(2)) != 0:
            raise PlanError(f"--fail-on {name}={limit}: a limit is how much worse the new plan may be, "
                            f"0% or more (a negative one would demand an improvement)")
        value = float(m.group(2)) / 100
        if not math.isfinite(value):
            raise PlanError(f"--fail-on {name}={limit}: the limit must be a finite percentage")
        out[name] = value
    return out


def check_limits(old, new, limits: dict[str, float]) -> tuple[str, bool]:
    """Each ``--fail-on`` metric of ``old`` and ``new``: (text, whether any got worse beyond its limit)."""
    lines = ["--fail-on checks (old -> new, change for the worse, limit):"]
    failed = 0
    for name, limit in limits.items():
        _, read, sign, fmt = FAIL_ON_METRICS[name]
        a, b = read(old), read(new)
        worse = sign * (b - a)
        if a:
            rel = worse / abs(a)
        else:
            rel = math.inf if worse > 0 else 0.0
        rel += 0.0   # no "-0.00%"
        bad = rel > limit + 1e-12
        failed += bad
        rel_text = "+inf" if math.isinf(rel) else f"{rel:+.2%}"
        lines.append(f"  {name}: {fmt(a)} -> {fmt(b)}, worse by {rel_text}, limit +{limit:.2%}: "
                     f"{'REGRESSION' if bad else 'ok'}")
    lines.append(f"{failed} of {len(limits)} metric(s) regressed beyond the limit" + (" (exit 1)" if failed else ""))
    return "\n".join(lines) + "\n", bool(failed)


def diff(old, new, threshold: float | None = 0.02, fail_on: dict[str, float] | None = None) -> tuple[str, bool]:
    """What changed between two plans; returns (text, regressed). A regression is predicted step
    time or peak memory growing by more than ``threshold`` (relative); with ``fail_on``
    (``parse_fail_on``) instead each named metric growing (mfu: falling) beyond its own limit."""
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
        if fail_on is None and threshold is not None and rel > threshold:
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
    text = "\n".join(lines) + "\n"
    if fail_on is not None:
        checks, regressed = check_limits(old, new, fail_on)
        text += checks
    return text, regressed
