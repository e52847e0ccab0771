"""Study: why trimming StabilityGuard's per-step Python does not bring it under 1% of a char-LM step.

Issue 17 asks for StabilityGuard at most 1% of a char-LM step; the thirty-first pass measured 1.24-1.30% on
23 ms steps (``benchmarks/studies/results/overhead_history/overhead_charlm_31st*.md``). ``guard_floor.py`` found the loss and
gradient-norm read most of the guard's time. This study asks about the rest, the guard's own Python logic: does
trimming the work it does per step show in the time it takes in a fit?

Three measurements:

1. In a fit (the char LM at ``benchmarks/overhead.py``'s settings, 3 seeds, arms interleaved per seed, hooks
   timed from outside by :class:`benchmarks.harness.HookTimer`): the guard as shipped, and the guard with two
   trims a maintainer would try first, applied from outside the library for this arm only:

   - one baseline window instead of two alike: without phases the guard keeps a window under the fixed key
     and the pooled window, which hold the same values; the trimmed arm judges on the pooled one alone;
   - a leaner read: no sparse check per gradient and the last norm by ``math.hypot`` (valid for this model:
     dense gradients, one process).

   The spike verdict's time per step in each fit is timed too (``StabilityCore.judge``, wrapped on the
   instance; the wrapper's own cost, about 1 µs, is in both arms).
2. The same verdict in a tight loop outside any fit (warm caches), on the same kind of values.
3. That loop again with a 16 MB copy between verdicts, which evicts the caches as a training step does.

Run: ``python -m benchmarks.studies.guard_cold_path`` (about 3 minutes on 2 cores; a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_pulse.callbacks.stability_guard as guard_module
from benchmarks.harness import Arm, run_arms
from benchmarks.overhead import WORKLOADS
from lightning_pulse import StabilityGuard
from lightning_pulse.core.spike_detection import POOLED

RESULTS_DIR = Path(__file__).parent / "results"


def lean_read(param_groups: Any, losses: list[torch.Tensor], all_reduce_sum: Any = None, world_size: int = 1):
    """The read with the two trims: dense gradients and one process only (what this study's model has)."""
    grads = [grad for group in param_groups for param in group["params"] if (grad := param.grad) is not None]
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
    read = torch.stack([loss.float(), *torch._foreach_norm(grads, 2.0)]).tolist()
    return read[0], math.hypot(*read[1:])


class LeanReadDuringFit(pl.Callback):
    """Puts :func:`lean_read` in the guard module's place for one fit and puts the original back after it."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.original = guard_module.step_loss_and_grad_norm
        guard_module.step_loss_and_grad_norm = lean_read

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        guard_module.step_loss_and_grad_norm = self.original


def timed_judge(guard: StabilityGuard) -> StabilityGuard:
    """Time the guard's spike verdict per call, on the instance (the guard's code is untouched)."""
    judge, times = guard.core.judge, []

    def judge_timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return judge(*args, **kwargs)
        finally:
            times.append(time.perf_counter_ns() - start)

    guard.core.judge = judge_timed
    guard.judge_times_ns = times  # read by the arm's metrics
    return guard


def shipped_guard(seed: int) -> list[pl.Callback]:
    return [timed_judge(StabilityGuard())]


def trimmed_guard(seed: int) -> list[pl.Callback]:
    guard = timed_judge(StabilityGuard())
    guard._fixed_key = POOLED  # one window: the pooled one holds the same values without phases
    return [guard, LeanReadDuringFit()]


def judge_metrics(callbacks: list[pl.Callback], trainer: pl.Trainer) -> dict[str, Any]:
    times = next(c for c in callbacks if isinstance(c, StabilityGuard)).judge_times_ns
    return {"judge_median_us": statistics.median(times) / 1e3}


ARMS = [
    Arm("plain"),
    Arm("stability_guard", callbacks=shipped_guard, metrics=judge_metrics),
    Arm("stability_guard_trimmed", callbacks=trimmed_guard, metrics=judge_metrics),
]


def loop_judge_us(evict: bool, steps: int = 2000, seed: int = 0) -> float:
    """Median time of one spike verdict in a loop outside a fit; ``evict``: a 16 MB copy between verdicts."""
    core = StabilityGuard().core
    core.start(0)
    rng = random.Random(seed)
    source = torch.randn(4_000_000)
    target = torch.empty_like(source)
    times = []
    for step in range(steps):
        loss, grad_norm = 2.0 + rng.gauss(0, 0.05), 0.5 + rng.gauss(0, 0.03)
        if evict:
            target.copy_(source)
        start = time.perf_counter_ns()
        core.judge(step, loss, grad_norm, POOLED, lambda: None)
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times[steps // 4 :]) / 1e3  # past the windows' warm-up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--name", default="guard_cold_path")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loops = {
        "warm loop": loop_judge_us(evict=False),
        "loop with a 16 MB copy between": loop_judge_us(evict=True),
    }
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
    result["loop_judge_us"] = loops
    plain_step = {
        r["seed"]: 1e3 * r["train_cpu_s"] / r["steps"] for r in result["runs"] if r["arm"] == "plain"
    }
    command = "python -m benchmarks.studies.guard_cold_path " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    lines = [
        f"# {args.name}",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Plain step: {statistics.median(plain_step.values()):.1f} ms of training CPU (median over seeds).",
        "",
        "| arm | guard hook time per step (µs), median | per seed | share of the plain step | "
        "spike verdict in the fit (µs), median |",
        "|---|---|---|---|---|",
    ]
    for arm in result["arms"][1:]:
        runs = [run for run in result["runs"] if run["arm"] == arm]
        hook_us = [1e6 * run["extra"]["hook_cpu_s"]["StabilityGuard"] / run["steps"] for run in runs]
        share = [us / (10 * plain_step[run["seed"]]) for us, run in zip(hook_us, runs)]
        judge = statistics.median(run["extra"]["judge_median_us"] for run in runs)
        per_seed = ", ".join(f"{us:.0f}" for us in hook_us)
        lines.append(
            f"| {arm} | {statistics.median(hook_us):.0f} | {per_seed} | {statistics.median(share):.2f}% | "
            f"{judge:.1f} |"
        )
    lines += ["", "The same spike verdict outside a fit (median of 1,500 calls):", ""]
    lines += [f"- {label}: {value:.1f} µs" for label, value in loops.items()]
    lines += ["", f"Environment: {result['environment']}."]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str))
    (RESULTS_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
