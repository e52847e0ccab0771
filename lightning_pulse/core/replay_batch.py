"""One training step of hard-sample replay, from the loaded batch to its recorded losses. No trainer.

:class:`ReplayBatchLifecycle` is what :class:`~lightning_pulse.HardSampleReplay`'s batch hooks call, for a
:class:`~lightning_pulse.core.replay.HardSampleSelector`:

1. :meth:`~ReplayBatchLifecycle.start_batch`, before the step: plan the batch
   (:meth:`~lightning_pulse.core.replay.HardSampleSelector.plan_batch`), cut it in place in batch mode and open
   the step's loss capture;
2. :meth:`~ReplayBatchLifecycle.close_capture`, before backward: what runs after it is not the step's loss;
3. :meth:`~ReplayBatchLifecycle.finish_batch`, after the step: take the per-sample losses (captured, or from a
   :class:`~lightning_pulse.core.per_sample_loss.PerSampleScorer`) and record them into the selector
   (:meth:`~ReplayBatchLifecycle.finish_trained_step` does it earlier for a checkpoint saved before the batch
   end, after the update);
4. :meth:`~ReplayBatchLifecycle.check_carried_state`: over a fit's first two batches, refuse a module that
   carries state from one batch to the next (:class:`~lightning_pulse.core.carried_state.CarriedStateCheck`).

The caller passes in what only the training loop knows: the optimizer step, whether the phase selects, the
rank, steps mode's window and cut from the sampler and, under data parallelism, an ``all_gather`` (batch
mode's vote on a per-sample pairwise tensor before a step gathers through ``torch.distributed`` itself).

Example::

    batches = ReplayBatchLifecycle()
    batches.start_fit()
    for step, (indices, batch) in enumerate(indexed_batches):   # indices: (B,) dataset indices of a list batch
        batches.start_batch(selector, batch, indices, step, batch_idx=step, active=True, module=model)
        loss = F.cross_entropy(model(batch[0]), batch[1])       # batch was cut in place; the capture sees this
        batches.close_capture()
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        batches.check_carried_state(model, batches.finish_batch(model, batch, outputs=loss))
    batches.release()
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pulse.core.carried_state import BURST_FIRST, CarriedStateCheck
from lightning_pulse.core.loss_direction import loss_directions, maximizes_loss
from lightning_pulse.core.loss_layout import sample_dimension_refusal
from lightning_pulse.core.per_sample_loss import (
    ForwardLossScorer,
    LossCapture,
    OutputKeyScorer,
    PerSampleScorer,
    StepLossCaptures,
    time_major_refusal,
)
from lightning_pulse.core.replay import BatchPlan, Composition, HardSampleSelector
from lightning_pulse.core.sample_index import (
    KEEP_ONE_ROW_PER_INDEX,
    SCORE_PACKED_ROWS,
    rows_short_of_indices,
    unmatched_rows,
    unmatched_rows_cause,
)
from lightning_pulse.core.selection import (
    PairwiseWatch,
    assign_in_place,
    concatenated_parts,
    concatenation_refusal,
    cut_refusal,
    joined_rows,
    joined_rows_refusal,
    pairwise_elsewhere_reason,
    square_parts,
    take_samples,
    time_major_later_refusal,
    whole_parts,
)
from lightning_pulse.errors import PulseRefusal

#: How many of a fit's first steps have their captured losses checked for per-sample coefficients of both
#: signs (:meth:`~lightning_pulse.core.per_sample_loss.LossCapture.signed_coefficients`): a step whose
#: coefficients are all 0 (equal rewards) shows none, so more than one. Under data parallelism the ranks
#: vote on each of them (one one-element ``all_gather`` each), so that every rank refuses or none does.
SIGN_CHECKED_STEPS = 3

#: Why a step's captured loss cannot score its samples when its coefficients have both signs (completes the
#: refusal after what was found; :meth:`ReplayBatchLifecycle.finish_batch`).
_SIGNED_WAYS_OUT = (
    "per-sample coefficients of both signs that do not follow the samples' losses (an element the step "
    "pushes up has a higher loss than one it pushes down: policy-gradient advantages, "
    "`(F.cross_entropy(logits, actions, reduction='none') * advantage).mean()`; a variance penalty across "
    "groups; a PU loss that subtracts a loss on the positives), and an unweighted per-sample loss does not "
    "rank how hard a sample is then: a sample whose term the step pushes up would score as one it pushes "
    "down. Set `scorer=` to a PerSampleScorer returning each sample's own term, e.g. "
    "lightning_pulse.core.per_sample_loss.OutputKeyScorer(key='per_sample_loss') with training_step "
    "returning {'loss': loss, 'per_sample_loss': (ce * advantage).detach()}, or use rule='random', which "
    "reads no score."
)

#: Why HardSampleReplay cannot score a run whose parameter groups mix ``maximize=True`` and ``False`` from its
#: captured losses, and the ways out (:func:`~lightning_pulse.core.loss_direction.maximizes_loss`).
_MIXED_DIRECTIONS = (
    "a sample's loss says no one thing about how hard it is: a high loss is hard for the groups that descend "
    "it and easy for those that ascend it"
)
_MIXED_WAYS_OUT = (
    "set `scorer=` to a PerSampleScorer returning each sample's hardness (read as given, the highest the "
    "hardest), use rule='random', which reads no score, or remove HardSampleReplay from the callbacks"
)


# what a rank votes at a batch's start or a step's end: no refusal, a pairwise one (its message says where
# it was found), another found before the step or at its end, one of carried state (raised after the step is
# logged: check_carried_state)
_PAIRWISE, _OTHER, _CARRIED = 1, 2, 3


def refuse(reason: str | None) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` for ``reason`` (it completes "HardSampleReplay ..."),
    if there is one."""
    if reason is not None:
        raise PulseRefusal(f"HardSampleReplay {reason}")


def scorer_refusal(scorer: PerSampleScorer, error: Exception) -> str:
    """Why HardSampleReplay refuses ``scorer``, which raised ``error`` on the fit's first batch, with the way
    out for its kind (completes "HardSampleReplay ...", one line)."""
    name = type(scorer).__name__
    raised = (str(error).splitlines() or [""])[0][:400].rstrip()
    raised += "" if raised.endswith((".", "!", "?")) else "."
    if isinstance(scorer, ForwardLossScorer):
        why = (
            f"It calls `pl_module(batch[{scorer.input!r}])` with that one input, which a module needing more "
            "(an encoder-decoder's decoder input or labels, as T5) cannot run on. Return per-sample losses from "
            "training_step and set `scorer=OutputKeyScorer(key=...)`, subclass PerSampleScorer, or drop "
            "`scorer` to capture the module's own loss."
        )
    elif isinstance(scorer, OutputKeyScorer):
        why = (
            f"Return the per-sample losses from training_step under that key (`{{'loss': loss, {scorer.key!r}: "
            "per_sample.detach()}`, a "
            "`(B,)` tensor), or drop `scorer` to capture the module's own loss (a torch.nn.functional loss)."
        )
    else:
        why = (
            "Fix the scorer (called as `scorer(pl_module, batch, outputs, batch_size)` after training_step), "
            "or drop `scorer` to capture the module's own loss."
        )
    return (
        f"cannot score this module's samples with its scorer {name}: tried on the fit's first batch, it "
        f"raised {type(error).__name__}: {raised} {why}"
    )


@dataclass
class StepInFlight:
    """The step between its batch's start and end.

    Attributes:
        selector: the selector that planned it and records it.
        plan: what it trains (indices, roles) and what it stands for (offered, active).
        step: the optimizer step it trains at.
        batch_size: ``B``, the dataset indices of the batch as loaded, before a cut in batch mode (the
            carried-state check's size).
        window: steps mode's window the sampler cut the batch from, ``0`` otherwise.
        batch_idx: the batch's place in its epoch.
        rows_unmatched: its batch holds another number of rows than ``batch_size`` (a collate_fn dropped
            samples): recorded without scores, and none of the fit's first-batch checks judges by it.
    """

    selector: HardSampleSelector
    plan: BatchPlan
    step: int
    batch_size: int
    window: int
    batch_idx: int = 0
    rows_unmatched: bool = False

    @property
    def offered_count(self) -> int:
        """How many samples the data offered: the sampler's window in steps mode, else the loaded batch."""
        return int(self.window or self.batch_size)


class ReplayBatchLifecycle:
    """What happens to each training batch of a replay run (see the module docstring).

    Args:
        mode: ``"steps"`` or ``"batch"`` (:data:`~lightning_pulse.core.replay.MODES`): how a light step trains.
        scorer: computes the per-sample losses instead of the capture; ``None`` captures the module's own loss.
        hold: keeps what the DDP vote hands to a collective until the backend lets go of it (``keep(*tensors)``,
            ``wait()``: the callback's ``_lightning_compat.CollectiveHold``); ``None`` keeps nothing.
        rule: the selection rule; ``"infobatch"`` weights the module's loss through the capture.

    Attributes:
        captures: the module's own per-sample losses, one capture per step inside a fit-long scope.
        captures_losses: whether the module's loss functions are captured at all: not with a scorer, unless
            InfoBatch's weights must reach the loss (the capture patches them for the fit, a graph break
            that a ``fullgraph=True`` part holding the loss cannot take).
        state_check: finds state the module carries across batches, over each fit's first two batches.
        current: the step between :meth:`start_batch` and :meth:`finish_batch` (or
            :meth:`finish_trained_step`), else ``None``.
    """

    def __init__(
        self, mode: str = "batch", scorer: PerSampleScorer | None = None, hold: Any = None, rule: str = "topk"
    ) -> None:
        self.mode = mode
        self.scorer = scorer
        self.rule = rule
        self.captures_losses = scorer is None or rule == "infobatch"
        self.hold = hold
        self.captures = StepLossCaptures()
        self.state_check = CarriedStateCheck()
        self.current: StepInFlight | None = None
        self._batch: Any = None  # the current step's batch (cut, if it was), for what a message says of it
        # steps of this fit whose losses were recorded, but for those of batches short of their indices
        self.recorded_steps = 0
        self.unscored_steps = 0  # steps whose loss did not split into their samples: recorded without scores
        # batch mode: whether the fit's first full batch was checked for a structure that can be cut in place
        # (not every batch: a short last batch of a few samples can match a per-batch constant's shape)
        self._structure_checked = self._scorer_tried = False
        # batch mode: the samples' items concatenated (concatenated_parts) that the first checked batch holds,
        # refused once the next full batch holds them too (a per-batch constant matches by chance, rarely
        # twice) or a cut comes first
        self._concatenated: dict[tuple[str, str], tuple[int, tuple[int, ...]]] = {}
        # batch mode: the shapes of the tensors the first checked batch holds whose first dimension is not B
        # (joined_rows), refused when the next full batch holds them with another first dimension
        self._joined_rows: dict[str, tuple[int, ...]] = {}
        # batch mode: the tensors of the first checked batch with B along both first dimensions ((B, B) tokens
        # or (T, B) with T == B), whose layout every later batch is checked for before its cut
        self._square_parts: dict[str, tuple[int, ...]] = {}
        # batch mode: those of them that may be per-sample pairwise (B, B) tensors, watched before each cut
        self._pairwise: PairwiseWatch | None = None
        # batch mode: the parts the first checked batch held whole, not B long (whole_parts), kept whole at
        # every cut: a (10,) class-weight vector matches a short last batch of 10, not its samples
        self._whole_parts: dict[str, tuple[Any, ...]] = {}
        # batch mode over ranks: whether they vote on the pairwise watch at the next batch, and at the next
        # batch of a size this fit has not had (the sizes are the same on every rank; what each rank watches
        # is not: its own batch's padded lengths can be B), and what the votes handed to the backend
        self._pairwise_vote_next, self._pairwise_vote_new_size = True, False
        self._sizes_seen: set[int] = set()
        self._backward_ran = False  # in the step in flight
        self._module: nn.Module | None = None  # the module training (its parameters and buffers are no batch)
        # the step in flight: whether its loss was accounted for by its captured calls, and why not
        self._accounted = False
        self._unaccounted: str | None = None
        # said once a fit: a step whose terms' coefficients could not be read (weighed relative to the
        # largest)
        self._said_coefficients = False
        # the fit's first steps whose captured losses are checked for per-sample coefficients of both signs
        # (LossCapture.signed_coefficients: a device sync each, and a vote of the ranks); none after them
        self._sign_checks_left = SIGN_CHECKED_STEPS
        self.world_size = 1  # ranks > 1: a rank's verdict waits for the others' at the step's end
        self._rerun: Callable[..., Any] | None = None  # start_fit's: the step run again, for a loss's layout
        self._signed: str | None = None  # the step in flight's refusal, for the ranks' vote
        # over ranks: the first refusal found at this batch's start (for the vote), one kept from a batch the
        # ranks did not vote at for the vote at its step's end, and the refusal agreed on there for
        # check_carried_state to raise (one process: the carried-state check's own)
        self._found: str | None = None
        self._deferred: str | None = None
        self._after_log: str | None = None
        self._dropped_deferral: str | None = None  # a deferred refusal whose step a rollback dropped
        self._start_votes = 0  # the ranks' votes at a batch's start this fit
        # the selector of the latest batch: an epoch's last batch applies its kept steps also when a rollback
        # dropped that batch's step (finish_batch's `epoch_ends`)
        self._selector: HardSampleSelector | None = None
        # with a scorer: what training_step returned, for a step finished before its batch end
        self._output: Any = None
        # finished by finish_trained_step (a checkpoint saved before the batch end): the batch end's to log
        self._finished_early: StepInFlight | None = None

    def start_fit(
        self, world_size: int = 1, optimizers: Sequence[Any] = (), rerun: Callable[..., Any] | None = None
    ) -> None:
        """Check this fit's first two batches for carried state anew and enter the capture scope; over
        ``world_size`` ranks, the checks of a fit's first steps that read each rank's own loss are voted
        on. ``optimizers`` say which way the returned loss goes (:meth:`read_loss_direction`). ``rerun``:
        ``(batch, batch_idx, batch_size, positions) ->`` the captured calls of ``training_step`` run again on
        the batch's samples at ``positions`` (:func:`lightning_pulse.probe.captured_losses`), with which the
        fit's first step tells where a loss holds its samples when its shape cannot
        (:func:`~lightning_pulse.core.loss_layout.sample_dimension_refusal`); ``None``: not told.

        Raises:
            PulseRefusal: for parameter groups that mix ``maximize=True`` and ``False`` where the captured
                losses select (no scorer, a rule other than ``'random'``).
        """
        self.read_loss_direction(optimizers)
        self.world_size, self._rerun = world_size, rerun
        self.state_check = CarriedStateCheck()
        self.recorded_steps = self.unscored_steps = 0
        self._structure_checked = self._said_coefficients = self._scorer_tried = False
        self._concatenated, self._joined_rows, self._square_parts = {}, {}, {}
        self._pairwise, self._whole_parts = None, {}
        self._pairwise_vote_next, self._pairwise_vote_new_size, self._sizes_seen = True, False, set()
        self._dropped_deferral, self._start_votes = None, 0
        self._sign_checks_left = SIGN_CHECKED_STEPS
        if self.captures_losses:
            self.captures.start()

    def read_loss_direction(self, optimizers: Sequence[Any]) -> None:
        """Read whether ``optimizers`` ascend the loss the module returns (torch's ``maximize=True`` in every
        parameter group): several captured terms then score each sample by its part in ``-loss``, the value
        they descend (:attr:`~lightning_pulse.core.per_sample_loss.LossCapture.maximized`); one captured call
        scores its own value either way, and a scorer's values are read as given. Groups that mix both
        directions are refused where the captured losses select."""
        if self.scorer is None and self.rule != "random":
            self.captures.maximized = maximizes_loss(
                optimizers, "HardSampleReplay", _MIXED_DIRECTIONS, _MIXED_WAYS_OUT
            )
            return
        ascending, descending = loss_directions(optimizers)
        self.captures.maximized = bool(ascending) and not descending  # the logged figures' direction only

    def start_batch(
        self,
        selector: HardSampleSelector,
        batch: Any,
        indices: Tensor,
        step: int,
        batch_idx: int,
        active: bool,
        rank: int = 0,
        window: int = 0,
        cut: Composition | None = None,
        module: nn.Module | None = None,
    ) -> StepInFlight:
        """Plan the batch about to train, cut it in place when the plan says so and open its loss capture.

        Args:
            selector: plans the batch and will record it.
            batch: the loaded batch; a batch-mode cut changes it in place (what ``training_step`` receives).
            indices: ``(B,)`` dataset indices of the loaded batch (steps mode: of the sampler's cut). They
                are what says how many samples the batch holds: no reading of the batch's tensors does (a
                time-major ``(T, B)`` tensor, a 0-dim count or a list of variable-length tensors would
                misread).
            step: the optimizer step the batch trains at.
            batch_idx: the batch's place in its epoch (seeds the random rules' draws).
            active: whether the phase selects.
            rank: the global rank (seeds the draws).
            window: steps mode's window size the sampler cut the batch from, else ``0``.
            cut: steps mode's choice at the sampler for a light step, already loaded, else ``None``.
            module: the module about to train. Before the fit's first batch its lists are noted: one it then
                only appends to (per-step outputs, also a list made anew in its ``on_train_epoch_start``,
                which runs after the fit's start) is told from state carried across batches also when the
                second batch is cut (steps mode).

        Raises:
            PulseRefusal: in batch mode, for a batch that cannot be cut in place to some of its samples
                (:func:`~lightning_pulse.core.selection.cut_refusal`), at the fit's first batch that holds a
                row per index, before any update; for one holding the samples' items concatenated
                (:func:`~lightning_pulse.core.selection.concatenated_parts`, CTC's 1-D targets, Qwen2-VL's
                patches next to their grids) in that batch and the next, or in the first cut batch; for one
                holding a tensor whose first dimension is neither ``B`` nor 1 and changes from that batch to
                the next (:func:`~lightning_pulse.core.selection.joined_rows`); for a later batch with ``B``
                second and another length first where the first checked batch held ``B`` along both first
                dimensions (:func:`~lightning_pulse.core.selection.time_major_later_refusal`: time-major
                with ``T == B`` then); for a per-sample pairwise ``(B, B)`` tensor there, found by the
                :class:`~lightning_pulse.core.selection.PairwiseWatch` before a cut. For a cut batch
                before the carried-state check is done while the module holds batch-shaped state. Over ranks
                every rank refuses when any does (:meth:`_vote_at_start`): before the step at the batches the
                ranks vote at (a fit's first ones), else at the step's end (:meth:`finish_batch`), the rank
                that found it training its batch whole meanwhile.
        """
        self.captures.drop()
        self._backward_ran = self._accounted = False
        self._unaccounted, self._module, self._signed = None, module, None
        self._output = self._finished_early = None
        # a refusal deferred to a step a rollback dropped: found again, for this batch's step
        self._found, self._deferred, self._dropped_deferral = self._dropped_deferral, None, None
        self._selector = selector
        batch_size = int(indices.numel())
        first_checked = False
        # the fit's first batch of two or more samples (one of 1 is never cut, and looks like any layout)
        if self.mode == "batch" and not self._structure_checked and batch_size >= 2:
            reason = cut_refusal(batch, batch_size)
            rows = unmatched_rows(batch, batch_size)
            if reason is not None and rows is not None and rows > batch_size:
                # steps mode takes the batch whole, and then refuses a loss over its packed rows: the way
                # out there is a scorer, said now, not after a second refusal
                reason = (
                    f"{reason} It holds {rows} packed rows for its {batch_size} samples (a graph batch's "
                    "nodes, packed sequences' tokens): in mode='steps' a loss over them does not split into "
                    f"samples either, so also {SCORE_PACKED_ROWS}."
                )
            # a batch that lost rows (a collate_fn dropped samples) has no part of B rows whatever its layout,
            # and is not cut: the next full batch tells its layout. One with more rows than indices and none
            # of B (a graph batch's nodes) never holds a row per index: its layout is judged now
            if reason is None or rows_short_of_indices(batch, batch_size) is None:
                self._refuse_here(reason)
                self._structure_checked = first_checked = True
                self._concatenated = concatenated_parts(batch, batch_size, with_items=True)
                self._joined_rows = joined_rows(batch, batch_size)
                self._square_parts = square_parts(batch, batch_size)
                self._pairwise = PairwiseWatch(batch, batch_size) if self._square_parts else None
                self._whole_parts = whole_parts(batch, batch_size)
        elif self._square_parts and batch_size >= 2:  # empty for most batches: then no cost
            self._refuse_here(time_major_later_refusal(self._square_parts, batch, batch_size))
        plan = selector.plan_batch(self.mode, indices, active, step, batch_idx, rank, cut, window)
        if self._concatenated or self._joined_rows:
            self._check_concatenated(batch, batch_size, first_checked, plan.positions is not None)
        pairwise = None
        if self._pairwise is not None:
            pairwise = self._pairwise.refusal(
                batch, batch_size, plan.positions is not None, first=first_checked
            )
        if module is not None and self.state_check.first_batch:
            self.state_check.note_lists(module)
        if not self.state_check.done:  # the fit's first two batches (the ways out are only read to refuse)
            whole_batches = partial(self._whole_batches, batch, batch_size)
            self._refuse_here(self.state_check.before_batch(plan.selected, whole_batches))
        if self.world_size > 1:
            pairwise = self._vote_at_start(pairwise, batch_size)
        refuse(pairwise)
        if self._found is not None:  # a rank's refusal where the ranks do not vote: said at the step's end
            self._deferred = self._found
            plan = selector.plan_batch(self.mode, indices, False, step, batch_idx, rank, cut, window)
        if plan.positions is not None:
            assign_in_place(batch, take_samples(batch, plan.positions, batch_size, whole=self._whole_parts))
        self.current = StepInFlight(selector, plan, step, batch_size, window, batch_idx)
        self._batch = batch
        # InfoBatch's weights reach the module's loss through the capture, also next to a scorer; they stand
        # for the batch as loaded (a "sum" loss estimates its sum, a "mean" its mean)
        if self.scorer is None or plan.weights is not None:
            self.captures.open(
                int(plan.roles.size),
                plan.weights,
                batch_size if plan.weights is not None else None,
                batch,
                module,
            )
        return self.current

    def step_returned(self, output: Any) -> None:
        """Right after ``training_step`` returned ``output`` (with a scorer): kept for the scorer of a step
        finished before its batch end (:meth:`finish_trained_step`), and tried once (:meth:`try_scorer`)."""
        self._output = output
        self.try_scorer(output)

    def try_scorer(self, output: Any) -> None:
        """At the fit's first step, right after ``training_step`` returned ``output`` (under automatic
        optimization: before its backward and update), score the batch once with the scorer and drop the result:
        a scorer that cannot score this module (a module its forward cannot run on one input, an output without
        the key) is refused before any update instead of after it, with the model's error inside the refusal.

        Raises:
            PulseRefusal: naming the scorer, what it raised and the way out (:func:`scorer_refusal`).
        """
        step, module = self.current, self._module
        if self.scorer is None or self._scorer_tried or self.recorded_steps or step is None or module is None:
            return
        if output is None:  # a step skipped by returning None has nothing to score: tried at the next one
            return
        self._scorer_tried = True
        outputs = dict(output) if isinstance(output, Mapping) else {"loss": output}  # as the batch end's
        cuda = sorted({p.device.index or 0 for p in module.parameters() if p.is_cuda})
        with torch.random.fork_rng(devices=cuda):  # the trial draws nothing from the run's random streams
            self._score(module, self._batch, outputs, int(step.plan.roles.size))

    def _score(self, module: Any, batch: Any, outputs: Any, batch_size: int) -> Tensor:
        """The scorer's losses; at the fit's first steps, a scorer that fails is refused naming itself."""
        assert self.scorer is not None
        if self.recorded_steps:
            return self.scorer.score(module, batch, outputs, batch_size)
        try:
            return self.scorer.score(module, batch, outputs, batch_size)
        except Exception as error:
            raise PulseRefusal(f"HardSampleReplay {scorer_refusal(self.scorer, error)}") from error

    def _check_concatenated(self, batch: Any, batch_size: int, first: bool, cut: bool) -> None:
        """Refuse the concatenations the first checked batch held when the next full batch holds them too, or
        before a cut of the first one, and the tensors whose first dimension (not ``B``) the next full batch
        changes; forget them after the next full batch."""
        if first:
            if cut:  # no second batch can confirm them before the harm (nor tell joined rows from a constant)
                lengths = {pair: length for pair, (length, _) in self._concatenated.items()}
                self._refuse_here(concatenation_refusal(lengths, batch_size))
        elif batch_size >= 2 and rows_short_of_indices(batch, batch_size) is None:
            again = concatenated_parts(batch, batch_size, with_items=True)
            # a concatenation's items change from batch to batch, or are all as long; a constant that matches
            # on every batch the same way (sorted labels from 0 next to a position vector) is none (a review)
            found = {
                pair: again[pair][0]
                for pair, first_match in self._concatenated.items()
                if pair in again and (again[pair] != first_match or len(set(again[pair][1])) == 1)
            }
            joined_before, self._concatenated, self._joined_rows = self._joined_rows, {}, {}
            self._refuse_here(concatenation_refusal(found, batch_size))
            self._refuse_here(joined_rows_refusal(joined_before, joined_rows(batch, batch_size), batch_size))

    def _refuse_here(self, reason: str | None) -> None:
        """Refuse the batch about to train for ``reason`` (``None``: nothing). One process: at once. Over
        ranks: the first one found is kept for the ranks' vote (another rank's batch may not show it)."""
        if reason is not None and self._found is None:
            if self.world_size <= 1:
                refuse(reason)
            self._found = reason

    def _vote_at_start(self, pairwise: str | None, batch_size: int) -> str | None:
        """Over ranks, before a batch's step: refuse on every rank when any rank refuses the batch (one
        rank's batch may be time-major where another's looks batch-first, hold joined rows, a constant
        same-label mask, a module state only its data makes it read; a rank refusing alone leaves the others
        in the step's backward, waiting for it). The ranks vote at each batch while any of them has a check
        of the fit's first batches open (the layout, concatenated or joined rows, the pairwise watch's values,
        the carried-state check before a cut), and after that at each batch of a new size (an epoch's short
        last batch, whose watched tensors' values are read: a shape alone never refuses) while any of them
        still watches a tensor: one all_gather of three numbers each, at the same batches on every rank. A
        refusal a rank finds at a later batch (a time-major length that stops matching ``B``) waits for the
        vote at its step's end (:meth:`finish_batch`), riding on the rows' gather every step has. Returns the
        pairwise refusal to raise; raises any other."""
        new_size = batch_size not in self._sizes_seen
        self._sizes_seen.add(batch_size)
        if not (self._pairwise_vote_next or (self._pairwise_vote_new_size and new_size)):
            return pairwise
        watch, checks = self._pairwise, self.state_check
        # a rank whose first batches lost rows has not made its watch yet: it may still read values
        pending = (
            (self.mode == "batch" and not self._structure_checked)
            or (watch is not None and watch.values_pending)
            or bool(self._concatenated or self._joined_rows)
            # the carried-state check waits for a batch whose rows match its indices: not for ever (every
            # batch may lose rows), or the vote would be a collective at every step
            or (checks.first_batch and self._start_votes < 3)
        )
        self._start_votes += 1
        code = _OTHER if self._found is not None else _PAIRWISE if pairwise is not None else 0
        votes = self._gather_flags([code, pending, watch is not None and watch.watching])
        if votes is None:  # no process group (a single process told world_size > 1): its own verdict
            refuse(self._found)
            return pairwise
        self._pairwise_vote_next, self._pairwise_vote_new_size = (
            bool(votes[:, 1].any()),
            bool(votes[:, 2].any()),
        )
        found, self._found = self._found, None  # voted on here: nothing waits for the step's end
        refuse(self._agreed_refusal(votes[:, 0].tolist(), found))
        refusing = [rank for rank, vote in enumerate(votes[:, 0].tolist()) if vote]
        if not refusing or pairwise is not None:
            return pairwise
        return pairwise_elsewhere_reason(refusing, len(votes), batch_size)

    def _agreed_refusal(self, codes: list[int], mine: str | None) -> str | None:
        """The refusal every rank raises alike, given every rank's refusal ``codes`` (this rank's for
        ``mine``): that of the first rank whose refusal is not a pairwise one (those say where they were found
        themselves), its text broadcast from there; ``None`` if there is none. Every rank takes the same
        branch: they all read the same ``codes``."""
        others = [rank for rank, vote in enumerate(codes) if vote not in (0, _PAIRWISE)]
        if not others:
            return None
        source, text = others[0], [mine]
        distributed = torch.distributed
        if len(codes) == 1 or not (distributed.is_available() and distributed.is_initialized()):
            return mine  # a gather over one process, or a caller's own gather without a process group
        torch.distributed.broadcast_object_list(text, src=source)
        if self.hold is not None:
            self.hold.keep()  # no tensor to keep (torch's own buffers), but the exit-time teardown registered
        return (
            f"{text[0]} (Found on rank {source} of {len(codes)}; every rank refuses alike, so that none "
            "waits for another in a collective.)"
        )

    def _gather_flags(self, flags: list[bool]) -> Tensor | None:
        """``flags`` of every rank, ``(world_size, len(flags))``, through ``torch.distributed`` (the batch's
        start is given no gather); ``None`` without a process group. What the backend is handed goes to
        :attr:`hold` until it lets go (:meth:`release` waits): a thread of its own dropping the last reference
        while the rank exits aborts it (as ``_lightning_compat.CollectiveHold`` says)."""
        distributed = torch.distributed
        if not (distributed.is_available() and distributed.is_initialized()):
            return None
        on_gpu = distributed.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        mine = torch.tensor([int(flag) for flag in flags], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(distributed.get_world_size())]
        distributed.all_gather(gathered, mine)
        if self.hold is not None:
            self.hold.keep(mine, *gathered)
        return torch.stack(gathered).cpu()

    def _whole_batches(self, batch: Any, batch_size: int) -> str:
        """How a fit can start with whole batches so that the carried-state check can tell, for its refusal
        before a cut second batch: a PulseCycle's burst, or batch mode where it can cut ``batch`` (only
        called when refusing: it reads the batch)."""
        burst = BURST_FIRST
        if self.mode == "batch" or batch_size < 2:
            return burst
        if cut_refusal(batch, batch_size) is not None:
            return f"{burst}; not `mode='batch'`, which cannot cut this batch in place"
        joined = concatenated_parts(batch, batch_size)
        if joined:
            parts = ", ".join(f"{where} (joined: {how})" for where, how in joined)
            return f"{burst}; not `mode='batch'`, which would keep {parts} whole next to the kept samples"
        rows = joined_rows(batch, batch_size)
        if rows:  # one batch cannot tell joined rows from a per-batch constant: batch mode refuses the former
            held = ", ".join(f"{where} {shape}" for where, shape in rows.items())
            return f"{burst}, or `mode='batch'` if {held} keeps its first dimension from batch to batch"
        return f"{burst}, or `mode='batch'`"

    def close_capture(self, loss: Tensor | None = None, divided_by: float | Tensor = 1.0) -> str | None:
        """Stop capturing before backward (what runs after, e.g. a maintain-phase probe, is not this batch's loss).

        ``loss`` is watched for its backward's scale
        (:meth:`~lightning_pulse.core.per_sample_loss.LossCapture.watch_loss`), so that several captured calls
        count with their exact coefficients in the loss the step returned, ``divided_by`` being what that loss
        was divided by before (Lightning's ``accumulate_grad_batches``).

        At the fit's first scored step, ``loss`` (what the step backpropagates) is checked to be accounted for
        by the captured calls (:meth:`~lightning_pulse.core.per_sample_loss.LossCapture.unaccounted_part`):
        a part that reads the batch outside them is said once after the backward (:meth:`after_backward`),
        unless no captured call is left in the loss then (the refusal that names what was captured says more).

        Returns:
            Once a fit, what to warn about when a later step's loss does not split into its samples (a loss on
            the part of a batch that some flag selects, whole in the first batches): that step is recorded
            without scores, so its samples keep the ones they had (or stay unscored and always train).

        Raises:
            PulseRefusal: at the fit's first step of a batch holding a row per index, when its loss yields
                no per-sample value and the capture is needed; at any step, when InfoBatch's weights could not
                reach the loss next to a scorer.
        """
        self.captures.close(before_backward=True)  # what training_step's own autograd.grad added is dropped
        closed = self.captures.closed
        if self.current is None or closed is None:
            return None
        if isinstance(loss, Tensor):
            closed.watch_loss(loss, divided_by)
        if not self._accounted and self.scorer is None and not self.recorded_steps and closed.maps_onto_batch:
            self._accounted = True  # the first backward's loss (manual optimization may run more)
            if isinstance(loss, Tensor):
                module = self._module
                constants = [] if module is None else [*module.parameters(), *module.buffers()]
                self._unaccounted = closed.unaccounted_part(loss, constants)
        closed.forget_graph()
        return None if closed.maps_onto_batch else self._unsplit(closed)

    def after_backward(self, manual: bool) -> str | None:
        """A backward ran: the captured calls it did not reach (values computed for logging) stop counting
        (:meth:`~lightning_pulse.core.per_sample_loss.LossCapture.drop_unused`), judged as
        :meth:`close_capture` judges, so that a first step whose loss is none of them is refused before its
        update. Under ``manual`` optimization more backward calls may follow: judged at the batch end.
        """
        self._backward_ran = True
        return None if manual else self._drop_unused()

    def _drop_unused(self) -> str | None:
        closed = self.captures.closed
        if self.current is None or closed is None or not closed.maps_onto_batch:
            return None  # said at close_capture already
        closed.drop_unused()
        if closed.maps_onto_batch:
            self._refuse_signed_coefficients(closed)  # a fit's first steps only: nothing per step after them
            # said once, not refused: a batch-level term written by hand (a mixture of experts' load-balancing
            # loss, a `0 * aux(x).sum()` kept for DDP) looks the same as a per-sample one, and such models
            # train well on the captured terms' scores
            unaccounted, self._unaccounted = self._unaccounted, None
            return unaccounted
        return self._unsplit(closed)

    def _checks_signs(self, step: StepInFlight) -> bool:
        """Whether ``step`` is one of a fit's first steps whose captured loss is checked for per-sample
        coefficients of both signs: not with a scorer, nor with rule='random' (no score read)."""
        return self._sign_checks_left > 0 and self.scorer is None and step.selector.config.rule != "random"

    def _refuse_signed_coefficients(self, closed: LossCapture) -> None:
        """Over a fit's first steps, refuse scores read from a captured loss whose samples enter the loss
        that trains with coefficients of both signs across the samples' losses (a policy gradient's
        advantages): the unweighted loss then ranks no hardness (a held-out REINFORCE module: rank correlation
        -0.4 with each sample's own term). One process: refused here, before the update. Several: kept for
        the ranks' vote at the step's end (:meth:`_vote_on_signs`), since another rank's batch may show no
        sign at all (equal rewards, all-zero advantages) and a rank refusing alone leaves the others waiting
        in the next collective."""
        assert self.current is not None
        if not self._checks_signs(self.current) or (signed := closed.signed_coefficients()) is None:
            return
        self._signed = f"cannot score the samples of step {self.current.step}'s loss: its captured {signed} "
        if self.world_size <= 1:
            refuse(f"{self._signed}enters the loss that trains with {_SIGNED_WAYS_OUT}")

    def _vote_on_signs(self, finished: StepInFlight, all_gather: Callable[[Tensor], Tensor] | None) -> None:
        """At the end of each of a fit's first checked steps, on every rank: refuse on every rank when any
        rank's captured loss had per-sample coefficients of both signs (one ``all_gather`` of one element)."""
        if not self._checks_signs(finished):
            return
        self._sign_checks_left -= 1
        mine, self._signed = self._signed, None
        if all_gather is None:  # one process: refused after the backward already (manual optimization: here)
            refuse(None if mine is None else f"{mine}enters the loss that trains with {_SIGNED_WAYS_OUT}")
            return
        votes = all_gather(torch.tensor([float(mine is not None)], dtype=torch.float64)).cpu().reshape(-1)
        refusing = [rank for rank, vote in enumerate(votes.tolist()) if vote]
        if not refusing:
            return
        self._sign_checks_left = 0
        if mine is not None:
            refuse(f"{mine}enters the loss that trains with {_SIGNED_WAYS_OUT}")
        ranks = f"rank{'s' * (len(refusing) > 1)} {', '.join(map(str, refusing))} of {len(votes)}"
        refuse(
            f"cannot score the samples of step {finished.step}'s loss: on {ranks} its captured "
            "per-sample loss enters the loss that trains with coefficients of both signs across its samples' "
            "losses, where this rank's did not "
            "(its batch may have given every sample the same sign, or none: equal rewards make all-zero "
            "advantages), so that every rank refuses alike. The loss has "
            f"{_SIGNED_WAYS_OUT}"
        )

    def _unsplit(self, closed: LossCapture) -> str | None:
        assert self.current is not None
        step, drawn = self.current.step, self.current.batch_size
        rows = unmatched_rows(self._batch, int(self.current.plan.roles.size), drawn)
        cause = None if rows is None else unmatched_rows_cause(rows, drawn)
        if rows is not None and rows > drawn and self.scorer is None and not self.recorded_steps:
            # more rows than indices (a graph batch's nodes, no tensor of B rows): nothing is dropped, and no
            # later batch holds a row per index, so the fit's first step is the one whose loss has to split
            refuse(
                f"found no per-sample loss in training_step ({closed.describe()}; batch of {drawn} samples): "
                f"{cause}. To replay, {SCORE_PACKED_ROWS}."
            )
        # the batch lost rows, which no loss can split into its samples: said as such; refused where InfoBatch
        # weights the loss; else recorded without scores, also at the fit's first step, which then does not
        # count as the step whose loss has to split (the first full batch's does)
        if rows is not None and rows < drawn:
            if self.scorer is not None:
                refuse(
                    f"cannot split the loss of step {step} into its batch's samples: {cause}. To replay, "
                    f"{KEEP_ONE_ROW_PER_INDEX}."
                )
            self.current.rows_unmatched = True
            self.unscored_steps += 1
            if self.unscored_steps > 1:
                return None
            return (
                f"the loss of step {step} could not split into its batch's samples: {cause}. Such steps are "
                "recorded without scores, so their samples keep the scores they had (or stay unscored and "
                f"always train); to score them, {KEEP_ONE_ROW_PER_INDEX}. Said once; "
                "`HardSampleReplay.batches.unscored_steps` counts them."
            )
        if self.scorer is not None:
            closed.require("HardSampleReplay, whose rule='infobatch' weights it,")
        if not self.recorded_steps:
            closed.require("HardSampleReplay")  # nothing can be scored: refused before any update
        self.unscored_steps += 1
        if self.unscored_steps > 1:
            return None
        return (
            f"the loss of step {step} did not split into its batch's samples ({closed.describe()}); "
            "such steps are recorded without scores, so their samples keep the scores they had (or stay unscored "
            "and always train). Said once; `HardSampleReplay.batches.unscored_steps` counts them."
        )

    def finish_batch(
        self,
        module: nn.Module,
        batch: Any,
        outputs: Any,
        all_gather: Callable[[Tensor], Tensor] | None = None,
        epoch_ends: bool = False,
    ) -> StepInFlight | None:
        """Record the step's per-sample losses into its selector and end the step.

        Args:
            module: the module that trained (what a scorer scores with).
            batch: the batch it trained on (cut, if it was).
            outputs: what ``training_step`` returned (for a scorer).
            all_gather: under data parallelism, ``tensor -> (world_size, *tensor.shape)``: every rank records
                every rank's rows, so tables and decisions stay identical.
            epoch_ends: the batch is its epoch's last: the selector applies its kept steps now, as the epoch's
                end would. A checkpoint saved at this batch's end
                (``ModelCheckpoint(every_n_train_steps=...)`` landing there) then holds them applied:
                Lightning resumes from it without running the epoch's end hooks again, so the next epoch chose
                from unapplied scores (a held-out two-rank run resumed at step 14 ended with other weights).

        Returns:
            The finished step (for :meth:`check_carried_state`; one :meth:`finish_trained_step` finished
            before, recorded then), or ``None`` when no step was started (or the one in flight was dropped).

        Raises:
            PulseRefusal: at the fit's first batch, for a token loss flattened time-major. Under data
                parallelism, on every rank at the end of one of a fit's first steps
                (:data:`SIGN_CHECKED_STEPS`) when some rank's captured loss had per-sample coefficients of
                both signs across its samples' losses.
        """
        if self._finished_early is not None:  # recorded already, for a checkpoint saved before this batch end
            finished, self._finished_early, self.current = self._finished_early, None, None
            self._end_epoch(epoch_ends)
            return finished
        if self._backward_ran and (note := self._drop_unused()) is not None:  # manual optimization's backward
            warnings.warn(f"HardSampleReplay: {note}", stacklevel=2)
        capture, finished, self.current, self._batch = self.captures.take(), self.current, None, None
        self._output = None  # the step's graph is not kept
        if finished is None:
            self._end_epoch(epoch_ends)
            return None
        # every rank, every step: the first steps' vote stays matched across ranks, before record's gather
        self._vote_on_signs(finished, all_gather)
        if capture is not None and not self._said_coefficients and capture.coefficients_unknown():
            self._said_coefficients = True
            warnings.warn(
                f"HardSampleReplay: the coefficients of step {finished.step}'s captured loss terms could not "
                "be read (its backward did not go through the loss the callback watches, e.g. a "
                "`loss.backward()` instead of `manual_backward`, or several backward calls had different "
                "scales), so its terms are weighed relative to the largest, which is off where coefficients "
                "change from step to step (a per-batch mixup lambda). Use `self.manual_backward(loss)`, or "
                "set `scorer=` (e.g. OutputKeyScorer). Said once.",
                stacklevel=2,
            )
        plan = finished.plan
        # Lightning's automatic optimization runs a backward for every batch that trains; none ran here:
        # training_step returned None and Lightning skipped the step. Its samples did not train: recorded as
        # no rows (no scores, counts or replay marks), still recorded for the ranks' vote. Manual optimization
        # may call loss.backward() itself, which no hook sees: every step counts as trained there
        trained = self._backward_ran or not getattr(module, "automatic_optimization", False)
        losses: LossCapture | Tensor
        found, code, self._deferred, self._after_log = self._deferred, _OTHER, None, None
        if not trained:
            losses = torch.empty(0)
        elif self.scorer is None:
            assert capture is not None  # opened at the batch start whenever there is no scorer
            if capture.maps_onto_batch:
                losses = capture
                if self.state_check.first_batch and found is None:
                    found = time_major_refusal(losses, batch)
                    if found is None and self._rerun is not None and not finished.rows_unmatched:
                        # a loss with B along both first dimensions: which holds the samples, by evidence
                        rerun = partial(self._rerun, batch, finished.batch_idx, losses.batch_size)
                        found = sample_dimension_refusal(losses, rerun)
            else:  # a later step whose loss does not split (close_capture said so): no scores, every rank alike
                losses = torch.full((int(plan.roles.size),), math.nan)
        else:
            losses = self._score(module, batch, outputs, int(plan.roles.size))
        # after the scorer (which may read the state) and before the rows' gather, which the ranks vote on
        if not (finished.rows_unmatched and self.state_check.first_batch):  # the first batch finds candidates
            self._after_log = self.state_check.after_batch(module, finished.batch_size)
            if found is None and self._after_log is not None:
                found, code = self._after_log, _CARRIED
        if all_gather is None and code != _CARRIED:  # one process: refused before the record, as found
            refuse(found)
        rows = slice(None) if trained else slice(0)
        codes = finished.selector.record(
            plan.indices[rows],
            losses,
            plan.roles[rows],
            finished.step,
            plan.active and trained,
            plan.offered if trained else 0,
            all_gather,
            refusal=0 if found is None else code,
        )
        if any(codes):  # over ranks: every rank refuses what the first refusing rank found
            agreed = self._agreed_refusal(codes, found)
            if codes[[bool(vote) for vote in codes].index(True)] != _CARRIED:
                refuse(agreed)
            self._after_log = agreed
        if trained and not finished.rows_unmatched:
            self.recorded_steps += 1
        self._end_epoch(epoch_ends)
        return finished

    def finish_trained_step(
        self,
        all_gather: Callable[[Tensor], Tensor] | None = None,
        batches_in_epoch: float = math.inf,
        accumulation: int = 1,
    ) -> None:
        """Finish the step in flight now, as :meth:`finish_batch` would at its batch end: its update ran and
        a checkpoint is saved before the batch end (a PulseCycle phase listener's, a callback listed first).
        Its resume starts after the step, so the step's measurement (and an epoch's last batch's apply) must
        be in the state saved now. The batch end then returns the step, for the caller's logging and
        :meth:`check_carried_state`; :attr:`current` stays the step until then. Nothing without a step in
        flight (or one started without its ``module``), or for one finished so already.

        Args:
            all_gather: as :meth:`finish_batch`'s (every rank saves at the same moment).
            batches_in_epoch: the epoch's batches: whether this batch ends it.
            accumulation: the Trainer's ``accumulate_grad_batches``: Lightning divides the returned ``loss``
                by it (under automatic optimization) before the batch end's ``outputs``.
        """
        if (step := self.current) is None or self._module is None or self._finished_early is not None:
            return
        # a scorer gets what the batch end would: training_step's output, its 'loss' divided as Lightning does
        output = self._output
        outputs = dict(output) if isinstance(output, Mapping) else {"loss": output}
        if getattr(self._module, "automatic_optimization", True) and isinstance(outputs.get("loss"), Tensor):
            outputs["loss"] = outputs["loss"].detach() / accumulation
        epoch_ends = step.batch_idx + 1 >= batches_in_epoch
        self._finished_early = self.finish_batch(self._module, self._batch, outputs, all_gather, epoch_ends)
        self.current = self._finished_early  # what trains, for the callbacks' batch ends after the save

    def _end_epoch(self, epoch_ends: bool) -> None:
        if epoch_ends and self._selector is not None:
            self._selector.apply()

    def check_carried_state(self, finished: StepInFlight | None) -> None:
        """After a finished step (and whatever the caller logs for it): refuse a module carrying state from one
        batch to the next, once the fit's first two batches show it. ``None`` (no step finished): nothing.

        Raises:
            PulseRefusal: naming the attributes that carry state.
        """
        # found by finish_batch (over ranks: agreed on there), raised here so that the refused step is logged
        if finished is not None:
            after_log, self._after_log = self._after_log, None
            refuse(after_log)

    def drop_step(self) -> None:
        """Forget the step in flight (a rollback replaces the model it was measured on); a refusal deferred to
        its end goes to the next batch's step."""
        self._dropped_deferral, self._deferred = self._deferred, None
        self.captures.drop()
        self.current = self._batch = self._output = self._finished_early = None

    def release(self) -> None:
        """Close every capture and watch, end the capture scope and forget the step in flight."""
        self.captures.release()
        self.state_check.stop()
        self.current = self._batch = self._module = None  # the module (its Trainer) not kept after the fit
        self._rerun = None  # holds the Trainer too
        self._output = self._finished_early = None
        if self.hold is not None:
            self.hold.wait()  # the rank may exit right after (see _gather_flags)
