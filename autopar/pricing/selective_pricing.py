"""Pricing selective activation recompute (Korthikanti et al. 2022) for the ILP: per repeated
block group with an attention core (autopar/rules/attention_core.py), a companion CheckpointGroup whose
bytes and time are the core's, linked to the block group by ``implied_by`` (solver/checkpoint_links.py).
Called by autopar/search/build.py ``build_problem``; also where the checkpoint pins of ``Settings`` (bool
or "none" / "selective" / "full", globally or per group) become ``forced`` decisions.
"""
from __future__ import annotations

import numpy as np

from autopar.rules.candidates import Candidates
from autopar.pricing.price import Priced, Settings
from solver.problem import CheckpointGroup
from autopar.errors import ConstraintError
from autopar.rules.attention_core import attention_cores


def selective_groups(c: Candidates, P: Priced, s: Settings, groups: dict, cgroups: list, index: dict) -> list:
    """Selective recompute (Korthikanti et al. 2022) as the third choice of a block group: per
    group whose blocks have an attention core (autopar/rules/attention_core.py), a companion
    CheckpointGroup "<group>/attention" that recomputes only the core. Its saved bytes are what the
    core's ops save (scores, softmax, dropout mask and output, q/k/v), moved out of the block
    group's saved bytes, except a core output's storage (kept by its consumer outside); its kept
    bytes the core's inputs as produced (the region keeps them; a reshard into the core runs
    inside it) unless an op outside the core saves them anyway; its recompute time the core's
    forward (moved out of the block group's recompute time); its working set what one core saves
    again when recomputed: its internal bytes (a saved input is the kept storage itself; the
    copies a batched matmul makes of a non-contiguous q, k^T or v are its own, internal, bytes:
    autopar/rules/ops_matmul.py ``saved_operands``). ``implied_by`` makes the companion on whenever
    the block group is: (off, off) = none, (off, on) = selective, (on, on) = full, whose bytes
    and time are then exactly the block group's. Also applies the checkpoint pins of ``s`` to
    every group (bool or "none" / "selective" / "full"; a global "selective" leaves groups
    without an attention core unchecked)."""

    cores = attention_cores(c.graph)
    pins = dict(s.checkpoint) if isinstance(s.checkpoint, tuple) else {}
    rootmaps = [c.storage_root] + list(c.memo.device_roots.values())
    out = []
    for g in sorted(groups):
        grp = groups[g]
        mode = pins.get(grp.name) if isinstance(s.checkpoint, tuple) else s.checkpoint
        mode = {True: "full", False: "none"}.get(mode, mode) if isinstance(mode, bool) else mode
        grp.forced = None if mode is None else mode == "full"
        core = [n for k in cores.get((g, 0), []) for n in k]
        if not core or any(n not in index for n in core):
            if mode == "selective" and isinstance(s.checkpoint, tuple):
                raise ConstraintError(f"constraint checkpoint pins block group {grp.name!r} to 'selective', but "
                                      f"its blocks have no attention core (softmax or scaled_dot_product_attention "
                                      f"between projections) to recompute; pin it to 'none' or 'full'")
            if mode == "selective":
                grp.forced = False   # nothing selective to do in this group: none
            continue
        nodes = c.memo.nodes_by_name(c.graph)
        inside = set(core)
        ins = [p for n in core for p in nodes[n].all_input_nodes if p.name not in inside]
        outs = [n for n in core if any(u.name not in inside for u in nodes[n].users)]
        in_roots = {m.get(p.name, p.name) for m in rootmaps for p in ins}
        out_roots = {m.get(n, n) for m in rootmaps for n in outs}
        sel = CheckpointGroup(name=f"{grp.name}/attention", implied_by=cgroups.index(grp),
                              forced=None if mode is None else mode != "none")
        for n in core:
            if n not in P.saved or c.nodes[n].kind != "op":
                continue
            k = c.nodes[n].repeats
            by_root = P.saved_by_root.get(n, {})
            zero = np.zeros_like(P.saved[n])
            # a core output's storage stays (its consumer outside keeps it): not moved
            outpart = sum((a for r, a in by_root.items() if r in out_roots and r not in in_roots), zero)
            inpart = sum((a for r, a in by_root.items() if r in in_roots), zero)
            internal = P.saved[n] - outpart - inpart
            moved = internal + inpart   # the input's storage is priced as kept below instead
            t = P.fwd_compute[n] + P.fwd_comm.get(n, 0.0)
            if moved.any():
                sel.saved.append((index[n], moved))
                grp.saved.append((index[n], -moved))
            work = internal
            if work.any():
                sel.recompute_memory.append((index[n], work / k))
            if np.any(t):
                sel.recompute_time.append((index[n], t))
                grp.recompute_time.append((index[n], -t))
        # What the region keeps: its inputs as produced (before any reshard into the core, which
        # codegen emits inside the region), unless an op outside the core saves them anyway.
        charged_outside = {r for n2, d in P.saved_by_root.items() if n2 not in inside for r in d}
        kept_roots = set()
        for p in ins:
            root = c.storage_root.get(p.name, p.name)
            if root in kept_roots or root in charged_outside or root not in index or \
                    p.name in c.graph.param_fqn or c.nodes[root].kind != "op":
                continue
            kept_roots.add(root)
            arr = P.transient[root] * c.nodes[root].repeats
            sel.kept.append((index[root], arr))
            # with the whole block recomputed (both groups on) the block keeps only its input:
            # the companion's kept bytes are taken back from the block group's
            grp.kept.append((index[root], -arr))
        out.append(sel)
    return out

