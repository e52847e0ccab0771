"""GradientCache: backward FLOPs and CPU time saved against accuracy, on the MNIST-1D CNN and the char LM.

Run: ``python -m benchmarks.gradient_cache`` (about 15 minutes of CPU on an idle core; ``--quick`` for a smoke
run). Writes ``benchmarks/results/gradient_cache.json`` and ``.md``. The finished side studies (plasticity
thresholds, the char-LM studies and their pre-registered tune-then-confirm) are in
``benchmarks/studies/gradient_cache_lm.py``, with their results in ``benchmarks/studies/results/``.

The committed results also hold arms of features removed since (issue 17; evidence in docs/gradient-cache.md,
"Changelog"): ``stale_replay`` and the "bookkeeping CPU share" column of the removed CPU self-timers. Those arms
ran at commit 3f874ad of this file; the arms below are what the library still offers.

Arms (the first is the baseline, all in one invocation, interleaved per seed):

* ``baseline``: the plain workload.
* ``freeze``: ``GradientCache()`` alone, defaults (continuous freezing, plasticity measure).
* CNN only: ``freeze+activations``, the same plus the activation cache (exact replay, so the same accuracy,
  and the frozen prefix's forward FLOPs are saved too); ``pulse``, ``PulseCycle`` + ``GradientCache`` with
  freezing only in replay phases.
* LM only: ``forced_last_quarter`` and ``forced_second_half``, freezing whatever is fresh from 75% / 50% of
  the run regardless of stability (what forcing the saving costs when the default criterion does not fire).

Backward FLOPs skipped come from GradientCache's ledger (each frozen-prefix configuration measured once with
``FlopCounterMode`` on a real backward); total training FLOPs from the harness's own counter (CNN, separate
pass) and CPU seconds from the timed pass. :func:`metrics` reads GradientCache's figures from its public state
after each fit (``Arm.metrics``).
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from lightning.pytorch.callbacks import Callback

from benchmarks.harness import Arm, run_arms, write_results
from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.gradient_cache import GradientCache


def metrics(callbacks: list[Callback], trainer: Any) -> dict[str, Any]:
    """GradientCache's run totals (all prefixed ``gc_``), read from its public state after a fit."""
    cache = next((cb for cb in callbacks if isinstance(cb, GradientCache)), None)
    if cache is None or cache.freezer is None:
        return {}
    freezer, names = cache.freezer, [unit.name for unit in cache.freezer.units]
    first: dict[str, int] = {}  # the optimizer step at which each unit was first frozen
    for event in cache.events:
        for index in range(event["from"], event["to"]):
            first.setdefault(names[index], int(event["step"]))
    activations = cache.activations
    return {
        "gc_units": names,
        "gc_mean_frozen_share": freezer.mean_frozen_share,
        "gc_backward_flops_skipped_share": cache.ledger.skipped_share,
        "gc_backward_flops_skipped": cache.ledger.skipped,
        "gc_backward_flops_by_prefix": dict(cache.ledger.flops_by_prefix),
        "gc_cache_hit_rate": freezer.cache_hit_rate,
        "gc_freezes": freezer.freezes,
        "gc_prefix_changes": len(cache.events),  # all of them: these runs make far fewer than RECENT_RECORDS
        "gc_activation_hit_rate": activations.hit_rate if activations is not None else None,
        "gc_activation_mb": activations.bytes_used / 2**20 if activations is not None else 0.0,
        "gc_last_scores": dict(zip(names, freezer.scores)),
        "gc_first_frozen_step": first,
    }


def gc_arm(name: str, callbacks: Any = None, **kwargs: Any) -> Arm:
    """An :class:`Arm` whose runs report :func:`metrics`."""
    made = Arm(name, callbacks=callbacks, **kwargs) if callbacks is not None else Arm(name, **kwargs)
    made.metrics = metrics  # type: ignore[attr-defined]
    return made


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
    arms = [gc_arm("baseline"), gc_arm("freeze", callbacks=lambda seed: [GradientCache()])]
    if workload == "mnist1d-cnn":
        pulse = {"burst": 60, "replay": 120, "maintain": 0, "warmup": 0.3, "anneal": 0.1}
        arms += [
            gc_arm("freeze+activations", callbacks=lambda seed: [GradientCache(activation_cache_mb=64)]),
            gc_arm(
                "pulse", callbacks=lambda seed: [PulseCycle(maintain_eval="none", **pulse), GradientCache()]
            ),
        ]
    else:
        # plasticity scores never exceed 1, so threshold 1.0 freezes whatever is fresh: the cost of forcing it
        arms += [
            gc_arm(
                "forced_last_quarter", callbacks=lambda seed: [GradientCache(threshold=1.0, start_at=0.75)]
            ),
            gc_arm("forced_second_half", callbacks=lambda seed: [GradientCache(threshold=1.0, start_at=0.5)]),
        ]
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
        f"| arm | backward FLOPs skipped | mean frozen share | cache hit rate | activation hit rate "
        f"| Δ {metric} vs baseline (per seed) |",
        "|---|---|---|---|---|---|",
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
            f"| {_median([e.get('gc_activation_hit_rate') for e in extra]):.2f} "
            f"| {', '.join(f'{d:+.4f}' for d in deltas)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workloads", nargs="+", default=["mnist1d-cnn", "charlm"])
    parser.add_argument("--quick", action="store_true", help="a few steps per run, to check the script runs")
    args = parser.parse_args()
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
