"""Validation of a plan file's contents before anything reads it.

``check_plan_data(data, source) -> None`` raises ``PlanError`` naming the file and the field
(``predictions.step_time``, ``mesh.names[1]``) for anything a later reader would trip on: a
missing key, a wrong type, a version written as a string. ``autopar show``/``diff``/``compile``
then fail with one sentence instead of a ``KeyError`` deep inside a report.

The schema is data (``_SCHEMA``): a field's path and the type it must have. Only what readers of a
plan actually use is required, so a plan may carry more (later versions add fields freely).

``PLAN_VERSION`` is the version written; ``migrate(data)`` reads an older one as the current one.
"""
from __future__ import annotations

from autopar.errors import PlanError

PLAN_VERSION = 3
# Version 2: tp_mode "2d" now means SUMMA on a q x q grid (autopar/search/grid_search.py); the 2-axis
# resharding mode version 1 called "2d" is "2d-reshard". Version 3: degrees.offload is what is
# offloaded ("none" | "optimizer" | "optimizer+params" | "optimizer-nvme" | "optimizer+params-nvme"),
# where versions 1-2 wrote false (nothing was ever offloaded). ``migrate`` rewrites an older plan
# step by step (nothing else changed, so its ops and params still run as they did).


def migrate(data):
    """A version-1 or -2 plan as version 3 (tp_mode "2d" -> "2d-reshard"; offload false ->
    "none"); anything else unchanged."""
    if not (isinstance(data, dict) and data.get("version") in (1, 2) and isinstance(data.get("degrees"), dict)):
        return data
    start = data["version"]
    data = dict(data, degrees=dict(data["degrees"]))
    if start == 1 and data["degrees"].get("tp_mode") == "2d":
        data["degrees"]["tp_mode"] = "2d-reshard"
    if data["degrees"].get("offload") in (False, None):
        data["degrees"]["offload"] = "none"
    data["version"], data["migrated_from"] = 3, start
    return data


_NUMBER = (int, float)

# path -> required type(s). "a.b" is a key of a mapping; "a[]" is every element of a list.
_SCHEMA: dict[str, tuple] = {
    "fingerprint": (str,),
    "cluster": (dict,),
    "cluster.name": (str,),
    "cluster.nodes": (int,),
    "cluster.devices_per_node": (int,),
    "cluster.device": (dict,),
    "mesh": (dict,),
    "mesh.shape": (list,),
    "mesh.shape[]": (int,),
    "mesh.names": (list,),
    "mesh.names[]": (str,),
    "mesh.devices_per_node": (int,),
    "settings": (dict,),
    "settings.memory_budget": _NUMBER,
    "settings.precision": (str,),
    "degrees": (dict,),
    "degrees.dp": (int,),
    "degrees.tp": (int,),
    "degrees.zero": (int,),
    "degrees.num_micro_batches": (int,),
    "stages": (list,),
    "ops": (list,),
    "ops[]": (dict,),
    "ops[].node": (str,),
    "ops[].strategy": (str,),
    "ops[].inputs": (list,),
    "ops[].outputs": (list,),
    "ops[].splits": (list,),
    "params": (dict,),
    "predictions": (dict,),
    "predictions.step_time": _NUMBER,
    "predictions.peak_memory": _NUMBER,
    "predictions.memory_breakdown": (dict,),
    "predictions.comm_bytes": (dict,),
    "predictions.time_breakdown": (dict,),
    "predictions.mfu": _NUMBER,
    "predictions.model_flops": _NUMBER,
    "solver": (dict,),
}


def _type_name(types: tuple) -> str:
    if set(types) == {int, float}:
        return "a number"
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
    return " or ".join(dict.fromkeys(names[t] for t in types))


def _shown(value) -> str:
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return repr(value)


def _values(data, path: str):
    """(concrete path, value) pairs at ``path``; missing keys yield (path, _MISSING)."""
    out = [("", data)]
    for part in path.split("."):
        each = part.endswith("[]")
        key = part[:-2] if each else part
        nxt = []
        for where, obj in out:
            if obj is _MISSING or not isinstance(obj, dict):
                continue   # the parent's own check reports it
            here = f"{where}.{key}" if where else key
            val = obj.get(key, _MISSING)
            if each:
                if isinstance(val, list):
                    nxt.extend((f"{here}[{i}]", v) for i, v in enumerate(val))
            else:
                nxt.append((here, val))
        out = nxt
    return out


_MISSING = object()

CHECKPOINT_MODES = ("none", "selective", "full")


def checkpoint_mode_of(value) -> str:
    """A block group's checkpoint decision as recorded in ``stages[].checkpoint``: plans record
    True (full recompute) / False (none) — as every plan before selective recompute did — or
    "selective"; the strings "none" / "full" are read too."""
    if value is True:
        return "full"
    if value is False or value is None:
        return "none"
    if value in CHECKPOINT_MODES:
        return value
    raise PlanError(f"checkpoint decision {value!r}: must be true, false or one of {list(CHECKPOINT_MODES)}")


def check_plan_data(data, source: str = "plan") -> None:
    """Raise PlanError for the first field of ``data`` a plan reader would trip on."""
    fix = "re-create it with `autopar plan` (or autopar.plan(...).save(path))"
    if not isinstance(data, dict):
        raise PlanError(f"{source} is not a plan file: it holds {_shown(data)}, not a JSON object; {fix}")
    if "version" not in data:
        raise PlanError(f"{source} is not a plan file: no 'version' field; {fix}")
    version = data["version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise PlanError(f"{source}: field 'version' must be an integer (this autopar reads version "
                        f"{PLAN_VERSION}), got {_shown(version)}; {fix}")
    if version != PLAN_VERSION:
        raise PlanError(f"{source}: plan version {version} is not supported by this autopar "
                        f"(it reads version {PLAN_VERSION}); re-plan with this version")
    for path, types in _SCHEMA.items():
        for where, value in _values(data, path):
            if value is _MISSING:
                raise PlanError(f"{source}: field '{where}' is missing: the file is not a complete "
                                f"autopar plan; {fix}")
            if not isinstance(value, types) or isinstance(value, bool):
                raise PlanError(f"{source}: field '{where}' must be {_type_name(types)}, got {_shown(value)}; {fix}")
    for k, stage in enumerate(data["stages"]):
        ck = stage.get("checkpoint") if isinstance(stage, dict) else None
        if ck is None:
            continue
        if not isinstance(ck, dict):
            raise PlanError(f"{source}: field 'stages[{k}].checkpoint' must be a mapping block group -> decision, "
                            f"got {_shown(ck)}; {fix}")
        for grp, v in ck.items():
            if not (isinstance(v, bool) or v in CHECKPOINT_MODES):
                raise PlanError(f"{source}: field 'stages[{k}].checkpoint.{grp}' must be true, false or one of "
                                f"{list(CHECKPOINT_MODES)}, got {_shown(v)}; {fix}")
    mesh = data["mesh"]
    if len(mesh["shape"]) != len(mesh["names"]):
        raise PlanError(f"{source}: field 'mesh' has {len(mesh['shape'])} sizes but {len(mesh['names'])} "
                        f"names; {fix}")
