"""Hard-sample replay without a framework: which samples of a batch (or of a wider window) to train on.

:class:`HardSampleSelector` holds a :class:`~lightning_pulse.core.sample_scores.SampleScoreTable` and a
:class:`ReplayConfig`. Per batch it is asked :meth:`~HardSampleSelector.compose` (the positions of the
offered batch to train on, their roles and, for InfoBatch, loss weights), then told what the step measured
with :meth:`~HardSampleSelector.record`. Measurements are kept and applied to the table in bulk (every
``apply_every`` steps, and before anything reads the whole table), which is what keeps the per-step cost low
on small models. :meth:`~HardSampleSelector.choose_windows` chooses a pass's step-saving batches from wider
windows instead, before they are loaded.

Under data parallelism every rank records every rank's rows (:func:`gather_rows`, given any ``all_gather``
callable), so every rank holds the same table and takes the same decisions.

Example::

    selector = HardSampleSelector(SampleScoreTable(len(dataset)), ReplayConfig(replay_fraction=0.5))
    for step in range(steps):
        indices = sampler_indices(step)                        # (B,) dataset indices of the next batch
        chosen = selector.compose(indices, step, batch_idx=step)
        x, y = dataset_x[chosen.indices], dataset_y[chosen.indices]
        losses = F.cross_entropy(model(x), y, reduction="none")
        losses.mean().backward()
        selector.record(chosen.indices, losses.detach(), chosen.roles, step, active=True, offered=len(indices))

``docs/hard-sample-replay.md`` has the same as a runnable snippet.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Subset, TensorDataset

from lightning_pulse.core.per_sample_loss import (
    CAPTURED_LOSSES,
    LossCapture,
    PerSampleScorer,
    concat_per_sample,
)
from lightning_pulse.core.sample_index import SampleIndexTracker
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.core.selection import RULES, Selection, infobatch_prune, select_random, select_topk
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import PHASE_NAMES, Duration, parse_duration

#: Why a sample was in the batch a step trained on.
UNTOUCHED, SELECTED, UNSEEN = 0, 1, 2
ROLE_NAMES = ("untouched", "selected", "unseen")

#: Measured steps kept before they are applied to the table together.
APPLY_EVERY = 32
#: the fewest samples a cut batch keeps: a one-sample batch breaks BatchNorm in training ("Expected more than 1
#: value per channel") and is a poor step anyway, so a cut that would keep one trains the batch whole
MIN_COMPOSED = 2


def _not_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)


@dataclass(frozen=True)
class ReplayConfig:
    """How samples are chosen; validated on construction.

    Args:
        rule: ``"topk"`` (highest scores), ``"infobatch"`` (drop below-mean samples with probability
            ``prune_ratio``, weight the kept ones so the mean loss stays unbiased) or ``"random"`` (a uniform
            subset of the same size as top-k's: the control).
        replay_fraction: share of each batch (or epoch) trained on, in ``(0, 1]``; not used by InfoBatch.
        prune_ratio: InfoBatch's ``r``, in ``[0, 1)``.
        seed: seed of the random draws, mixed with step, batch and rank.

    Raises:
        ValueError: naming the field, for a value outside these ranges.
    """

    rule: str = "topk"
    replay_fraction: float = 0.5
    prune_ratio: float = 0.5
    seed: int = 0

    def describe(self, mode: str, phases: Sequence[str]) -> str:
        """The settings a fit runs with, as said once at its start."""
        return (
            f"mode={mode}, rule={self.rule}, replay_fraction={self.replay_fraction:g}, phases={list(phases)}."
        )

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"`rule`={self.rule!r} is not one of {list(RULES)}.")
        if _not_number(self.replay_fraction) or not 0.0 < self.replay_fraction <= 1.0:
            raise ValueError(f"`replay_fraction`={self.replay_fraction!r} must be a number in (0, 1].")
        if _not_number(self.prune_ratio) or not 0.0 <= self.prune_ratio < 1.0:
            raise ValueError(f"`prune_ratio`={self.prune_ratio!r} must be a number in [0, 1).")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"`seed`={self.seed!r} must be an int.")
        # each rule reads one of the two shares: the other, set away from its default, would do nothing
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        if self.rule == "infobatch" and self.replay_fraction != defaults["replay_fraction"]:
            raise ValueError(
                f"`replay_fraction`={self.replay_fraction!r} is not read by rule='infobatch', which keeps a share "
                "set by `prune_ratio`; drop `replay_fraction`, or use rule='topk' or 'random'."
            )
        if self.rule != "infobatch" and self.prune_ratio != defaults["prune_ratio"]:
            raise ValueError(
                f"`prune_ratio`={self.prune_ratio!r} is read by rule='infobatch' only; rule={self.rule!r} trains "
                "the share `replay_fraction`. Drop `prune_ratio`, or use rule='infobatch'."
            )


#: How a light step trains: ``"steps"`` (full batches chosen from wider windows, fewer steps) or ``"batch"``
#: (smaller batches, same steps).
MODES = ("steps", "batch")
#: why ``mode="epoch"`` is gone, for the error its old configurations get
EPOCH_MODE_REMOVED = (
    "`mode`='epoch' was removed: mode='steps' (the default) without a PulseCycle trains full batches on "
    "replay_fraction of each epoch, as epoch mode did, and matched it (benchmarks/studies/results/"
    "replay_steps_vs_epoch.md); drop `mode` or use mode='batch'."
)


def validate_replay_args(
    phases: Sequence[str] | str, mode: str | None, rule: str, scorer: Any, log_every_n_steps: int | None
) -> tuple[tuple[str, ...], str]:
    """Check :class:`~lightning_pulse.HardSampleReplay`'s arguments beyond :class:`ReplayConfig`; return
    ``phases`` as a tuple and the mode (``None``: ``"steps"``, or ``"batch"`` for ``rule="infobatch"``).

    Raises:
        ValueError: naming the argument, its value and what is allowed.
    """
    mode = mode if mode is not None else "batch" if rule == "infobatch" else "steps"
    given = phases
    phases = [given] if isinstance(given, str) else list(given) if isinstance(given, Iterable) else []
    if not phases or any(p not in PHASE_NAMES for p in phases):
        raise ValueError(f"`phases`={given!r} must be a non-empty list of phases from {list(PHASE_NAMES)}.")
    if mode == "epoch":
        raise ValueError(EPOCH_MODE_REMOVED)
    if mode not in MODES:
        raise ValueError(f"`mode`={mode!r} is not one of {list(MODES)}.")
    if mode == "steps" and rule == "infobatch":
        raise ValueError(
            f"`mode`={mode!r} needs batches of a count known in advance, which InfoBatch's random pruning does "
            "not give; use rule='topk' or 'random', or mode='batch' (the default for rule='infobatch')."
        )
    if scorer is not None and not isinstance(scorer, PerSampleScorer):
        raise ValueError(f"`scorer`={scorer!r} must be a PerSampleScorer instance (or None).")
    every = log_every_n_steps
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"`log_every_n_steps`={every!r} must be a positive int or None.")
    return tuple(phases), mode


#: Why HardSampleReplay refuses a setup (the first completes "HardSampleReplay ...").
MODEL_PARALLEL_REFUSAL = (
    "does not support ModelParallelStrategy, whatever its tensor_parallel_size: with tensor parallelism the "
    "ranks that share a batch must cut it alike, but its random draws are seeded per global rank, and its "
    "device mesh is not read (a tensor_parallel_size of 1 is not checked either). Train with strategy='ddp' "
    "(or FSDPStrategy or DeepSpeed, on GPUs only in Lightning), or remove HardSampleReplay from the callbacks."
)
FULLGRAPH_REFUSAL = (
    "cannot capture the loss of {part}, whose training_step runs under torch.compile(..., fullgraph=True): the "
    "loss is captured at a graph break, which fullgraph makes an error (and a compiled training_step is not "
    "supported by the capture). Compile the network alone (e.g. `self.net = torch.compile(self.net, "
    "fullgraph=True)` in configure_model, the loss computed on its outputs in training_step), set `scorer=` "
    "to a PerSampleScorer (e.g. OutputKeyScorer over per-sample losses training_step returns) with a rule "
    "other than 'infobatch' (nothing is captured then), or remove HardSampleReplay."
)
FULLGRAPH_LOSS_REFUSAL = (
    "cannot capture the {loss} called inside {part}, compiled with torch.compile(..., fullgraph=True): the "
    "capture runs at a graph break, which fullgraph makes an error. Compute the loss on {part}'s outputs in "
    "training_step (a fullgraph part without the loss works), compile without fullgraph=True (a graph without "
    "breaks compiles the same; the capture adds one per loss call), set `scorer=` to a PerSampleScorer (e.g. "
    "OutputKeyScorer over per-sample losses training_step returns) with a rule other than 'infobatch' "
    "(nothing is captured then), or remove HardSampleReplay."
)


def fullgraph_loss_refusal(part: str, message: str) -> str | None:
    """Why a fit is refused at its first step (completes "HardSampleReplay ..."), else ``None``: ``part``,
    compiled with ``fullgraph=True``, raised dynamo's graph-break error (``message``) at a call of a captured
    loss (patched in, and run eagerly behind ``torch.compiler.disable``)."""
    if "disable" not in message:
        return None
    loss = next((name for name in CAPTURED_LOSSES if re.search(rf"\b{name}\b", message)), None)
    return None if loss is None else FULLGRAPH_LOSS_REFUSAL.format(loss=f"F.{loss}", part=part)


TUNER_REFUSAL = (
    "does not take part in a Tuner search: the attached {search} runs its trials as a fit, whose steps "
    "HardSampleReplay would cut into replayed batches (and cap at its planned steps), and then restores a "
    "checkpoint from before the trials. Run Tuner.lr_find / scale_batch_size on a Trainer without "
    "HardSampleReplay, then fit with it."
)
STEPS_MODE_CLOCK_REFUSAL = (
    "HardSampleReplay: mode='steps' plans the run's steps before the first one from the PulseCycle's phase "
    "durations, which here are in seconds; give them in steps or epochs, or use mode='batch'."
)
STEPS_MODE_LENGTH_REFUSAL = (
    "HardSampleReplay: mode='steps' plans the run's steps before the first one, which needs a finite max_epochs "
    "or max_steps; set one, or use mode='batch'."
)
STEPS_MODE_SAMPLER_LENGTH_REFUSAL = (
    "HardSampleReplay: mode='steps' plans every pass of the training DataLoader's sampler before it runs, "
    "which needs the pass's length, and its sampler ({sampler}) has no `__len__`; give it one, or use "
    "mode='batch'."
)
STEPS_MODE_ACCUMULATION_SCHEDULE_REFUSAL = (
    "HardSampleReplay: mode='steps' plans the run's optimizer steps at fit start with `accumulate_grad_batches`="
    "{accumulate} (the Trainer's; the scheduler sets {scheduled} at epoch 0), and a GradientAccumulationScheduler "
    "changes it during the run, so max_steps and a schedule "
    "built from estimated_stepping_batches would not be the steps the run takes; use a fixed "
    "`accumulate_grad_batches`, or mode='batch'."
)
STEPS_MODE_STEP_BOUND_REFUSAL = (
    "HardSampleReplay: in a run bounded by max_steps alone (max_epochs={max_epochs!r}), Lightning builds the "
    "LR scheduler before the training data, so a per-step scheduler here was built for max_steps={max_steps} "
    "steps, and mode='steps' plans {planned}: the schedule would stop at {share:.0%} of its course. "
    "Set max_epochs too (max_epochs={epochs} holds max_steps' data): Lightning then loads the data, and the plan "
    "is made, before the scheduler reads the run's length. Or use mode='batch'."
)
STEPS_MODE_SCHEDULE_LENGTH_REFUSAL = (
    "HardSampleReplay: the per-step {scheduler} was built for {length} steps, the run's length without "
    "step-saving replay ({source}), and mode='steps' plans {planned}: the schedule would stop at {share:.0%} of "
    "its course. {way_out}"
)
# the way out of STEPS_MODE_SCHEDULE_LENGTH_REFUSAL for a scheduler Lightning steps at each optimizer step
SCHEDULE_LENGTH_WAY_OUT = (
    "Build its length from `self.trainer.estimated_stepping_batches` in configure_optimizers (it holds the "
    "{planned} planned steps), or use mode='batch'."
)
# a SequentialLR restarts each scheduler at its milestone: the planned steps are its span, not the length of
# the scheduler whose course ends it (the decay: a held floor may follow it)
SEQUENTIAL_SCHEDULE_WAY_OUT = (
    " A SequentialLR restarts each scheduler at its milestone, and its {scheduler} from milestone {start} "
    "ends at step {length}: build that one for `estimated_stepping_batches` less {start}."
)
# the decay's length is the planned steps and its milestone plus that is the unplanned run's: either way it
# is built for `estimated_stepping_batches` less the milestone
STEPS_MODE_SEQUENTIAL_MILESTONE_REFUSAL = (
    "HardSampleReplay: the per-step SequentialLR's {scheduler} starts at milestone {start} and was built for "
    "{planned} steps: the run's {planned} planned steps (`estimated_stepping_batches`) with the milestone "
    "not taken off, or, with it, the SequentialLR built for {length}, the run's length without step-saving "
    "replay ({source}). Either way the SequentialLR ends at step {length}, and mode='steps' plans {planned}: "
    "the schedule would stop at {share:.0%} of its course. Build its {scheduler} for "
    "`self.trainer.estimated_stepping_batches - {start}` in configure_optimizers, or use mode='batch'."
)
# a length that is both the planned steps left undivided and the unplanned ones over the frequency: either way
# the run steps it planned // frequency times
STEPS_MODE_SCHEDULE_FREQUENCY_REFUSAL = (
    "HardSampleReplay: the per-step {scheduler}, stepped every `frequency`={frequency} optimizer steps, was "
    "built for {length} steps: the run's {planned} planned steps (`estimated_stepping_batches`) read "
    "without dividing by its frequency, or the run's length without step-saving replay over the frequency "
    "({source}). Either way the run steps it {stepped} times: the schedule would stop at {share:.0%} of its "
    "course. Build its length as those {stepped} steps in configure_optimizers (Lightning steps it after each "
    "batch that steps the optimizer whose number in its epoch is a multiple of {frequency}: per epoch, in "
    "batches, so `estimated_stepping_batches // {frequency}` holds them only where each planned epoch's "
    "batches are a multiple of {frequency} and no gradients accumulate), or use mode='batch'."
)
# the way out of STEPS_MODE_SCHEDULE_LENGTH_REFUSAL for a scheduler of `frequency` > 1 that Lightning steps
# fewer times than the planned optimizer steps: its count, in place of `estimated_stepping_batches` (a review
# found both named, and the run built for the planned steps stopped the schedule at 50% with no word)
SCHEDULE_FREQUENCY_WAY_OUT = (
    "With `frequency`={frequency}, Lightning steps it after each batch that steps the optimizer whose number "
    "in its epoch is a multiple of {frequency} (per epoch, in batches under gradient accumulation): {stepped} "
    "times over the {planned} planned steps. Build its length as those {stepped} steps in "
    "configure_optimizers (not `estimated_stepping_batches`, the {planned} optimizer steps), or use "
    "mode='batch'."
)
# a scheduler of `frequency` > 1 that no planned epoch steps: no length of it ends with the run (a length of 0
# raises in OneCycleLR: a review found the refusal advised it)
STEPS_MODE_SCHEDULE_NEVER_STEPPED_REFUSAL = (
    "HardSampleReplay: the per-step {scheduler}, stepped every `frequency`={frequency} optimizer steps, was "
    "built for {length} steps, and Lightning never steps it over the {planned} planned steps: it steps it "
    "after each batch that steps the optimizer whose number in its epoch is a multiple of {frequency} (per "
    "epoch, in batches under gradient accumulation), and the plan's epochs have no such batch, so the "
    "schedule would stay at its start. Step it at `frequency`=1 (its length is then "
    "`self.trainer.estimated_stepping_batches`, the {planned} planned steps), or use mode='batch'."
)
# a per-step scheduler that raises past its end and that the planned run steps more often than its length (the
# plain run would too): refused at fit start rather than crashing mid-run
STEPS_MODE_SCHEDULE_OUTRUN_REFUSAL = (
    "HardSampleReplay: the per-step {scheduler} was built for {length} steps, and the run steps it {stepped} "
    "times over its {planned} planned steps{how}: it would raise past its end mid-run. Build its length as "
    "those {stepped} steps in configure_optimizers, or use mode='batch'."
)
# how Lightning counts the steps of a scheduler of `frequency` > 1, for STEPS_MODE_SCHEDULE_OUTRUN_REFUSAL
SCHEDULE_FREQUENCY_COUNT = (
    " (stepped every `frequency`={frequency} optimizer steps: Lightning steps it after each batch that steps "
    "the optimizer whose number in its epoch is a multiple of {frequency}, per epoch, in batches under "
    "gradient accumulation)"
)
# a resume whose plan is longer than the saved one: the restored scheduler keeps the saved plan's length
STEPS_MODE_RESUMED_SCHEDULE_REFUSAL = (
    "HardSampleReplay: the per-step {scheduler} restored from the checkpoint spans {length} steps, and this "
    "run would step it past its end ({change}); OneCycleLR raises there mid-run. Resume with the callbacks, "
    "max_epochs and max_steps the checkpoint was saved with, or start a new run (its schedule is then built "
    "for the new plan)."
)
STEPS_MODE_LIMIT_REFUSAL = (
    "HardSampleReplay: mode='steps' plans whole epochs of the DataLoader, which `{flag}`={value!r} cuts "
    "short; drop `{flag}` or use mode='batch'."
)
STEPS_MODE_OPTIMIZERS_REFUSAL = (
    "HardSampleReplay: mode='steps' plans one optimizer step per batch, and this module steps {count} optimizers "
    "per batch under manual optimization (trainer.global_step counts each), so the plan would end the run early; "
    "use mode='batch'."
)
STEPS_MODE_RELOAD_REFUSAL = (
    "HardSampleReplay: mode='steps' plans the run on the training DataLoader it finds at fit start, and "
    "`reload_dataloaders_every_n_epochs`={every!r} replaces that DataLoader with one the plan does not drive; "
    "set reload_dataloaders_every_n_epochs=0 or use mode='batch'."
)
# a plain run's mid-epoch checkpoint: Lightning restarts the DataLoader's pass, so which samples of the epoch
# trained is not known, and a plan of the epoch's rest would train some twice and others never
STEPS_MODE_JOINED_MID_EPOCH_REFUSAL = (
    "HardSampleReplay: the checkpoint holds no HardSampleReplay(mode='steps') state, and the fit resumes "
    "at step {step}, {batches} batches into epoch {epoch}. mode='steps' plans the rest of the run's data "
    "from where it goes on, and which samples of a part-trained epoch trained is not known (the checkpoint "
    "was saved mid-epoch, and Lightning restarts the DataLoader's pass). Resume from a checkpoint saved at "
    "an epoch's end (`ModelCheckpoint(save_last=True)`, or `save_on_train_epoch_end=True` where it saves "
    "at validation), or finish this epoch "
    "without HardSampleReplay (resume with `max_epochs={next_epoch}`) and add it from that fit's "
    "checkpoint, or use mode='batch'."
)


# each process plans its own share of the data (a DistributedSampler's), and the checkpoint counts rank 0's: on
# another number of processes a part-trained epoch's rest is not known in this fit's shares (at an epoch's
# start the rest of the run is planned again instead, see StepSavingLoader.follow_world_size)
STEPS_MODE_WORLD_SIZE_REFUSAL = (
    "HardSampleReplay: the checkpoint's mode='steps' plan was made on {saved} process(es) and this fit runs on "
    "{now}; it was saved at step {step}, inside epoch {epoch}. Each process plans its own share of the data, "
    "which {now} process(es) split otherwise, so which samples of epoch {epoch} are left is not known here "
    "(some would train twice, others never). Resume on {saved} process(es), or from a checkpoint saved at a "
    "training epoch's end (`ModelCheckpoint(save_on_train_epoch_end=True)`, which saves there also where "
    "validation does not run every epoch) of a max_epochs run, from which the rest of the run is planned again "
    "for {now} (under `max_steps` Lightning goes on inside the saved epoch by its batch count even from its "
    "end); or use mode='batch' (no plan: it keeps every sample's score)."
)


# the scores are one row per training sample, in both modes: a table of another size is another dataset's
RESUMED_DATA_SIZE_REFUSAL = (
    "HardSampleReplay: the checkpoint's sample scores cover {saved} training samples, and this fit's "
    "training data holds {now}: they were saved for another dataset (mode='batch' keeps the same per-sample "
    "scores, so it does not help). Resume on the data the checkpoint was saved with, or start a new fit (no "
    "`ckpt_path`) from its weights (`YourModule.load_from_checkpoint(path)`), whose scores start afresh."
)


STEPS_MODE_CUT_EPOCH_SCHEDULE_REFUSAL = (
    "HardSampleReplay: {cut}, and the rest of the run, planned again from step {step}, takes {more} more "
    "optimizer steps{given}, where the per-step {scheduler} of {length} steps has {left} left (Lightning also steps "
    "it for each batch that `on_train_batch_start` skips, with no optimizer step): it would be stepped past "
    "its end; "
)
CUT_EPOCH_WAY_OUT_BY_EPOCHS = (
    "use mode='batch' (its schedule then spans whole epochs), or build the scheduler for more steps."
)
CUT_EPOCH_WAY_OUT_BY_STEPS = (
    "build the scheduler for a step more per epoch that `on_train_batch_start` ends early (in either mode)."
)
STEPS_MODE_EMPTY_EPOCH_REFUSAL = (
    "HardSampleReplay: mode='steps' drew no batch from the planned data in epoch {epoch} while steps remain "
    "(global_step={step}, trainer.max_steps={max_steps}), and Lightning would start every following epoch the "
    "same way, without end; stopped here instead. Resume the saved run with a new Trainer and new callbacks "
    "(`Trainer(max_steps=...)`, then `trainer.fit(..., ckpt_path=...)`), or use mode='batch'."
)


def setup_refusal(model_parallel: bool, tuner_search: str | None, fullgraph_part: str | None) -> str | None:
    """Why a fit is refused at setup (completes "HardSampleReplay ..."), else ``None``: a model-parallel
    strategy (FSDP and DeepSpeed cut no batch: they work), a Tuner search (``tuner_search``, its class name) or a
    training_step compiled with ``fullgraph=True`` (``fullgraph_part``, the module's name; at fit start)."""
    if model_parallel:
        return MODEL_PARALLEL_REFUSAL
    if tuner_search is not None:
        return TUNER_REFUSAL.format(search=tuner_search)
    if fullgraph_part is not None:
        return FULLGRAPH_REFUSAL.format(part=fullgraph_part)
    return None


def untrackable_refusal(reason: str) -> str:
    """Why a DataLoader whose dataset indices cannot be tracked is refused (completes "HardSampleReplay ...")."""
    return (
        f"needs the dataset index of every sample, but {reason}. Use a map-style dataset "
        "in a torch DataLoader with its default batch sampler, or remove HardSampleReplay (a batch sampler "
        "feeding contiguous streams to a stateful model cannot be cut anyway)."
    )


#: the reason :func:`several_loaders_refusal` gives when a second DataLoader comes in the same data set-up
SEVERAL_LOADERS = "the fit trains on several DataLoaders at once (a CombinedLoader)"


def loader_refusal(
    loader: Any, second: bool, all_gather: Callable[[Tensor], Tensor] | None = None
) -> str | None:
    """Why a training DataLoader handed over at a data set-up is refused (completes "HardSampleReplay ..."),
    else ``None``: its dataset indices cannot be tracked (:func:`untrackable_refusal`), it is a ``second``
    loader of the same set-up (a CombinedLoader: :data:`SEVERAL_LOADERS`), or, under DDP (``all_gather``
    given: ``tensor -> (world_size, *tensor.shape)``), the ranks' datasets differ
    (:func:`per_rank_data_refusal`). Said before anything is installed."""
    if (reason := SampleIndexTracker.unsupported_reason(loader)) is not None:
        return untrackable_refusal(reason)
    if second:
        return several_loaders_refusal(SEVERAL_LOADERS)
    return None if all_gather is None else per_rank_data_refusal(loader.dataset, all_gather)


def given_loaders_refusal(loaders: Sequence[Any]) -> str | None:
    """Why training DataLoaders known before their data set-up (given to ``fit``) will be refused there
    (completes "HardSampleReplay ..."), else ``None``: :func:`loader_refusal` of each, in the order they are
    handed over (the ranks' datasets are compared at the data set-up). Said before a Trainer setting's
    refusal, whose way out (``mode='batch'``) such a DataLoader refuses too."""
    refusals = (loader_refusal(loader, second=i > 0) for i, loader in enumerate(loaders))
    return next((refusal for refusal in refusals if refusal is not None), None)


def dataset_fingerprint(dataset: Any) -> list[int]:
    """Cheap identity facts of ``dataset``, equal in every process that holds the same data: its length, the
    type names down a chain of ``Subset`` s, those ``Subset`` s' indices (CRC-32) and the innermost length."""
    names, indices_crc, inner = [], 0, dataset
    while True:
        names.append(f"{type(inner).__module__}.{type(inner).__qualname__}")
        if not isinstance(inner, Subset):
            break
        indices_crc = zlib.crc32(np.ascontiguousarray(inner.indices, dtype=np.int64).tobytes(), indices_crc)
        inner = inner.dataset
    return [len(dataset), zlib.crc32("/".join(names).encode()), indices_crc, len(inner)]


#: what each :func:`dataset_fingerprint` entry says, for the refusal
_FINGERPRINT_FACTS = ("lengths", "dataset types", "Subset indices", "lengths of the dataset under the Subset")


def per_rank_data_refusal(dataset: Any, all_gather: Callable[[Tensor], Tensor]) -> str | None:
    """Why a multi-process fit whose ranks train different datasets is refused (completes "HardSampleReplay
    ..."), else ``None``. One all-gather of each rank's :func:`dataset_fingerprint`, so every rank takes the
    same decision. The score table is kept by dataset index and each rank's scored rows are gathered into
    every rank's table: that holds when index ``i`` is the same sample on every rank (one dataset, drawn by a
    ``DistributedSampler`` or any rank-aware sampler), not with a dataset per rank (a ``Subset`` each, or
    another dataset), where a row would mix two ranks' samples (equal lengths) or lie past a shorter dataset's
    table (an ``IndexError`` at the first epoch end). Two datasets of the same length and type, not
    ``Subset`` s or ``Subset`` s with the same indices, cannot be told apart this way."""
    mine = torch.tensor(dataset_fingerprint(dataset), dtype=torch.int64)
    ranks = all_gather(mine).reshape(-1, len(mine)).cpu().tolist()
    differ = [fact for column, fact in enumerate(_FINGERPRINT_FACTS) if len({r[column] for r in ranks}) > 1]
    if not differ:
        return None
    lengths = ", ".join(f"rank {rank}: {facts[0]}" for rank, facts in enumerate(ranks))
    return (
        f"needs one dataset index space shared by the {len(ranks)} processes, but the ranks' training "
        f"datasets differ ({' and '.join(differ)}; lengths {lengths}): its scores are kept by dataset index "
        "and gathered from every rank into one table, so a row would mix different samples or index past a "
        "shorter dataset. Give every rank the same whole dataset and shard it with a sampler (Lightning's "
        "use_distributed_sampler=True, the default, or a rank-aware sampler of your own over the whole "
        "dataset) instead of a Subset or dataset per rank, or train in one process."
    )


def same_samples(previous: Any, current: Any) -> bool | None:
    """Whether ``current`` holds ``previous``'s samples at the same indices: ``True`` when that is certain (the
    same object; a ``TensorDataset`` over the same tensor memory; a ``Subset`` of such with the same
    indices), ``False`` for another length, ``None`` when nothing says."""
    if current is previous:
        return True
    if len(current) != len(previous):
        return False
    if isinstance(current, TensorDataset) and isinstance(previous, TensorDataset):
        pairs = list(zip(current.tensors, previous.tensors))
        same = len(current.tensors) == len(previous.tensors) and all(
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() for a, b in pairs
        )
        return True if same else None
    if isinstance(current, Subset) and isinstance(previous, Subset):
        indices_equal = np.array_equal(np.asarray(current.indices), np.asarray(previous.indices))
        return True if indices_equal and same_samples(previous.dataset, current.dataset) else None
    return None


def reloaded_data_note(previous: Any, current: Any) -> tuple[str | None, bool]:
    """At a reload of the training DataLoader (``reload_dataloaders_every_n_epochs``, batch mode): what to say,
    and whether the scores start again. Scores are kept by dataset index (:func:`same_samples`): kept silently
    for the same samples; kept, with a note of the assumption, for another object of the same length (a
    dataset built anew over the same data, most often); started again for another length. The texts do not
    change from reload to reload, so Python's warning filter says each once. ``previous`` is ``None`` for the
    fit's first DataLoader: nothing to say, nothing to start again."""
    if previous is None:
        return None, False
    same = same_samples(previous, current)
    if same:
        return None, False
    kind = type(current).__name__
    if same is None:
        return (
            f"the reloaded training DataLoader holds another dataset object ({kind}) of the same length. Its "
            "scores are kept by dataset index, which assumes each index still holds the same sample. If "
            "train_dataloader() draws other samples at each reload, return one dataset object from it, or "
            "remove HardSampleReplay.",
            False,
        )
    return (
        f"the reloaded training DataLoader holds a dataset ({kind}) of another length than the one scored. "
        "Scores are kept by dataset index, so they start again at each such reload: batches train in full "
        "until their samples are scored. To select across reloads, keep the training set's length and the "
        "sample at each index.",
        True,
    )


def several_loaders_refusal(reason: str | None) -> str | None:
    """Why a fit on several training DataLoaders is refused (completes "HardSampleReplay ..."); ``None`` without
    a ``reason``. Each loader would get its own index tracker, and none of them describes the combined batch."""
    if reason is None:
        return None
    return (
        f"needs one training DataLoader, but {reason}. Put the datasets in one DataLoader "
        "(torch.utils.data.ConcatDataset), or remove HardSampleReplay."
    )


def parse_half_life(value: int | float | str | None) -> Duration | None:
    """``score_half_life`` as a :class:`~lightning_pulse.phase.Duration` of steps or epochs (``None``: off).

    Raises:
        ValueError: naming ``score_half_life``, for a wall-clock, zero or malformed value.
    """
    if value is None:
        return None
    allowed = "a positive number of steps (int, '500steps') or epochs (float, '2epochs'), or None"
    duration = parse_duration(value, "score_half_life", allowed)  # its messages list only these forms
    if duration.kind == "seconds" or duration.is_zero:
        raise ValueError(f"`score_half_life`={value!r} must be {allowed}.")
    return duration


def half_life_steps(duration: Duration | None, steps_per_epoch: float | None) -> float | None:
    """The half-life in optimizer steps (what :class:`SampleScoreTable` takes).

    Raises:
        ValueError: for a half-life in epochs when the epoch length is unknown (an infinite DataLoader).
    """
    if duration is None or duration.kind == "steps":
        return None if duration is None else duration.amount
    if not steps_per_epoch:
        raise ValueError(
            f"`score_half_life`={duration} is in epochs but the training DataLoader has no length; give it in steps."
        )
    return duration.amount * steps_per_epoch


def epoch_half_life_note(
    half_life: Duration | None, steps_per_epoch: int | None, optimizers: int
) -> str | None:
    """What to tell the user when a module steps its ``optimizers`` itself (manual optimization, several
    optimizers per batch) and ``score_half_life`` is in epochs, else ``None``: an epoch is read as
    ``steps_per_epoch`` optimizer steps, one a batch, but scores age by global steps."""
    if half_life is None or half_life.kind != "epochs":
        return None
    # ages count global steps, which count every optimizer's step: a GAN's two players halve an epoch
    return (
        f"`score_half_life`={half_life.amount:g} epochs is read as {steps_per_epoch} optimizer "
        f"steps an epoch, one a batch, but this module steps its {optimizers} optimizers "
        "itself (manual optimization) and trainer.global_step counts every step: scores age faster by "
        "the steps a batch makes. Give the half-life in steps (`score_half_life='400steps'`)."
    )


def shorter_than_an_epoch(
    planned_steps: float, steps_per_epoch: int | None, mode: str = "batch"
) -> str | None:
    """What to tell the user when a run of ``planned_steps`` optimizer steps ends before any sample trains
    twice (so nothing can be selected), else ``None``. Samples are scored when they train: selecting before a
    sample's first visit would need a second, gradient-free forward of every batch (about a third of a
    training step of the full batch), which the module's own loss computation does not give for free."""
    if not steps_per_epoch or not math.isfinite(planned_steps) or planned_steps > steps_per_epoch:
        return None
    head = (
        f"this run plans {int(planned_steps)} optimizer steps and one epoch is {steps_per_epoch} steps, so no "
        "sample trains twice. A sample is scored when it trains and only scored samples can be selected: "
    )
    if mode == "steps":
        return head + (
            "a light step keeps the first never-scored samples of its window and skips the rest for this epoch, "
            "so it saves the step but chooses no better than a fixed subset. Train for more than one epoch to "
            "select, use mode='batch', or remove HardSampleReplay."
        )
    return head + (
        "no batch will be cut (replay_fraction stays 1.0) and the run costs what it costs without "
        "HardSampleReplay. Train for more than one epoch to select, or remove HardSampleReplay."
    )


def training_monitor_note(
    rule: str, monitors: Callable[[], Sequence[tuple[str, str]]], phases: Sequence[str]
) -> str | None:
    """What to say (completes "HardSampleReplay: ") of a monitor that reads a figure logged in the training
    loop, ``monitors()`` giving ``(the monitor, its key)`` pairs: with ``rule="topk"`` the steps of ``phases``
    train the hardest samples only, so a training loss (accuracy, any metric updated there) is theirs, not the
    data's: it rises when a replay phase starts because the samples are harder, not because the model got
    worse, and falls when it ends. An EarlyStopping, ModelCheckpoint or ``ReduceLROnPlateau`` reads that as a
    plateau or a regression (a held-out pulse run: ``train_loss_epoch`` 0.138 before a replay phase, 0.229 in
    it; ``ReduceLROnPlateau`` on it cut the learning rate 4x, while a plain run trained every epoch at the
    first). ``None`` without such a monitor, and for ``"random"`` (a uniform subset) and ``"infobatch"``
    (weighted to the loaded data's mean), which keep the figure the loaded data's: ``monitors`` is not called
    then."""
    if rule != "topk" or not (found := list(monitors())):
        return None
    names = "; ".join(monitor for monitor, _ in found)
    return (
        f"{names} {'monitors' if len(found) == 1 else 'monitor'} a figure logged in the training loop "
        "(training_step), but HardSampleReplay trains its selecting steps (the phases "
        f"{list(phases)} of a PulseCycle; every step without one) on the hardest samples only (rule='topk'), "
        "so there the figure is theirs, not the data's: it rises when a replay phase starts (harder samples, "
        "not a worse model) and falls when it ends, and the monitor reads that as a plateau or a regression "
        "(a learning-rate cut, an early stop, a best checkpoint missed). Monitor a validation metric instead "
        "(logged in validation_step, e.g. `val_loss`)."
    )


def uncut_batches_refusal(mode: str, config: ReplayConfig, batch_size: int) -> str | None:
    """Why ``mode="batch"`` can never cut the run's batches of ``batch_size`` samples (a cut keeps
    :data:`MIN_COMPOSED` samples or more, and fewer than offered), so that the run would train as without the
    callback and its figures count every sample as selected; with what is needed. ``None`` if it can cut."""
    if mode != "batch" or batch_size < 1:
        return None
    if config.rule == "infobatch":
        if batch_size > MIN_COMPOSED:
            return None
        return (
            f"cannot prune batches of {batch_size} sample(s) with rule='infobatch': a pruned batch keeps at least "
            f"{MIN_COMPOSED} samples, so every batch would train whole and the run would train as without "
            f"HardSampleReplay. Use a batch_size of {MIN_COMPOSED + 1} or more, or rule='topk' with mode='steps'."
        )
    fraction = config.replay_fraction

    def cuts(size: int) -> bool:
        return MIN_COMPOSED <= max(1, round(fraction * size)) < size

    if fraction >= 1 or cuts(batch_size):  # 1.0 trains whole batches on purpose (a control run)
        return None
    needed = next(size for size in itertools.count(batch_size + 1) if cuts(size))  # fraction < 1: exists
    return (
        f"cannot cut batches of {batch_size} sample(s) to replay_fraction={fraction} in mode='batch': a cut "
        f"keeps at least {MIN_COMPOSED} samples and fewer than the batch, so every batch would train whole and "
        f"the run would train as without HardSampleReplay. Use a batch_size of {needed} or more, or "
        "mode='steps' (full batches drawn from wider windows, in fewer steps)."
    )


@dataclass(frozen=True)
class Composition:
    """What a replay step trains on.

    Attributes:
        positions: ``(k,)`` positions into the offered batch, ascending, or ``None`` when the whole batch
            trains (nothing to cut).
        indices: ``(k,)`` dataset indices of the trained samples.
        roles: ``(k,)`` int64 roles (:data:`SELECTED` or :data:`UNSEEN`).
        weights: ``(k,)`` loss weights (InfoBatch), or ``None``.
    """

    positions: Tensor | None
    indices: Tensor
    roles: np.ndarray
    weights: Tensor | None

    def state_dict(self) -> dict[str, Tensor | None]:
        """Tensors only, which a checkpoint loaded with ``weights_only=True`` reads back."""
        weights = self.weights
        return {
            "positions": self.positions,
            "indices": self.indices,
            "roles": torch.from_numpy(self.roles),
        } | ({} if weights is None else {"weights": weights})

    @classmethod
    def from_state(cls, state: dict[str, Tensor | None]) -> Composition:
        roles = torch.as_tensor(state["roles"]).long().numpy()
        return cls(state["positions"], torch.as_tensor(state["indices"]).long(), roles, state.get("weights"))


@dataclass
class BatchPlan:
    """What one training step of a replay run trains, and what it stands for.

    Attributes:
        indices: ``(k,)`` dataset indices of the samples that train.
        roles: ``(k,)`` int64 roles (:data:`UNTOUCHED`, :data:`SELECTED` or :data:`UNSEEN`).
        weights: ``(k,)`` loss weights (InfoBatch), or ``None``.
        positions: positions to cut from the loaded batch (batch mode), or ``None``.
        offered: how many samples of the data the step stands for (for the totals).
        active: whether the step selected.
        selected: whether the batch is a selection (cut here or at the sampler), not the loader's own batch.
    """

    indices: Tensor
    roles: np.ndarray
    weights: Tensor | None
    positions: Tensor | None
    offered: float
    active: bool
    selected: bool

    @property
    def origins(self) -> list[str]:
        """Why each sample is there, by name: ``"untouched"``, ``"selected"`` or ``"unseen"``
        (:data:`ROLE_NAMES`)."""
        return [ROLE_NAMES[r] for r in self.roles]


class _Measured:
    """One training step's measurement, kept until it is applied to the table."""

    __slots__ = ("indices", "losses", "roles", "step", "threshold", "active", "offered", "shared")

    def __init__(
        self,
        indices: Tensor,
        losses: LossCapture | Tensor | np.ndarray,
        roles: np.ndarray,
        step: int,
        threshold: float,
        active: bool,
        offered: float,
        shared: bool = False,
    ) -> None:
        self.indices = indices
        self.losses = losses  # a capture (read when applied), or (B,) losses
        self.roles = roles
        self.step = step
        self.threshold = threshold
        self.active = active
        self.offered = offered
        self.shared = shared  # rows of every rank (indices may repeat: DistributedSampler's padding)


def host_losses(parts: Sequence[LossCapture | Tensor | np.ndarray]) -> np.ndarray:
    """The per-sample losses of several steps as one float32 host array, with one device transfer."""
    if parts and all(isinstance(part, LossCapture) for part in parts):
        joined = concat_per_sample(list(parts))  # type: ignore[arg-type]
        if joined is not None:
            return joined
    values = [part.per_sample() if isinstance(part, LossCapture) else part for part in parts]
    on_device = [v for v in values if isinstance(v, torch.Tensor) and not v.is_cpu]
    if on_device:
        device = on_device[0].device
        joined = torch.cat([torch.as_tensor(v).to(device).float().flatten() for v in values])
        return joined.cpu().numpy()
    arrays = [
        v.detach().float().numpy().reshape(-1)
        if isinstance(v, torch.Tensor)
        else np.asarray(v, dtype=np.float32).reshape(-1)
        for v in values
    ]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def gather_rows(
    all_gather: Callable[[Tensor], Tensor],
    indices: Tensor,
    losses: Tensor,
    roles: np.ndarray,
    offered: float,
) -> tuple[Tensor, Tensor, np.ndarray, float]:
    """Every rank's ``(index, loss, role)`` rows in rank order, identical on every rank, and the summed offered
    batch size.

    Args:
        all_gather: ``tensor -> (world_size, *tensor.shape)`` stacked over ranks (e.g. a Lightning strategy's
            ``all_gather``, a ``torch.distributed`` wrapper, or ``lambda t: t[None]`` for one process).
        indices: ``(k,)`` this rank's dataset indices; losses ``(k,)``; roles ``(k,)``.
    """
    return gather_rows_and_codes(all_gather, indices, losses, roles, offered, None)[:4]


def gather_rows_and_codes(
    all_gather: Callable[[Tensor], Tensor],
    indices: Tensor,
    losses: Tensor,
    roles: np.ndarray,
    offered: float,
    code: int | None = 0,
) -> tuple[Tensor, Tensor, np.ndarray, float, list[int]]:
    """:func:`gather_rows`, and every rank's ``code`` in rank order, sent with the row counts the gather
    exchanges anyway: what a caller's ranks vote on at every step costs no collective of its own (``None``:
    no code is sent, and none comes back)."""
    sent = [float(losses.numel()), float(offered)] + ([] if code is None else [float(code)])
    gathered_sizes = all_gather(torch.tensor(sent, dtype=torch.float64)).cpu().reshape(-1, len(sent))
    counts = [int(n) for n in gathered_sizes[:, 0].tolist()]
    capacity = max(counts)
    rows = torch.full((capacity, 3), math.nan, dtype=torch.float64)  # ranks' batches may differ in size
    rows[: losses.numel(), 0] = indices.double()
    rows[: losses.numel(), 1] = losses.double()
    rows[: losses.numel(), 2] = torch.from_numpy(roles).double()
    gathered = all_gather(rows).cpu().reshape(len(counts), capacity, 3)  # no row on any rank: capacity 0
    merged = torch.cat([gathered[rank, :n] for rank, n in enumerate(counts)])
    return (
        merged[:, 0].long(),
        merged[:, 1].float(),
        merged[:, 2].long().numpy(),
        float(gathered_sizes[:, 1].sum()),
        [] if code is None else [int(c) for c in gathered_sizes[:, 2].tolist()],
    )


def mix_seed(seed: int, step: int, batch_idx: int, rank: int) -> int:
    """One seed per (seed, step, batch, rank): a resumed run draws what the uninterrupted one would have."""
    return (seed * 1_000_003 + step * 10_007 + (batch_idx + 1) * 101 + rank) % (2**63 - 1)


# running totals are one float64 vector: steps, active steps, offered and trained samples, the selected
# samples recorded with no finite loss (a step whose loss did not split into its samples: in no role), then
# the count and the loss sum of each role
TOTAL_NAMES = (
    "steps",
    "active_steps",
    "offered",
    "trained",
    "selected_unrecorded",
    *(f"{name}_count" for name in ROLE_NAMES),
    *(f"{name}_loss" for name in ROLE_NAMES),
    # active steps that trained their batch whole with no choice made (steps mode's light step whose window
    # held no more samples than the batch: full-batch training)
    "unchosen_steps",
)
_STEPS, _ACTIVE_STEPS, _OFFERED, _TRAINED, _SELECTED_UNRECORDED = range(5)
_COUNTS = slice(5, 5 + len(ROLE_NAMES))
_SUMS = slice(5 + len(ROLE_NAMES), 5 + 2 * len(ROLE_NAMES))
_UNCHOSEN_STEPS = 5 + 2 * len(ROLE_NAMES)


def _figures(vector: np.ndarray) -> dict[str, float]:
    totals = dict(zip(TOTAL_NAMES, vector.tolist()))

    def mean(names: Sequence[str]) -> float:
        count = sum(totals[f"{n}_count"] for n in names)
        return sum(totals[f"{n}_loss"] for n in names) / count if count else math.nan

    return {
        "replay_fraction": totals["trained"] / totals["offered"] if totals["offered"] else math.nan,
        "active_share": totals["active_steps"] / totals["steps"] if totals["steps"] else math.nan,
        "loss_replayed": mean(("selected",)),
        "loss_fresh": mean(("untouched", "unseen")),
    }


class HardSampleSelector:
    """Chooses hard samples from a score table and keeps the table up to date.

    Args:
        table: the per-sample scores (its ``half_life`` sets the staleness).
        config: the rule and its parameters.

    Attributes:
        threshold_every: how many steps a hardness threshold is reused (it scans the whole table).
        apply_every: how many measured steps are kept before they are applied together.
    """

    def __init__(self, table: SampleScoreTable, config: ReplayConfig | None = None) -> None:
        self.table = table
        self.config = config or ReplayConfig()
        self.threshold_every = 1
        self.apply_every = APPLY_EVERY
        self.log_every = APPLY_EVERY  # the metrics window's steps (set_cadence); 0: a window per epoch
        self._threshold = (math.nan, -1)  # (value, step it was computed at)
        self._applied_since_threshold = False  # a NaN threshold (nothing scored yet) is redone after an apply
        self._unapplied: list[_Measured] = []
        self._totals = np.zeros(len(TOTAL_NAMES))
        self._window = np.zeros(len(TOTAL_NAMES))
        self._window_steps = 0  # _window's step count as an int: read every step, changed only at an apply

    @classmethod
    def for_data(
        cls,
        current: HardSampleSelector | None,
        num_samples: int,
        new_table: Callable[[int], SampleScoreTable],
        config: ReplayConfig,
        restored: dict[str, Any] | None = None,
    ) -> HardSampleSelector:
        """The selector for training data of ``num_samples`` samples (a DataLoader was built): ``current`` while
        its table has that many rows, else a new one on ``new_table(num_samples)``. Steps measured but not yet
        applied are dropped, and ``restored``, a checkpoint's state that came before the data, is loaded.

        Raises:
            PulseRefusal: when ``restored`` holds the scores of a dataset of another size.
        """
        if current is None or current.table.num_samples != num_samples:
            current = cls(new_table(num_samples), config)
        current.drop_pending()
        if restored is not None:
            scores = (restored.get("table") or {}).get("scores")
            if scores is not None and scores.numel() != num_samples:
                raise PulseRefusal(RESUMED_DATA_SIZE_REFUSAL.format(saved=scores.numel(), now=num_samples))
            current.load_state_dict(restored)
        return current

    @property
    def threshold(self) -> float:
        """The score above which a sample counts as hard (``NaN`` before anything was scored)."""
        return self._threshold[0]

    def set_half_life(self, half_life: Duration | None, steps_per_epoch: int | None) -> None:
        """Age the table's scores by ``half_life`` (``score_half_life``, parsed: steps, or epochs of
        ``steps_per_epoch`` optimizer steps; ``None``: no ageing).

        Raises:
            ValueError: for a half-life in epochs when the epoch length is unknown (an infinite DataLoader).
        """
        self.table.half_life = half_life_steps(half_life, steps_per_epoch)

    def set_threshold_every(self, steps_per_epoch: int | None) -> None:
        """Refresh the threshold twice per epoch of ``steps_per_epoch`` optimizer steps (every 50 steps for an
        epoch of unknown length)."""
        self.threshold_every = max(1, steps_per_epoch // 2) if steps_per_epoch else 50

    def set_cadence(self, steps_per_epoch: int | None, log_every: int) -> None:
        """Refresh the threshold twice per epoch (it scans every score) and apply measured steps as often as
        logging needs (a setting, not whether a logger is attached, so attaching one never changes what is
        selected); start a new metrics window. ``log_every`` 0 is Lightning's ``log_every_n_steps=0``: no
        step-level rows, so a window per epoch (:meth:`window_due`)."""
        self.set_threshold_every(steps_per_epoch)
        self.apply_every = min(APPLY_EVERY, log_every) if log_every > 0 else APPLY_EVERY
        self.log_every = log_every
        self.take_window()

    @property
    def totals(self) -> dict[str, float]:
        """The applied steps' running totals by name (:data:`TOTAL_NAMES`), e.g. ``selected_count``."""
        return dict(zip(TOTAL_NAMES, self._totals.tolist()))

    def nothing_selected(self) -> str | None:
        """A note when steps were in a replay phase but not one sample was counted as selected in them, else
        ``None``. It says why, from the totals: the samples were never scored (they all trained, or only they
        did), the steps had nothing to choose from (steps mode's windows no wider than their batch, as in
        full-batch training), or the steps' losses were not recorded, so whatever they selected is counted in
        no role."""
        totals = self.totals
        if not totals["active_steps"] or totals["selected_count"]:
            return None
        steps, offered, trained = (int(totals[name]) for name in ("active_steps", "offered", "trained"))
        if totals["selected_unrecorded"]:
            return (
                f"no selected sample was counted in this run. {steps} steps were in a replay phase and "
                f"trained {trained} of the {offered} samples offered to them, but the "
                f"{int(totals['selected_unrecorded'])} selected among them have no loss recorded (a step "
                "whose loss does not split into its batch's samples is recorded without scores, "
                "`HardSampleReplay.batches.unscored_steps` counts such steps; a loss that is not finite is "
                "not counted): they count in no role, and their scores were not updated."
            )
        if trained == offered and totals["unchosen_steps"] == steps:
            # a held-out sweep: a full-batch PINN's end said "none of their samples had a score yet", though
            # every sample was scored at every step
            return (
                f"nothing was selected in this run. {steps} steps were in a replay phase, but none had more "
                "samples to choose from than it trains: in mode='steps' a light step chooses from a window of "
                "batch_size / replay_fraction samples that ends at its epoch's end, and here no window held "
                "more samples than its batch (as in full-batch training, where an epoch is one batch), so every "
                "step trained its batch whole. Use mode='batch', which cuts each batch to its hardest samples, or a smaller "
                "batch_size."
            )
        if trained < offered:
            return (
                f"nothing was selected in this run. {steps} steps were in a replay phase and trained "
                f"{trained} of the {offered} samples offered to them: only samples that had no score yet (a "
                "sample is scored when it first trains), which are kept first; the scored ones were left out."
            )
        return (
            f"nothing was selected in this run. {steps} steps were in a replay phase, but none of their "
            "samples had a score yet (a sample is scored when it first trains), so all of them trained."
        )

    def end_run(self) -> str | None:
        """The run is over: apply the kept steps, then return :meth:`nothing_selected`'s note."""
        self.apply()
        return self.nothing_selected()

    @property
    def window_steps(self) -> int:
        """Applied steps since the last :meth:`take_window`."""
        return self._window_steps

    def window_due(self, epoch_end: bool = False) -> bool:
        """Whether the metrics window is due to the loggers: it holds ``log_every`` applied steps
        (:meth:`set_cadence`), or, with no step-level rows (``log_every`` 0), any at an ``epoch_end``."""
        if self.log_every > 0:
            return self._window_steps >= self.log_every
        return epoch_end and self._window_steps > 0

    # ------------------------------------------------------------------ selection
    def _select(
        self, scores: Tensor | np.ndarray, count: int, step: int, generator: torch.Generator | None
    ) -> Selection:
        rule = self.config.rule
        if rule == "topk":
            return select_topk(scores, count)
        if rule == "random":
            return select_random(scores, count, generator)
        return infobatch_prune(scores, self.current_threshold(step), self.config.prune_ratio, generator)

    def compose(self, indices: Tensor, step: int, batch_idx: int, rank: int = 0) -> Composition:
        """The samples of the batch holding dataset ``indices`` ``(B,)`` to train on at ``step`` (batch mode).

        Never-scored samples are always kept; top-k draws nothing, the other rules draw from a generator
        seeded by ``(seed, step, batch_idx, rank)``.
        """
        offered = int(indices.numel())
        generator = None
        if self.config.rule != "topk":
            generator = torch.Generator().manual_seed(mix_seed(self.config.seed, step, batch_idx, rank))
        budget = max(1, round(self.config.replay_fraction * offered))
        scores = self.table.effective_array(indices, step)  # arrays throughout: each tensor wrap costs a call
        selection = self._select(scores, budget, step, generator)
        if selection.count < min(
            MIN_COMPOSED, offered
        ):  # the short last batch of an epoch, cut to one sample
            selection = Selection(torch.arange(offered), None, selection.threshold)
        roles = np.where(np.isnan(scores[selection.positions.numpy()]), UNSEEN, SELECTED)
        weights, kept_all = selection.weights, selection.count == offered
        # nothing pruned: leave the module's loss exactly as it is. Weights of 1 on a pruned step are still
        # needed: (1/q)(k/n) is 1 when k/n == q, and a "sum" loss gets 1/q only through them
        if weights is not None and kept_all and bool((weights == 1).all()):
            weights = None
        positions = None if kept_all else selection.positions
        return Composition(positions, indices[selection.positions], roles, weights)

    def plan_batch(
        self,
        mode: str,
        indices: Tensor,
        active: bool,
        step: int,
        batch_idx: int,
        rank: int = 0,
        cut: Composition | None = None,
        window: int = 0,
    ) -> BatchPlan:
        """The step's :class:`BatchPlan` for a loaded batch of dataset ``indices``, in a selecting phase when
        ``active``. ``cut`` is steps mode's choice at the sampler (of a ``window`` of indices), already loaded."""
        offered = int(indices.numel())
        if cut is not None:
            return BatchPlan(cut.indices, cut.roles, None, None, float(window), True, True)
        if active and mode == "batch":
            pick = self.compose(indices, step, batch_idx, rank)
            chosen = pick.positions is not None
            return BatchPlan(
                pick.indices, pick.roles, pick.weights, pick.positions, float(offered), True, chosen
            )
        return BatchPlan(indices, np.full(offered, UNTOUCHED), None, None, float(offered), active, False)

    def choose_windows(
        self,
        windows: Sequence[Sequence[int]],
        keep: int,
        steps: Sequence[int],
        ordinals: Sequence[int],
        prior: float,
        rank: int = 0,
    ) -> list[Composition]:
        """Step-saving replay at the sampler: for each light step's ``window`` of dataset indices, the ``keep``
        samples to load and train, chosen before any is loaded (never-scored ones first, then the rule's choice;
        in window order).

        ``steps[i]`` is the optimizer step window ``i`` will train at and ``prior`` the score prior at its
        pass's start, so the choice does not depend on how far ahead the DataLoader reads: within a pass no
        window sample is rescored (each sample comes once per pass), or, for a sampler that may draw a sample
        twice, the table reads the pass's samples as they stood at its start
        (:meth:`~lightning_pulse.core.sample_scores.SampleScoreTable.begin_pass`). One call chooses a whole
        pass, so top-k is a handful of array operations per pass rather than per step.
        """
        if not windows:
            return []
        sizes = np.fromiter((len(w) for w in windows), dtype=np.int64, count=len(windows))
        slots = np.fromiter((i for w in windows for i in w), dtype=np.int64, count=int(sizes.sum()))
        at_step = np.repeat(np.asarray(steps, dtype=np.int64), sizes)
        scores = self.table.pass_start_array(slots, at_step, prior)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        if self.config.rule != "topk":
            chosen = []
            for i, (step, ordinal) in enumerate(zip(steps, ordinals)):
                part = slice(int(offsets[i]), int(offsets[i + 1]))
                generator = torch.Generator().manual_seed(mix_seed(self.config.seed, step, ordinal, rank))
                count = min(keep, int(sizes[i]))
                chosen.append(
                    self._compose_exactly(torch.from_numpy(slots[part]), scores[part], count, step, generator)
                )
            return chosen
        # top-k: never-scored first (+inf), then the highest scores, ties to the earlier position; windows of one
        # size are sorted together as the rows of a matrix
        key = np.where(np.isnan(scores), np.inf, scores)
        chosen: list[Composition] = [None] * len(windows)  # type: ignore[list-item]  # every row is filled below
        for size in np.unique(sizes):
            rows = np.flatnonzero(sizes == size)
            block = offsets[rows][:, None] + np.arange(size)[None, :]
            count = min(keep, int(size))
            order = np.sort(np.argsort(-key[block], axis=1, kind="stable")[:, :count], axis=1)
            for row, window_slots, positions in zip(rows, block, order):
                at = window_slots[positions]  # positions into the pass's flat arrays
                roles = np.where(np.isnan(scores[at]), UNSEEN, SELECTED)
                chosen[row] = Composition(
                    torch.from_numpy(positions), torch.from_numpy(slots[at]), roles, None
                )
        return chosen

    def _compose_exactly(
        self, indices: Tensor, scores: np.ndarray, count: int, step: int, generator: torch.Generator | None
    ) -> Composition:
        unseen = np.flatnonzero(np.isnan(scores))
        if unseen.size >= count:
            positions = unseen[:count]
        else:
            seen = np.flatnonzero(~np.isnan(scores))
            chosen = self._select(scores[seen], count - unseen.size, step, generator)
            positions = np.sort(np.concatenate([unseen, seen[chosen.positions.numpy()]]))
        roles = np.where(np.isnan(scores[positions]), UNSEEN, SELECTED)
        kept = torch.from_numpy(positions.astype(np.int64, copy=False))
        return Composition(None if kept.numel() == indices.numel() else kept, indices[kept], roles, None)

    def current_threshold(self, step: int) -> float:
        """The hardness threshold at ``step``: the mean score (InfoBatch) or the ``1 - replay_fraction``
        quantile; refreshed every ``threshold_every`` steps."""
        value, computed_at = self._threshold
        if (
            computed_at >= 0
            and step - computed_at < self.threshold_every
            and not (math.isnan(value) and self._applied_since_threshold)
        ):
            return value
        self.apply()
        self._applied_since_threshold = False
        if self.config.rule == "infobatch":
            value = self.table.mean_score(step)
        else:
            value = self.table.quantile_score(1.0 - self.config.replay_fraction, step)
        self._threshold = (value, step)
        return value

    # ------------------------------------------------------------------ measurements
    def record(
        self,
        indices: Tensor,
        losses: LossCapture | Tensor,
        roles: np.ndarray,
        step: int,
        active: bool,
        offered: float,
        all_gather: Callable[[Tensor], Tensor] | None = None,
        refusal: int = 0,
    ) -> list[int]:
        """Keep a step's measurement: the trained samples' ``indices`` ``(k,)``, their ``losses`` (a capture,
        read when applied, or a ``(k,)`` tensor), ``roles``, whether the step selected (``active``) and how
        many samples were offered. With ``all_gather`` (data parallel), every rank's rows are kept, and every
        rank's ``refusal`` (a caller's code, 0 for none) returned, in rank order (``[]`` without)."""
        entry = _Measured(indices, losses, roles, step, self.current_threshold(step), active, float(offered))
        codes: list[int] = []
        if all_gather is not None:
            local = torch.from_numpy(host_losses([losses]))
            entry.indices, entry.losses, entry.roles, entry.offered, codes = gather_rows_and_codes(
                all_gather, indices, local, roles, offered, refusal
            )
            entry.shared = True
        self._unapplied.append(entry)
        if len(self._unapplied) >= self.apply_every:
            self.apply()
        return codes

    def apply(self) -> None:
        """Apply the kept steps' losses to the table (one vectorized update) and to the running totals."""
        pending = self._unapplied
        if not pending:
            return
        self._unapplied = []
        losses = host_losses([entry.losses for entry in pending])
        roles = np.concatenate([entry.roles for entry in pending])
        sizes = np.fromiter((entry.roles.size for entry in pending), dtype=np.int64, count=len(pending))
        indices = np.concatenate([entry.indices.numpy() for entry in pending])
        hard = None
        if any(entry.active for entry in pending):
            hard = np.repeat([entry.active for entry in pending], sizes) & (roles == SELECTED)
        if any(entry.shared for entry in pending):  # data parallel: repeated padding samples merge per step
            for entry, start, size in zip(pending, np.cumsum(sizes) - sizes, sizes):
                part = slice(int(start), int(start + size))
                self.table.update(indices[part], losses[part], entry.step, entry.threshold, may_repeat=True)
                if hard is not None and hard[part].any():
                    self.table.mark_replayed(indices[part][hard[part]], may_repeat=True)
        else:
            steps = [entry.step for entry in pending]
            thresholds = [entry.threshold for entry in pending]
            self.table.update_steps(indices, losses, sizes, steps, thresholds, replayed=hard)
        self._count(pending, losses, roles)
        self._applied_since_threshold = True

    def apply_measured_before(self, step: int) -> None:
        """Apply the kept steps if one was measured before ``step``, the start of a pass: a rollback to a
        snapshot older than the pass brings back steps that the epoch end had applied before the pass chose
        (the next epoch selects from every score of this one)."""
        if any(entry.step < step for entry in self._unapplied):
            self.apply()

    def drop_pending(self) -> None:
        """Forget measured steps not yet applied (a rollback replaces the model they were measured on)."""
        self._unapplied = []

    def _count(self, pending: list[_Measured], losses: np.ndarray, roles: np.ndarray) -> None:
        step = np.zeros(len(TOTAL_NAMES))
        # a step training_step skipped (it returned None) is recorded with no rows: no step of the replay
        step[_STEPS] = sum(entry.roles.size > 0 for entry in pending)
        step[_ACTIVE_STEPS] = sum(entry.active for entry in pending)
        step[_OFFERED] = sum(entry.offered for entry in pending if entry.active)
        step[_TRAINED] = sum(entry.roles.size for entry in pending if entry.active)
        step[_UNCHOSEN_STEPS] = sum(
            entry.active and entry.roles.size > 0 and bool((entry.roles == UNTOUCHED).all())
            for entry in pending
        )
        finite = np.isfinite(losses)
        if not finite.all():
            step[_SELECTED_UNRECORDED] = np.count_nonzero((roles == SELECTED) & ~finite)
            roles, losses = roles[finite], losses[finite]
        step[_COUNTS] = np.bincount(roles, minlength=len(ROLE_NAMES))
        step[_SUMS] = np.bincount(roles, weights=losses, minlength=len(ROLE_NAMES))
        self._totals += step
        self._window += step
        self._window_steps += len(pending)

    # ------------------------------------------------------------------ figures
    def _with_table(self, figures: dict[str, float]) -> dict[str, float]:
        figures.update(self.table.stats())
        figures["threshold"] = self.threshold
        return figures

    def metrics(self) -> dict[str, float]:
        """Totals of the applied steps: replay fraction, active share, losses by role, table size and reuse."""
        return self._with_table(_figures(self._totals))

    def take_window(self) -> dict[str, float]:
        """The same figures over the steps applied since the last call, which starts a new window."""
        figures = self._with_table(_figures(self._window))
        self._window = np.zeros(len(TOTAL_NAMES))
        self._window_steps = 0
        return figures

    def window_metrics(self) -> dict[str, float]:
        """:meth:`take_window` as a logger takes it: the figures that have a value, under
        ``hard_sample_replay/``."""
        return {f"hard_sample_replay/{k}": v for k, v in self.take_window().items() if not math.isnan(v)}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "table": self.table.state_dict(),
            "unapplied": _unapplied_state(self._unapplied),
            "totals": dict(zip(TOTAL_NAMES, self._totals.tolist())),
            "threshold": list(self._threshold),
            # a NaN threshold is redone at the next step after an apply; without it a resume waits
            # `threshold_every` steps and its figures part from the uninterrupted run's
            "applied_since_threshold": self._applied_since_threshold,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("table") is None:
            raise ValueError("HardSampleSelector: the state holds no score table.")
        self.table.load_state_dict(state["table"])
        self._unapplied = _unapplied_from_state(state.get("unapplied"))
        saved = state.get("totals", {})
        self._totals = np.array([float(saved.get(name, 0.0)) for name in TOTAL_NAMES])
        value, step = state.get("threshold", (math.nan, -1))
        self._threshold = (float(value), int(step))
        self._applied_since_threshold = bool(state.get("applied_since_threshold", False))  # older: absent


def _unapplied_state(unapplied: list[_Measured]) -> dict[str, Any] | None:
    """The measured steps not yet applied, as tensors and lists (reading them changes nothing)."""
    if not unapplied:
        return None
    return {
        "indices": torch.cat([entry.indices for entry in unapplied]).clone(),
        "losses": torch.from_numpy(host_losses([entry.losses for entry in unapplied]).copy()),
        "roles": torch.from_numpy(np.concatenate([entry.roles for entry in unapplied])),
        "sizes": [int(entry.roles.size) for entry in unapplied],
        "steps": [entry.step for entry in unapplied],
        "thresholds": [entry.threshold for entry in unapplied],
        "active": [entry.active for entry in unapplied],
        "offered": [entry.offered for entry in unapplied],
        "shared": [entry.shared for entry in unapplied],
    }


def _unapplied_from_state(state: dict[str, Any] | None) -> list[_Measured]:
    if not state:
        return []
    entries, start = [], 0
    losses = torch.as_tensor(state["losses"]).float()
    roles = torch.as_tensor(state["roles"]).long().numpy()
    indices = torch.as_tensor(state["indices"]).long()
    for position, size in enumerate(state["sizes"]):
        part = slice(start, start + size)
        entries.append(
            _Measured(
                indices[part].clone(),
                losses[part].clone(),
                roles[part].copy(),
                int(state["steps"][position]),
                float(state["thresholds"][position]),
                bool(state["active"][position]),
                float(state["offered"][position]),
                bool(state["shared"][position]),
            )
        )
        start += size
    return entries
