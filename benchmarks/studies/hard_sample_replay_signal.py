"""How much signal a selection by loss can exploit: per-sample losses and gradients in the baselines.

HardSampleReplay's top-k rule beats a random subset at the same compute on MNIST-1D and does not on the
character-level LM (``hard_sample_replay.md`` against ``hard_sample_replay_charlm_long.md`` and
``hard_sample_replay_charlm_rho.md``). This study measures why. It trains each benchmark's baseline,
unchanged, and at the end of epochs ``round(E * q)`` for ``q`` in :data:`CHECKPOINTS` takes, for every
training sample ``i``, its loss ``L_i`` (a window's mean token loss for the LM) and the gradient ``g_i`` of
that loss over all parameters, with the weights of that moment. Fresh losses are the best case for a selection
by loss; the callback's stored losses are older. The measures, for a kept fraction ``f``:

* ``fair_share_ratio``: the share of ``sum ||g_i||`` held by the ``(1 - f) N`` lowest-loss samples (those
  top-k drops), over ``1 - f``. Near 0: the easiest samples carry no gradient, so dropping them is free and
  the saved compute goes to samples that matter. Near 1: they carry their share, and a loss ranking picks
  samples no more useful than a random draw.
* ``loss_fair_share_ratio``: the same with the losses in place of the gradient norms, a figure the callback's
  own score table can give without any gradient.
* ``table_easy_half_loss_ratio``: :func:`easy_half_loss_ratio` of HardSampleReplay's score table (a library
  figure until the lean-core refactor, now kept here)
  at the same moment, from a score-only callback (scoring every step, never selecting) attached to the
  baseline: the stale-loss counterpart of ``loss_fair_share_ratio`` at ``f = 0.5``.
* ``cos_topk`` and ``cos_random``: the cosine between the mean gradient of the ``f N`` highest-loss samples
  (of a random ``f N``, median over :data:`RANDOM_DRAWS` draws) and the mean gradient over all ``N``.
* ``spearman_loss_gradnorm``: how well the loss ranks the samples by gradient size.
* ``loss_cv``: the standard deviation of ``L_i`` over its mean; for the LM also over single tokens.
* ``persistence``: the rank correlation of ``L_i`` with the previous checkpoint's.

The plan, hypotheses included, was written before any run (and committed with the results):
``results/hard_sample_replay_signal_plan.md``. The measuring callback takes per-sample gradients with
``torch.func`` (``vmap`` of ``grad``; a test checks them against one-sample ``torch.autograd.grad``) in eval
mode (neither model has dropout or batch norm), writes no ``.grad``, and draws from its own generator, so
training is unchanged: each seed's final validation metric must equal the committed baseline's, which the run
checks and reports.

A follow-up, planned after the first results (in the same plan file), adds at every checkpoint the mean
gradient of the validation samples and the cosines to it (``cos_val_*``): agreement with the gradient that
generalisation asks for. With ``--reducible`` (char LM) it also ranks by reducible loss, the training loss
minus the loss of a strong held-out model (the full-size LM trained for the baseline's epochs on the other half
of the training windows, :func:`benchmarks.studies.hard_sample_replay_lm.irreducible_losses`): the ranking RHO-LOSS would
see with a held-out model far beyond any usable budget (the two cost about one baseline run).

Run: ``python -m benchmarks.studies.hard_sample_replay_signal`` (both workloads, seeds 0 1 2; here about a minute for
MNIST-1D's three seeds and 2-3 minutes per LM seed; ``--reducible``, with ``--workloads charlm``, adds about one
baseline run per seed), or ``--workloads mnist1d-cnn --seeds 0`` for a part; ``--raw-out part.json`` then
``--merge a.json b.json`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.func import functional_call, grad, vmap

from benchmarks.hard_sample_replay import SETTINGS as HEADLINE_SETTINGS
from benchmarks.hard_sample_replay import ScoreOnly
from benchmarks.harness import Arm, environment, run_one
from benchmarks.studies import RESULTS_DIR
from benchmarks.studies.hard_sample_replay_lm import STUDY_SETTINGS, irreducible_losses
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.core.sample_scores import SampleScoreTable

#: The benchmark settings whose baselines are measured, and their committed final validation metrics per seed
#: (``hard_sample_replay.md``, ``hard_sample_replay_charlm_long.md``), which the runs here must reproduce.
STUDIES: dict[str, dict[str, Any]] = {
    "mnist1d-cnn": {"setting": "mnist1d-cnn", "metric": "val_acc", "committed": (0.9287, 0.9150, 0.9162)},
    "charlm": {"setting": "charlm-long", "metric": "val_loss", "committed": (1.2125, 1.2172, 1.2265)},
}
CHECKPOINTS = (0.25, 0.5, 0.75, 1.0)
KEPT_FRACTIONS = (0.5, 0.7)
RANDOM_DRAWS = 20
CHUNK = 64


def easy_half_loss_ratio(table: SampleScoreTable) -> float:
    """How much the easier half of the scored samples still weighs: the summed stored loss of the half with the
    lowest losses over half the summed loss of all scored samples.

    1 when every sample has the same loss, near 0 when the easier half is learned. ``NaN`` with fewer than 2
    scored samples, a negative stored loss or a zero total.
    """
    losses = table.scores[table.steps >= 0].astype(np.float64)
    if losses.size < 2 or losses.min() < 0:
        return math.nan
    total = losses.sum()
    if not total > 0:
        return math.nan
    half = losses.size // 2
    easier = np.partition(losses, half - 1)[:half].sum()
    return float(easier / (total * half / losses.size))


def signal_metrics(callbacks: list[Callback], trainer: Any = None) -> dict[str, Any]:
    """What the study reads after a run (``Arm.metrics``): the probe's points."""
    return {"signal": next(c.points for c in callbacks if isinstance(c, SignalProbe))}


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    rank_a = np.argsort(np.argsort(a)).astype(np.float64)
    rank_b = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(rank_a, rank_b)[0, 1])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-30))


def _subset_mean(gradients: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    # a matrix-vector product: indexing would copy most of the (N, P) matrix for every subset
    weights = torch.zeros(len(gradients), dtype=gradients.dtype)
    weights[indices] = 1.0 / len(indices)
    return weights @ gradients


def _token_losses(module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` cross-entropy of every target (``T`` = 1 for a classifier)."""
    logits = module(inputs)
    token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return token.view(len(inputs), -1)


def per_sample_losses_and_gradients(
    module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
    """Each sample's mean cross-entropy, its flattened gradient ``(N, P)`` and every token's loss."""
    params = {name: p.detach() for name, p in module.named_parameters()}

    def sample_loss(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(module, weights, (x[None],))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    per_sample_grad = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    losses, token_losses, rows = [], [], []
    for start in range(0, len(inputs), CHUNK):
        x, y = inputs[start : start + CHUNK], targets[start : start + CHUNK]
        with torch.no_grad():
            token = _token_losses(module, x, y)
        losses.append(token.mean(1))
        token_losses.append(token.reshape(-1))
        grads = per_sample_grad(params, x, y)
        rows.append(torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1))
    return torch.cat(losses).numpy(), torch.cat(rows), torch.cat(token_losses).numpy()


def signal_measures(
    losses: np.ndarray,
    gradients: torch.Tensor,
    generator: torch.Generator,
    validation_gradient: torch.Tensor | None = None,
    reference: np.ndarray | None = None,
) -> dict[str, Any]:
    """The measures of the module docstring for one checkpoint.

    With ``validation_gradient`` (the mean gradient over the validation samples) also the ``cos_val_*``
    measures; with ``reference`` (a held-out model's loss per training sample) also the ranking by reducible
    loss, ``losses - reference``.
    """
    count = len(losses)
    norms = gradients.norm(dim=1).double().numpy()
    full = gradients.mean(0)
    by_loss = np.argsort(losses)  # easiest first
    out: dict[str, Any] = {
        "mean_loss": float(losses.mean()),
        "loss_cv": float(losses.std() / losses.mean()),
        "spearman_loss_gradnorm": _spearman(losses, norms),
        "gradnorm_cv": float(norms.std() / norms.mean()),
        "full_gradient_norm_over_mean_sample_norm": float(full.norm()) / float(norms.mean()),
    }
    if validation_gradient is not None:
        out["cos_val_full"] = _cosine(full, validation_gradient)
    by_reducible = None if reference is None else np.argsort(losses - reference)
    for kept in KEPT_FRACTIONS:
        keep = int(round(kept * count))
        dropped = by_loss[: count - keep]
        dropped_share = float(norms[dropped].sum() / norms.sum())
        random_means = [
            _subset_mean(gradients, torch.randperm(count, generator=generator)[:keep])
            for _ in range(RANDOM_DRAWS)
        ]
        random_cos = [_cosine(mean, full) for mean in random_means]
        topk = _subset_mean(gradients, torch.as_tensor(by_loss[count - keep :]))
        figures = {
            "dropped_mass_share": dropped_share,
            "fair_share_ratio": dropped_share / (1 - kept),
            "loss_fair_share_ratio": float(losses[dropped].sum() / losses.sum()) / (1 - kept),
            "cos_topk": _cosine(topk, full),
            "cos_random": statistics.median(random_cos),
            "cos_random_min": min(random_cos),
        }
        if validation_gradient is not None:
            figures["cos_val_topk"] = _cosine(topk, validation_gradient)
            figures["cos_val_random"] = statistics.median(
                _cosine(mean, validation_gradient) for mean in random_means
            )
        if by_reducible is not None:
            reducible_topk = _subset_mean(gradients, torch.as_tensor(by_reducible[count - keep :]))
            figures["fair_share_reducible"] = float(
                norms[by_reducible[: count - keep]].sum() / norms.sum()
            ) / (1 - kept)
            figures["cos_topk_reducible"] = _cosine(reducible_topk, full)
            if validation_gradient is not None:
                figures["cos_val_topk_reducible"] = _cosine(reducible_topk, validation_gradient)
        out[f"f{kept}"] = figures
    return out


def mean_gradient(module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The flattened gradient of the mean loss over all ``inputs`` (every sample weighing the same)."""
    total = [torch.zeros_like(p) for p in module.parameters()]
    for start in range(0, len(inputs), 256):
        x, y = inputs[start : start + 256], targets[start : start + 256]
        loss = _token_losses(module, x, y).mean(1).sum() / len(inputs)
        for accumulated, part in zip(total, torch.autograd.grad(loss, list(module.parameters()))):
            accumulated += part
    return torch.cat([g.reshape(-1) for g in total])


class SignalProbe(Callback):
    """Measures the training set's per-sample losses and gradients at the end of chosen epochs."""

    def __init__(
        self,
        epochs: list[int],
        seed: int,
        replay: HardSampleReplay | None = None,
        reference: np.ndarray | None = None,
    ) -> None:
        self.epochs = set(epochs)
        self.replay = replay
        self.reference = reference
        self.generator = torch.Generator().manual_seed(10_000 + seed)
        self.points: list[dict[str, Any]] = []
        self._previous_losses: np.ndarray | None = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        epoch = trainer.current_epoch + 1
        if epoch not in self.epochs:
            return
        inputs, targets = trainer.datamodule.train_set.tensors
        was_training = pl_module.training
        pl_module.eval()
        started = time.process_time()
        with torch.enable_grad():
            losses, gradients, token_losses = per_sample_losses_and_gradients(pl_module, inputs, targets)
            validation_gradient = mean_gradient(pl_module, *trainer.datamodule.val_set.tensors)
        point = {"epoch": epoch, "samples": len(losses), "parameters": int(gradients.shape[1])}
        point.update(signal_measures(losses, gradients, self.generator, validation_gradient, self.reference))
        if token_losses.shape != losses.shape:
            point["token_loss_cv"] = float(token_losses.std() / token_losses.mean())
        if self._previous_losses is not None:
            point["persistence"] = _spearman(self._previous_losses, losses)
        if self.replay is not None and self.replay.table is not None:
            point["table_easy_half_loss_ratio"] = easy_half_loss_ratio(self.replay.table)
        point["probe_cpu_s"] = time.process_time() - started
        self._previous_losses = losses
        self.points.append(point)
        pl_module.train(was_training)


def _score_only_and_probe(
    epochs: list[int], seed: int, reference: np.ndarray | None = None
) -> list[Callback]:
    # HardSampleReplay scoring every step and never selecting (the benchmark's score-only arm, which trains
    # exactly as the baseline does), listed first so its epoch-end table update precedes the probe
    replay = ScoreOnly(phases=("burst",), mode="batch", seed=seed)
    return [replay, SignalProbe(epochs, seed, replay, reference)]


def run_study(workload: str, seeds: list[int], reducible: bool = False) -> dict[str, Any]:
    study = STUDIES[workload]
    setting = {**HEADLINE_SETTINGS, **STUDY_SETTINGS}[study["setting"]]
    trainer_kwargs = dict(setting["trainer_kwargs"])
    epochs = trainer_kwargs["max_epochs"]
    checkpoint_epochs = sorted({max(1, round(epochs * q)) for q in CHECKPOINTS})
    torch.set_num_threads(1)
    runs = []
    for seed in seeds:
        reference, reference_flops = None, math.nan
        if reducible:
            # the follow-up's strong held-out models: the workload's own model and schedule, the baseline's
            # epochs, on each half of the training windows (a forked RNG: the baseline's stream is unchanged)
            il, reference_flops = irreducible_losses(
                setting["workload_kwargs"], seed, model_overrides={}, epochs=epochs, batch_size=32
            )
            reference = il.numpy()
        arm = Arm(
            "baseline", callbacks=partial(_score_only_and_probe, checkpoint_epochs, reference=reference)
        )
        arm.metrics = signal_metrics
        run = run_one(workload, arm, seed, trainer_kwargs, setting["workload_kwargs"], count_flops=False)
        final = run["final_val"][study["metric"]]
        committed = study["committed"][seed] if seed < len(study["committed"]) else None
        runs.append(
            {
                "seed": seed,
                "final_val": final,
                "committed_final_val": committed,
                "reproduces_committed": committed is not None and abs(final - committed) < 5e-5,
                "train_cpu_s": run["train_cpu_s"],
                "reference_mean_loss": None if reference is None else float(reference.mean()),
                "reference_flops": reference_flops,
                "points": run["extra"]["signal"],
            }
        )
        print(
            f"[{workload}] seed={seed} final {study['metric']}={final:.4f} (committed {committed})",
            flush=True,
        )
    return {
        "workload": workload,
        "setting": study["setting"],
        "trainer_kwargs": trainer_kwargs,
        "workload_kwargs": setting["workload_kwargs"],
        "checkpoint_epochs": checkpoint_epochs,
        "seeds": seeds,
        "runs": runs,
        "environment": environment(),
    }


def _median_at(runs: list[dict[str, Any]], index: int, *keys: str) -> float:
    values = []
    for run in runs:
        value: Any = run["points"][index]
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            values.append(float(value))
    return statistics.median(values) if values else float("nan")


#: Markdown columns: (header, keys into a checkpoint's figures).
SIGNAL_COLUMNS = (
    ("mean loss", ("mean_loss",)),
    ("loss CV", ("loss_cv",)),
    ("token loss CV", ("token_loss_cv",)),
    ("Spearman(loss, grad norm)", ("spearman_loss_gradnorm",)),
    ("persistence", ("persistence",)),
    ("fair share f=0.5", ("f0.5", "fair_share_ratio")),
    ("fair share f=0.7", ("f0.7", "fair_share_ratio")),
    ("loss fair share f=0.5", ("f0.5", "loss_fair_share_ratio")),
    ("table easy-half ratio", ("table_easy_half_loss_ratio",)),
    ("cos top-k f=0.5", ("f0.5", "cos_topk")),
    ("cos random f=0.5", ("f0.5", "cos_random")),
    ("cos top-k f=0.7", ("f0.7", "cos_topk")),
    ("cos random f=0.7", ("f0.7", "cos_random")),
)
FOLLOW_UP_COLUMNS = (
    ("cos(train, val)", ("cos_val_full",)),
    ("val: top-k f=0.5", ("f0.5", "cos_val_topk")),
    ("val: random f=0.5", ("f0.5", "cos_val_random")),
    ("val: reducible top-k f=0.5", ("f0.5", "cos_val_topk_reducible")),
    ("val: top-k f=0.7", ("f0.7", "cos_val_topk")),
    ("val: random f=0.7", ("f0.7", "cos_val_random")),
    ("val: reducible top-k f=0.7", ("f0.7", "cos_val_topk_reducible")),
    ("reducible top-k f=0.5", ("f0.5", "cos_topk_reducible")),
    ("reducible fair share f=0.5", ("f0.5", "fair_share_reducible")),
)


def _table(result: dict[str, Any], columns: tuple[tuple[str, tuple[str, ...]], ...]) -> list[str]:
    runs = result["runs"]
    lines = [
        "| epoch | " + " | ".join(header for header, _ in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for index, epoch in enumerate(result["checkpoint_epochs"]):
        cells = [_median_at(runs, index, *keys) for _, keys in columns]
        lines.append(f"| {epoch} | " + " | ".join("-" if np.isnan(c) else f"{c:.3f}" for c in cells) + " |")
    return lines


def markdown(results: list[dict[str, Any]], command: str) -> str:
    lines = ["# hard_sample_replay_signal", "", f"Command: `{command}`", ""]
    lines += [
        "Plan and hypotheses, written before any run (committed with the results): "
        "`hard_sample_replay_signal_plan.md`. Medians over seeds at each checkpoint (end of the epoch "
        "shown). f = kept fraction; `fair share` = the gradient mass (sum of per-sample gradient norms) "
        "of the (1-f)N lowest-loss samples over 1-f (0: dropping them loses no gradient; 1: they carry as "
        "much as any others). cos = cosine to the full-data mean gradient of the mean gradient of the fN "
        f"highest-loss samples (top-k) or of a random fN (median of {RANDOM_DRAWS} draws). The follow-up "
        "table: `val:` = the same cosine to the mean gradient of the validation samples instead; "
        "`reducible` = ranked by loss minus a strong held-out model's loss (char LM only).",
        "",
    ]
    for result in results:
        runs = result["runs"]
        reproduced = ", ".join(
            f"seed {r['seed']}: {r['final_val']:.4f} (committed {r['committed_final_val']})" for r in runs
        )
        lines += [
            f"## {result['workload']} ({result['setting']} baseline)",
            "",
            f"Trainer: {result['trainer_kwargs']}; workload: {result['workload_kwargs']}. Final validation "
            f"metric, which must equal the committed baseline's: {reproduced}.",
            "",
            *_table(result, SIGNAL_COLUMNS),
            "",
        ]
        if any("cos_val_full" in point for run in runs for point in run["points"]):
            references = [r for r in runs if r.get("reference_mean_loss") is not None]
            lines += ["Follow-up: agreement with the validation gradient.", ""]
            if references:
                lines += [
                    "Held-out models (the full-size LM, 20 epochs on each half of the training windows): "
                    "mean held-out loss "
                    + ", ".join(f"{r['reference_mean_loss']:.3f}" for r in references)
                    + " over seeds; their cost, "
                    + ", ".join(f"{r['reference_flops']:.3g}" for r in references)
                    + " FLOPs, is about one baseline run (a measurement, not a usable budget).",
                    "",
                ]
            lines += [*_table(result, FOLLOW_UP_COLUMNS), ""]
    lines.append(f"Environment: {results[0]['environment']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(STUDIES), choices=list(STUDIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--raw-out", help="write this part's results here instead of benchmarks/studies/results/"
    )
    parser.add_argument("--merge", nargs="+", help="part files to write up as one result")
    parser.add_argument("--command", help="the command(s) that made the parts, for the results file")
    parser.add_argument(
        "--reducible",
        action="store_true",
        help="char LM: also rank by reducible loss from strong held-out models (about one baseline run)",
    )
    args = parser.parse_args()
    if args.merge:
        by_workload: dict[str, dict[str, Any]] = {}
        for path in args.merge:
            for result in json.loads(open(path).read()):
                known = by_workload.setdefault(result["workload"], {**result, "runs": []})
                known["runs"] += result["runs"]
                known["seeds"] = sorted({*known["seeds"], *result["seeds"]})
        results = [by_workload[w] for w in STUDIES if w in by_workload]
        for result in results:
            result["runs"].sort(key=lambda r: r["seed"])
        command = args.command or "python -m benchmarks.studies.hard_sample_replay_signal"
    else:
        if args.reducible and args.workloads != ["charlm"]:
            parser.error("--reducible is for --workloads charlm only")
        results = [run_study(workload, args.seeds, args.reducible) for workload in args.workloads]
        command = "python -m benchmarks.studies.hard_sample_replay_signal " + " ".join(
            ["--workloads", *args.workloads, "--seeds", *map(str, args.seeds)]
            + (["--reducible"] if args.reducible else [])
        )
        if args.raw_out:
            with open(args.raw_out, "w") as handle:
                json.dump(results, handle, indent=2)
            return
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "hard_sample_replay_signal.json").write_text(
        json.dumps({"command": command, "results": results}, indent=2)
    )
    (RESULTS_DIR / "hard_sample_replay_signal.md").write_text(markdown(results, command))
    print(markdown(results, command))


if __name__ == "__main__":
    main()
