"""Local multi-process launching on CPU (gloo): for tests, demos and `autopar run`.

``run_local(fn, nprocs)`` forks ``nprocs`` processes (fork start: ~0.3 s for 8 ranks, where
spawn re-imports torch in every child), initialises a gloo process group in each, calls
``fn(rank, world_size, *args)`` and returns the per-rank results in rank order. A rank that
raises makes ``run_local`` raise ``LocalLaunchError`` naming the rank and carrying its
traceback; a rank that dies without reporting (killed, ``os._exit``, a crash) is detected from its
exit code; a rank that hangs is killed after ``timeout`` seconds — never a hang. Once one rank has
failed, the others get the collective timeout (``pg_timeout``) to report their own errors (a
peer's death surfaces as a collective error on them); the message names the first cause and
lists what every other rank reported.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from datetime import timedelta


class LocalLaunchError(RuntimeError):
    pass


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (what bind(0) and outgoing connections get)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port() -> int:
    """A port free now, below the ephemeral range when one is: the store's port is picked here
    and bound later by rank 0, and in between gloo's own connections (each rank pair opens some,
    and parallel test workers run many groups) take ephemeral ports; one of them taking this
    port made init fail with EADDRINUSE (it happened in CI)."""
    import random

    top = _ephemeral_start()
    rng = random.Random()
    for _ in range(50):
        port = rng.randrange(max(1024, top - 12000), top) if top > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORT_TAKEN = "port taken"   # a rank's report: the store's port was in use at init (run_local retries)
PORT_ATTEMPTS = 3


def _port_taken(text: str) -> bool:
    return "EADDRINUSE" in text or "ddress already in use" in text


def _child(rank, world_size, port, fn, args, queue, pg_timeout):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        except Exception:
            text = traceback.format_exc()
            queue.put((rank, _PORT_TAKEN if _port_taken(text) else False, text))
            return
        # Pickled here, by value: the queue's own pickler would pass tensors as shared-memory file
        # descriptors served by this process, which may have exited before the parent reads them.
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, True, result))
    except BaseException:  # report every failure, including KeyboardInterrupt in a child
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class _PortTaken(Exception):
    pass


def run_local(fn, nprocs: int, args: tuple = (), timeout: float = 300.0, pg_timeout: float = 60.0):
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` forked gloo ranks; return results by rank.
    When the store's port was taken before rank 0 bound it (``_free_port``), every rank is stopped
    before ``fn`` ran and the group starts again on another port (``PORT_ATTEMPTS`` in all)."""
    # Import once in the parent: a forked rank's first backward otherwise spends 1-2 s importing it.
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _run_once(fn, nprocs, args, timeout, pg_timeout, last=False)
        except _PortTaken:
            continue
    return _run_once(fn, nprocs, args, timeout, pg_timeout, last=True)   # a taken port is an error now


def _run_once(fn, nprocs: int, args: tuple, timeout: float, pg_timeout: float, last: bool):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, nprocs, port, fn, args, queue, pg_timeout), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    taken = False   # the store's port was in use: stop everyone, the caller starts again
    grace_end = None   # once a rank failed: how long the others get to report their own error

    def record(rank, ok, payload) -> bool:
        """File a rank's report; True when it says the store's port was taken (and this is not
        the last try: then it is an error like any other)."""
        if ok == _PORT_TAKEN and not last:
            return True
        if ok is True:
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
        return False

    try:
        while len(results) + len(errors) < nprocs:
            now = time.monotonic()
            if now > deadline or (grace_end is not None and now > grace_end):
                break
            try:
                taken = record(*queue.get(timeout=0.2))
            except queue_mod.Empty:
                # A rank that is gone without reporting (killed, os._exit, a crash in C code).
                for r, p in enumerate(procs):
                    if p.exitcode is not None and r not in results and r not in errors:
                        time.sleep(0.2)   # its report may still be in the pipe
                        try:
                            while not taken:
                                taken = record(*queue.get_nowait())
                        except queue_mod.Empty:
                            pass
                        if taken:
                            break
                        if r not in results and r not in errors:
                            errors[r] = f"rank {r} exited with code {p.exitcode} without reporting (killed or crashed)"
            if taken:
                break
            if errors and grace_end is None:
                grace_end = time.monotonic() + min(pg_timeout + 5.0, max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            p.join(timeout=5 if not (errors or taken) else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if taken:
        raise _PortTaken()
    if errors:
        rank = min(errors, key=lambda r: (_is_secondary(errors[r]), r))
        others = [f"  rank {r}: {_last_line(errors[r])}" for r in sorted(errors) if r != rank]
        others += [f"  rank {r}: did not report (stopped)" for r in range(nprocs)
                   if r not in errors and r not in results]
        extra = ("\nthe other ranks:\n" + "\n".join(others)) if others else ""
        raise LocalLaunchError(f"rank {rank} of {nprocs} failed:\n{errors[rank]}{extra}")
    if len(results) < nprocs:
        missing = sorted(set(range(nprocs)) - set(results))
        raise LocalLaunchError(f"ranks {missing} did not finish within {timeout:.0f} s")
    return [results[r] for r in range(nprocs)]


def _last_line(text: str) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _is_secondary(text: str) -> bool:
    """A rank that failed because a peer did (a collective error) is not the first cause."""
    t = str(text)
    return any(k in t for k in ("Connection closed by peer", "Connection reset", "timed out", "Timed out", "Timeout",
                                "failed because rank", "cannot run again"))


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
