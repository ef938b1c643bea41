"""The Plan: versioned, deterministic JSON — the only thing that crosses from planning to running.

Schema (version 2; version-1 files are migrated on load, see ``plan_schema.migrate``):
  version, fingerprint (of the traced graph), cluster (Cluster.to_dict), mesh (Mesh.to_json),
  settings (optimizer, precision, memory budget, overlap), degrees (api.md's keys),
  stages: [{index, ranks: [first, last], nodes: [first node, last node], checkpoint: {block group: bool | "selective"}}]
  (one stage without pipelining; with ``degrees.pp`` > 1 one per pipeline stage, each also with
  ``blocks`` [first, end) into the traced graph's block instances, ``params`` and predicted
  ``time`` / ``peak_memory``: autopar/search/pipeline.py; ``mesh`` is then ONE stage's sub-mesh and stage
  s runs on ranks [s * mesh.size, (s + 1) * mesh.size)), ops: [{node, target, module, rule, strategy, inputs, outputs,
  splits, special}], params: {fqn: {node, shape, layout}}, inputs (placeholder names), batch_dims
  (per input the dim the data axes split and micro-batching cuts, or null; absent in older plans:
  dim 0, autopar/frontend/batching.py), predictions (step time and breakdown,
  peak memory and breakdown, comm bytes per mesh axis, model FLOPs, MFU), solver (status, gap, backend).

Byte-identical for identical inputs: keys sorted, floats written with repr (deterministic), and
nothing time-dependent (planning wall time lives in ``Plan.stats``, outside the JSON).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from autopar.cluster import Cluster
from autopar.errors import PlanError
from autopar.mesh import Mesh
from autopar.plans.plan_schema import PLAN_VERSION, check_plan_data, migrate  # noqa: F401  (PLAN_VERSION: public here too)


def _round(x):
    """Round floats to 12 significant digits so tiny platform noise cannot change the bytes."""
    if isinstance(x, float):
        return float(f"{x:.12g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


@dataclass
class Plan:
    data: dict
    stats: dict = field(default_factory=dict)   # not serialised: planning wall time, configs tried

    # ---- api.md properties
    @property
    def step_time(self) -> float:
        return self.data["predictions"]["step_time"]

    @property
    def global_batch(self) -> int:
        """Rows of the global batch one step trains on (plans made before the ``batch`` field:
        micro-batch size x micro-batches x dp)."""
        b = self.data.get("batch") or {}
        d = self.degrees
        return int(b.get("global_batch") or d["micro_batch_size"] * d["num_micro_batches"] * d["dp"])

    @property
    def tokens_per_step(self):
        """Tokens one step trains on (batch x sequence of the token-id input), or None."""
        return (self.data.get("batch") or {}).get("tokens_per_step")

    @property
    def kernels(self) -> str:
        """"triton": the plan runs the fused Triton kernels (ops in ``fused``); "torch": ATen ops."""
        return self.data.get("settings", {}).get("kernels", "torch")

    @property
    def fused(self) -> dict[str, int]:
        """Fused pattern -> how many the traced graph had (autopar/frontend/fuse.py)."""
        return dict(self.data.get("fused", {}))

    @property
    def peak_memory(self) -> int:
        return self.data["predictions"]["peak_memory"]

    @property
    def memory_breakdown(self) -> dict:
        return dict(self.data["predictions"]["memory_breakdown"])

    @property
    def comm_bytes(self) -> dict:
        return dict(self.data["predictions"]["comm_bytes"])

    @property
    def mfu(self) -> float:
        return self.data["predictions"]["mfu"]

    @property
    def degrees(self) -> dict:
        return dict(self.data["degrees"])

    @property
    def pp(self) -> int:
        """Pipeline stages (1: no pipeline)."""
        return int(self.data["degrees"].get("pp", 1) or 1)

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on: pipeline stages x the stage mesh (``mesh`` is one stage's)."""
        return self.mesh.size * self.pp

    def stage_plan(self) -> "Plan":
        """The plan one pipeline stage's program is generated from: this plan with one stage
        (every stage runs the same strategies on its sub-mesh; autopar/search/pipeline.py)."""
        if self.pp == 1:
            return self
        data = dict(self.data)
        data["degrees"] = dict(self.data["degrees"], pp=1, pp_schedule=None)
        st = self.data["stages"][0]
        data["stages"] = [{"index": 0, "ranks": [0, self.mesh.size - 1], "nodes": st.get("nodes"),
                           "checkpoint": st.get("checkpoint", {})}]
        return Plan(data)

    @property
    def fingerprint(self) -> str:
        return self.data["fingerprint"]

    @property
    def predictions(self) -> dict:
        return self.data["predictions"]

    @property
    def ops(self) -> list[dict]:
        return self.data["ops"]

    @property
    def mesh(self):
        return Mesh.from_json(self.data["mesh"])

    @property
    def cluster(self):
        return Cluster.from_dict(self.data["cluster"])

    # ---- serialisation
    def to_json(self) -> str:
        return json.dumps(_round(self.data), sort_keys=True, indent=1) + "\n"

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def from_json(text: str, source: str = "plan") -> "Plan":
        """Parse and validate (autopar/plans/plan_schema.py): a bad file is one PlanError naming the field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{source} is not a plan file: invalid JSON ({e})") from None
        data = migrate(data)
        check_plan_data(data, source)
        return Plan(data)

    @staticmethod
    def load(path) -> "Plan":
        p = Path(path)
        if not p.exists():
            raise PlanError(f"plan file {p} does not exist")
        if p.is_dir():
            raise PlanError(f"{p} is a directory, not a plan file: give the path of a .json plan "
                            f"(written by `autopar plan -o plan.json` or Plan.save)")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read plan file {p}: {e}") from None
        return Plan.from_json(text, source=f"plan file {p}")

    def summary(self) -> str:
        from autopar.plans.report import summary_text   # here: report needs rich, `import autopar` does not
        return summary_text(self)

    def __repr__(self) -> str:
        d = self.degrees
        return (f"Plan(step_time={self.step_time:.4g}s, peak_memory={self.peak_memory / 2**30:.2f}GiB, "
                f"dp={d['dp']}, tp={d['tp']}, zero={d['zero']}, mbs={d['micro_batch_size']})")
