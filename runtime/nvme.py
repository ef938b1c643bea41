"""Optimizer state in files (ZeRO-Infinity's NVMe offload of the optimizer state), for
runtime/offload.py ``offload="optimizer-nvme"``.

``NvmeStore(directory, tag)``: one file per offloaded chunk and state tensor (Adam's exp_avg and
exp_avg_sq, SGD's momentum buffer, ...), ``<directory>/<tag>-XXXX/chunk<i>.<name>.bin``, each
mapped as an fp32 tensor (``torch.from_file(path, shared=True, size=n)``: every change goes to
the file, and checkpoints read and write the state like any tensor). ``directory`` None: a
temporary directory per rank. The files and their directory are removed by ``close()`` (and when
the store is collected, or at exit).

The step streams each chunk's state through two host buffers, each sized to the largest chunk's
state, on one I/O thread (``prefetch``: file -> the next buffer; ``take``: wait for it;
``write_back``: buffer -> file; ``drain``: wait for every write): the thread reads chunk i+1's
state while the CPU steps chunk i, and writes chunk i back while chunk i+1 steps (torch's copies
release the GIL). The thread runs its work in order, so a buffer is read into only after the
write from it is done. The CPU step works on memory it owns and the files see one sequential read
and one sequential write of the state per step, counted in ``bytes`` (``read``, ``write``). The
files are memory-mapped, not opened with O_DIRECT: the kernel's page cache may keep recently used
pages, clean once written back and reclaimable.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
from torch import Tensor


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _stop(pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)


class NvmeStore:
    """File-backed optimizer state of the offloaded chunks, and the buffers the step streams it through."""

    def __init__(self, directory: Optional[str], tag: str):
        if directory is not None:
            if not os.path.isdir(directory):
                raise ValueError(f"offload_dir {directory!r} is not a directory; create it on the NVMe drive "
                                 f"the optimizer state should live on")
        self.path = tempfile.mkdtemp(prefix=f"{tag}-", dir=directory)
        self._finalizer = weakref.finalize(self, _remove, self.path)
        self.files: dict[str, str] = {}     # "<chunk>.<name>" -> its file
        self.bytes = {"read": 0, "write": 0}
        self._buffers: tuple[dict[str, Tensor], dict[str, Tensor]] = ({}, {})
        self._next = 0      # the buffer the next prefetch fills
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-nvme")
        self._pool_finalizer = weakref.finalize(self, _stop, self._pool)
        self._writes: list[Future] = []

    def state(self, index: int, initial: dict[str, Tensor]) -> dict[str, Tensor]:
        """Chunk ``index``'s state as file-backed tensors holding ``initial``'s values."""
        out = {}
        for name, t in initial.items():
            path = os.path.join(self.path, f"chunk{index}.{name}.bin")
            f = torch.from_file(path, shared=True, size=t.numel(), dtype=torch.float32)
            f.copy_(t)
            self.files[f"{index}.{name}"] = path
            out[name] = f
            for buffers in self._buffers:
                cur = buffers.get(name)
                if cur is None or cur.numel() < t.numel():   # each buffer: the largest chunk's state
                    buffers[name] = torch.empty(t.numel(), dtype=torch.float32)
        return out

    def prefetch(self, state: dict[str, Tensor]) -> Future:
        """Start copying a chunk's file-backed state into the next buffer (on the I/O thread)."""
        buffers = self._buffers[self._next]
        self._next ^= 1

        def read() -> dict[str, Tensor]:
            out = {}
            for name, f in state.items():
                b = buffers[name][:f.numel()]
                b.copy_(f)
                self.bytes["read"] += f.numel() * f.element_size()
                out[name] = b
            return out
        return self._pool.submit(read)

    @staticmethod
    def take(handle: Future) -> dict[str, Tensor]:
        """The prefetched state: views of its buffer, to step."""
        return handle.result()

    def write_back(self, state: dict[str, Tensor], stepped: dict[str, Tensor]) -> None:
        """Start copying the stepped buffer back into the chunk's files (on the I/O thread)."""
        def write() -> None:
            for name, f in state.items():
                f.copy_(stepped[name])
                self.bytes["write"] += f.numel() * f.element_size()
        self._writes.append(self._pool.submit(write))

    def drain(self) -> None:
        """Wait for every write back (the files hold the step's state after it)."""
        for w in self._writes:
            w.result()
        self._writes.clear()

    def disk_bytes(self) -> int:
        """Bytes of the state files on disk."""
        return sum(os.path.getsize(p) for p in self.files.values() if os.path.exists(p))

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for buffers in self._buffers for b in buffers.values())

    def close(self) -> None:
        """Finish the writes, stop the I/O thread and remove the files and their directory (the
        mapped tensors stay readable until dropped)."""
        self.drain()
        self._pool_finalizer()
        self._finalizer()


__all__ = ["NvmeStore"]
