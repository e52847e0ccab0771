"""Study: after a rollback in a run of fixed length, should the LR schedule go back with the model?

The question came from seed 1 of the GPU headline (``benchmarks/results/gpu_headline.md``). A loss spike
in a replay phase made StabilityGuard skip two steps, roll back 43 steps to its snapshot, then skip 20
batches; the run ended at 0.859 test accuracy, against 0.966 for the same seed without the guard. With
``rewind_lr_schedule=True`` (the default) the OneCycleLR schedule goes back with the model while Lightning's
step counter runs on to the planned ``max_steps``, so the schedule ends short of its anneal. With ``False``
the schedule follows the step counter and finishes.

The spike cannot be reproduced on a CPU (bf16 numerics differ), so it is injected: the loss of three
consecutive optimizer steps, at 40% of the run, is multiplied by ``--factor`` in place before backward (the
gradients grow with it). The batch itself is healthy, so the guard's rollback test finds that a rollback
helps, and the guard rolls back, as it did on the GPU.

Arms, on the CPU headline's workload (``examples/mnist1d/pulse.yaml``: the MNIST-1D CNN and the shipped
suite):

- ``suite``: the suite, no spike;
- ``spike-no-guard``: the suite without StabilityGuard, spike injected (the scaled steps are applied);
- ``spike-rewind``: the suite, spike injected, ``rewind_lr_schedule=True`` (default);
- ``spike-keep-schedule``: the same with ``rewind_lr_schedule=False``.

Run: ``python -m benchmarks.studies.guard_lr_rewind`` (about 15 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.harness import Arm, instantiate_callbacks, run_arms
from benchmarks.headline import MNIST, WORKLOADS
from lightning_pulse import StabilityGuard

RESULTS_DIR = Path(__file__).parent / "results"


class InjectLossSpike(pl.Callback):
    """Multiplies the loss of the optimizer steps ``first .. first + count - 1`` by ``factor``, in place,
    before backward: a spike that the batch does not cause. Placed before the guard, which then reads the
    scaled loss. ``first`` is a share of the run's planned steps, read at train start."""

    def __init__(self, at: float, count: int, factor: float) -> None:
        self.at, self.count, self.factor = at, count, factor
        self.first: int | None = None
        self.injected: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.first = int(self.at * trainer.estimated_stepping_batches)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        step = trainer.global_step
        if self.first is not None and self.first <= step < self.first + self.count:
            loss.mul_(self.factor)
            self.injected.append(step)


def _suite(guard_config: dict[str, Any] | None, with_guard: bool = True) -> list[pl.Callback]:
    specs = copy.deepcopy(MNIST["trainer"]["callbacks"])
    if not with_guard:
        specs = [s for s in specs if not s["class_path"].endswith("StabilityGuard")]
    callbacks = instantiate_callbacks(specs)
    if guard_config is not None:
        from lightning_pulse import StabilityGuardConfig

        callbacks = [
            StabilityGuard(config=StabilityGuardConfig(**guard_config))
            if isinstance(c, StabilityGuard)
            else c
            for c in callbacks
        ]
    return callbacks


def _guard_figures(callbacks: list[pl.Callback], trainer: pl.Trainer) -> dict[str, Any]:
    guard = next((c for c in callbacks if isinstance(c, StabilityGuard)), None)
    injector = next((c for c in callbacks if isinstance(c, InjectLossSpike)), None)
    figures: dict[str, Any] = {"final_lr": trainer.optimizers[0].param_groups[0]["lr"]}
    if injector is not None:
        figures["injected_steps"] = injector.injected
    if guard is not None:
        figures.update(
            rollbacks=guard.rollbacks,
            steps_skipped=guard.steps_skipped,
            steps_lost=guard.steps_lost,
            flagged=[e["step"] for e in guard.events if e["event"] != "rollback"],
        )
    return figures


def arms(at: float, count: int, factor: float) -> list[Arm]:
    def spike() -> InjectLossSpike:
        return InjectLossSpike(at, count, factor)

    return [
        Arm("suite", callbacks=lambda seed: _suite(None), metrics=_guard_figures),
        Arm("spike-no-guard", callbacks=lambda seed: [spike(), *_suite(None, False)], metrics=_guard_figures),
        Arm("spike-rewind", callbacks=lambda seed: [spike(), *_suite(None)], metrics=_guard_figures),
        Arm(
            "spike-keep-schedule",
            callbacks=lambda seed: [spike(), *_suite({"rewind_lr_schedule": False})],
            metrics=_guard_figures,
        ),
    ]


def _table(result: dict[str, Any]) -> str:
    rows = [
        "| arm | test accuracy, median | per seed | rollbacks | steps lost | final LR, median "
        "| injected steps (first seed) | flagged steps (first seed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run in result["runs"]:
        by_arm.setdefault(run["arm"], []).append(run)
    for arm, runs in by_arm.items():
        accuracy = [run["test"]["test_acc"] for run in runs]
        extra = [run["extra"] for run in runs]
        rows.append(
            f"| {arm} | {statistics.median(accuracy):.3f} | {', '.join(f'{a:.3f}' for a in accuracy)} | "
            f"{', '.join(str(e.get('rollbacks', '-')) for e in extra)} | "
            f"{', '.join(str(e.get('steps_lost', '-')) for e in extra)} | "
            f"{statistics.median(e['final_lr'] for e in extra):.2e} | "
            f"{extra[0].get('injected_steps', '-')} | {extra[0].get('flagged', '-')} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--at", type=float, default=0.4, help="share of the planned steps where the spike starts"
    )
    parser.add_argument("--count", type=int, default=3, help="consecutive spiked steps")
    parser.add_argument("--factor", type=float, default=20.0, help="the loss is multiplied by this")
    parser.add_argument("--name", default="guard_lr_rewind")
    args = parser.parse_args(argv)
    spec = WORKLOADS["mnist1d-cnn"]
    result = run_arms(
        spec["workload"],
        arms(args.at, args.count, args.factor),
        seeds=args.seeds,
        trainer_kwargs=dict(spec["trainer"]),
        workload_kwargs=dict(spec["overrides"]),
        flops="none",
    )
    command = "python -m benchmarks.studies.guard_lr_rewind " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str))
    text = f"# {args.name}\n\nCommand: `{command.strip()}`\n\n{_table(result)}\n"
    (RESULTS_DIR / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
