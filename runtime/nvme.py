"""Optimizer state in files (ZeRO-Infinity's NVMe offload of the optimizer state), for
runtime/offload.py ``offload="optimizer-nvme"``.

``NvmeStore(directory, tag)``: one file per offloaded chunk and state tensor (Adam's exp_avg and
exp_avg_sq, SGD's momentum buffer, ...), ``<directory>/<tag>-XXXX/chunk<i>.<name>.bin``, each
mapped as an fp32 tensor (``torch.from_file(path, shared=True, size=n)``: every change goes to
the file, and checkpoints read and write the state like any tensor). ``directory`` None: a
temporary directory per rank. The files and their directory are removed by ``close()`` (and when
the store is collected, or at exit).

The step streams each chunk's state through a host buffer sized to the largest chunk's state
(``read``: file -> buffer, ``write``: buffer -> file), so the CPU step works on memory it owns and
the files see one sequential read and one sequential write of the state per step, counted in
``bytes`` (``read``, ``write``). The files are memory-mapped, not opened with O_DIRECT: the
kernel's page cache may keep recently used pages, clean once written back and reclaimable.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Optional

import torch
from torch import Tensor


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class NvmeStore:
    """File-backed optimizer state of the offloaded chunks, and the buffer the step streams it through."""

    def __init__(self, directory: Optional[str], tag: str):
        if directory is not None:
            if not os.path.isdir(directory):
                raise ValueError(f"offload_dir {directory!r} is not a directory; create it on the NVMe drive "
                                 f"the optimizer state should live on")
        self.path = tempfile.mkdtemp(prefix=f"{tag}-", dir=directory)
        self._finalizer = weakref.finalize(self, _remove, self.path)
        self.files: dict[str, str] = {}     # "<chunk>.<name>" -> its file
        self.bytes = {"read": 0, "write": 0}
        self._buffer: dict[str, Tensor] = {}

    def state(self, index: int, initial: dict[str, Tensor]) -> dict[str, Tensor]:
        """Chunk ``index``'s state as file-backed tensors holding ``initial``'s values."""
        out = {}
        for name, t in initial.items():
            path = os.path.join(self.path, f"chunk{index}.{name}.bin")
            f = torch.from_file(path, shared=True, size=t.numel(), dtype=torch.float32)
            f.copy_(t)
            self.files[f"{index}.{name}"] = path
            out[name] = f
            cur = self._buffer.get(name)
            if cur is None or cur.numel() < t.numel():   # the buffer: the largest chunk's state
                self._buffer[name] = torch.empty(t.numel(), dtype=torch.float32)
        return out

    def read(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A chunk's file-backed state copied into the buffer; the buffer's views, to step."""
        out = {}
        for name, f in state.items():
            b = self._buffer[name][:f.numel()]
            b.copy_(f)
            self.bytes["read"] += f.numel() * f.element_size()
            out[name] = b
        return out

    def write(self, state: dict[str, Tensor], stepped: dict[str, Tensor]) -> None:
        """The stepped buffer back into the chunk's files."""
        for name, f in state.items():
            f.copy_(stepped[name])
            self.bytes["write"] += f.numel() * f.element_size()

    def disk_bytes(self) -> int:
        """Bytes of the state files on disk."""
        return sum(os.path.getsize(p) for p in self.files.values() if os.path.exists(p))

    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffer.values())

    def close(self) -> None:
        """Remove the files and their directory (the mapped tensors stay readable until dropped)."""
        self._finalizer()


__all__ = ["NvmeStore"]
