"""Atomic checkpoints: after a crash at any point of ``compiled.save(D)``, ``D`` holds either the
complete previous checkpoint or the complete new one, never a mixture.

Layout of a checkpoint directory ``D``::

    D/autopar_checkpoint.json     {"format": 1, "current": "step-00000012-1a2b3c4d", "kept": [older, ...]}
    D/step-00000012-1a2b3c4d/     one torch.distributed.checkpoint directory per save (a *generation*):
                                  .metadata, __<rank>_0.distcp

A save writes a NEW generation beside the committed one (``begin``: rank 0 creates ``D`` and
picks the name, ``step-<optimizer step>-<random nonce>``, broadcast to every rank), every rank
writes its files into it (dcp.save; its coordinator writes ``.metadata`` last, after every rank
reported its writes), then ``commit``: a barrier, rank 0 checks the generation is complete
(``check_complete``) and replaces the pointer file ``autopar_checkpoint.json`` with
``os.replace`` (written to a temporary file, fsynced, renamed, directory fsynced): that rename is
the one atomic step. Another barrier, then rank 0 removes what the pointer no longer names
(generations beyond ``keep_last``, generations of saves that died, a pre-pointer checkpoint's
top-level files). A crash before the rename leaves the pointer on the previous generation
(whatever the dead save wrote is ignored and removed by the next save); after it, the new one.

``committed_path(D)``: the generation the pointer names (the directory to give
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, or any DCP reader); a ``D``
without the pointer but with ``.metadata`` (a plain DCP directory, e.g. written by an older
autopar) is itself the checkpoint. ``check_complete(path)``: the ``.metadata`` is there and
readable and every file it references exists at its recorded length, else an ``ExecutionError``
naming what is missing.

Fault injection, for tests: ``AUTOPAR_CHECKPOINT_FAULT=before|during|after|committed`` makes the
rank ``AUTOPAR_CHECKPOINT_FAULT_RANK`` (default 0) leave with ``os._exit(17)``: ``before`` once
the generation is named and before anything is written, ``during`` after the rank wrote its first
item (autopar/execution/checkpoint_io.py's planner calls ``fault("during")``), ``after`` once
every rank's data and the metadata are written but before the commit, ``committed`` right after
the pointer was replaced, before the clean-up.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil

import torch.distributed as dist

from autopar.errors import ExecutionError

POINTER = "autopar_checkpoint.json"
FORMAT = 1
_GENERATION = re.compile(r"^step-\d+-[0-9a-f]+$")
_LEGACY_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")


# ---------------------------------------------------------------- fault injection (tests)

def fault(point: str) -> None:
    """Leave the process now (``os._exit``, no clean-up) when the test hook asks for ``point``."""
    if os.environ.get("AUTOPAR_CHECKPOINT_FAULT") != point:
        return
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == int(os.environ.get("AUTOPAR_CHECKPOINT_FAULT_RANK", "0")):
        os._exit(17)


# ---------------------------------------------------------------- reading the pointer

def read_pointer(directory) -> dict | None:
    path = os.path.join(os.fspath(directory), POINTER)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("current"), str):
            raise ValueError("no 'current' generation")
    except (OSError, ValueError) as e:
        raise ExecutionError(f"checkpoint {directory}: unreadable {POINTER} ({type(e).__name__}: {e})",
                             collective=True) from None
    return data


def committed_path(directory) -> str:
    """The DCP directory holding ``directory``'s committed checkpoint (module doc)."""
    d = os.fspath(directory)
    if not os.path.exists(d):
        raise ExecutionError(f"checkpoint directory {d} does not exist: give the directory "
                             f"compiled.save() wrote", collective=True)
    if not os.path.isdir(d):
        raise ExecutionError(f"{d} is a file, not a checkpoint directory: give the directory "
                             f"compiled.save() wrote", collective=True)
    ptr = read_pointer(d)
    if ptr is not None:
        return os.path.join(d, ptr["current"])
    if os.path.exists(os.path.join(d, ".metadata")):
        return d
    gens = sorted(n for n in os.listdir(d) if _GENERATION.match(n))
    what = (f"only uncommitted generations ({', '.join(gens[:4])}) of a save that did not finish"
            if gens else "no .metadata")
    raise ExecutionError(f"checkpoint {d} is incomplete: no {POINTER} and {what}: no save into it "
                         f"finished; nothing was loaded", collective=True)


def check_complete(path) -> None:
    """Raise an ExecutionError naming what is missing when the DCP directory ``path`` is not a
    complete checkpoint (module doc)."""
    import torch.distributed.checkpoint as dcp

    p = os.fspath(path)
    if not os.path.isdir(p):
        raise ExecutionError(f"checkpoint {p} is incomplete: the directory is missing", collective=True)
    if not os.path.exists(os.path.join(p, ".metadata")):
        raise ExecutionError(f"checkpoint {p} is incomplete: .metadata is missing (the save did not finish)",
                             collective=True)
    try:
        meta = dcp.FileSystemReader(p).read_metadata()
    except Exception as e:
        raise ExecutionError(f"checkpoint {p} is incomplete: .metadata is unreadable ({type(e).__name__}: {e})",
                             collective=True) from None
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    missing = sorted(f for f in need if not os.path.exists(os.path.join(p, f)))
    short = sorted(f"{f} ({os.path.getsize(os.path.join(p, f))} of {n} bytes)" for f, n in need.items()
                   if f not in missing and os.path.getsize(os.path.join(p, f)) < n)
    if missing or short:
        parts = ([f"missing files: {', '.join(missing[:8])}"] if missing else []) + \
                ([f"truncated files: {', '.join(short[:8])}"] if short else [])
        raise ExecutionError(f"checkpoint {p} is incomplete ({'; '.join(parts)}): nothing was loaded",
                             collective=True)


# ---------------------------------------------------------------- writing

def begin(directory, step: int) -> str:
    """Collective: the path of a new, empty generation of ``directory`` (module doc)."""
    d = os.fspath(directory)
    world = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    box = [None]
    if rank == 0:
        try:
            if os.path.exists(d) and not os.path.isdir(d):
                raise ExecutionError(f"cannot save into {d}: it is a file")
            os.makedirs(d, exist_ok=True)
            name = f"step-{int(step):08d}-{secrets.token_hex(4)}"
            os.mkdir(os.path.join(d, name))
            box = [name]
        except OSError as e:
            box = [ExecutionError(f"cannot save into {d}: {type(e).__name__}: {e}")]
        except ExecutionError as e:
            box = [e]
    if world:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ExecutionError):
        raise ExecutionError(str(box[0]), collective=True)
    fault("before")
    return os.path.join(d, box[0])


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_pointer(d: str, data: dict) -> None:
    tmp = os.path.join(d, f".{POINTER}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, POINTER))
    _fsync_dir(d)


def commit(directory, generation: str, keep_last: int = 1, group=None) -> None:
    """Collective (over ``group``, default the world), after every rank wrote ``generation``: make
    it the committed checkpoint of ``directory``, then remove what is no longer named (module doc)."""
    d = os.fspath(directory)
    name = os.path.basename(os.fspath(generation))
    world = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world:
        dist.barrier(group=group)
    fault("after")
    box = [None]
    if rank == 0:
        try:
            _fsync_dir(os.path.join(d, name))
            check_complete(os.path.join(d, name))
            old = read_pointer(d)
            kept = ([old["current"]] + list(old.get("kept", []))) if old else []
            data = {"format": FORMAT, "current": name, "kept": kept[:max(0, int(keep_last) - 1)]}
            _write_pointer(d, data)
            fault("committed")
        except (OSError, ExecutionError) as e:
            box = [f"checkpoint {d}: the save could not be committed ({type(e).__name__}: {e}); "
                   f"the previous checkpoint is unchanged"]
    if world:
        dist.broadcast_object_list(box, src=0, group=group)
    if box[0] is not None:
        raise ExecutionError(box[0], collective=True)
    if rank == 0:
        clean(d)


def clean(directory) -> None:
    """Remove from ``directory`` the generations and files its pointer does not name (rank 0)."""
    d = os.fspath(directory)
    ptr = read_pointer(d)
    if ptr is None:
        return
    keep = {ptr["current"], *ptr.get("kept", [])}
    for n in os.listdir(d):
        p = os.path.join(d, n)
        try:
            if _GENERATION.match(n) and n not in keep and os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            elif (_LEGACY_FILE.match(n) or (n.startswith(f".{POINTER}.") and n.endswith(".tmp"))) \
                    and os.path.isfile(p):
                os.remove(p)
        except OSError:
            pass


def generations(directory) -> list[str]:
    """The committed generations of ``directory``, newest first (the current one and those kept)."""
    ptr = read_pointer(directory)
    return [] if ptr is None else [ptr["current"], *ptr.get("kept", [])]
