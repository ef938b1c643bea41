#!/usr/bin/env bash
# Creates .venv (if missing) and installs autopar with what the demo and tests need.
# torch is pinned to the CPU build already on these machines (constraints.txt); the package itself
# only requires torch>=2.5. Safe to run repeatedly: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
extras=${1:-test,hf}
stamp=".venv/.autopar-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "[setup] installing autopar[$extras] into .venv (first run: ~1-2 min)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi
# The browser tests of `autopar report` (tests/cli/test_report_html.py) open the page in a headless
# Chromium; they skip when there is none. Install it when missing and we can (root or password-less
# sudo, apt-get); otherwise say so and go on.
if [[ ",$extras," == *",test,"* ]] && [ -z "${AUTOPAR_CHROMIUM:-}" ] \
   && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
   && ! command -v google-chrome >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; fi
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }; then
    echo "[setup] installing chromium (browser tests of autopar report; ~1 min)"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
      || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; } \
      || echo "[setup] WARNING: apt-get could not install chromium: the browser tests of autopar report will skip"
  else
    echo "[setup] no Chromium and no way to install it here (needs apt-get as root or password-less sudo):" \
         "the browser tests of autopar report will skip. Install chromium, or set AUTOPAR_CHROMIUM=/path/to/chrome"
  fi
fi
