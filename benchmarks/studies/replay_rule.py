"""Study: HardSampleReplay's ``rule="topk"`` against its control ``rule="random"`` on held-out modules, over seeds.

One-seed sweeps saw ``topk`` lose to ``random`` on some held-out models (DistilBERT, ViT) and win on others. This
study asks on which data it wins or loses, with the shipped rhythm on every module:
``PulseCycle(burst=20, replay=40, maintain=4, warmup=0.1, anneal=0.1, budget=0.6, maintain_eval="none")`` plus

* ``topk``: ``HardSampleReplay(rule="topk", replay_fraction=0.5, seed=seed)``;
* ``random``: the same with ``rule="random"`` (a uniform subset of the same size);
* ``plain_full``: no callbacks, every step;
* ``plain_cut``: no callbacks, as many steps as the ``topk`` run of the same seed took.

Modules (:mod:`benchmarks.studies.replay_rule_modules`, built on :mod:`benchmarks.studies.heldout_modules`):
a ResNet, a MobileNet, HF ViT and DistilBERT from configs, a GRU, MLPs on digits (clean, 20% of training labels
flipped, a 10:1 long tail with a balanced and with a long-tail validation set), Friedman1 regression (clean and
with 10% outlier targets), a mixture of experts, HF Llama and T5 on the standard library's source, a VAE and a
DDPM. Per fit: final ``val_loss`` (and ``val_acc``), steps, and for the noisy/outlier/long-tail data the share of
loaded training samples that were flipped, outliers or of the 5 rarest classes. Datasets are fixed across
seeds; a seed changes the initialisation, the shuffling and the selection's draws.

Run: ``python -m benchmarks.studies.replay_rule`` (seeds 0-9, about 20 minutes on 2 cores; ``--seeds 0 1 2`` or
``--modules mlp_noisy resnet`` for less). Writes ``benchmarks/studies/results/replay_rule.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.harness import environment
from benchmarks.studies.replay_rule_modules import MODULES
from lightning_pulse import HardSampleReplay, PulseCycle

RESULTS = Path(__file__).parent / "results"
BURST = 20
ARMS = ("topk", "random", "plain_full", "plain_cut")


def _callbacks(arm: str, seed: int) -> list[pl.Callback]:
    if arm not in ("topk", "random"):
        return []
    cycle = PulseCycle(
        burst=BURST, replay=2 * BURST, maintain=4, warmup=0.1, anneal=0.1, budget=0.6, maintain_eval="none"
    )
    return [cycle, HardSampleReplay(rule=arm, replay_fraction=0.5, seed=seed)]


def fit(module: str, arm: str, seed: int, max_steps: int = -1) -> dict[str, Any]:
    """One fit of ``module`` in ``arm``; its figures."""
    make_model, make_data, epochs, kind = MODULES[module]
    pl.seed_everything(seed, verbose=False)
    model, data = make_model(), make_data()
    trainer = pl.Trainer(
        max_epochs=epochs,
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=_callbacks(arm, seed),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    metrics = trainer.callback_metrics
    record: dict[str, Any] = {
        "module": module,
        "kind": kind,
        "arm": arm,
        "seed": seed,
        "steps": trainer.global_step,
        "val_loss": float(metrics["val_loss"]),
        "val_acc": float(metrics["val_acc"]) if "val_acc" in metrics else None,
        "warnings": sorted({str(w.message)[:300] for w in caught if "lightning_pulse" in (w.filename or "")}),
    }
    special = getattr(data, "special", None)
    if special is not None:  # the flipped / outlier / rare-class samples, and how often they were loaded
        counts = data.train_set.counts.float()
        record["special_share_data"] = float(special.float().mean())
        record["special_share_loads"] = float(counts[special].sum() / counts.sum())
    return record


def run(modules: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    records = []
    for module in modules:
        for seed in seeds:
            topk_steps = -1
            for arm in ARMS:
                record = fit(module, arm, seed, max_steps=topk_steps if arm == "plain_cut" else -1)
                if arm == "topk":
                    topk_steps = record["steps"]
                records.append(record)
                print(
                    json.dumps({k: record[k] for k in ("module", "arm", "seed", "steps", "val_loss")}),
                    flush=True,
                )
    return records


def _fmt(value: float | None) -> str:
    return "-" if value is None else (f"{value:.4g}" if abs(value) < 10 else f"{value:.2f}")


def _spread(values: list[float]) -> str:
    return f"{_fmt(statistics.median(values))} ({_fmt(min(values))}-{_fmt(max(values))})"


def _sign_test(wins: int, n: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven under a fair coin."""
    k = min(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def summary_markdown(records: list[dict[str, Any]], command: str) -> str:
    by = defaultdict(dict)  # (module, arm) -> seed -> record
    order: list[str] = []
    for record in records:
        by[(record["module"], record["arm"])][record["seed"]] = record
        if record["module"] not in order:
            order.append(record["module"])
    lines = [
        "# replay rule: topk against random on held-out modules",
        "",
        f"Command: `{command}`. Final val loss, median (min-max) over seeds; `topk wins` counts the seeds where",
        "topk's val loss is below random's (p: two-sided sign test); `special`: share of loaded training samples",
        "that were flipped labels, outlier targets or of the 5 rarest classes (share in the data in brackets).",
        "",
        "| module | data | topk | random | plain_full | plain_cut | topk wins (p) | median topk/random - 1 | "
        "special: topk / random (data) | steps topk / full |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for module in order:
        arms = {arm: by[(module, arm)] for arm in ARMS}
        seeds = sorted(set(arms["topk"]) & set(arms["random"]))
        topk = [arms["topk"][s]["val_loss"] for s in seeds]
        rand = [arms["random"][s]["val_loss"] for s in seeds]
        wins = sum(a < b for a, b in zip(topk, rand))
        relative = statistics.median(a / b - 1 for a, b in zip(topk, rand))
        full = [r["val_loss"] for r in arms["plain_full"].values()]
        cut = [r["val_loss"] for r in arms["plain_cut"].values()]
        special = "-"
        if "special_share_loads" in arms["topk"][seeds[0]]:
            share = statistics.median(arms["topk"][s]["special_share_loads"] for s in seeds)
            share_random = statistics.median(arms["random"][s]["special_share_loads"] for s in seeds)
            special = f"{share:.2f} / {share_random:.2f} ({arms['topk'][seeds[0]]['special_share_data']:.2f})"
        steps = f"{statistics.median(arms['topk'][s]['steps'] for s in seeds):g} / " + (
            f"{statistics.median(r['steps'] for r in arms['plain_full'].values()):g}"
        )
        lines.append(
            f"| {module} | {arms['topk'][seeds[0]]['kind']} | {_spread(topk)} | {_spread(rand)} | {_spread(full)} | "
            f"{_spread(cut)} | {wins}/{len(seeds)} ({_sign_test(wins, len(seeds)):.3f}) | {relative:+.1%} | {special} | "
            f"{steps} |"
        )
    said = sorted({(r["module"], w) for r in records for w in r["warnings"]})
    lines += ["", "Library warnings: " + ("; ".join(f"{m}: {w}" for m, w in said) if said else "none.")]
    lines += ["", f"Environment: {environment()}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", nargs="+", default=list(MODULES), choices=list(MODULES))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--name", default="replay_rule")
    args = parser.parse_args()
    torch.set_num_threads(1)
    command = (
        "python -m benchmarks.studies.replay_rule"
        + ("" if args.seeds == list(range(10)) else " --seeds " + " ".join(map(str, args.seeds)))
        + ("" if args.modules == list(MODULES) else " --modules " + " ".join(args.modules))
    )
    records = run(args.modules, args.seeds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"command": command, "records": records}, indent=1))
    markdown = summary_markdown(records, command)
    (RESULTS / f"{args.name}.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
