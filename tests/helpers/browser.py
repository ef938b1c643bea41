"""Open an HTML file in a real headless Chromium: the JS errors it raised and a screenshot.

``find_chromium()`` is the browser's path or None (``AUTOPAR_CHROMIUM``, else ``chromium``,
``chromium-browser``, ``google-chrome`` on PATH; scripts/setup.sh installs Debian's ``chromium``).
``load_page(path, workdir)`` runs it twice, no driver or extra package needed:

- ``--dump-dom`` on a copy of the page with a collector script injected first in ``<head>``: it
  records uncaught errors (``window`` ``error`` events, failed resource loads included),
  unhandled promise rejections and ``console.error`` calls, and after ``load`` writes them into
  the DOM as JSON, which the dumped DOM returns. Chromium's own console log (``--enable-logging
  =stderr``: ``CONSOLE ... "Uncaught ..."`` lines) is read too, so an error before the collector
  runs is not missed. A page whose ``load`` never fires is reported as an error.
- ``--screenshot`` of the page itself, read back with matplotlib; ``blank_reason`` says why a
  screenshot looks empty (one colour, or almost nothing but the background).
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib import image

MARKER = "__autopar_page_errors"
COLLECTOR = """<script>(function(){var errs=[];window.__autoparErrors=errs;
window.addEventListener('error',function(e){var t=e.target;errs.push('error: '+(e.message||(t&&t.outerHTML?
'failed to load '+t.outerHTML.slice(0,120):'?')));},true);
window.addEventListener('unhandledrejection',function(e){errs.push('unhandled rejection: '+e.reason);});
var ce=console.error;console.error=function(){errs.push('console.error: '+Array.prototype.join.call(arguments,' '));
return ce.apply(console,arguments);};
window.addEventListener('load',function(){setTimeout(function(){var p=document.createElement('pre');
p.id='%s';p.textContent=JSON.stringify(errs);document.body.appendChild(p);},0);});})();</script>""" % MARKER


def find_chromium() -> str | None:
    env = os.environ.get("AUTOPAR_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageResult:
    errors: list[str]          # JS errors, failed loads, console.error calls; [] on a clean page
    dom: str                   # the DOM after load (collector included)
    screenshot: Path


def _run(browser: str, args: list[str], workdir: Path, timeout: float) -> subprocess.CompletedProcess:
    profile = workdir / "chromium-profile"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)


def inject_collector(page: str) -> str:
    m = re.search(r"<head[^>]*>", page, re.IGNORECASE)
    if m:
        return page[:m.end()] + COLLECTOR + page[m.end():]
    return COLLECTOR + page


def load_page(path: str | os.PathLike, workdir: str | os.PathLike, browser: str | None = None,
              window: tuple[int, int] = (1280, 2000), fragment: str = "", timeout: float = 90.0) -> PageResult:
    """Open ``path`` (``#fragment`` appended) in headless Chromium; see the module docstring."""
    browser = browser or find_chromium()
    if browser is None:
        raise RuntimeError("no Chromium found (install chromium, or set AUTOPAR_CHROMIUM)")
    path, workdir = Path(path).resolve(), Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    probe = path.with_name(path.stem + ".probe.html")   # same directory: relative links resolve alike
    probe.write_text(inject_collector(path.read_text(encoding="utf-8")), encoding="utf-8")
    try:
        res = _run(browser, ["--virtual-time-budget=3000", "--dump-dom", probe.as_uri() + fragment], workdir, timeout)
    finally:
        probe.unlink()
    errors: list[str] = []
    m = re.search(r'<pre id="%s">(.*?)</pre>' % MARKER, res.stdout, re.DOTALL)
    if m is None:
        errors.append(f"the page never finished loading (no {MARKER} in the DOM; chromium exit {res.returncode}: "
                      f"{res.stderr.strip()[-300:]})")
    else:
        errors += json.loads(html.unescape(m.group(1)))
    for line in res.stderr.splitlines():   # chromium's own console log: errors the collector missed
        m = re.search(r'CONSOLE[^\]]*\] "(.*)", source: (.*)$', line)
        if m and ("Uncaught" in m.group(1) or "Error" in m.group(1)) and not any(m.group(1) in e for e in errors):
            errors.append(f"console: {m.group(1)} ({m.group(2)})")
    shot = workdir / (path.stem + ".png")
    res2 = _run(browser, [f"--window-size={window[0]},{window[1]}", f"--screenshot={shot}", path.as_uri() + fragment],
                workdir, timeout)
    if not shot.exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {res2.returncode}): {res2.stderr.strip()[-500:]}")
    return PageResult(errors, res.stdout, shot)


def blank_reason(png: str | os.PathLike) -> str | None:
    """Why the screenshot looks blank, or None when it shows something: more than a handful of
    colours and at least 1% of the pixels differ from the most common (background) colour."""
    img = image.imread(os.fspath(png))
    px = (np.asarray(img)[..., :3] * 255).round().astype(np.int64).reshape(-1, 3)
    keys = px[:, 0] * 65536 + px[:, 1] * 256 + px[:, 2]
    values, counts = np.unique(keys, return_counts=True)
    if len(values) < 8:
        return f"only {len(values)} distinct colour(s)"
    background_share = counts.max() / len(keys)
    if background_share > 0.99:
        return f"{background_share:.1%} of the pixels are the background colour"
    return None
