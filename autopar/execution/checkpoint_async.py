"""Asynchronous saves: ``compiled.save(directory, blocking=False)`` returns a ``SaveHandle`` while
training goes on.

On the calling thread (collective, every rank): the new generation is named
(checkpoint_atomic.begin) and this rank's pieces are staged, copied to CPU memory (a staged copy
costs this rank's shard of parameters and optimizer state once more, until the write ends). A
background thread then writes the staged copy through torch.distributed.checkpoint and commits
the generation as a blocking save does (checkpoint_atomic.commit): atomic the same way. The
thread's collectives (DCP's plan exchange, the commit's barrier and broadcast) run on a gloo
process group of their own (``dist.new_group(backend="gloo")``, made collectively at the first
asynchronous save of a model), so they never interleave with the training step's collectives on
the default group. ``dcp.async_save`` would do the same staging and thread; it is not used because
the commit must follow the write on the same thread.

At most one save is in flight per model: ``save`` and ``load`` first wait for it (``wait_pending``).
``SaveHandle.wait()`` blocks until the generation is committed (or raises the background error,
an ``ExecutionError``), ``done()`` tells whether it ended. A process must wait before it exits or
destroys its process group (the thread is not a daemon: the interpreter waits for it at exit).
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError
from autopar.execution import checkpoint_atomic, checkpoint_io


class SaveHandle:
    """An asynchronous save in flight (module doc)."""

    def __init__(self, directory: str, generation: str):
        self.directory, self.generation = directory, generation
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _run(self, state, keep_last, group):
        try:
            checkpoint_io.write(state, self.generation, group=group)
            checkpoint_atomic.commit(self.directory, self.generation, keep_last, group=group)
        except BaseException as e:   # DCP's CheckpointException is a BaseException
            self._error = e

    def start(self, state, keep_last, group) -> "SaveHandle":
        self._thread = threading.Thread(target=self._run, args=(state, keep_last, group),
                                        name="autopar-checkpoint-save")
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save is committed; raise what the background write raised."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, ExecutionError):
                raise e
            raise ExecutionError(f"asynchronous save into {self.directory} failed: {type(e).__name__}: "
                                 f"{str(e).strip()[:500]}; the previous checkpoint is unchanged") from None


def staged(state: dict) -> dict:
    """A CPU copy of ``state`` (tensors and Pieces cloned; other entries as they are)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = staged(v)
        elif isinstance(v, checkpoint_io.Pieces):
            pc = checkpoint_io.Pieces(v.shape, v.dtype)
            for off, t in v.pieces:
                pc.add(off, t.detach().to("cpu", copy=True))
            out[k] = pc
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().to("cpu", copy=True)
        else:
            out[k] = v
    return out


def wait_pending(cm) -> None:
    """Wait for ``cm``'s save in flight, if any (its error is raised here)."""
    handle = getattr(cm, "_pending_save", None)
    if handle is not None:
        cm._pending_save = None
        handle.wait()


def save_async(cm, state: dict, directory, step: int, keep_last: int) -> SaveHandle:
    """Collective: start writing ``state`` (module doc)."""
    if getattr(cm, "_checkpoint_group", None) is None:
        cm._checkpoint_group = dist.new_group(backend="gloo") if dist.get_world_size() > 1 else None
    generation = checkpoint_atomic.begin(directory, step)
    handle = SaveHandle(str(directory), generation).start(staged(state), keep_last, cm._checkpoint_group)
    cm._pending_save = handle
    return handle
