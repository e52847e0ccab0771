"""Study: where StabilityGuard's time per step goes on the char LM, hook by hook.

Issue 17 asks for StabilityGuard at most 1% of a char-LM step; ``benchmarks/overhead.py`` times the guard as a
whole. This study splits that time: each hook the guard overrides, its work off the hooks (the optimizer step
hooks, the copy at ``training_step``'s entry: :attr:`benchmarks.harness.HookTimer.OFF_HOOK_WORK`), and inside
``on_before_optimizer_step`` the loss and gradient-norm read (``step_loss_and_grad_norm``) and the verdict
(``StabilityCore.judge``), each wrapped from outside for the fit. CPU µs per optimizer step, median over
seeds;
the char LM at ``benchmarks/overhead.py``'s settings, no validation.

Run: ``python -m benchmarks.studies.guard_hooks`` (about 2 minutes on 2 cores; a quiet machine).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_pulse.callbacks.stability_guard as guard_module
from benchmarks import harness
from benchmarks.harness import QUIET_TRAINER, HookTimer, environment
from benchmarks.workloads import get_workload
from lightning_pulse import StabilityGuard

RESULTS = Path(__file__).parent / "results"
STEPS = 300


class PerHookTimer(HookTimer):
    """:class:`HookTimer` with one figure per hook (and per off-hook method) instead of one per callback."""

    def install(self, callback: Any, apart: tuple[str, ...] = ()) -> None:
        for name in harness._HOOK_NAMES:
            method = getattr(callback, name, None)
            if method is None or getattr(type(callback), name, None) is getattr(harness.Callback, name, None):
                continue
            self.cpu_s.setdefault(name, 0.0)
            self.calls.setdefault(name, 0)
            setattr(callback, name, self._timed(name, method, self.cpu_s))
        for path in self.OFF_HOOK_WORK.get(type(callback).__name__, ()):
            *owners, name = path.split(".")
            owner = functools.reduce(getattr, owners, callback)
            self.cpu_s.setdefault(path, 0.0)
            self.calls.setdefault(path, 0)
            setattr(owner, name, self._timed(path, getattr(owner, name), self.cpu_s))


def _timed(totals: dict[str, float], name: str, function: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.process_time() - started

    return timed


def run(seed: int) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    module, data = get_workload("charlm").build(data__max_chars=200_000)
    data.prepare_data()
    guard, timer, inside = StabilityGuard(), PerHookTimer(), {}
    timer.install(guard)
    guard.core.judge = _timed(inside, "inside: verdict (StabilityCore.judge)", guard.core.judge)
    read = guard_module.step_loss_and_grad_norm
    guard_module.step_loss_and_grad_norm = _timed(inside, "inside: loss and gradient-norm read", read)
    try:
        kwargs = {**QUIET_TRAINER, "default_root_dir": tempfile.mkdtemp(), "max_steps": STEPS}
        pl.Trainer(callbacks=[guard], limit_val_batches=0, **kwargs).fit(module, data)
    finally:
        guard_module.step_loss_and_grad_norm = read
    figures = {name: 1e6 * seconds / STEPS for name, seconds in {**timer.cpu_s, **inside}.items()}
    figures["all (hooks and off-hook work)"] = 1e6 * sum(timer.cpu_s.values()) / STEPS
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [run(seed) for seed in args.seeds]
    medians = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "seeds": args.seeds,
        "steps": STEPS,
        "runs": runs,
        "medians": medians,
        "environment": environment(),
    }
    (RESULTS / "guard_hooks.json").write_text(json.dumps(payload, indent=2))
    rows = sorted(medians.items(), key=lambda item: -item[1])
    lines = [
        "# StabilityGuard's time per step, hook by hook (char LM)",
        "",
        f"Command: `python -m benchmarks.studies.guard_hooks`. CPU µs per optimizer step ({STEPS} steps), "
        f"median over seeds {args.seeds}; `inside:` rows are parts of `on_before_optimizer_step`.",
        "",
        "| where | µs per step |",
        "|---|---|",
        *(f"| {name} | {value:.1f} |" for name, value in rows if value >= 0.05),
        "",
        f"Environment: {payload['environment']}.",
    ]
    text = "\n".join(lines) + "\n"
    (RESULTS / "guard_hooks.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
