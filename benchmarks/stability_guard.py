"""StabilityGuard: overhead without faults, and recovery over a sweep of injected faults.

    flock /tmp/lp-bench.lock python -m benchmarks.stability_guard --only overhead   # timing: under the lock
    python -m benchmarks.stability_guard --only faults     # recovery figures (no timing, no lock needed)
    python -m benchmarks.stability_guard                   # both parts in one go
    python -m benchmarks.stability_guard --quick           # a smoke run (1 seed, fewer epochs), not for reporting

``--only`` reruns one part and keeps the other part's committed results (each part records its command).

Part 1, overhead. The MNIST-1D CNN and MLP reference runs (the cheapest steps we have, so the worst case
for a per-step cost) and the char-level transformer LM are trained with no callback, with an empty
``Callback`` (Lightning's own cost of dispatching every hook to one more callback, plus the noise floor of
the machine) and with a default ``StabilityGuard``, through the shared harness with rotated arm order:
seed-paired process CPU time ratios, the CPU time spent inside the guard's own hooks as a share of training
CPU time (timed from outside by :func:`time_hooks`; its snapshots included, also reported alone; the
harness merges :func:`guard_metrics` into each run), and the spikes it flags on these clean runs
(false positives). On the MNIST-1D workloads also a paired measurement inside single fits: the guard's hooks run
on a seeded random half of the batches (:class:`CoinFlipGuard`), and the CPU time of guarded and unguarded
steps is compared, both for the whole iteration (data loading included) and for the step proper, with a
control run of the gate alone for the method's noise floor.

Part 2, faults. Each fault alone, at 40% and at 80% of a 12-epoch one-cycle run, three seeds:

* ``nan``: one NaN input value in one batch;
* ``scale``: one batch scaled by 1e4;
* ``labels``: 8 batches with every label wrong;
* ``lr``: the learning rate x100 for 8 steps;
* ``nan_output_forever``: the model's output NaN at every step from 40% on, with finite data (nothing can
  recover: the guard must stop cleanly). Until issue 18 this was ``nan_forever``, NaN *inputs* from 40% on;
  the guard now skips non-finite data as the data's fault, without escalating, so that fault no longer
  stops a run: it skips every step to the end.

Arms: unguarded; ``StabilityGuard()`` with its defaults; and a tuned guard with frequent snapshots. Per
fault and arm: how many runs finished (no stop, finite loss), how many recovered (final validation loss
within 5% of the same seed's clean run), the median ratio to the clean run, steps lost, rollbacks.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import QUIET_TRAINER, RESULTS_DIR, Arm, environment, markdown_table, run_arms
from lightning_pulse.callbacks.stability_guard import StabilityGuard, StabilityGuardError

FAULT_KINDS = ("nan", "nan_output", "scale", "labels", "lr")
REFERENCE = {"model__lr": 0.03, "model__weight_decay": 5e-4, "model__scheduler": "onecycle"}
RECOVERED_WITHIN = 0.05


class FaultInjector(Callback):
    """Corrupts optimizer steps ``start .. start + length - 1`` (all micro-batches of each), from outside
    the module.

    * ``nan``: one input value becomes NaN (bad data: StabilityGuard skips it as the data's fault);
    * ``nan_output``: the output of the module's last layer becomes NaN, with finite data and a finite model
      (a numerical fault inside the forward: StabilityGuard escalates it like a spike);
    * ``scale``: the inputs are multiplied by ``1e4``;
    * ``labels``: every label is replaced by a wrong one;
    * ``lr``: the learning rate is multiplied by ``factor`` for the step, then set back.

    Batches are mutated in place in ``on_train_batch_start``; ``training_step`` sees the same list.
    ``ranks`` limits the fault to those DDP ranks.
    """

    def __init__(
        self,
        kind: str,
        start: int,
        length: int = 1,
        factor: float = 100.0,
        ranks: Sequence[int] | None = None,
    ) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"`kind`={kind!r} is not one of {list(FAULT_KINDS)}.")
        self.kind, self.start, self.length, self.factor = kind, start, length, factor
        self.ranks = None if ranks is None else tuple(ranks)
        self._saved_lrs: list[float] | None = None
        self._hook: Any = None

    def _active(self, trainer: pl.Trainer) -> bool:
        in_window = self.start <= trainer.global_step < self.start + self.length
        return in_window and (self.ranks is None or trainer.global_rank in self.ranks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._active(trainer):
            return
        if self.kind == "nan_output":
            if self._hook is None:
                owners = [
                    m for m in pl_module.modules() if next(m.parameters(recurse=False), None) is not None
                ]
                self._hook = owners[-1].register_forward_hook(lambda module, args, out: out * float("nan"))
            return
        x, y = batch if self.kind != "lr" else (None, None)  # the lr fault works on any batch (dicts too)
        if self.kind == "nan":
            x[0, 0] = float("nan")
        elif self.kind == "scale":
            x.mul_(1e4)
        elif self.kind == "labels":
            generator = torch.Generator().manual_seed(trainer.global_step)
            y.copy_((y + torch.randint(1, 10, y.shape, generator=generator)) % 10)
        elif self._saved_lrs is None:
            groups = trainer.optimizers[0].param_groups
            self._saved_lrs = [group["lr"] for group in groups]
            for group in groups:
                group["lr"] = group["lr"] * self.factor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._saved_lrs is not None:
            for group, lr in zip(trainer.optimizers[0].param_groups, self._saved_lrs):
                group["lr"] = lr  # absolute, so a guard rollback in between cannot compound it
            self._saved_lrs = None


# ------------------------------------------------------------------------------------------ measuring from outside
#: the Lightning hooks a callback can override
HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown"))


def time_hooks(callback: Callback, extra: Sequence[str] = ()) -> dict[str, float]:
    """Time ``callback``'s hooks from outside: process CPU seconds, accumulated per method name.

    Every Lightning hook that the callback's class overrides is replaced, on the instance, by a wrapper that
    adds its ``time.process_time`` to the returned dict (which keeps filling during the fit); ``"total"`` is
    their sum. ``extra`` names further methods (e.g. ``"_take_snapshot"``) timed on their own: they run inside
    the hooks, so they are part of ``"total"`` already, not added to it again.
    """
    seconds: dict[str, float] = {"total": 0.0}

    def wrap(name: str, in_total: bool) -> None:
        original = getattr(callback, name)
        seconds[name] = 0.0

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.process_time() - started
                seconds[name] += elapsed
                if in_total:
                    seconds["total"] += elapsed

        setattr(callback, name, timed)

    for name in HOOKS:
        if getattr(type(callback), name) is not getattr(Callback, name):
            wrap(name, in_total=True)
    for name in extra:
        wrap(name, in_total=False)
    return seconds


_HOOK_SECONDS: weakref.WeakKeyDictionary[StabilityGuard, dict[str, float]] = weakref.WeakKeyDictionary()


def timed_guard(**kwargs: Any) -> StabilityGuard:
    """A ``StabilityGuard`` whose hooks (and snapshots) are timed by :func:`time_hooks`."""
    guard = StabilityGuard(**kwargs)
    _HOOK_SECONDS[guard] = time_hooks(guard, extra=("_take_snapshot",))
    return guard


def guard_figures(guard: StabilityGuard) -> dict[str, Any]:
    """The guard's public counters (and, for a :func:`timed_guard`, its hook CPU time)."""
    figures: dict[str, Any] = {
        "spikes_detected": guard.spikes_detected,
        "spikes_by_kind": dict(guard.spikes_by_kind),
        "steps_skipped": guard.steps_skipped,
        "rollbacks": guard.rollbacks,
        "steps_undone": guard.steps_undone,
        "steps_lost": guard.steps_lost,
        "energy_wasted_kwh": guard.metrics().get("stability/energy_wasted_kwh"),
        "snapshots_taken": guard.snapshots_taken,
        "snapshot_bytes": guard.snapshots.nbytes,
        "stopped": guard.stopped,
    }
    if guard in _HOOK_SECONDS:
        figures["guard_cpu_seconds"] = _HOOK_SECONDS[guard]["total"]
        figures["snapshot_cpu_seconds"] = _HOOK_SECONDS[guard]["_take_snapshot"]
    return figures


def guard_metrics(callbacks: Sequence[Callback], trainer: pl.Trainer) -> dict[str, Any]:
    """``Arm.metrics`` for the harness: the figures of the run's guard (merged into the run's ``extra``)."""
    guard = next(callback for callback in callbacks if isinstance(callback, StabilityGuard))
    return guard_figures(guard)


# ------------------------------------------------------------------------------------------ overhead
# the paired measurement's per-seed differences scatter by tens of microseconds: more seeds and steps than the
# end-to-end arms, so the median over seeds is stable to a few
PAIRED_SEEDS, PAIRED_EPOCHS = tuple(range(10)), 20


class CoinFlipGuard(StabilityGuard):
    """``StabilityGuard`` whose per-step hooks run on a random half of the batches (the paired arm).

    The gate (one seeded coin flip per batch) costs the same on both kinds of batch, so guarded and
    unguarded steps of the same fit differ by the guard's per-step work alone, including what it shifts
    onto the rest of the step (caches it warms or evicts for the optimizer right after it). A coin, not
    strict alternation: steps have period-2 effects of their own (the allocator hands out the same blocks
    every other step), which alternation would add to one side. Snapshots follow the guarded steps
    (reported by :func:`time_hooks` in the end-to-end arms, not here). Assumes no gradient accumulation.
    """

    def __init__(self, seed: int = 0, active: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.on = False
        self.active = active  # False: the gate alone, the control that measures the method's noise floor
        self._coin = random.Random(seed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.on = self._coin.random() < 0.5
        if self.on and self.active:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.on and self.active:
            super().on_before_backward(trainer, pl_module, loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.on and self.active:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.on and self.active:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class StepTimer(Callback):
    """Per-batch CPU time of this thread, split by ``gate.on``, two ways.

    ``ns``: from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step and
    every callback's batch hooks placed before the timer). ``iteration_ns``: from one
    ``on_train_batch_start`` to the next, so also the next batch's loading and the loop's own work between
    batches: the step time a user sees. Intervals that span an epoch boundary (validation) are dropped.
    """

    def __init__(self, gate: CoinFlipGuard) -> None:
        self.gate = gate
        self.ns: dict[bool, list[int]] = {True: [], False: []}
        self.iteration_ns: dict[bool, list[int]] = {True: [], False: []}
        self._start = 0
        self._previous: tuple[int, bool, int] | None = None  # (start, gate, epoch) of the batch before

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.thread_time_ns()
        if self._previous is not None and self._previous[2] == trainer.current_epoch:
            self.iteration_ns[self._previous[1]].append(now - self._previous[0])
        self._start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ns[self.gate.on].append(time.thread_time_ns() - self._start)
        self._previous = (self._start, self.gate.on, trainer.current_epoch)


def fit_reference(workload: str, seed: int, epochs: int, callbacks: list[Callback]) -> pl.Trainer:
    """Fit ``workload`` in its reference configuration with ``callbacks`` and nothing else; return the Trainer."""
    from benchmarks.workloads import get_workload

    pl.seed_everything(seed, workers=True, verbose=False)
    module, datamodule = get_workload(workload).build(**REFERENCE)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, **QUIET_TRAINER)
    trainer.fit(module, datamodule)
    return trainer


def paired_step_cost(workload: str, seeds: Sequence[int], epochs: int, active: bool = True) -> dict[str, Any]:
    """The guard's marginal cost per quiet step, from guarded and unguarded steps of the same fits.

    One fit per seed with :class:`CoinFlipGuard` and a :class:`StepTimer` after it; per seed the
    difference of the median CPU of guarded and unguarded steps (medians: robust to the rare snapshot
    step, a collection or a preemption), then the median over seeds, for the step proper and for the whole
    iteration (data loading included). Steps of the first epoch are left out (warm-up of the allocator and of
    torch's caches). ``active=False`` runs the gate alone: the same split of the steps, nothing else, so its
    result is the method's noise floor.
    """

    per_seed = []
    for seed in seeds:
        gate = CoinFlipGuard(seed, active=active)
        timer = StepTimer(gate)
        trainer = fit_reference(workload, seed, epochs, [gate, timer])
        skip = trainer.num_training_batches // 2  # per kind of step: about the first epoch
        row = {"seed": seed}
        for name, samples in (("step", timer.ns), ("iteration", timer.iteration_ns)):
            row[f"guarded_{name}_us"] = statistics.median(samples[True][skip:]) / 1e3
            row[f"unguarded_{name}_us"] = statistics.median(samples[False][skip:]) / 1e3
        per_seed.append(row)
        print(
            f"[{workload}] paired active={active} seed={seed}: step on {row['guarded_step_us']:.0f} us, "
            f"off {row['unguarded_step_us']:.0f} us; iteration on {row['guarded_iteration_us']:.0f} us, "
            f"off {row['unguarded_iteration_us']:.0f} us"
        )
    result: dict[str, Any] = {"seeds": list(seeds), "epochs": epochs, "per_seed": per_seed}
    for name in ("step", "iteration"):
        marginal = [r[f"guarded_{name}_us"] - r[f"unguarded_{name}_us"] for r in per_seed]
        prefix = "" if name == "step" else "iteration_"
        result[f"{prefix}marginal_us_median"] = statistics.median(marginal)
        result[f"{prefix}marginal_us_quartiles"] = (
            statistics.quantiles(marginal, n=4)[::2] if len(marginal) > 1 else [marginal[0]] * 2
        )
        result[f"{prefix}marginal_share_median"] = statistics.median(
            r[f"guarded_{name}_us"] / r[f"unguarded_{name}_us"] - 1 for r in per_seed
        )
        result[f"unguarded_{name}_us_median"] = statistics.median(r[f"unguarded_{name}_us"] for r in per_seed)
    return result


def overhead(
    seeds: Sequence[int],
    epochs: int,
    charlm_steps: int,
    paired_seeds: Sequence[int] = PAIRED_SEEDS,
    paired_epochs: int = PAIRED_EPOCHS,
) -> list[dict[str, Any]]:
    results = []
    setups = [
        ("mnist1d-cnn", {"max_epochs": epochs}, REFERENCE),
        ("mnist1d-mlp", {"max_epochs": epochs}, REFERENCE),
        ("charlm", {"max_epochs": 1, "max_steps": charlm_steps}, {}),
    ]
    for workload, trainer_kwargs, workload_kwargs in setups:
        arms = [
            Arm("baseline"),
            Arm("empty_callback", callbacks=lambda seed: [Callback()]),
            Arm("stability_guard", callbacks=lambda seed: [timed_guard()], metrics=guard_metrics),
        ]
        workload_seeds = seeds if workload.startswith("mnist1d") else seeds[:3]
        result = run_arms(
            workload, arms, workload_seeds, trainer_kwargs, workload_kwargs, flops="none", rotate_arms=True
        )
        guarded = [run for run in result["runs"] if run["arm"] == "stability_guard"]
        empty = {run["seed"]: run for run in result["runs"] if run["arm"] == "empty_callback"}
        result["guard"] = {
            "hook_cpu_share_median": statistics.median(
                run["extra"]["guard_cpu_seconds"] / run["train_cpu_s"] for run in guarded
            ),
            "hook_cpu_us_per_step_median": statistics.median(
                1e6 * run["extra"]["guard_cpu_seconds"] / run["steps"] for run in guarded
            ),
            "step_cpu_us_median": statistics.median(
                1e6 * run["train_cpu_s"] / run["steps"] for run in guarded
            ),
            "snapshot_cpu_share_median": statistics.median(
                run["extra"]["snapshot_cpu_seconds"] / run["train_cpu_s"] for run in guarded
            ),
            "snapshots_taken": [run["extra"]["snapshots_taken"] for run in guarded],
            "cpu_ratio_vs_empty_callback_median": statistics.median(
                run["train_cpu_s"] / empty[run["seed"]]["train_cpu_s"] for run in guarded
            ),
            "false_positive_spikes": [run["extra"]["spikes_detected"] for run in guarded],
            "snapshot_bytes": guarded[0]["extra"]["snapshot_bytes"],
        }
        if workload.startswith("mnist1d"):
            result["guard"]["paired"] = paired_step_cost(workload, paired_seeds, paired_epochs)
            result["guard"]["paired_control"] = paired_step_cost(
                workload, paired_seeds, paired_epochs, active=False
            )
        results.append(result)
    return results


# ------------------------------------------------------------------------------------------ faults
def default_guard() -> StabilityGuard:
    return StabilityGuard()


def tuned_guard() -> StabilityGuard:
    # snapshots of a 6k-parameter model are cheap: take them often, so a rollback undoes few steps
    return StabilityGuard(
        snapshot_every=5, max_snapshots=3, rollback_margin=5, rollback_after=2, skip_after_rollback=6
    )


GUARDS: dict[str, Callable[[], StabilityGuard] | None] = {
    "unguarded": None,
    "guard_default": default_guard,
    "guard_tuned": tuned_guard,
}


def run_fault(data, seed: int, epochs: int, faults: list[Callback], guard: StabilityGuard | None, root: str):
    from examples.mnist1d import MNIST1DClassifier

    pl.seed_everything(seed, verbose=False)
    model = MNIST1DClassifier(arch="cnn", lr=0.03, weight_decay=5e-4, scheduler="onecycle")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        callbacks=[*faults, *([guard] if guard else [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=epochs + 1,
        default_root_dir=root,
    )
    stopped, started = False, time.process_time()
    try:
        trainer.fit(model, data)
    except StabilityGuardError:
        stopped = True
    cpu_s = time.process_time() - started
    val_loss = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    record = {"val_loss": val_loss, "stopped": stopped, "steps": trainer.global_step, "train_cpu_s": cpu_s}
    if guard is not None:
        record.update(guard_figures(guard))
    return record


def fault_sweep(seeds: Sequence[int], epochs: int, positions: Sequence[float], window: int) -> dict[str, Any]:
    from examples.mnist1d import MNIST1DDataModule

    data = MNIST1DDataModule()
    data.setup()
    steps_per_epoch = math.ceil(len(data.train_set) / data.hparams.batch_size)
    total_steps = epochs * steps_per_epoch
    scenarios = [(kind, position) for position in positions for kind in FAULT_KINDS]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        for seed in seeds:
            clean = run_fault(data, seed, epochs, [], None, root)
            runs.append({"seed": seed, "fault": "none", "position": None, "arm": "clean", **clean})
            print(f"[faults] seed={seed} clean val_loss={clean['val_loss']:.4f}", flush=True)
            for kind, position in [*scenarios, ("nan_output_forever", positions[0])]:
                start = int(position * total_steps)
                if kind.endswith("_forever"):
                    length = total_steps
                else:
                    length = 1 if kind in ("nan", "scale") else window
                for arm, make_guard in GUARDS.items():
                    injected = [FaultInjector(kind.removesuffix("_forever"), start, length)]
                    record = run_fault(
                        data, seed, epochs, injected, make_guard() if make_guard else None, root
                    )
                    record.update(
                        seed=seed, fault=kind, position=position, arm=arm, start=start, length=length
                    )
                    record["val_loss_ratio"] = record["val_loss"] / clean["val_loss"]
                    runs.append(record)
                    print(
                        f"[faults] seed={seed} {kind}@{position:.0%} {arm}: val_loss={record['val_loss']:.4f} "
                        f"ratio={record['val_loss_ratio']:.3f} stopped={record['stopped']} "
                        f"lost={record.get('steps_lost', '-')} rollbacks={record.get('rollbacks', '-')}",
                        flush=True,
                    )
    return {
        "workload": "mnist1d-cnn (reference: Adam 0.03, weight decay 5e-4, one-cycle)",
        "epochs": epochs,
        "total_steps": total_steps,
        "positions": list(positions),
        "window": window,
        "seeds": list(seeds),
        "runs": runs,
        "summary": summarise_faults(runs),
    }


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarise_faults(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted(
        {(run["fault"], run["position"]) for run in runs if run["fault"] != "none"},
        key=lambda k: (k[1], FAULT_KINDS.index(k[0]) if k[0] in FAULT_KINDS else 99),
    )
    for fault, position in keys:
        for arm in GUARDS:
            own = [
                run for run in runs if (run["fault"], run["position"], run["arm"]) == (fault, position, arm)
            ]
            finished = [run for run in own if not run["stopped"] and math.isfinite(run["val_loss"])]
            recovered = [run for run in finished if run["val_loss_ratio"] <= 1 + RECOVERED_WITHIN]
            rows.append(
                {
                    "fault": fault,
                    "position": position,
                    "arm": arm,
                    "runs": len(own),
                    "finished": len(finished),
                    "recovered": len(recovered),
                    "stopped_with_checkpoint": sum(run["stopped"] for run in own),
                    "val_loss_ratio_median": _median(
                        [run["val_loss_ratio"] if math.isfinite(run["val_loss"]) else math.inf for run in own]
                    ),
                    "steps_lost_median": _median([run.get("steps_lost", math.nan) for run in own]),
                    "rollbacks_median": _median([run.get("rollbacks", math.nan) for run in own]),
                    "spikes_median": _median([run.get("spikes_detected", math.nan) for run in own]),
                }
            )
    return rows


# ------------------------------------------------------------------------------------------ report
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf (NaN loss)"
        return f"{value:.4g}"
    return str(value)


def markdown(
    overhead_results: list[dict[str, Any]],
    faults: dict[str, Any],
    commands: dict[str, str],
    environments: dict[str, Any],
) -> str:
    lines = [
        "# stability_guard",
        "",
        f"Overhead: `{commands.get('overhead')}`",
        "",
        f"Faults: `{commands.get('faults')}`",
        "",
        "## Overhead without faults",
        "",
        "`StabilityGuard()` with its defaults against no callback and against an empty `Callback` (what "
        "Lightning charges for one more callback, and the noise floor of the machine), through the shared "
        "harness (process CPU time of training, arm order rotated per seed, seed-paired ratios, medians). "
        "*Hook CPU share* is the CPU time spent inside the guard's own hooks (detection, snapshots, "
        "bookkeeping) over training CPU time; it is much less sensitive to a busy machine than the "
        "end-to-end ratios. *Paired* compares guarded and unguarded steps of the same fit (the guard's hooks "
        "run on a seeded random half of the batches; medians of the CPU time of the whole iteration, from "
        "one batch start to the next, and of the step proper, from batch start to batch end): it also counts "
        "what the guard's work costs the rest of the step (caches it evicts), and its control (the same coin, "
        "no guard) shows the method's noise. *False positives* are the spikes flagged on these fault-free "
        "runs.",
        "",
    ]
    for result in overhead_results:
        guard = result["guard"]
        lines += [
            f"### {result['workload']}",
            "",
            f"Seeds {result['seeds']}; trainer {result['trainer_kwargs']}; workload {result['workload_kwargs']}.",
            "",
            markdown_table(result),
            "",
            f"- hook CPU share (median): {guard['hook_cpu_share_median']:.2%} "
            f"({guard['hook_cpu_us_per_step_median']:.0f} µs per optimizer step of "
            f"{guard['step_cpu_us_median'] / 1000:.2f} ms)",
            f"- of which snapshots: {guard['snapshot_cpu_share_median']:.2%} "
            f"({guard['snapshots_taken']} snapshots per run)",
            f"- end-to-end CPU ratio against the empty callback (median): "
            f"{guard['cpu_ratio_vs_empty_callback_median']:.4g}",
            *(
                [
                    _paired_line(guard["paired"], guard["paired_control"], "iteration"),
                    _paired_line(guard["paired"], guard["paired_control"], "step"),
                ]
                if "paired" in guard
                else []
            ),
            f"- false positives per run: {guard['false_positive_spikes']}",
            f"- snapshot memory at the end: {guard['snapshot_bytes'] / 1024:.0f} KiB (CPU)",
            "",
        ]
    lines += [
        "## Recovery from injected faults",
        "",
        f"{faults['workload']}, {faults['epochs']} epochs ({faults['total_steps']} optimizer steps), seeds "
        f"{faults['seeds']}. Each fault alone, starting at the given share of the run; `labels` and `lr` last "
        f"{faults['window']} steps, `nan_output_forever` lasts to the end. *finished*: no stop and a finite final "
        f"validation loss; *recovered*: final validation loss within {RECOVERED_WITHIN:.0%} of the same "
        "seed's clean run; *ratio*: final validation loss over the clean run's (median; inf = NaN loss). "
        "*steps lost*: skipped steps plus applied steps undone by rollbacks.",
        "",
        "`guard_default` is `StabilityGuard()`; `guard_tuned` is `StabilityGuard(snapshot_every=5, "
        "max_snapshots=3, rollback_margin=5, rollback_after=2, skip_after_rollback=6)`.",
        "",
        "| fault | at | arm | finished | recovered | stopped (checkpoint saved) | val loss ratio | steps lost | "
        "rollbacks | spikes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in faults["summary"]:
        lines.append(
            f"| {row['fault']} | {row['position']:.0%} | {row['arm']} | {row['finished']}/{row['runs']} | "
            f"{row['recovered']}/{row['runs']} | {row['stopped_with_checkpoint']}/{row['runs']} | "
            f"{_fmt(row['val_loss_ratio_median'])} | {_fmt(row['steps_lost_median'])} | "
            f"{_fmt(row['rollbacks_median'])} | {_fmt(row['spikes_median'])} |"
        )
    lines += [""]
    for part, env in environments.items():
        lines.append(f"Environment ({part}): {env}.")
    return "\n".join(lines) + "\n"


def _paired_line(paired: dict[str, Any], control: dict[str, Any], name: str) -> str:
    """One Markdown bullet of the paired measurement (``name``: ``"iteration"`` or ``"step"``)."""
    prefix = "" if name == "step" else "iteration_"
    what = (
        "whole iteration (from one batch start to the next: data loading included, the step time a user sees)"
        if name == "iteration"
        else "step proper (batch start to batch end)"
    )
    low, high = paired[f"{prefix}marginal_us_quartiles"]
    marginal, share = paired[f"{prefix}marginal_us_median"], paired[f"{prefix}marginal_share_median"]
    unguarded_ms = paired[f"unguarded_{name}_us_median"] / 1000
    seeds, epochs = paired["seeds"], paired.get("epochs", "?")
    return (
        f"- paired, {what}: a guarded quiet step costs {marginal:+.0f} µs (quartiles over seeds {low:+.0f} to "
        f"{high:+.0f}), {share:+.2%} of an unguarded one of {unguarded_ms:.2f} ms (medians over steps, then "
        f"over seeds {seeds[0]}-{seeds[-1]}, {epochs} epochs each); the control (the same coin, no guard) gives "
        f"{control[f'{prefix}marginal_us_median']:+.0f} µs ({control[f'{prefix}marginal_share_median']:+.2%}), "
        "the method's noise floor"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 seed, short runs: a smoke test, not for reporting"
    )
    parser.add_argument(
        "--only",
        choices=("overhead", "faults"),
        help="run one part and keep the other part's results from the existing JSON",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m benchmarks.stability_guard" + (" --quick" if args.quick else "")
    command += f" --only {args.only}" if args.only else ""
    name = "stability_guard_quick" if args.quick else "stability_guard"
    path = RESULTS_DIR / f"{name}.json"
    previous = json.loads(path.read_text()) if args.only and path.exists() else {}
    legacy_command = previous.get("command")  # results written before the parts had their own commands
    payload: dict[str, Any] = {
        "commands": dict(
            previous.get(
                "commands", {part: legacy_command for part in ("overhead", "faults") if legacy_command}
            )
        ),
        "environments": dict(previous.get("environments", {})),
        "elapsed_s": dict(previous.get("elapsed_s", {}))
        if isinstance(previous.get("elapsed_s"), dict)
        else {},
        "overhead": previous.get("overhead"),
        "faults": previous.get("faults"),
    }
    env = {**environment(), "python": sys.version.split()[0]}
    if args.only != "faults":
        started = time.perf_counter()
        seeds = (0,) if args.quick else (0, 1, 2, 3, 4)
        epochs, charlm_steps = (3, 30) if args.quick else (10, 150)
        paired = ((0, 1), 3) if args.quick else (PAIRED_SEEDS, PAIRED_EPOCHS)
        payload["overhead"] = overhead(
            seeds, epochs=epochs, charlm_steps=charlm_steps, paired_seeds=paired[0], paired_epochs=paired[1]
        )
        payload["commands"]["overhead"] = command
        payload["environments"]["overhead"] = env
        payload["elapsed_s"]["overhead"] = time.perf_counter() - started
    if args.only != "overhead":
        started = time.perf_counter()
        seeds = (0,) if args.quick else (0, 1, 2)
        payload["faults"] = fault_sweep(seeds, epochs=6 if args.quick else 12, positions=(0.4, 0.8), window=8)
        payload["commands"]["faults"] = command
        payload["environments"]["faults"] = env
        payload["elapsed_s"]["faults"] = time.perf_counter() - started
    if payload["overhead"] is None or payload["faults"] is None:
        parser.error(f"--only {args.only} needs {path} with the other part; run both parts once first")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    (RESULTS_DIR / f"{name}.md").write_text(
        markdown(payload["overhead"], payload["faults"], payload["commands"], payload["environments"])
    )
    print(f"wrote {RESULTS_DIR / name}.json/.md ({payload['elapsed_s']})")


if __name__ == "__main__":
    main()
