"""Study: how much of StabilityGuard's cost per step is the one gradient-norm read it cannot do without?

Issue 17 asks for StabilityGuard at most 1% of a char-LM step (``benchmarks/overhead.py``); the committed runs
measured 1.01-1.29%. The guard must read the step's loss and global gradient norm before every optimizer
step (it decides the step's fate from them), with one implementation on torch ops (``torch._foreach_norm``)
and one transfer to the host. This study times that read alone, the floor of any guard, next to the guard.

Arms, on the char LM at ``benchmarks/overhead.py``'s settings, each callback timed from outside by
:class:`benchmarks.harness.HookTimer`:

- ``plain``;
- ``norm_read``: a callback that keeps each micro-batch's loss (``on_before_backward``) and reads the step's
  loss and gradient norm with the guard's own function, ``core.grad_norm.step_loss_and_grad_norm``, before
  every optimizer step, and does nothing else;
- ``stability_guard``: ``StabilityGuard()`` with its defaults.

Run: ``python -m benchmarks.studies.guard_floor`` (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.harness import Arm, run_arms
from benchmarks.overhead import WORKLOADS
from lightning_pulse import StabilityGuard
from lightning_pulse.core.grad_norm import step_loss_and_grad_norm

RESULTS_DIR = Path(__file__).parent / "results"


class NormRead(pl.Callback):
    """The read every guard needs, and nothing else: the step's loss and gradient norm on the host."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self.losses.append(loss.detach())

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        losses, self.losses = self.losses, []
        self.last = step_loss_and_grad_norm(optimizer.param_groups, losses)


ARMS = [
    Arm("plain"),
    Arm("norm_read", callbacks=lambda seed: [NormRead()]),
    Arm("stability_guard", callbacks=lambda seed: [StabilityGuard()]),
]


def shares(result: dict[str, Any]) -> list[tuple[str, float, float, list[float]]]:
    """Per arm: the median plain step (ms), the median hook time per step (µs), the per-seed hook shares."""
    plain_step = {
        run["seed"]: 1e3 * run["train_cpu_s"] / run["steps"]
        for run in result["runs"]
        if run["arm"] == "plain"
    }
    rows = []
    for arm in result["arms"][1:]:
        runs = [run for run in result["runs"] if run["arm"] == arm]
        hook_us = [1e6 * sum(run["extra"]["hook_cpu_s"].values()) / run["steps"] for run in runs]
        share = [us / (10 * plain_step[run["seed"]]) for us, run in zip(hook_us, runs)]
        rows.append((arm, statistics.median(plain_step.values()), statistics.median(hook_us), share))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--name", default="guard_floor")
    args = parser.parse_args(argv)
    spec = WORKLOADS["charlm"]
    result = run_arms(
        "charlm",
        ARMS,
        seeds=args.seeds,
        trainer_kwargs=dict(spec["trainer_kwargs"]),
        workload_kwargs=dict(spec["workload_kwargs"]),
        flops="none",
        rotate_arms=True,
    )
    command = "python -m benchmarks.studies.guard_floor " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"# {args.name}",
        "",
        f"Command: `{command.strip()}`",
        "",
        "Hook CPU per optimizer step, timed from outside, as a share of the same seed's plain training CPU "
        "per step; medians over seeds.",
        "",
        "| arm | plain step (ms) | hook time per step (µs) | share, median | per seed |",
        "|---|---|---|---|---|",
    ]
    for arm, step_ms, hook_us, share in shares(result):
        per_seed = ", ".join(f"{s:.2f}%" for s in share)
        lines.append(
            f"| {arm} | {step_ms:.1f} | {hook_us:.0f} | {statistics.median(share):.2f}% | {per_seed} |"
        )
    lines += ["", f"Environment: {result['environment']}."]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str))
    (RESULTS_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
