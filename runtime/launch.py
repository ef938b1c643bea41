"""Local multi-process launching on CPU (gloo): for tests, demos and `autopar run`.

``run_local(fn, nprocs)`` forks ``nprocs`` processes (fork start: ~0.3 s for 8 ranks, where
spawn re-imports torch in every child), initialises a gloo process group in each, calls
``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. A rank that
raises makes ``run_local`` raise ``LocalLaunchError`` naming the rank and carrying its
traceback; a rank that hangs is killed after ``timeout`` seconds — never a hang.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta


class LocalLaunchError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, fn, args, queue, pg_timeout):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report every failure, including KeyboardInterrupt in a child
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_local(fn, nprocs: int, args: tuple = (), timeout: float = 300.0, pg_timeout: float = 60.0):
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` forked gloo ranks; return results by rank."""
    # Import once in the parent: a forked rank's first backward otherwise spends 1-2 s importing it.
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, fn, args, queue, pg_timeout), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    import queue as queue_mod
    try:
        for _ in range(nprocs):
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(nprocs)) - set(results) - set(errors))
                raise LocalLaunchError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            (results if ok else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise LocalLaunchError(f"rank {rank} of {nprocs} failed:\n{errors[rank]}")
    return [results[r] for r in range(nprocs)]


def run_script(script: str, script_args: list[str], nprocs: int = 2, timeout: float | None = None) -> int:
    """`autopar run -n N script.py args...`: start N local processes with the torchrun environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so a script written for torchrun runs
    unchanged on CPU. If one rank fails the others are stopped; returns the first non-zero exit code."""
    import subprocess
    import sys
    import time

    if nprocs < 1:
        raise ValueError(f"-n must be at least 1, got {nprocs}")
    port = _free_port()
    procs = []
    for r in range(nprocs):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, script, *script_args], env=env))
    start = time.monotonic()
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or (timeout is not None and time.monotonic() - start > timeout):
                code = failed[0] if failed else 124
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    if code == 0:
        code = next((p.returncode for p in procs if p.returncode), 0)
    return code
