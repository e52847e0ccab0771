"""ScheduledPrune: accuracy at 50/80/90% unstructured sparsity, and real speedups from structured pruning.

Workload: the MNIST-1D CNN (30 epochs, seeds 0 1 2, medians), in two widths:

* the paper's width (25 channels per conv layer): dense baseline; unstructured 50/80/90% of all conv and
  linear weights, and 90% with the input conv and the classifier kept dense; structured 50% of channels,
  without and with distillation;
* a wider variant (``--wide-channels``, 128 by default): dense baseline and structured 50%, because at 25
  channels a CPU step is dominated by per-operator overhead rather than arithmetic.

Every pruning arm runs under a PulseCycle (burst 20 / replay 10 / maintain 5 steps, maintain probe on), so
pruning events happen at maintain-phase starts, between 10% and 70% of the run.

Speed is measured on the final model at fit end by :class:`SpeedProbe`: median seconds of an inference
forward (no grad, eval mode) and of a training step (forward, backward, Adam step, on a copy) at batch size
100, alternating call by call with the same measurement on a freshly built dense model of the same
architecture, so the ratio ``dense / final`` is paired in time and insensitive to a busy neighbour. FLOPs of one training step
come from ``FlopCounterMode``. The in-run step speedup comes from :class:`BatchTimer`, which times training batches from
outside the library; :func:`arm_metrics` reads everything else from ScheduledPrune's public ``events``.

Run: ``python -m benchmarks.scheduled_prune``
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.harness import Arm, run_arms, write_results
from lightning_pulse import PulseCycle, ScheduledPrune
from lightning_pulse.core.distillation import DistillConfig

BATCH = 100


def _step_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


class SpeedProbe(Callback):
    """Times the final model against a fresh dense model of the same architecture, call by call.

    Calls alternate (final, dense, final, dense, ...), so a busy neighbour slows both alike; each figure is the
    median over ``pairs`` calls.
    """

    def __init__(self, pairs: int = 200, warmup: int = 5) -> None:
        self.pairs = pairs
        self.warmup = warmup
        self.metrics: dict[str, Any] = {}

    def on_fit_end(self, trainer, pl_module) -> None:
        dense = type(pl_module)(**pl_module.hparams)
        final = copy.deepcopy(pl_module)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH, 40, generator=generator)
        y = torch.randint(0, 10, (BATCH,), generator=generator)
        # counted before the timing loop, whose Adam steps move the copies' zeros
        self.metrics = {
            "params_final": sum(p.numel() for p in final.parameters()),
            "nonzero_params_final": sum(int(torch.count_nonzero(p)) for p in final.parameters()),
            "params_dense": sum(p.numel() for p in dense.parameters()),
            "train_step_flops_final": _step_flops(final, x, y),
            "train_step_flops_dense": _step_flops(dense, x, y),
        }
        models = {"final": final, "dense": dense}
        optimizers = {name: torch.optim.Adam(model.parameters(), lr=1e-3) for name, model in models.items()}

        def infer(name: str) -> None:
            with torch.no_grad():
                models[name](x)

        def train_step(name: str) -> None:
            optimizers[name].zero_grad(set_to_none=True)
            F.cross_entropy(models[name](x), y).backward()
            optimizers[name].step()

        for kind, run, training in (("infer", infer, False), ("train_step", train_step, True)):
            for model in models.values():
                model.train(training)
            times: dict[str, list[float]] = {"final": [], "dense": []}
            for index in range(self.warmup + self.pairs):
                for name in ("final", "dense"):
                    started = time.perf_counter()
                    run(name)
                    if index >= self.warmup:
                        times[name].append(time.perf_counter() - started)
            final_s, dense_s = statistics.median(times["final"]), statistics.median(times["dense"])
            self.metrics.update(
                {f"{kind}_s_final": final_s, f"{kind}_s_dense": dense_s, f"{kind}_speedup": dense_s / final_s}
            )


class BatchTimer(Callback):
    """Wall seconds of every training batch, with the optimizer step it ended at."""

    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append((trainer.global_step, time.perf_counter() - self._started))

    def speedup(self, first_event: int, last_event: int, window: int = 10) -> float:
        """Median batch time of the ``window`` batches before the first event over that of the ``window``
        batches after the last one (the first batch after it, which pays one-off costs, skipped)."""
        before = [seconds for step, seconds in self.times if step < first_event][-window:]
        after = [seconds for step, seconds in self.times if step > last_event + 1][:window]
        return statistics.median(before) / statistics.median(after) if before and after else math.nan


def arm_metrics(callbacks: list[Callback], trainer: Any = None) -> dict[str, Any]:
    """What the tables need, read from the callbacks of one run (``Arm.metrics`` of the harness)."""
    extra: dict[str, Any] = {}
    prune = next((c for c in callbacks if isinstance(c, ScheduledPrune)), None)
    timer = next((c for c in callbacks if isinstance(c, BatchTimer)), None)
    for callback in callbacks:
        if isinstance(callback, SpeedProbe):
            extra.update(callback.metrics)
    if prune is not None:
        extra.update({"prune_events": len(prune.events), "prune_sparsity": prune.sparsity})
        if prune.events and timer is not None:
            extra["in_run_step_speedup"] = timer.speedup(prune.events[0]["step"], prune.events[-1]["step"])
    return extra


def _arm(name: str, callbacks: Any) -> Arm:
    arm = Arm(name, callbacks=callbacks)
    arm.metrics = arm_metrics  # called by the harness after each run
    return arm


CYCLE = dict(burst=20, replay=10, maintain=5)
INPUT_AND_OUTPUT_LAYERS = r"^net\.(1|8)$"


def pruning_arm(name: str, **prune_kwargs: Any) -> Arm:
    return _arm(
        name,
        lambda seed: [
            PulseCycle(**CYCLE),
            ScheduledPrune(start=0.1, end=0.7, **prune_kwargs),
            SpeedProbe(),
            BatchTimer(),
        ],
    )


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else math.nan


def _arm_extra(result: dict[str, Any], arm: str, key: str) -> float:
    return _median([run["extra"].get(key) for run in result["runs"] if run["arm"] == arm])


def summary_tables(results: list[dict[str, Any]]) -> str:
    lines = []
    for result in results:
        channels = result["workload_kwargs"].get("model__channels", 25)
        lines += [
            f"### {result['workload']}, {channels} channels",
            "",
            "| arm | test_acc | Δ test_acc (pp) | params | non-zero params | train-step FLOPs ratio | inference speedup | "
            "training-step speedup | in-run step speedup |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for arm in result["arms"]:
            row = result["summary"][arm]
            flops = _arm_extra(result, arm, "train_step_flops_final") / _arm_extra(
                result, arm, "train_step_flops_dense"
            )
            lines.append(
                f"| {arm} | {row['test_acc']:.4f} | {100 * row['delta_test_acc_vs_baseline']:+.2f} | "
                f"{_arm_extra(result, arm, 'params_final'):.0f} | {_arm_extra(result, arm, 'nonzero_params_final'):.0f} | "
                f"{flops:.3f} | {_arm_extra(result, arm, 'infer_speedup'):.2f}x | "
                f"{_arm_extra(result, arm, 'train_step_speedup'):.2f}x | {_arm_extra(result, arm, 'in_run_step_speedup'):.2f}x |"
            )
        lines.append("")
    return "\n".join(lines)


NOTES = """\
Speedups: `dense / final` seconds at batch size 100 on one thread, measured at fit end with the final model and
a freshly built dense model of the same width, calls alternating (200 pairs, medians), so the ratio is paired
in time. Training step = forward + backward + Adam step. The dense arm's ratio (about 1.0) shows the
noise floor. "In-run step speedup": the training-batch time in the window before the first pruning event over
the window after the last one, inside the real run (includes data handling and callbacks). Unstructured arms
keep the dense shapes (masks folded into zeros at fit end), so they save no compute: their speedups are 1.0
within noise. Δ test_acc is paired by seed against the dense baseline of the same width.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--wide-channels", type=int, default=128)
    parser.add_argument("--name", default="scheduled_prune")
    args = parser.parse_args()
    trainer_kwargs = {"max_epochs": args.epochs}
    narrow_arms = [
        _arm("dense", lambda seed: [SpeedProbe()]),
        pruning_arm("unstructured-50", final_sparsity=0.5),
        pruning_arm("unstructured-80", final_sparsity=0.8),
        pruning_arm("unstructured-90", final_sparsity=0.9),
        # common practice: keep the input conv (5 taps per filter) and the classifier dense
        pruning_arm("unstructured-90-inner", final_sparsity=0.9, exclude_pattern=INPUT_AND_OUTPUT_LAYERS),
        pruning_arm("structured-50", final_sparsity=0.5, mode="structured"),
        pruning_arm("structured-50+distill", final_sparsity=0.5, mode="structured", distill=DistillConfig()),
    ]
    results = [
        run_arms("mnist1d-cnn", narrow_arms, seeds=args.seeds, trainer_kwargs=trainer_kwargs, flops="none")
    ]
    if args.wide_channels:
        wide_arms = [
            _arm("dense", lambda seed: [SpeedProbe()]),
            pruning_arm("structured-50", final_sparsity=0.5, mode="structured"),
        ]
        results.append(
            run_arms(
                "mnist1d-cnn",
                wide_arms,
                seeds=args.seeds,
                trainer_kwargs=trainer_kwargs,
                workload_kwargs={"model__channels": args.wide_channels},
                flops="none",
            )
        )
    notes = NOTES + "\n" + summary_tables(results)
    command = "python -m benchmarks.scheduled_prune" + (
        ""
        if (args.epochs, args.seeds, args.wide_channels) == (30, [0, 1, 2], 128)
        else f" --epochs {args.epochs} --seeds {' '.join(map(str, args.seeds))} --wide-channels {args.wide_channels}"
    )
    write_results(results, args.name, command=command, notes=notes)
    print(notes)


if __name__ == "__main__":
    main()
