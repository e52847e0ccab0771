"""Study: what StabilityGuard really adds to a char-LM CPU step, and why its in-hook share sits near 1%.

``benchmarks/overhead.py`` charges each callback the CPU time spent inside its hooks. On the char LM
StabilityGuard's share is about 1.1%, against a 1% target. This study asks two questions in the same fits:

* **Marginal cost.** One fit with the guard's per-step hooks switched on at even steps and off at odd ones.
  Each step's CPU time is measured from one batch start to the next, so the machine's load falls on both sets
  alike. The marginal cost is the median "on" step over the median "off" step, minus one. The guard's own
  in-hook time on the "on" steps of the same fit is reported next to it. The guard's windows only see every
  other step here: the verdict path is the same, which is what is timed.
* **Where the time goes.** A separate fit with no guard. In ``on_before_optimizer_step``, right after
  backward, one call is timed and then the same call again: at even steps ``torch._foreach_norm`` on 30
  tensors of four values (an op backward did not run, on 120 values already in cache), at odd steps the
  guard's own read (:func:`lightning_pulse.core.grad_norm.step_loss_and_grad_norm`) on the real gradients.
  The first call minus the second is the price of running code that backward pushed out of the CPU's caches.

Run: ``python -m benchmarks.studies.guard_cost`` (about 3 minutes on 2 cores). Writes
``benchmarks/studies/results/guard_cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.harness import QUIET_TRAINER, environment
from benchmarks.overhead import WORKLOADS
from benchmarks.workloads import get_workload
from lightning_pulse import StabilityGuard
from lightning_pulse.core.grad_norm import step_loss_and_grad_norm

RESULTS = Path(__file__).parent / "results"
#: the hooks StabilityGuard runs on every optimizer step
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class _Alternate(pl.Callback):
    """Put first in the callbacks: opens each step, times the previous one, and switches the guard."""

    def __init__(self) -> None:
        self.guard_on = True
        self.step_cpu_s: dict[bool, list[float]] = {True: [], False: []}
        self.hook_cpu_s = 0.0  # the guard's in-hook time on "on" steps
        self._started: float | None = None
        self._clean = False  # no validation inside the step being timed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.process_time()
        if self._started is not None and self._clean:
            self.step_cpu_s[self.guard_on].append(now - self._started)
        self.guard_on = trainer.global_step % 2 == 0
        self._started, self._clean = now, True

    def on_validation_start(self, trainer, pl_module) -> None:
        self._clean = False


def _gate(guard: StabilityGuard, switch: _Alternate) -> None:
    """Run the guard's per-step hooks only on the steps ``switch`` turns on, and time them there."""
    for name in STEP_HOOKS:
        hook = getattr(guard, name)

        def gated(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
            if not switch.guard_on:
                return None
            started = time.process_time()
            try:
                return _hook(*args, **kwargs)
            finally:
                switch.hook_cpu_s += time.process_time() - started

        setattr(guard, name, gated)


class _ColdProbe(pl.Callback):
    """Right after backward, times one call and then the same call again; even steps time a tiny op, odd
    steps the guard's read of the real gradients."""

    def __init__(self) -> None:
        self.tiny = [torch.randn(4) for _ in range(30)]
        self.ns: dict[str, list[int]] = {
            "tiny_first": [],
            "tiny_again": [],
            "read_first": [],
            "read_again": [],
        }

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        loss = torch.zeros(())
        if trainer.global_step % 2 == 0:
            call, keys = (lambda: torch._foreach_norm(self.tiny, 2.0)), ("tiny_first", "tiny_again")
        else:
            call = lambda: step_loss_and_grad_norm(optimizer.param_groups, [loss])  # noqa: E731
            keys = ("read_first", "read_again")
        for key in keys:
            started = time.perf_counter_ns()
            call()
            self.ns[key].append(time.perf_counter_ns() - started)


def _fit(seed: int, callbacks: list[pl.Callback], max_steps: int) -> pl.Trainer:
    settings = WORKLOADS["charlm"]
    pl.seed_everything(seed, workers=True, verbose=False)
    module, datamodule = get_workload("charlm").build(**settings["workload_kwargs"])
    kwargs = {**QUIET_TRAINER, **settings["trainer_kwargs"], "max_steps": max_steps}
    kwargs["default_root_dir"] = tempfile.mkdtemp(prefix="lp-guard-cost-")
    trainer = pl.Trainer(callbacks=callbacks, **kwargs)
    trainer.fit(module, datamodule)
    return trainer


def marginal(seed: int, max_steps: int) -> dict[str, Any]:
    switch, guard = _Alternate(), StabilityGuard()
    _gate(guard, switch)
    _fit(seed, [switch, guard], max_steps)
    on, off = switch.step_cpu_s[True][5:], switch.step_cpu_s[False][5:]  # past the first steps' warm-up
    on_median, off_median = statistics.median(on), statistics.median(off)
    return {
        "seed": seed,
        "steps_on": len(on),
        "steps_off": len(off),
        "step_ms_off": 1e3 * off_median,
        "step_ms_on": 1e3 * on_median,
        "marginal_share": on_median / off_median - 1,
        "in_hook_share": switch.hook_cpu_s / sum(switch.step_cpu_s[True]),
    }


def probe(seed: int, max_steps: int) -> dict[str, Any]:
    cold = _ColdProbe()
    _fit(seed, [cold], max_steps)
    return {"seed": seed, **{key: statistics.median(ns[5:]) / 1e3 for key, ns in cold.ns.items()}}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# guard_cost",
        "",
        f"Command: `{result['command']}`",
        "",
        "Char LM (`benchmarks/overhead.py`'s settings), one torch thread. CPU per step from one batch start to the "
        "next; validation steps left out.",
        "",
        "## Marginal cost: the guard on at even steps, off at odd ones, in one fit",
        "",
        "| seed | step off (ms) | step on (ms) | marginal | in-hook share (same fit) |",
        "|---|---|---|---|---|",
    ]
    for row in result["marginal"]:
        lines.append(
            f"| {row['seed']} | {row['step_ms_off']:.2f} | {row['step_ms_on']:.2f} | "
            f"{100 * row['marginal_share']:+.2f}% | {100 * row['in_hook_share']:.2f}% |"
        )
    summary = result["summary"]
    lines += [
        f"| median | | | {100 * summary['marginal_share']:+.2f}% | {100 * summary['in_hook_share']:.2f}% |",
        "",
        "## Where the time goes: calls timed right after backward (µs, median over steps)",
        "",
        "| seed | foreach_norm on 30x4 values: first op | again | the guard's read, real gradients: first op | again |",
        "|---|---|---|---|---|",
    ]
    for row in result["probe"]:
        lines.append(
            f"| {row['seed']} | {row['tiny_first']:.1f} | {row['tiny_again']:.1f} | {row['read_first']:.1f} | "
            f"{row['read_again']:.1f} |"
        )
    lines += [
        f"| median | {summary['tiny_first']:.1f} | {summary['tiny_again']:.1f} | {summary['read_first']:.1f} | "
        f"{summary['read_again']:.1f} |",
        "",
        f"Environment: {result['environment']}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of each marginal-cost fit")
    parser.add_argument("--probe-steps", type=int, default=150)
    parser.add_argument("--name", default="guard_cost")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.studies.guard_cost"
        + (f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds != [0, 1, 2, 3, 4] else "")
        + (f" --steps {args.steps}" if args.steps != 600 else "")
        + (f" --name {args.name}" if args.name != "guard_cost" else ""),
        "marginal": [marginal(seed, args.steps) for seed in args.seeds],
        "probe": [probe(seed, args.probe_steps) for seed in args.seeds[:3]],
        "environment": environment(),
    }
    result["summary"] = {
        **{
            key: statistics.median(row[key] for row in result["marginal"])
            for key in ("marginal_share", "in_hook_share")
        },
        **{
            key: statistics.median(row[key] for row in result["probe"])
            for key in ("tiny_first", "tiny_again", "read_first", "read_again")
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2, default=str))
    (RESULTS / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
