"""GradientCache: backward FLOPs and CPU time saved against accuracy, on the MNIST-1D CNN and the char LM.

Run: ``python -m benchmarks.gradient_cache`` (about 15 minutes of CPU on an idle core; ``--quick`` for a smoke
run). Writes ``benchmarks/results/gradient_cache.json`` and ``.md``. ``--study thresholds`` (about 5 minutes)
writes ``gradient_cache_thresholds.*``: three plasticity thresholds on the CNN, the CNN at constant LR, and
the LM's per-unit plasticity scores.

Arms (the first is the baseline, all in one invocation, interleaved per seed):

* ``baseline``: the plain workload.
* ``freeze``: ``GradientCache()`` alone, defaults (continuous freezing, plasticity measure).
* CNN only: ``freeze+activations``, the same plus the activation cache (exact replay, so the same accuracy,
  and the frozen prefix's forward FLOPs are saved too); ``pulse``, ``PulseCycle`` + ``GradientCache`` with
  freezing only in replay phases.
* LM only: ``forced_last_quarter`` and ``forced_second_half``, freezing whatever is fresh from 75% / 50% of
  the run regardless of stability (what forcing the saving costs when the default criterion does not fire).
* ``stale_replay``: the opt-in mode that replays stale cached gradients for every unit but the head, from
  mid-run.

Backward FLOPs skipped come from GradientCache's ledger (each frozen-prefix configuration measured once with
``FlopCounterMode`` on a real backward); total training FLOPs from the harness's own counter (CNN, separate
pass) and CPU seconds from the timed pass. "Bookkeeping CPU share" is the process CPU time spent inside
GradientCache's hooks over the run's training CPU time; "FLOP-measuring CPU s" is the time of the few
backwards run under the FLOP counter (once per frozen-prefix length).
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from benchmarks.harness import Arm, run_arms, write_results
from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.gradient_cache import GradientCache

CNN = {
    "workload": "mnist1d-cnn",
    "trainer_kwargs": {"max_epochs": 40},
    "workload_kwargs": {"model__lr": 0.03, "model__weight_decay": 5e-4, "model__scheduler": "onecycle"},
    "flops": "separate",
}
LM = {
    "workload": "charlm",
    "trainer_kwargs": {"max_epochs": 3},
    "workload_kwargs": {},
    "flops": "none",
}


def arms_for(workload: str) -> list[Arm]:
    arms = [Arm("baseline"), Arm("freeze", callbacks=lambda seed: [GradientCache()])]
    if workload == "mnist1d-cnn":
        pulse = {"burst": 60, "replay": 120, "maintain": 0, "warmup": 0.3, "anneal": 0.1}
        arms += [
            Arm("freeze+activations", callbacks=lambda seed: [GradientCache(activation_cache_mb=64)]),
            Arm("pulse", callbacks=lambda seed: [PulseCycle(maintain_eval="none", **pulse), GradientCache()]),
        ]
    else:
        # plasticity scores never exceed 1, so threshold 1.0 freezes whatever is fresh: the cost of forcing it
        arms += [
            Arm("forced_last_quarter", callbacks=lambda seed: [GradientCache(threshold=1.0, start_at=0.75)]),
            Arm("forced_second_half", callbacks=lambda seed: [GradientCache(threshold=1.0, start_at=0.5)]),
        ]
    arms.append(
        Arm("stale_replay", callbacks=lambda seed: [GradientCache(mode="stale_replay", start_at=0.5)])
    )
    return arms


def _median(values: list[float | None]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def cache_table(result: dict[str, Any]) -> str:
    """Medians over seeds of what GradientCache itself measured, one row per arm."""
    metric = result["test_metric"]
    lines = [
        f"### {result['workload']} ({result['trainer_kwargs']}, {result['workload_kwargs']}): "
        "GradientCache's own figures (medians over seeds)",
        "",
        f"| arm | backward FLOPs skipped | mean frozen share | cache hit rate | similarity at refresh | "
        f"activation hit rate | bookkeeping CPU share | FLOP-measuring CPU s | Δ {metric} vs baseline (per seed) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    baseline = {run["seed"]: run for run in result["runs"] if run["arm"] == result["arms"][0]}
    for arm in result["arms"][1:]:
        runs = [run for run in result["runs"] if run["arm"] == arm]
        extra = [run["extra"] for run in runs]
        deltas = [run["test"][metric] - baseline[run["seed"]]["test"][metric] for run in runs]
        lines.append(
            f"| {arm} | {_median([e.get('gc_backward_flops_skipped_share') for e in extra]):.3f} "
            f"| {_median([e.get('gc_mean_frozen_share') for e in extra]):.3f} "
            f"| {_median([e.get('gc_cache_hit_rate') for e in extra]):.2f} "
            f"| {_median([e.get('gc_mean_similarity_at_refresh') for e in extra]):.3f} "
            f"| {_median([e.get('gc_activation_hit_rate') for e in extra]):.2f} "
            f"| {_median([run['extra'].get('gc_hook_cpu_s', math.nan) / run['train_cpu_s'] for run in runs]):.4f} "
            f"| {_median([e.get('gc_flop_measure_cpu_s') for e in extra]):.2f} "
            f"| {', '.join(f'{d:+.4f}' for d in deltas)} |"
        )
    return "\n".join(lines)


def study_thresholds(seeds: tuple[int, ...]) -> tuple[list[dict[str, Any]], str]:
    """The threshold study: backward saved vs accuracy for three plasticity thresholds, at one-cycle and at
    constant LR, and the LM's final plasticity scores per unit (why nothing freezes there)."""
    thresholds = [Arm("baseline")] + [
        Arm(f"threshold={t}", callbacks=lambda seed, t=t: [GradientCache(threshold=t)])
        for t in (0.3, 0.2, 0.1)
    ]
    results = [
        run_arms(
            "mnist1d-cnn", thresholds, seeds, CNN["trainer_kwargs"], CNN["workload_kwargs"], flops="none"
        ),
        run_arms(
            "mnist1d-cnn",
            [Arm("baseline"), Arm("freeze", callbacks=lambda seed: [GradientCache()])],
            seeds,
            {"max_epochs": 30},
            {"model__lr": 0.01, "model__scheduler": "none"},
            flops="none",
        ),
        run_arms(
            "charlm",
            [Arm("freeze", callbacks=lambda seed: [GradientCache()])],
            seeds,
            LM["trainer_kwargs"],
            flops="none",
        ),
    ]
    notes = [cache_table(result) for result in results[:2]]
    lines = ["### charlm: plasticity score of each unit at the last check (stable when <= 0.2)", ""]
    for run in results[2]["runs"]:
        scores = ", ".join(
            f"{name} {'n/a' if score is None else format(score, '.2f')}"
            for name, score in run["extra"]["gc_last_scores"].items()
        )
        lines.append(f"- seed {run['seed']}: {scores}")
    notes.append("\n".join(lines))
    return results, "\n\n".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workloads", nargs="+", default=["mnist1d-cnn", "charlm"])
    parser.add_argument("--quick", action="store_true", help="a few steps per run, to check the script runs")
    parser.add_argument("--study", choices=["thresholds"], help="run a side study instead of the main arms")
    args = parser.parse_args()
    if args.study == "thresholds":
        results, notes = study_thresholds(tuple(args.seeds))
        command = "python -m benchmarks.gradient_cache --study thresholds"
        write_results(results, "gradient_cache_thresholds", command, notes=notes)
        return
    results = []
    for spec in (CNN, LM):
        if spec["workload"] not in args.workloads:
            continue
        trainer_kwargs = dict(spec["trainer_kwargs"])
        if args.quick:
            trainer_kwargs = {"max_steps": 30, "limit_val_batches": 2}
        results.append(
            run_arms(
                spec["workload"],
                arms_for(spec["workload"]),
                seeds=tuple(args.seeds),
                trainer_kwargs=trainer_kwargs,
                workload_kwargs=spec["workload_kwargs"],
                flops=spec["flops"],
            )
        )
    notes = "\n\n".join(cache_table(result) for result in results)
    command = "python -m benchmarks.gradient_cache" + (" --quick" if args.quick else "")
    if args.seeds != [0, 1, 2]:
        command += " --seeds " + " ".join(map(str, args.seeds))
    if args.workloads != ["mnist1d-cnn", "charlm"]:
        command += " --workloads " + " ".join(args.workloads)
    write_results(results, "gradient_cache" + ("_quick" if args.quick else ""), command, notes=notes)


if __name__ == "__main__":
    main()
