"""HardSampleReplay: training compute to reach the baseline's accuracy, against a random-subset control.

The committed headline setting (:data:`SETTINGS`, ``mnist1d-cnn``): MNIST-1D CNN on 10000 generated samples
(7200 train / 800 val), 15 epochs of OneCycleLR. Arms, each on every seed, interleaved, in one invocation:

* ``baseline``: the plain Trainer.
* ``score-only``: the callback scoring every step but never selecting (``phases=("burst",)`` with no
  PulseCycle): full batches, so its whole-run CPU against the baseline's is the scoring cost, measured from
  outside the callback.
* ``topk-batch-0.5``: HardSampleReplay alone, ``mode="batch"``: every batch keeps the half with the highest
  stored, age-weighted loss (never-scored samples always kept); steps per epoch unchanged.
* ``random-batch-0.5``: the control: same callback, same compute, a uniform half instead of the hardest.
* ``topk-steps-0.7``: ``mode="steps"`` without a PulseCycle: each window of ``B / 0.7`` samples gives a full
  batch of its hardest (never-scored samples first), so epochs have 30% fewer steps. (The committed result
  predates it: its ``topk-epoch-0.7`` and ``random-epoch-0.7`` arms ran ``mode="epoch"``, since removed;
  ``benchmarks/studies/results/replay_steps_vs_epoch.md`` compares the two.)
* ``random-steps-0.7``: its control.
* ``infobatch-batch-0.5``: the InfoBatch rule in batch mode (drop below-mean samples with probability 0.5,
  rescale the kept ones).
* ``pulse``: PulseCycle (burst / replay in steps, 10% warm-up and anneal) with batch-mode selection (0.5) in
  its replay phases only: the pulse-training cadence, which spends full compute in bursts.

The arm grammar (:func:`make_arm`) also reads ``<rule>-<mode>-<fraction>-<k>x`` (k times the epochs),
``...-anneal`` (InfoBatch's annealing) and ``shorter-<share>`` (no callback, the run cut to a share of the
baseline's steps), which the finished char-LM studies use (``benchmarks/studies/hard_sample_replay_lm.py``,
which adds RHO-LOSS and learnability arms).

The figures that answer the issue: ``FLOPs to baseline metric`` and ``CPU to baseline metric`` (compute a run
needed to first reach the baseline's final validation metric, as a share of the baseline's whole run,
paired by seed, median over seeds), and the final metric itself. The callback's own figures are read from its
public ``metrics()`` after the run (:func:`replay_metrics`, the arms' ``Arm.metrics``).

Run: ``python -m benchmarks.hard_sample_replay --workloads mnist1d-cnn --seeds 0 1 2`` (the committed
``results/hard_sample_replay.md``). One setting's arms can be split over processes: ``--arms A B --raw-out
part.json`` in each (one part with the baseline), then ``--merge part1.json part2.json --name <name>`` writes
them up as one result. A setting with a ``tolerance`` also reports, per seed, the final metric over the
baseline's and the compute to first get within that relative tolerance of it. ``--epochs N`` overrides the
setting's epochs (a smoke run, not for reporting).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from benchmarks.harness import RESULTS_DIR, Arm, TrainingFlopCounter, run_arms, summarise, write_results
from benchmarks.workloads import get_workload
from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay

#: The committed setting, chosen to fit the benchmark in ~15 CPU minutes on 2 shared cores. Arm names read
#: ``<rule>-<mode>-<replay_fraction>[-<option>]`` (:func:`make_arm`); ``pulse`` adds a PulseCycle.
SETTINGS: dict[str, dict[str, Any]] = {
    # 10000 generated samples: 7200 train / 800 val, so one validation sample is 0.125 pp (0.3 pp is 2-3
    # samples); 15 epochs of OneCycleLR (72 steps each), so the baseline is still learning at the end
    "mnist1d-cnn": {
        "trainer_kwargs": {"max_epochs": 15},
        "workload_kwargs": {"data__num_samples": 10000, "model__scheduler": "onecycle"},
        "arms": (
            "score-only",
            "topk-batch-0.5",
            "random-batch-0.5",
            "topk-steps-0.7",
            "random-steps-0.7",
            "infobatch-batch-0.5",
            "pulse",
        ),
        "pulse": {"burst": 36, "replay": 72, "maintain": 0},
    },
}


class ScoreOnly(HardSampleReplay):
    """HardSampleReplay scoring every step and never selecting: in ``mode="batch"`` with phases (``("burst",)``)
    that never come in a run without a PulseCycle, every batch trains whole. The library refuses that setting for a user, since it would do nothing but score; for
    the score-only arm the scoring is the point, so that one fit-start refusal is passed over here."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with mock.patch("lightning_pulse.callbacks.hard_sample_replay.refuse_unreachable_phases"):
            super().on_train_start(trainer, pl_module)


def replay_metrics(callbacks: list[Callback], trainer: pl.Trainer | None = None) -> dict[str, Any]:
    """What this benchmark reads after a run (``Arm.metrics``): the callback's public totals (``hsr_*``) and
    the trained-sample curve."""
    figures: dict[str, Any] = {}
    for callback in callbacks:
        if isinstance(callback, HardSampleReplay):
            figures.update({f"hsr_{name}": value for name, value in callback.metrics().items()})
        if isinstance(callback, SampleCurve):
            figures["samples_curve"] = list(callback.curve)
    return figures


def make_arm(
    name: str,
    epochs: int,
    cadence: dict[str, int],
    steps_per_epoch: int | None = None,
    replay_class: type[HardSampleReplay] = HardSampleReplay,
) -> Arm:
    """The arm an arm name describes: ``shorter-<share>``, ``pulse``, ``score-only`` or
    ``<rule>-<mode>-<fraction>[-<k>x][-anneal]``; ``replay_class`` lets a study swap the callback's scores."""
    if name.startswith("shorter-"):
        # no callback: the whole data, with the run (and its LR schedule) cut to a share of the baseline's steps
        assert steps_per_epoch is not None, "a 'shorter-' arm needs the workload's steps per epoch"
        steps = round(float(name.split("-")[1]) * epochs * steps_per_epoch)
        return Arm(name, trainer_kwargs={"max_steps": steps, "max_epochs": epochs})
    if name == "pulse":

        def pulse(seed: int) -> list:
            return [
                PulseCycle(**cadence, warmup=0.1, anneal=0.1, maintain_eval="none"),
                HardSampleReplay(replay_fraction=0.5, seed=seed),
            ]

        return Arm(name, callbacks=pulse)
    if name == "score-only":
        return Arm(name, callbacks=lambda seed: [ScoreOnly(phases=("burst",), mode="batch", seed=seed)])
    rule, mode, fraction, *options = name.split("-")
    kwargs: dict[str, Any] = {"rule": rule, "mode": mode}
    if rule == "infobatch":
        kwargs["prune_ratio"] = float(fraction)
    else:
        kwargs["replay_fraction"] = float(fraction)
    trainer_kwargs = {}
    extra = []
    for option in options:
        if option.endswith("x"):
            trainer_kwargs["max_epochs"] = epochs * int(option.rstrip("x"))
        elif option == "anneal":
            # InfoBatch's annealing, the last 12.5% of the run on whole batches: a cycle of replay only, whose
            # anneal is pure burst (the callback's own `anneal=` until the lean-core refactor)
            extra = [dict(burst=0, replay=1, maintain=0, warmup=0.0, anneal=0.125, maintain_eval="none")]
        else:
            raise ValueError(f"Unknown arm option {option!r} in {name!r}.")
    return Arm(
        name,
        callbacks=lambda seed: [*(PulseCycle(**c) for c in extra), replay_class(seed=seed, **kwargs)],
        trainer_kwargs=trainer_kwargs,
    )


#: ``(name, epochs, cadence, steps_per_epoch, workload_kwargs) -> Arm``: how a settings table's arm names
#: become arms (a study passes its own, which handles its extra arms and falls back to :func:`make_arm`)
ArmMaker = Callable[[str, int, dict[str, int], int | None, dict[str, Any]], Arm]


def _default_arm(
    name: str,
    epochs: int,
    cadence: dict[str, int],
    steps_per_epoch: int | None,
    workload_kwargs: dict[str, Any],
) -> Arm:
    return make_arm(name, epochs, cadence, steps_per_epoch)


class SampleCurve(Callback):
    """Cumulative training samples at every validation, next to the harness's own curve points."""

    def __init__(self) -> None:
        self.samples = 0
        self.curve: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples += extract_batch_size(batch)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.curve.append(self.samples)


def per_sample_flops(workload: str, workload_kwargs: dict[str, Any]) -> float:
    """Training FLOPs per sample, counted by the harness's ``FlopCounterMode`` callback on real steps.

    The workloads have fixed shapes, so a step's FLOPs are exactly proportional to its batch size (checked
    here on a full and a half batch); a run's FLOPs are then its trained samples times this figure, with no
    second, 3x slower counted pass per run.
    """
    spec = get_workload(workload)
    figures = []
    for factor in (1, 2):
        module, data = spec.build(**workload_kwargs)
        data.hparams.batch_size //= factor
        counter = TrainingFlopCounter()
        samples = SampleCurve()
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=2,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[counter, samples],
        )
        trainer.fit(module, data)
        figures.append(counter.total / samples.samples)
    if abs(figures[0] - figures[1]) > 1e-9 * figures[0]:
        raise RuntimeError(
            f"{workload}: FLOPs per sample differ between batch sizes ({figures}); count them per run."
        )
    return figures[0]


def fill_flops(result: dict[str, Any], flops_per_sample: float) -> None:
    """Put ``samples x FLOPs per sample`` into every run and curve point, then summarise again."""
    upfront = False
    for run in result["runs"]:
        curve = run["extra"].pop("samples_curve")
        # FLOPs a method spends before training (RHO-LOSS's irreducible-loss models) count from the start
        extra = float(run["extra"].get("upfront_flops", 0.0))
        upfront = upfront or extra > 0
        for point, samples in zip(run["curve"], curve):
            point["train_flops"] = samples * flops_per_sample + extra
        run["train_flops"] = run["samples"] * flops_per_sample + extra
    result["flops_mode"] = f"trained samples x {flops_per_sample:.6g} FLOPs/sample (FlopCounterMode)" + (
        " + the arm's up-front FLOPs (irreducible-loss models, FlopCounterMode)" if upfront else ""
    )
    result["summary"] = summarise(
        result["runs"], result["arms"], result["metric"], result["mode"], result["test_metric"]
    )


@dataclass(frozen=True)
class Bench:
    """What a run of this script (or a study built on it) reads: its settings table, how arm names become
    arms, what is read after each fit, where results go and the command that names it."""

    settings: dict[str, dict[str, Any]]
    make_arm: ArmMaker = _default_arm
    metrics: Callable[[list[Callback], pl.Trainer], dict[str, Any]] = replay_metrics
    results_dir: Path = RESULTS_DIR
    module: str = "benchmarks.hard_sample_replay"
    default_name: str = "hard_sample_replay"


HEADLINE = Bench(SETTINGS)


def arms_for(workload: str, bench: Bench = HEADLINE) -> list[Arm]:
    settings = bench.settings[workload]
    epochs = settings["trainer_kwargs"]["max_epochs"]
    arms = [
        Arm("baseline"),
        *(
            bench.make_arm(
                name,
                epochs,
                settings["pulse"],
                settings.get("steps_per_epoch"),
                settings["workload_kwargs"],
            )
            for name in settings["arms"]
        ),
    ]
    for arm in arms:  # every arm also records its trained samples per epoch
        arm.callbacks = _with_sample_curve(arm.callbacks)
        arm.metrics = bench.metrics
    return arms


def _with_sample_curve(make):
    def callbacks(seed: int) -> list:
        return [*make(seed), SampleCurve()]

    return callbacks


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def add_replay_figures(result: dict[str, Any]) -> None:
    """Medians of the callback's own figures (replay fraction, losses, reuse) per arm."""
    names = (
        "hsr_replay_fraction",
        "hsr_active_share",
        "hsr_loss_replayed",
        "hsr_loss_fresh",
        "hsr_came_back_rate",
        "hsr_learned_rate",
        "hsr_table_bytes",
    )
    for arm in result["arms"][1:]:
        runs = [run for run in result["runs"] if run["arm"] == arm]
        result["summary"][arm]["replay"] = {
            name: _median([run["extra"].get(name, math.nan) for run in runs]) for name in names
        }
        # compute actually spent, relative to the baseline (training FLOPs of the whole run)
        result["summary"][arm]["samples_ratio"] = _median(
            [
                run["samples"]
                / next(
                    b["samples"]
                    for b in result["runs"]
                    if b["arm"] == result["arms"][0] and b["seed"] == run["seed"]
                )
                for run in runs
            ]
        )


def replay_table(result: dict[str, Any]) -> str:
    metric = result["metric"]
    lines = [
        f"HardSampleReplay figures ({result['workload']}, medians over seeds):",
        "",
        "| arm | samples trained / baseline | replay fraction | loss replayed | loss fresh | came back | learned | "
        "table bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in result["arms"][1:]:
        row = result["summary"][arm]
        figures = row["replay"]
        lines.append(
            f"| {arm} | {row['samples_ratio']:.3f} | {figures['hsr_replay_fraction']:.3f} | "
            f"{figures['hsr_loss_replayed']:.4g} | {figures['hsr_loss_fresh']:.4g} | {figures['hsr_came_back_rate']:.3f} | "
            f"{figures['hsr_learned_rate']:.3f} | {figures['hsr_table_bytes']:.0f} |"
        )
    lines += ["", f"Final {metric} per seed:", ""]
    for arm in result["arms"]:
        values = [run["final_val"].get(metric, math.nan) for run in result["runs"] if run["arm"] == arm]
        lines.append(f"- {arm}: " + ", ".join(f"{v:.4f}" for v in values))
    return "\n".join(lines)


def tolerance_table(result: dict[str, Any], tolerance: float) -> str:
    """Per seed: final metric relative to the baseline's, and the compute to first get within ``tolerance``.

    The issue's language-model criterion is "equal accuracy within 1% relative loss": a run counts when its
    validation loss reaches ``(1 + tolerance) x`` the same seed's baseline final loss (``(1 - tolerance) x``
    for a metric to maximise); compute to get there is its FLOPs / CPU at that validation over the baseline's
    whole run.
    """
    metric, mode = result["metric"], result["mode"]
    factor = 1 + tolerance if mode == "min" else 1 - tolerance
    base = {run["seed"]: run for run in result["runs"] if run["arm"] == result["arms"][0]}
    lines = [
        f"Within {tolerance:.0%} of the baseline's final {metric} (target: {factor:g} x the same seed's baseline "
        "final), per seed; FLOPs / CPU to first get there over the baseline's whole run:",
        "",
        "| arm | final / baseline final, per seed | seeds within | FLOPs to within, per seed | "
        "median FLOPs to within | median CPU to within |",
        "|---|---|---|---|---|---|",
    ]
    summary = result.setdefault("tolerance", {"relative": tolerance, "arms": {}})
    for arm in result["arms"]:
        ratios, flops, cpu = [], [], []
        for run in (run for run in result["runs"] if run["arm"] == arm):
            reference = base[run["seed"]]
            target = reference["final_val"][metric] * factor
            ratios.append(run["final_val"][metric] / reference["final_val"][metric])
            point = next(
                (
                    p
                    for p in run["curve"]
                    if metric in p and (p[metric] <= target if mode == "min" else p[metric] >= target)
                ),
                None,
            )
            flops.append(point["train_flops"] / reference["train_flops"] if point else math.nan)
            cpu.append(point["train_cpu_s"] / reference["train_cpu_s"] if point else math.nan)
        within = sum(not math.isnan(value) for value in flops)
        summary["arms"][arm] = {
            "final_over_baseline": ratios,
            "seeds_within": within,
            "flops_to_within": flops,
            "cpu_to_within": cpu,
            "median_flops_to_within": _median(flops),
            "median_cpu_to_within": _median(cpu),
        }
        lines.append(
            f"| {arm} | {', '.join(f'{r:.4f}' for r in ratios)} | {within}/{len(ratios)} | "
            + ", ".join("-" if math.isnan(f) else f"{f:.3f}" for f in flops)
            + f" | {_median(flops):.3f} | {_median(cpu):.3f} |"
        )
    return "\n".join(lines)


def _run_workload(
    workload: str,
    seeds: list[int],
    arm_names: list[str] | None,
    bench: Bench = HEADLINE,
    epochs: int | None = None,
) -> dict[str, Any]:
    settings = bench.settings[workload]
    arms = arms_for(workload, bench)
    if arm_names:
        unknown = sorted(set(arm_names) - {arm.name for arm in arms})
        if unknown:
            raise ValueError(
                f"`--arms` {unknown} are not arms of {workload!r}: {[arm.name for arm in arms]}."
            )
        arms = [arm for arm in arms if arm.name in arm_names]
    result = run_arms(
        settings.get("workload", workload),
        arms,
        seeds=seeds,
        trainer_kwargs={**settings["trainer_kwargs"], **({"max_epochs": epochs} if epochs else {})},
        workload_kwargs=settings["workload_kwargs"],
        flops="none",
        rotate_arms=True,
    )
    result["workload"] = workload  # the settings' name: "charlm-cosine" is the charlm workload, cosine LR
    return result


def merge_parts(paths: list[str], bench: Bench = HEADLINE) -> dict[str, Any]:
    """One result from parts of one workload's arms run in separate processes (``--raw-out``)."""
    parts = [json.loads(Path(path).read_text()) for path in paths]
    workloads = {part["workload"] for part in parts}
    if len(workloads) != 1:
        raise ValueError(f"`--merge` parts are of several workloads: {sorted(workloads)}; give one.")
    workload = workloads.pop()
    order = [arm.name for arm in arms_for(workload, bench)]
    present = {run["arm"] for part in parts for run in part["runs"]}
    if order[0] not in present:
        raise ValueError(f"`--merge` parts have no {order[0]!r} runs; one part must hold the baseline.")
    merged = dict(parts[0])
    merged["arms"] = [name for name in order if name in present]
    merged["runs"] = [run for part in parts for run in part["runs"]]
    merged["elapsed_s"] = max(part["elapsed_s"] for part in parts)
    merged["parts"] = [
        {"command": part["command"], "arms": part["arms"], "elapsed_s": part["elapsed_s"]} for part in parts
    ]
    spec = get_workload(bench.settings[workload].get("workload", workload))
    merged["summary"] = summarise(merged["runs"], merged["arms"], spec.metric, spec.mode, spec.test_metric)
    return merged


def _finish(result: dict[str, Any], bench: Bench = HEADLINE) -> str:
    settings = bench.settings[result["workload"]]
    fill_flops(
        result, per_sample_flops(settings.get("workload", result["workload"]), settings["workload_kwargs"])
    )
    add_replay_figures(result)
    notes = replay_table(result)
    if "tolerance" in settings:
        notes += "\n\n" + tolerance_table(result, settings["tolerance"])
    return notes


def main(bench: Bench = HEADLINE) -> None:
    settings = bench.settings
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(settings), choices=list(settings))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--name", default=bench.default_name)
    parser.add_argument("--arms", nargs="+", help="run only these arms of the (one) workload")
    parser.add_argument("--raw-out", help="write the (one) workload's raw runs to this JSON file and stop")
    parser.add_argument("--merge", nargs="+", help="raw-run files of one workload to merge and write up")
    parser.add_argument(
        "--epochs", type=int, help="override the setting's epochs (a smoke run, not for reporting)"
    )
    args = parser.parse_args()
    own = ["--seeds", *map(str, args.seeds)] + (["--arms", *args.arms] if args.arms else [])
    own += ["--epochs", str(args.epochs)] if args.epochs else []
    command = f"python -m {bench.module} " + " ".join(["--workloads", *args.workloads, *own])
    if args.merge:
        result = merge_parts(args.merge, bench)
        notes = [_finish(result, bench)]
        command = "; ".join(
            [
                *(part["command"] for part in result["parts"]),
                f"python -m {bench.module} --merge " + " ".join(args.merge) + f" --name {args.name}",
            ]
        )
        write_results([result], args.name, command=command, notes=notes[0], results_dir=bench.results_dir)
        return
    if (args.arms or args.raw_out) and len(args.workloads) != 1:
        raise ValueError("`--arms` and `--raw-out` need exactly one workload in `--workloads`.")
    if args.raw_out:
        result = _run_workload(args.workloads[0], args.seeds, args.arms, bench, args.epochs)
        result["command"] = command + f" --raw-out {args.raw_out}"
        Path(args.raw_out).write_text(json.dumps(result, indent=1, default=str))
        return
    results, notes = [], []
    for workload in args.workloads:
        result = _run_workload(workload, args.seeds, args.arms, bench, args.epochs)
        notes.append(_finish(result, bench))
        results.append(result)
    if args.name != bench.default_name:
        command += f" --name {args.name}"
    write_results(
        results, args.name, command=command, notes="\n\n".join(notes), results_dir=bench.results_dir
    )


if __name__ == "__main__":
    main()
