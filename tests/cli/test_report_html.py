"""`autopar report` (autopar/plans/report_html.py): the HTML page of a plan, opened in a real
headless Chromium (tests/helpers/browser.py) for a pipelined, a sequence-parallel and a 2D tensor-parallel
plan: it loads without a JS error and its screenshot is not blank. The checker itself is shown to
catch a page with a deliberate JS error. Without a browser those tests skip (scripts/setup.sh
installs one)."""
from __future__ import annotations

import json
import re

import pytest

import autopar
from autopar.cli import main
from autopar.models import ZOO
from autopar.plans.plan import Plan
from autopar.plans.report_html import memory_bars
from helpers.browser import blank_reason, find_chromium, load_page

BROWSER = find_chromium()
needs_browser = pytest.mark.skipif(
    BROWSER is None, reason="no Chromium on this machine: `apt-get install chromium` (scripts/setup.sh does it "
                            "when it can) or set AUTOPAR_CHROMIUM to a Chromium/Chrome binary")


def _plan(devices, **constraints):
    model, batch = ZOO["gpt2"]()
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), precision="fp32",
                        constraints=constraints)


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    plans = {"pipelined": _plan(2, pp=2, pp_schedule="1f1b", num_micro_batches=4),
             "sequence": _plan(4, sp=2, sp_mode="ulysses"),
             "grid2d": _plan(4, tp_mode="2d")}
    assert plans["pipelined"].pp == 2
    assert plans["sequence"].degrees["sp"] == 2
    assert plans["grid2d"].degrees["tp_mode"] == "2d"
    out = {}
    for name, p in plans.items():
        out[name] = d / f"{name}.json"
        p.save(out[name])
    return out


def _report(capsys, plan, out, *extra):
    code = main(["report", str(plan), "-o", str(out), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return out.read_text()


@pytest.mark.parametrize("kind", ["pipelined", "sequence", "grid2d"])
def test_report_is_self_contained_and_complete(capsys, plan_files, tmp_path, kind):
    page = _report(capsys, plan_files[kind], tmp_path / "r.html")
    plan = Plan.load(plan_files[kind])
    # self-contained: no external script, stylesheet, image or font
    assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=|<link\b|@import|url\(\s*['\"]?https?:", page)
    for section in ("Summary", "Memory per rank", "Communication", "Per-op strategies"):
        assert f"<h2>{section}</h2>" in page
    assert ("<h2>Pipeline timeline</h2>" in page) == (kind == "pipelined")
    assert page.count("<svg") >= (3 if kind == "pipelined" else 2)
    for axis, sent in plan.comm_bytes.items():
        assert f"<td>{axis}</td>" in page
    assert page.count("<tr>") >= len(plan.ops)
    assert "samples per step" in page and "step time" in page and "peak memory" in page


def test_memory_bars_per_stage_add_up_to_the_stage_peaks(plan_files):
    p = Plan.load(plan_files["pipelined"])
    bars = memory_bars(p)
    assert len(bars) == 2
    for (_, parts), stage in zip(bars, p.data["stages"]):
        assert sum(parts.values()) == pytest.approx(stage["rank_peak_memory"])
        assert parts["activations"] == pytest.approx(stage["peak_memory"] - stage["static_memory"])
    (_, one), = memory_bars(Plan.load(plan_files["grid2d"]))
    assert sum(one.values()) == Plan.load(plan_files["grid2d"]).peak_memory


def test_text_is_escaped(capsys, plan_files, tmp_path):
    data = json.loads(plan_files["sequence"].read_text())
    data["ops"][0]["module"] = "<script>alert(1)</script>"
    bad = tmp_path / "evil.json"
    bad.write_text(json.dumps(data))
    page = _report(capsys, bad, tmp_path / "r.html")
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page


def test_missing_and_invalid_plan_files_are_clear_errors(capsys, tmp_path):
    code = main(["report", str(tmp_path / "nope.json"), "-o", str(tmp_path / "r.html")])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code = main(["report", str(bad), "-o", str(tmp_path / "r.html")])
    assert code == 2 and "invalid JSON" in capsys.readouterr().err
    code = main(["report", str(bad), "-o", str(tmp_path / "no" / "dir" / "r.html")])
    assert code == 2
    assert not (tmp_path / "r.html").exists()


@needs_browser
@pytest.mark.parametrize("kind", ["pipelined", "sequence", "grid2d"])
def test_report_opens_in_chromium_without_errors(capsys, plan_files, tmp_path, kind):
    html_file = tmp_path / f"{kind}.html"
    _report(capsys, plan_files[kind], html_file)
    res = load_page(html_file, tmp_path, BROWSER)
    assert res.errors == [], res.errors
    assert blank_reason(res.screenshot) is None, blank_reason(res.screenshot)
    assert res.dom.count("<svg") >= 2


@needs_browser
def test_compare_page_and_filter_in_chromium(capsys, plan_files, tmp_path):
    """--compare: both plans side by side (comparison table, both memory charts); the filter box,
    pre-filled from ``#q=``, hides the rows that do not match."""
    html_file = tmp_path / "cmp.html"
    page = _report(capsys, plan_files["sequence"], html_file, "--compare", str(plan_files["grid2d"]))
    assert "<h2>Comparison</h2>" in page and "memory per rank: sequence.json" in page
    assert "memory per rank: grid2d.json" in page
    res = load_page(html_file, tmp_path, BROWSER, fragment="#q=scaled_dot")
    assert res.errors == [], res.errors
    assert blank_reason(res.screenshot) is None
    body = res.dom[res.dom.index('id="ops"'):].split("<tbody>")[1].split("</tbody>")[0]
    rows = re.findall(r"<tr[^>]*>(?:(?!</tr>).)*</tr>", body, re.DOTALL)
    visible = [r for r in rows if "display: none" not in r]
    n_ops = len(Plan.load(plan_files["sequence"]).ops)
    assert len(rows) == n_ops
    assert 0 < len(visible) < n_ops and all("scaled_dot_product_attention" in r for r in visible)
    assert f"{len(visible)} of {n_ops} ops" in res.dom


@needs_browser
def test_checker_catches_js_errors_and_blank_pages(tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text("<!DOCTYPE html><html><head><title>t</title></head><body><h1>hello</h1>"
                      "<p>some text to draw</p><script>undefinedFunction();</script></body></html>")
    res = load_page(broken, tmp_path, BROWSER, window=(400, 300))
    assert any("undefinedFunction" in e for e in res.errors), res.errors
    logged = tmp_path / "logged.html"
    logged.write_text("<html><head></head><body><script>console.error('bad thing')</script></body></html>")
    assert any("bad thing" in e for e in load_page(logged, tmp_path, BROWSER, window=(400, 300)).errors)
    blank = tmp_path / "blank.html"
    blank.write_text("<html><head></head><body style='background:#fff'></body></html>")
    res = load_page(blank, tmp_path, BROWSER, window=(400, 300))
    assert res.errors == [] and blank_reason(res.screenshot) is not None


def test_memory_parts_the_plan_names_are_drawn(capsys, plan_files, tmp_path):
    """Offloaded bytes (a part a future plan may record) and unknown parts get their own bars'
    segments and table columns; the budget is named when it is far above the bars."""
    data = json.loads(plan_files["grid2d"].read_text())
    data["predictions"]["memory_breakdown"].update(offload=2**20, kv_cache=2**19)
    f = tmp_path / "offload.json"
    f.write_text(json.dumps(data))
    (_, parts), = memory_bars(Plan.load(f))
    assert parts["offload"] == 2**20 and parts["kv_cache"] == 2**19
    page = _report(capsys, f, tmp_path / "r.html")
    assert "<th>offloaded</th>" in page and "<th>kv_cache</th>" in page
    assert "off the chart" in page          # a 4 GiB budget over ~2 MiB of bars
