"""GradientCache's finished studies: plasticity thresholds and the char-LM studies (``benchmarks/studies/README.md``).

Run: ``python -m benchmarks.studies.gradient_cache_lm --study <name>`` with ``<name>`` one of ``thresholds``
(about 5 minutes: three plasticity thresholds on the CNN, the CNN at constant LR, and the LM's per-unit
plasticity scores), ``lm``, ``lm_long``, ``lm_converged``, ``lm_converged_800k``, ``lm_converged_800k_tuning``
(with ``--seeds 10 11 12``), ``lm_converged_800k_confirm`` and ``lm_converged_selected`` (each with ``--jobs
2``; 10-40 minutes on the shared machine). Writes ``benchmarks/studies/results/gradient_cache_<name>.*``.

* ``lm``: the 4-layer cosine-LR char LM against the LM target: plasticity thresholds, a forced late freeze
  (and, in the committed results, FreezeOut);
* ``lm_long``: the same LM trained 15 epochs instead of 6, long enough for its loss to flatten (and to
  overfit);
* ``lm_converged``: the same LM on 3x the text for 5 epochs: no overfitting, still improving at the end;
* ``lm_converged_800k``: 2x the text for 8 epochs, flat at the end without clear overfitting;
* ``lm_converged_800k_tuning`` then ``lm_converged_800k_confirm``: a pre-registered tune-then-confirm study on
  that workload: candidates and selection rule (:data:`LM_TUNING_CANDIDATES`, :data:`LM_TUNING_RULE`) were
  committed before the tuning seeds ran; the selected candidate (:data:`LM_CONFIRM_CANDIDATE`) alone is then
  run against the baseline on seeds 0 1 2;
* ``lm_converged_selected``: that selected configuration unchanged on the ``lm_converged`` workload.

The committed results' own ``Command:`` lines name the script's old path (``benchmarks.gradient_cache
--study ...``), where these studies lived when they ran; arms of features removed since (FreezeOut,
``stale_replay``) are in the committed results only (evidence in docs/gradient-cache.md, "Changelog").
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

from benchmarks.gradient_cache import CNN, LM, GradientCache, _median, cache_table, gc_arm
from benchmarks.harness import Arm, run_arms, summarise, write_results
from benchmarks.studies import RESULTS_DIR

# the LM study: deep enough that a frozen prefix is worth something (4 layers = 8 residual blocks), trained
# with warm-up + cosine decay for 6 epochs (1044 steps), so the low-LR late phase is a real share of the run
LM_COSINE = {
    "workload": "charlm",
    "trainer_kwargs": {"max_epochs": 6},
    "workload_kwargs": {"model__n_layers": 4, "model__scheduler": "cosine"},
}
# plasticity thresholds compared on the LM study (0.2 is the default); from a seed-0 sweep of 0.2/0.3/0.4
LM_THRESHOLDS = (0.2, 0.3)
# a schedule tied to the LR instead of a stability test: freeze whatever is fresh once the cosine schedule is
# at 80% of the run (LR below a fifth of its peak), as deep as max_frozen_share allows
LM_FORCED_FROM = 0.8
# the long-run variant: the same model and schedule over 15 epochs (2,610 steps), whose validation loss flattens
LM_LONG_TRAINER = {"max_epochs": 15}
# the converged-without-overfitting variant: 3x the text (1.2M characters) for 5 epochs = 2,600 steps
# (lm_long: 2,610), so every window is seen 5 times instead of 15; validation 4 times per epoch, for the
# baseline's curve. Size chosen on baseline-only pilots with seed 7 (not a study seed): 1.6M x 4 epochs still
# fell 1.9% over the last sixth; 800k x 8 epochs ended at its lowest but wandered up to +0.6% above an earlier
# low; 1.2M x 5 epochs fell 0.46% over the last sixth and ended at its lowest.
LM_CONVERGED_TRAINER = {"max_epochs": 5, "val_check_interval": 0.25}
LM_CONVERGED_WORKLOAD = {**LM_COSINE["workload_kwargs"], "data__max_chars": 1_200_000}
# its flatter sibling, run after lm_converged's baselines still fell 1.5-2.0% over their last quarter: 2x the
# text (800k characters) for 8 epochs = 2,776 steps; the seed-7 pilot fell 0.17% over its last sixth
LM_CONVERGED_800K_TRAINER = {"max_epochs": 8, "val_check_interval": 0.25}
LM_CONVERGED_800K_WORKLOAD = {**LM_COSINE["workload_kwargs"], "data__max_chars": 800_000}


def study_thresholds(seeds: tuple[int, ...]) -> tuple[list[dict[str, Any]], str]:
    """The threshold study: backward saved vs accuracy for three plasticity thresholds, at one-cycle and at
    constant LR, and the LM's final plasticity scores per unit (why nothing freezes there)."""
    thresholds = [gc_arm("baseline")] + [
        gc_arm(f"threshold={t}", callbacks=lambda seed, t=t: [GradientCache(threshold=t)])
        for t in (0.3, 0.2, 0.1)
    ]
    results = [
        run_arms(
            "mnist1d-cnn", thresholds, seeds, CNN["trainer_kwargs"], CNN["workload_kwargs"], flops="none"
        ),
        run_arms(
            "mnist1d-cnn",
            [gc_arm("baseline"), gc_arm("freeze", callbacks=lambda seed: [GradientCache()])],
            seeds,
            {"max_epochs": 30},
            {"model__lr": 0.01, "model__scheduler": "none"},
            flops="none",
        ),
        run_arms(
            "charlm",
            [gc_arm("freeze", callbacks=lambda seed: [GradientCache()])],
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


def lm_arms() -> list[Arm]:
    arms = [gc_arm("baseline")]
    for threshold in LM_THRESHOLDS:
        arms.append(
            gc_arm(
                f"freeze threshold={threshold}",
                callbacks=lambda seed, t=threshold: [GradientCache(threshold=t)],
            )
        )
    # plasticity scores never exceed 1, so threshold 1.0 freezes whatever is fresh
    arms.append(
        gc_arm(
            f"forced from {LM_FORCED_FROM:.0%}",
            callbacks=lambda seed: [GradientCache(threshold=1.0, start_at=LM_FORCED_FROM)],
        )
    )
    return arms


def lm_long_arms() -> list[Arm]:
    """Arms of the long-run LM study, fixed before it ran (no tuning on its seeds)."""
    return [
        gc_arm("baseline"),
        gc_arm("freeze threshold=0.2", callbacks=lambda seed: [GradientCache()]),
        gc_arm("freeze threshold=0.3", callbacks=lambda seed: [GradientCache(threshold=0.3)]),
    ]


def lm_converged_arms() -> list[Arm]:
    """Arms of the converged LM study: those of the long study, fixed before any study seed ran."""
    return lm_long_arms()


# Pre-registered tune-then-confirm study on the lm_converged_800k workload (written and committed before any
# of its runs). Stage 1, ``--study lm_converged_800k_tuning --seeds 10 11 12`` (seeds never used on this
# workload): the baseline and the candidates below. Stage 2, ``--study lm_converged_800k_confirm`` on seeds 0
# 1 2: the baseline and only the candidate LM_TUNING_RULE selected, unchanged. Each candidate has a reason to
# reach the target's saving with less loss than the committed arms (threshold 0.3: 24.1% at +0.78%; FreezeOut
# from 50%: 25.1% at +1.004%), all with the plasticity test:
# - threshold 0.35: freezes a little earlier than 0.3 (0.2 -> 0.3 added 7 points of saving for 0.05 points of
#   loss on this workload, so a little more saving may still come cheap there);
# - threshold 0.3 with freeze_for 400: the same freeze points as 0.3, but half the refresh windows, in which
#   the whole frozen prefix (80% of the backward) trains again for 20 steps; they cost 0.3 about 2 points of
#   saving;
# - threshold 0.25 with max_frozen_share 0.97 and freeze_for 400: later but deeper: the last block (16% of the
#   backward, as slow as the others at the end: plasticity 0.08-0.09) may freeze too, so the same saving needs
#   fewer frozen steps, and the blocks keep learning longer;
# - threshold 0.3 with max_frozen_share 0.97: the committed 0.3 arm with the last block allowed to freeze.
# Not candidates: frozen_update="cached" (the cached window-mean gradients have cosine similarity -0.21 to
# -0.28 with the fresh ones at refresh on this workload: a stale one points against the next, so applying it
# has no reason to help), and FreezeOut (its annealing takes learning away before the freeze: at equal saving
# it cost more than the plasticity test on every LM study; from 50% of the run it needs cubic t0 <= 0.25 for
# 25.5%, where the paper's LR scaling would multiply the embedding's LR by 64; a later start cannot reach
# 25.5%).
LM_TUNING_CANDIDATES = (
    ("freeze threshold=0.35", {"threshold": 0.35}),
    ("freeze threshold=0.3 freeze_for=400", {"threshold": 0.3, "freeze_for": 400}),
    (
        "freeze threshold=0.25 max_frozen_share=0.97 freeze_for=400",
        {"threshold": 0.25, "max_frozen_share": 0.97, "freeze_for": 400},
    ),
    ("freeze threshold=0.3 max_frozen_share=0.97", {"threshold": 0.3, "max_frozen_share": 0.97}),
)
# the selection rule, fixed before the tuning runs: among the candidates whose median backward FLOPs skipped
# on the tuning seeds is >= 25.5%, the one with the lowest median relative test-loss change against the same
# seed's baseline (a tie: the larger median saving); none qualifies: no confirmation run
LM_TUNING_MIN_SKIPPED = 0.255
LM_TUNING_RULE = (
    "among the candidates whose median backward FLOPs skipped on the tuning seeds is >= 25.5%, the one with "
    "the lowest median relative test-loss change against the same seed's baseline (a tie: the larger median "
    "saving); if none qualifies, no confirmation run"
)
# the candidate the rule selected on the tuning seeds (26.0% at +0.42%, in
# studies/results/gradient_cache_lm_converged_800k_tuning.md), set after those results were committed; the
# confirmation stage runs it unchanged
LM_CONFIRM_CANDIDATE: str | None = "freeze threshold=0.25 max_frozen_share=0.97 freeze_for=400"


def _candidate_arm(name: str, kwargs: dict[str, Any]) -> Arm:
    return gc_arm(name, callbacks=lambda seed: [GradientCache(**kwargs)])


def lm_tuning_arms() -> list[Arm]:
    """Arms of the tuning stage: the baseline and the pre-registered candidates."""
    return [gc_arm("baseline")] + [_candidate_arm(name, kwargs) for name, kwargs in LM_TUNING_CANDIDATES]


def lm_confirm_arms() -> list[Arm]:
    """Arms of the confirmation stage: the baseline and the one candidate the tuning stage selected."""
    if LM_CONFIRM_CANDIDATE is None:
        raise ValueError(
            "LM_CONFIRM_CANDIDATE is None: run --study lm_converged_800k_tuning and set it first"
        )
    kwargs = dict(LM_TUNING_CANDIDATES)[LM_CONFIRM_CANDIDATE]
    return [gc_arm("baseline"), _candidate_arm(LM_CONFIRM_CANDIDATE, kwargs)]


def lm_selection(result: dict[str, Any]) -> tuple[str | None, str]:
    """Apply LM_TUNING_RULE to a tuning result: the selected candidate (or None) and a Markdown table."""
    metric = result["test_metric"]
    baseline = {run["seed"]: run for run in result["runs"] if run["arm"] == result["arms"][0]}
    rows = []
    for arm in result["arms"][1:]:
        runs = [run for run in result["runs"] if run["arm"] == arm]
        skipped = _median([run["extra"].get("gc_backward_flops_skipped_share") for run in runs])
        relative = statistics.median(
            run["test"][metric] / baseline[run["seed"]]["test"][metric] - 1 for run in runs
        )
        rows.append((arm, skipped, relative, skipped >= LM_TUNING_MIN_SKIPPED))
    qualified = [row for row in rows if row[3]]
    selected = min(qualified, key=lambda row: (row[2], -row[1]))[0] if qualified else None
    lines = [
        f"### Selection (rule fixed before the run: {LM_TUNING_RULE})",
        "",
        "| candidate | backward FLOPs skipped (median) | relative Δ test_loss (median) "
        "| qualifies (>= 25.5%) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {arm} | {s:.1%} | {r:+.2%} | {'yes' if q else 'no'} |" for arm, s, r, q in rows]
    lines += ["", f"Selected: {selected if selected else 'none (no confirmation run)'}."]
    return selected, "\n".join(lines)


# study name -> (arms, trainer kwargs, workload kwargs)
LM_STUDIES = {
    "lm": (lm_arms, LM_COSINE["trainer_kwargs"], LM_COSINE["workload_kwargs"]),
    "lm_long": (lm_long_arms, LM_LONG_TRAINER, LM_COSINE["workload_kwargs"]),
    "lm_converged": (lm_converged_arms, LM_CONVERGED_TRAINER, LM_CONVERGED_WORKLOAD),
    "lm_converged_800k": (lm_converged_arms, LM_CONVERGED_800K_TRAINER, LM_CONVERGED_800K_WORKLOAD),
    "lm_converged_800k_tuning": (lm_tuning_arms, LM_CONVERGED_800K_TRAINER, LM_CONVERGED_800K_WORKLOAD),
    "lm_converged_800k_confirm": (lm_confirm_arms, LM_CONVERGED_800K_TRAINER, LM_CONVERGED_800K_WORKLOAD),
    # a transfer check added after the confirmation (not part of the pre-registered protocol): the selected
    # configuration, unchanged, on the 1.2M-character workload whose baseline still improves at the end
    "lm_converged_selected": (lm_confirm_arms, LM_CONVERGED_TRAINER, LM_CONVERGED_WORKLOAD),
}


def _lm_run(task: tuple[int, int], study: str = "lm") -> dict[str, Any]:
    """One (seed, arm index) run of an LM study (each in a worker process with ``--jobs``)."""
    seed, index = task
    arms, trainer_kwargs, workload_kwargs = LM_STUDIES[study]
    return run_arms(
        LM_COSINE["workload"],
        [arms()[index]],
        seeds=(seed,),
        trainer_kwargs=trainer_kwargs,
        workload_kwargs=workload_kwargs,
        flops="none",
    )


def study_lm(seeds: tuple[int, ...], jobs: int, study: str = "lm") -> tuple[dict[str, Any], str]:
    """The char LM studies: backward FLOPs, CPU and loss of plasticity freezing on a 4-layer cosine-LR LM.

    Every (seed, arm) run is one task; ``jobs`` worker processes take them in order (every seed's baseline
    first), so the cores stay busy whatever the number of seeds. Ratios are paired with the same seed's
    baseline: FLOPs and losses are deterministic, CPU ratios indicative. ``study``: ``"lm"`` (6 epochs),
    ``"lm_long"`` (15 epochs, long enough for the validation loss to flatten, and to overfit),
    ``"lm_converged"`` (5 epochs on 3x the text: no overfitting, still improving), ``"lm_converged_800k"``
    (8 epochs on 2x the text: flat at the end), or that workload's pre-registered tune-then-confirm stages
    ``"lm_converged_800k_tuning"`` (the candidates, with the selection rule applied) and
    ``"lm_converged_800k_confirm"`` (the selected candidate only).
    """
    arms = LM_STUDIES[study][0]()
    tasks = [(seed, index) for index in range(len(arms)) for seed in seeds]
    run_task = functools.partial(_lm_run, study=study)
    started = time.perf_counter()
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            parts = pool.map(run_task, tasks, chunksize=1)
    else:
        parts = [run_task(task) for task in tasks]
    result = dict(parts[0])
    result["seeds"] = list(seeds)
    result["arms"] = [arm.name for arm in arms]
    result["runs"] = [run for part in parts for run in part["runs"]]
    result["elapsed_s"] = time.perf_counter() - started
    result["summary"] = summarise(
        result["runs"], result["arms"], result["metric"], result["mode"], result["test_metric"]
    )
    tables = [lm_target_table(result, against_lowest=study.startswith("lm_converged")), cache_table(result)]
    tables.append(lm_unit_table(result))
    if study != "lm":
        tables.insert(1, lm_baseline_curve_table(result))
    if study == "lm_converged_800k_tuning":
        tables.insert(0, lm_selection(result)[1])
    return result, "\n\n".join(tables)


def lm_baseline_curve_table(result: dict[str, Any]) -> str:
    """The baseline's validation loss: where it was lowest and where it ended (does it still fall?)."""
    lines = ["### charlm: the baseline's validation loss, lowest and final, per seed", ""]
    for run in result["runs"]:
        if run["arm"] != result["arms"][0]:
            continue
        curve = [(point["step"], point["val_loss"]) for point in run["curve"] if "val_loss" in point]
        if not curve:
            continue
        step, lowest = min(curve, key=lambda item: item[1])
        final_step, final = curve[-1]
        # the last validation at or before 75% of the run: how much the last quarter still gained
        quarter_step, quarter = [point for point in curve if point[0] <= 0.75 * final_step][-1]
        lines.append(
            f"- seed {run['seed']}: lowest {lowest:.4f} at step {step}, final {final:.4f} at step "
            f"{final_step} ({final / lowest - 1:+.2%} vs lowest; {final / quarter - 1:+.2%} since step "
            f"{quarter_step}); test {run['test'][result['test_metric']]:.4f}; val loss at every validation: "
            + ", ".join(f"{value:.4f}" for _, value in curve)
        )
    return "\n".join(lines)


def lm_target_table(result: dict[str, Any], against_lowest: bool = False) -> str:
    """Against the issue's LM target: >= 25% of the backward FLOPs skipped at <= 1% relative loss increase.

    ``against_lowest`` adds the relative test loss against each seed's lowest baseline validation loss over
    the run (an early-stopped baseline; validation and test are the same split here, so it favours the
    baseline): if the baseline overfits, part of a saving there is free and this column shows it.
    """
    metric = result["test_metric"]
    baseline = {run["seed"]: run for run in result["runs"] if run["arm"] == result["arms"][0]}
    lowest = {
        seed: min(point["val_loss"] for point in run["curve"] if "val_loss" in point)
        for seed, run in baseline.items()
    }
    extra_head = " vs baseline's lowest val loss (median) | per seed |" if against_lowest else ""
    lines = [
        "### charlm: against the target (>= 25% of backward FLOPs skipped at <= 1% relative test-loss increase)",
        "",
        "| arm | backward FLOPs skipped (median) | relative Δ test_loss (median) | per seed |"
        + extra_head
        + " CPU ratio (median) |",
        "|---|---|---|---|" + ("---|---|" if against_lowest else "") + "---|",
    ]
    for arm in result["arms"][1:]:
        runs = [run for run in result["runs"] if run["arm"] == arm]
        relative = [run["test"][metric] / baseline[run["seed"]]["test"][metric] - 1 for run in runs]
        skipped = _median([run["extra"].get("gc_backward_flops_skipped_share") for run in runs])
        per_seed = ", ".join(f"{r:+.2%}" for r in relative)
        cells = f"| {arm} | {skipped:.1%} | {statistics.median(relative):+.2%} | {per_seed} |"
        if against_lowest:
            to_lowest = [run["test"][metric] / lowest[run["seed"]] - 1 for run in runs]
            cells += f" {statistics.median(to_lowest):+.2%} | {', '.join(f'{r:+.2%}' for r in to_lowest)} |"
        lines.append(cells + f" {result['summary'][arm]['cpu_ratio']:.3f} |")
    return "\n".join(lines)


def lm_unit_table(result: dict[str, Any]) -> str:
    """When each unit first froze, per arm and seed (optimizer step; '-' never)."""
    lines = [
        "### charlm: first step at which each unit was frozen (unit order: input to output)",
        "",
    ]
    for run in result["runs"]:
        extra = run["extra"]
        if "gc_first_frozen_step" not in extra:
            continue
        first = extra["gc_first_frozen_step"]
        cells = ", ".join(f"{name} {first.get(name, '-')}" for name in extra["gc_units"])
        lines.append(f"- {run['arm']}, seed {run['seed']}: {cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", required=True, choices=["thresholds", *LM_STUDIES])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="LM studies: runs in this many processes")
    args = parser.parse_args()
    if args.study == "thresholds":
        results, notes = study_thresholds(tuple(args.seeds))
        command = "python -m benchmarks.studies.gradient_cache_lm --study thresholds"
        write_results(results, "gradient_cache_thresholds", command, notes=notes, results_dir=RESULTS_DIR)
        return
    result, notes = study_lm(tuple(args.seeds), args.jobs, study=args.study)
    command = f"python -m benchmarks.studies.gradient_cache_lm --study {args.study}" + (
        f" --jobs {args.jobs}" if args.jobs > 1 else ""
    )
    if args.seeds != [0, 1, 2]:
        command += " --seeds " + " ".join(map(str, args.seeds))
    write_results([result], f"gradient_cache_{args.study}", command, notes=notes, results_dir=RESULTS_DIR)


if __name__ == "__main__":
    main()
