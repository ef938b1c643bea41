"""``autopar serve`` in a child process, for scripts, load tests and tests.

``with serve_process(["hf_llama", "--devices", "2", ...]) as url:`` starts ``autopar serve`` with
those arguments on a free loopback port (its own process group), waits until ``/health`` answers,
yields the base URL, and on exit stops the server and its ranks with SIGINT (SIGKILL after
``stop_timeout``). A server that exits before it is up, or is not up within ``start_timeout``, is
an ExecutionError carrying what it printed.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from autopar.errors import ExecutionError

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(args: list[str], start_timeout: float = 180.0, stop_timeout: float = 30.0):
    import httpx
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "autopar.cli", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise ExecutionError(f"autopar serve exited with code {proc.returncode} before it was up: "
                                     f"{proc.stdout.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise ExecutionError(f"autopar serve was not up within {start_timeout:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
