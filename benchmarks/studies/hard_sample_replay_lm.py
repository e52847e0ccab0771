"""HardSampleReplay on the character-level LM: the finished studies (``benchmarks/studies/README.md``).

Settings (:data:`STUDY_SETTINGS`), each with its own baseline and its results in
``benchmarks/studies/results/``:

* ``charlm``: AdamW at a constant rate, 5 epochs (kept for the record; no committed result of its own);
* ``charlm-cosine`` / ``charlm-cosine-epoch``: warm-up + cosine over 8 epochs, batch and epoch mode
  (``hard_sample_replay_charlm.md``, ``hard_sample_replay_charlm_epoch.md``);
* ``charlm-long``: 20 epochs, until the validation loss is flat (``hard_sample_replay_charlm_long.md``);
* ``charlm-rho``: RHO-LOSS (Mindermann et al. 2022), pre-registered (``hard_sample_replay_charlm_rho_plan.md``,
  ``hard_sample_replay_charlm_rho.md``);
* ``charlm-rho-strong``: the same with held-out models as strong as the LM (``..._rho_strong.md``; plan in
  ``hard_sample_replay_signal_plan.md``).

Arms beyond :func:`benchmarks.hard_sample_replay.make_arm`'s grammar:

* ``topk-<mode>-<fraction>-learn``: top-k on learnability scores (the loss above the sample's own best so far,
  :class:`LearnabilityReplay`; the library's ``score="learnability"`` until the lean-core refactor);
* ``rho-batch-0.625``: top-k in batch mode on the reducible loss, the stored training loss minus an
  irreducible loss from small models trained on the other half of the training windows
  (:func:`irreducible_losses`); those models' FLOPs count in the arm's total from its first curve point. Its
  controls: ``random-batch-0.625`` (same trained samples) and ``random-batch-0.656`` (same total FLOPs);
* ``rho-batch-0.625-strong``: the same with held-out models the LM's own size and schedule, the baseline's
  epochs on each half (about one baseline run of FLOPs); its control is ``random-batch-0.625``.

Run: ``python -m benchmarks.studies.hard_sample_replay_lm --workloads charlm-cosine --seeds 0 1 2 --name
hard_sample_replay_charlm`` (the options of ``benchmarks.hard_sample_replay``: ``--arms``, ``--raw-out``,
``--merge``, ``--name``). The committed results' own ``Command:`` lines name the script's old path,
``benchmarks.hard_sample_replay``, where these settings lived when they ran.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.hard_sample_replay import HEADLINE, Bench, main, make_arm, replay_metrics
from benchmarks.harness import Arm, TrainingFlopCounter
from benchmarks.studies import RESULTS_DIR
from benchmarks.workloads import get_workload
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.core.sample_scores import SampleScoreTable

#: The char-LM study settings, as they ran (arm names: :func:`lm_arm`).
STUDY_SETTINGS: dict[str, dict[str, Any]] = {
    # 200k characters of stdlib source in windows of 64: 2769 training windows, 87 batches of 32 per epoch;
    # AdamW at a constant rate
    "charlm": {
        "trainer_kwargs": {"max_epochs": 5},
        "workload_kwargs": {"data__max_chars": 200_000},
        "arms": (
            "topk-batch-0.5",
            "random-batch-0.5",
            "topk-epoch-0.7",
            "random-epoch-0.7",
            "topk-epoch-0.5-2x",
        ),
        "pulse": {"burst": 40, "replay": 80, "maintain": 0},
    },
    # the same language model with a warm-up + cosine schedule over 8 epochs (the constant-rate baseline above
    # is still far from converged at its end), and the variants that fare better than top-k on LMs:
    # learnability scores (loss above the sample's own best), InfoBatch with its annealing
    "charlm-cosine": {
        "workload": "charlm",
        "trainer_kwargs": {"max_epochs": 8},
        "workload_kwargs": {"data__max_chars": 200_000, "model__scheduler": "cosine"},
        "arms": (
            "random-batch-0.5",
            "topk-batch-0.5",
            "topk-batch-0.5-learn",
            "infobatch-batch-0.7-anneal",
        ),
        "pulse": {"burst": 40, "replay": 80, "maintain": 0},
    },
    # the same, in epoch mode (full batches, 70% of the windows per epoch, the cosine schedule planned over the
    # shorter epochs), against the plain way to spend 30% less: full data, the schedule cut to 70% of the steps
    "charlm-cosine-epoch": {
        "workload": "charlm",
        "trainer_kwargs": {"max_epochs": 8},
        "workload_kwargs": {"data__max_chars": 200_000, "model__scheduler": "cosine"},
        "arms": ("shorter-0.7", "random-epoch-0.7", "topk-epoch-0.7", "topk-epoch-0.7-learn"),
        "steps_per_epoch": 87,
        "pulse": {"burst": 40, "replay": 80, "maintain": 0},
    },
    # the regime data-pruning papers work in: the same model and data trained until its validation loss is
    # flat. Probed on seed 0 (baseline / full data on a schedule cut to 70% of the steps): 20 epochs 1.212 /
    # 1.253 (the baseline's last 5 validations within 1%); 30 epochs 1.245 / 1.205, the baseline overfits
    # (best 1.212 at epoch 17), so 20 is the longest run here that is flat without overfitting. 0.7 x 20
    # epochs is a whole number, so every arm's last validation is at its end. Arms fixed before the 3-seed
    # run; "tolerance" adds the within-1% figures
    "charlm-long": {
        "workload": "charlm",
        "trainer_kwargs": {"max_epochs": 20},
        "workload_kwargs": {"data__max_chars": 200_000, "model__scheduler": "cosine"},
        "arms": (
            "shorter-0.7",
            "random-epoch-0.7",
            "topk-epoch-0.7",
            "topk-epoch-0.7-learn",
            "infobatch-batch-0.7-anneal",
            # added after the first 3-seed run: InfoBatch keeps every step (smaller batches, 0.72x the
            # samples), the epoch-mode control does not; this is the random subset at InfoBatch's compute
            "random-batch-0.72",
        ),
        "steps_per_epoch": 87,
        "tolerance": 0.01,
        "pulse": {"burst": 40, "replay": 80, "maintain": 0},
    },
    # added later: RHO-LOSS (Mindermann et al. 2022) on the same run as charlm-long, pre-registered (the plan,
    # written before any run: studies/results/hard_sample_replay_charlm_rho_plan.md). Score = stored training loss - irreducible loss (IL) from small models trained on
    # the other half of the training windows (no extra data); the IL models' FLOPs count in the arm's total.
    # 0.625 = 20/32 of every batch after the (full) first epoch: 0.644x the samples, ~0.69x FLOPs with the IL
    # cost. Controls: a random subset at the same trained-sample share, and at the same total FLOPs (0.656:
    # 21/32 per batch, the largest share not above the RHO arm's total)
    "charlm-rho": {
        "workload": "charlm",
        "trainer_kwargs": {"max_epochs": 20},
        "workload_kwargs": {"data__max_chars": 200_000, "model__scheduler": "cosine"},
        "arms": ("rho-batch-0.625", "random-batch-0.625", "random-batch-0.656"),
        "steps_per_epoch": 87,
        "tolerance": 0.01,
        "pulse": {"burst": 40, "replay": 80, "maintain": 0},
    },
}

# added later: the same RHO-LOSS arm with strong held-out models (the full-size LM, 20 epochs on each half:
# about one baseline run together, so no compute saving is possible), because the per-sample gradient study
# found their reducible-loss ranking agrees with the validation gradient better than a random subset
# (studies/results/hard_sample_replay_signal.md); the question is only whether the selection then beats the
# same-size random subset. Plan fixed before the run: studies/results/hard_sample_replay_signal_plan.md
STUDY_SETTINGS["charlm-rho-strong"] = {
    **STUDY_SETTINGS["charlm-rho"],
    "arms": ("rho-batch-0.625-strong", "random-batch-0.625"),
}

#: The RHO-LOSS arms' irreducible-loss models (``charlm-rho``): the workload's model class, smaller, trained
#: on half of the training windows each; fixed before any result.
IL_MODEL = {"model__d_model": 32, "model__n_layers": 2, "model__n_heads": 4}
IL_EPOCHS = 3
IL_BATCH_SIZE = 16
IL_SPLIT_SEED = 1234


class ReducibleLossTable(SampleScoreTable):
    """A score table whose stored score is RHO-LOSS's reducible loss: measured loss - irreducible loss."""

    def __init__(self, reference: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(int(reference.numel()), **kwargs)
        self.reference = reference.detach().float().numpy().copy()

    def _as_scores(self, slots: np.ndarray, losses: np.ndarray) -> np.ndarray:
        return losses - self.reference[slots]


class LearnabilityTable(SampleScoreTable):
    """A score table whose stored score is each loss minus the lowest loss its sample has had so far (the
    library's ``score="learnability"`` until the lean-core refactor; a study arm now)."""

    def __init__(self, num_samples: int, **kwargs: Any) -> None:
        super().__init__(num_samples, **kwargs)
        self.minima = np.full(num_samples, np.inf, dtype=np.float32)

    def _as_scores(self, slots: np.ndarray, losses: np.ndarray) -> np.ndarray:
        lowest = np.fmin(self.minima[slots], losses)
        self.minima[slots] = lowest
        return losses - lowest


class LearnabilityReplay(HardSampleReplay):
    """HardSampleReplay ranking samples by their loss above their own best so far."""

    def _new_table(self, num_samples: int) -> SampleScoreTable:
        return LearnabilityTable(num_samples)


class RhoReplay(HardSampleReplay):
    """HardSampleReplay ranking samples by reducible loss; the irreducible losses are computed when it is built
    (two half-data models, :func:`irreducible_losses`, whose size and training ``held_out`` may override), and
    their FLOPs are kept as ``upfront_flops``."""

    def __init__(
        self,
        workload_kwargs: dict[str, Any],
        seed: int,
        held_out: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(seed=seed, **kwargs)
        started = time.process_time()
        self.reference, self.upfront_flops = irreducible_losses(workload_kwargs, seed, **(held_out or {}))
        self.upfront_cpu_s = time.process_time() - started

    def _new_table(self, num_samples: int) -> SampleScoreTable:
        if num_samples != self.reference.numel():
            raise RuntimeError("RhoReplay: the training set's size differs from the irreducible losses'.")
        return ReducibleLossTable(self.reference)


def rho_metrics(callbacks: list[Callback], trainer: pl.Trainer | None = None) -> dict[str, Any]:
    """:func:`benchmarks.hard_sample_replay.replay_metrics`, plus the RHO arms' up-front cost and their
    irreducible losses' spread."""
    figures = replay_metrics(callbacks, trainer)
    for callback in callbacks:
        if isinstance(callback, RhoReplay):
            reference = callback.reference
            figures.update(
                upfront_flops=callback.upfront_flops,
                upfront_cpu_s=callback.upfront_cpu_s,
                il_mean=float(reference.mean()),
                il_p10=float(reference.quantile(0.1)),
                il_p90=float(reference.quantile(0.9)),
            )
    return figures


class _FirstBatchFlops(TrainingFlopCounter):
    """Training FLOPs per sample from the first batch (counting every batch slows a step ~3x), and samples."""

    def __init__(self) -> None:
        super().__init__()
        self.flops_per_sample = math.nan
        self.samples = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.samples == 0:
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.samples == 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.flops_per_sample = self.total / extract_batch_size(batch)
        self.samples += extract_batch_size(batch)


def irreducible_losses(
    workload_kwargs: dict[str, Any],
    seed: int,
    model_overrides: dict[str, Any] = IL_MODEL,
    epochs: int = IL_EPOCHS,
    batch_size: int = IL_BATCH_SIZE,
) -> tuple[torch.Tensor, float]:
    """``((N,) irreducible loss per training window, FLOPs spent)``: the two-halves recipe.

    The training windows are split in two halves by :data:`IL_SPLIT_SEED`; a model (by default the small
    :data:`IL_MODEL`: the workload's model with ``model_overrides``) is trained on each half for ``epochs``
    epochs, and a window's irreducible loss is its token-mean cross-entropy under the model that did not train
    on it. FLOPs: both fits (FlopCounterMode on the first training batch, per sample, times the samples
    trained: shapes are fixed, so a step's FLOPs are proportional to its batch size, as
    :func:`per_sample_flops` checks) plus the scoring forward pass (counted whole). Runs in a forked RNG, so
    the caller's stream is unchanged.
    """
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng():
            return _irreducible_losses(workload_kwargs, seed, model_overrides, epochs, batch_size)
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _irreducible_losses(
    workload_kwargs: dict[str, Any],
    seed: int,
    model_overrides: dict[str, Any],
    epochs: int,
    batch_size: int,
) -> tuple[torch.Tensor, float]:
    spec = get_workload("charlm")
    _, data = spec.build(**workload_kwargs)
    data.setup("fit")
    inputs, targets = data.train_set.tensors
    count = inputs.shape[0]
    order = torch.randperm(count, generator=torch.Generator().manual_seed(IL_SPLIT_SEED))
    halves = (order[: count // 2], order[count // 2 :])
    reference = torch.full((count,), math.nan)
    flops = 0.0
    for part, (own, other) in enumerate((halves, halves[::-1])):
        torch.manual_seed(1000 * (part + 1) + seed)
        model, _ = spec.build(**{**workload_kwargs, **model_overrides})
        loader = DataLoader(
            TensorDataset(inputs[own], targets[own]),
            batch_size=batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(1000 * (part + 1) + seed),
        )
        counter = _FirstBatchFlops()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=epochs,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[counter],
        )
        trainer.fit(model, loader)
        flops += counter.flops_per_sample * counter.samples
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as forward:
            for chunk in other.split(256):
                logits = model(inputs[chunk])
                token_losses = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets[chunk].reshape(-1), reduction="none"
                )
                reference[chunk] = token_losses.view(chunk.numel(), -1).mean(dim=1)
        flops += forward.get_total_flops()
    return reference, flops


def lm_arm(
    name: str,
    epochs: int,
    cadence: dict[str, int],
    steps_per_epoch: int | None,
    workload_kwargs: dict[str, Any],
) -> Arm:
    """The studies' arms: ``rho-...`` and ``...-learn`` here, every other name through
    :func:`benchmarks.hard_sample_replay.make_arm`."""
    rule, *rest = name.split("-")
    if rule == "rho":  # RHO-LOSS: top-k on reducible loss
        mode, fraction, *options = rest
        assert options in ([], ["strong"]), f"Unknown options {options} in {name!r}."
        # "strong": the held-out models are the workload's own model trained for the baseline's epochs
        held_out = {"model_overrides": {}, "epochs": epochs, "batch_size": 32} if options else None
        return Arm(
            name,
            callbacks=lambda seed: [
                RhoReplay(
                    workload_kwargs,
                    seed,
                    held_out,
                    rule="topk",
                    mode=mode,
                    replay_fraction=float(fraction),
                )
            ],
        )
    if name.endswith("-learn"):
        made = make_arm(name.removesuffix("-learn"), epochs, cadence, steps_per_epoch, LearnabilityReplay)
        made.name = name
        return made
    return make_arm(name, epochs, cadence, steps_per_epoch)


#: The studies' bench: their settings and arms, their metrics, their results folder and command.
STUDIES = replace(
    HEADLINE,
    settings=STUDY_SETTINGS,
    make_arm=lm_arm,
    metrics=rho_metrics,
    results_dir=RESULTS_DIR,
    module="benchmarks.studies.hard_sample_replay_lm",
    default_name="hard_sample_replay_lm",
)

__all__ = ["STUDIES", "STUDY_SETTINGS", "Bench", "irreducible_losses", "lm_arm", "rho_metrics"]


if __name__ == "__main__":
    main(STUDIES)
