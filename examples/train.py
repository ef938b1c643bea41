"""Train a zoo model (or your own factory) under autopar's automatic plan, on any number of processes.

A plain torchrun script: autopar.compile creates the process group from the torchrun environment
with the cluster's backend (gloo for the ``cpu`` preset, NCCL for GPU clusters), rank 0 plans and
broadcasts the plan, every rank trains its part.

    torchrun --nproc_per_node 4 examples/train.py --model gpt2 --steps 20          # 4 CPU processes
    autopar run -n 4 examples/train.py --model gpt2 --steps 20                      # the same, no torchrun
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint HOST:29500 \\
        examples/train.py --model gpt2_xl --cluster dgx-a100 --nodes 2             # 2 DGX-A100 nodes, NCCL

``--model`` takes a zoo name or ``module:FACTORY`` / ``file.py:FACTORY`` (FACTORY() returns
(model, example_inputs), the inputs being one global batch); ``--arg name=value`` passes keyword
arguments to it. ``--plan plan.json`` runs a saved plan instead of planning; ``--save DIR`` writes
a checkpoint (torch.distributed.checkpoint) at the end.

Checkpoints during training: ``--checkpoint-dir DIR --save-every N`` saves every N steps (in the
background: ``compiled.save(DIR, blocking=False)``, atomic, keeping ``--keep-last`` of them) and
at the end; ``--resume`` first loads DIR's latest committed checkpoint (any plan, any number of
processes saved it) and continues from its step:

    autopar run -n 4 examples/train.py --model gpt2 --steps 20 --checkpoint-dir run/ck --save-every 5
    autopar run -n 2 examples/train.py --model gpt2 --steps 40 --checkpoint-dir run/ck --resume

Fault injection (for resume tests): ``AUTOPAR_FAIL_AT_STEP=k AUTOPAR_FAIL_MARKER=FILE`` makes rank 1
leave after step k once (``fail_once``); under ``torchrun --max-restarts 1 ... --resume`` the
restarted processes resume from the newest committed checkpoint (autopar.compile connects each
restart's process group under its own key prefix in torchrun's shared rendezvous store, so a
restarted rank never reads a dead attempt's address: nothing to set).

Live figures: every ``--log-every`` steps (default 5) the measured step time, tokens/s, TFLOP/s per
device and MFU, each next to the plan's prediction (``autopar.compile(log_every=..., on_step=...)``).
On a terminal rank 0 shows them under a rich progress bar; otherwise (a pipe, a log file, no rich)
it prints one plain line per step and per report.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import time


def cluster_for(name: str, nodes: int, world: int):
    import autopar

    if name == "cpu":
        return autopar.Cluster.preset("cpu", devices=world)
    if name.endswith((".yaml", ".yml")):
        return autopar.Cluster.from_yaml(name)
    return autopar.Cluster.preset(name, nodes=nodes)


class LiveBar:
    """Rank 0's rich progress bar with the latest measured-vs-predicted figures under it (a tty only)."""

    def __init__(self, steps: int):
        try:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        except ImportError:
            self.ok = False
            return
        self.ok = True
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[figures]}"))
        self.task = self.progress.add_task("train", total=steps, loss="-", figures="")

    def start(self):
        self.progress.start()

    def stop(self):
        self.progress.stop()

    def advance(self, loss: float):
        self.progress.update(self.task, advance=1, loss=f"{loss:.4f}")

    def report(self, s):
        """compile's on_step: every --log-every steps (on every rank; this bar exists on rank 0 only)."""
        figures = (f"{s.step_time * 1e3:.0f} ms/step (plan {s.predicted_step_time * 1e3:.0f}) | "
                   f"{s.throughput:,.0f} {s.unit}/s (plan {s.predicted_throughput:,.0f}) | "
                   f"MFU {100 * s.mfu:.1f}% (plan {100 * s.predicted_mfu:.1f}%)")
        self.progress.update(self.task, figures=figures)


def fail_once(step: int, rank: int) -> None:
    """Fault injection for resume tests: with ``AUTOPAR_FAIL_AT_STEP=k`` and ``AUTOPAR_FAIL_MARKER=FILE``,
    rank ``AUTOPAR_FAIL_RANK`` (default 1) leaves with exit code 13 after step k, once: it creates
    FILE first, and a restarted run that finds FILE goes on (torchrun --max-restarts restarts it)."""
    at, marker = os.environ.get("AUTOPAR_FAIL_AT_STEP"), os.environ.get("AUTOPAR_FAIL_MARKER")
    if at is None or marker is None or step != int(at) or rank != int(os.environ.get("AUTOPAR_FAIL_RANK", "1")):
        return
    if os.path.exists(marker):
        return
    with open(marker, "w") as f:
        f.write(f"rank {rank} failed after step {step}\n")
    print(f"rank {rank}: injected failure after step {step} (AUTOPAR_FAIL_AT_STEP)", flush=True)
    os._exit(13)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train a model under autopar (run with torchrun or `autopar run`).")
    ap.add_argument("--model", default="gpt2", help="zoo name or module:FACTORY (default gpt2)")
    ap.add_argument("--arg", action="append", default=[], help="name=value keyword argument of the factory")
    ap.add_argument("--cluster", default="cpu", help="preset name or cluster YAML (default cpu: these processes)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--plan", help="a saved plan to run instead of planning")
    ap.add_argument("--save", help="directory for a checkpoint at the end")
    ap.add_argument("--checkpoint-dir", help="directory for checkpoints during training (see --save-every, --resume)")
    ap.add_argument("--save-every", type=int, default=0, help="save to --checkpoint-dir every N steps (0: at the end)")
    ap.add_argument("--keep-last", type=int, default=2, help="checkpoints kept in --checkpoint-dir (default 2)")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's latest checkpoint")
    ap.add_argument("--log-every", type=int, default=5, help="steps between measured-vs-predicted reports")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    import autopar
    from autopar.models import load_factory

    kwargs = {}
    for pair in args.arg:
        k, _, v = pair.partition("=")
        try:
            kwargs[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            kwargs[k] = v
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cluster = cluster_for(args.cluster, args.nodes, world)
    model, batch = load_factory(args.model)(**kwargs)
    plan = autopar.Plan.load(args.plan) if args.plan else None
    bar = LiveBar(args.steps) if int(os.environ.get("RANK", "0")) == 0 and sys.stdout.isatty() else None
    if bar is not None and not bar.ok:
        bar = None
    compiled = autopar.compile(model, cluster, example_inputs=batch, plan=plan, lr=args.lr,
                               log_every=args.log_every, on_step=bar.report if bar else None)
    rank = dist.get_rank()
    if rank == 0:
        print(compiled.plan.summary(), end="", flush=True)
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        ap.error("--resume and --save-every need --checkpoint-dir")
    start = 0
    if args.resume:
        start = compiled.load_latest(args.checkpoint_dir) or 0
        if rank == 0:
            print(f"resumed from {args.checkpoint_dir} at step {start}" if start else
                  f"nothing to resume in {args.checkpoint_dir}: starting at step 0", flush=True)
    if bar is not None:
        bar.start()
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        loss = compiled.step(*batch)
        if bar is not None:
            bar.advance(loss)
        elif rank == 0:   # plain lines; compile prints the measured-vs-plan figures every --log-every steps
            print(f"step {step:4d}  loss {loss:.4f}  {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            compiled.save(args.checkpoint_dir, keep_last=args.keep_last, blocking=False)
        fail_once(step, rank)
    if bar is not None:
        bar.stop()
        last = compiled.stats()
        if last is not None:
            print(last.line())
    if args.checkpoint_dir and compiled.step_count > start:
        compiled.save(args.checkpoint_dir, keep_last=args.keep_last)   # waits for one in flight first
        if rank == 0:
            print(f"checkpoint at step {compiled.step_count} committed in {args.checkpoint_dir}")
    if args.save:
        compiled.save(args.save)
        if rank == 0:
            print(f"checkpoint written to {args.save}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
