"""Step-saving replay: which batch sizes a run's sampler yields, planned before the first step.

In a light phase a step trains a full batch of ``B`` samples chosen from a window of ``round(B / f)`` raw
samples (``f`` = the replay fraction), so a phase that stands for ``N`` batches of data takes about ``f * N``
optimizer steps. The sampler fetches the window, :class:`~lightning_pulse.HardSampleReplay` keeps the ``B``
samples its rule picks. An epoch stays one pass over the data, so it holds fewer batches.

Since the phase clock is deterministic in steps, the whole run is known up front: :func:`plan_steps` plays
the phase clock forward step by step and returns every epoch's raw batch sizes and the run's total number of
optimizer steps, the figure ``OneCycleLR``, cosine schedules and ``max_steps`` are given. Warm-up and anneal
are shares of that total, which depends on them: :func:`plan_steps` solves the fixed point.

:func:`replay_steps_for_budget` turns a compute budget (the share of the plain run's steps to spend) into a
replay-phase length.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import Duration, Phase, PhaseClock


@dataclass(frozen=True)
class StepPlan:
    """A run's planned batches.

    Attributes:
        first_epoch: the epoch ``batch_sizes[0]`` belongs to.
        batch_sizes: per epoch, the raw size of each batch the sampler yields (its last one may be short).
        total_steps: optimizer steps the run takes.
        plain_steps: optimizer steps the same data takes without step-saving replay.
        light_steps: of the steps from ``from_step`` on, those in a light (selecting) phase.
        data_steps: optimizer steps the planned batches give (``None``: ``total_steps``). It falls short of
            ``total_steps`` only on a resume whose saved total the data no longer fills (a checkpoint of an
            older plan); the run then trains plain batches past the plan while its epochs allow.
        phase_steps: the run length warm-up and anneal are shares of (``None``: ``total_steps``). Where they
            have no exact fixed point it differs from ``total_steps`` by a step or two, and the clock is
            pinned to it (:meth:`~lightning_pulse.phase.PhaseClock.pin_span`), so the run is exactly its
            data's steps.
    """

    first_epoch: int
    batch_sizes: list[list[int]]
    total_steps: int
    plain_steps: int
    light_steps: int = 0
    data_steps: int | None = None
    from_step: int = 0  # the optimizer step the plan was made at (a resume plans the rest of the run)
    phase_steps: int | None = None
    # steps trained before the plan without step-saving replay (a HardSampleReplay added on a resume):
    # ``total_steps`` counts them, the plan saved nothing on them
    steps_before: int = 0
    # the plain run's steps before the plan joined (the joined epoch's whole plain epochs, as ``plain_steps``
    # counts them): the earlier fit may have taken another number (another batch size or accumulation)
    plain_before: int = 0
    # the plain run's steps over the samples a resume from a stop inside an epoch leaves untrained (the rest
    # of that epoch's pass, see StepSavingStream._drop_rest_of_pass): no saving, so left out of the ratios
    plain_dropped: int = 0
    # epochs of a max_epochs run that Lightning ended before their planned pass did (the module's
    # on_train_batch_start returned -1, or the sampler ran out short of its length), their rests dropped (in
    # plain_dropped): see StepSavingStream.cut_pass
    epochs_cut: int = 0
    # of those, the epochs the sampler ended: it gave fewer samples than its length, which the plan was made of
    sampler_cuts: int = 0

    @property
    def span(self) -> int:
        """The run length warm-up and anneal are placed on as shares (see ``phase_steps``)."""
        return self.total_steps if self.phase_steps is None else self.phase_steps

    @property
    def steps_past_data(self) -> int:
        """Steps the run takes past the planned batches, on plain batches (see ``data_steps``)."""
        return 0 if self.data_steps is None else max(0, self.total_steps - self.data_steps)

    def sizes_of(self, epoch: int) -> list[int]:
        """The raw batch sizes of ``epoch`` (empty past the plan)."""
        position = epoch - self.first_epoch
        return self.batch_sizes[position] if 0 <= position < len(self.batch_sizes) else []

    def run_steps(self, bounded_by_epochs: bool) -> int:
        """The optimizer steps the run takes: :attr:`total_steps`, but only :attr:`data_steps` where the
        planned batches fall short of the total and ``max_epochs`` ends the run when they run out."""
        return self.data_steps if self.data_steps is not None and bounded_by_epochs else self.total_steps

    @property
    def own_steps(self) -> int:
        """The planned optimizer steps from where the plan joined the run (all of them for a plan from the
        run's start)."""
        return self.total_steps - self.steps_before

    @property
    def own_plain_steps(self) -> int:
        """The plain run's optimizer steps over the data :attr:`own_steps` train (not over the untrained rest
        of a stopped epoch: :attr:`plain_dropped`)."""
        return self.plain_steps - self.plain_before - self.plain_dropped

    @property
    def dropped_text(self) -> str:
        """What a ratio of :attr:`own_plain_steps` leaves out (empty: nothing)."""
        if not self.plain_dropped:
            return ""
        dropped, epochs = self.plain_dropped, "epochs ended early" if self.epochs_cut else "stopped epochs"
        return f"the plain run's {dropped} steps over the untrained rest of {epochs} left out"

    @property
    def cut_note(self) -> str:
        """What a ratio of :attr:`own_plain_steps` cannot say after :attr:`epochs_cut` (empty: none were)."""
        if not self.epochs_cut:
            return ""
        epochs = "1 epoch" if self.epochs_cut == 1 else f"{self.epochs_cut} epochs"
        passes = "its planned pass" if self.epochs_cut == 1 else "their planned passes"
        by_hook, by_sampler = self.epochs_cut - self.sampler_cuts, self.sampler_cuts
        sampler = "the sampler gave fewer samples than its length says"
        if not by_hook:  # the plain run's epochs end where the sampler runs out too, over the same samples
            return (
                f"{epochs} ended before {passes} did: {sampler}, and Lightning ends an epoch where its sampler "
                "runs out. The plan, and the plain run's steps the fit's first line named, counted on that "
                "length; the plain run's epochs end where the sampler's do too, so its steps here, over the "
                "samples the sampler gave, are the plain run's."
            )
        hook = "`on_train_batch_start` returned -1"
        why = f"{by_sampler} because {sampler}, {by_hook} because {hook}" if by_sampler else hook
        return (
            f"{epochs} ended before {passes} did ({why}): the plain run of this module ends its epochs by "
            "that rule too, after other samples, so its steps are not known here, and this is no saving "
            "against it."
        )

    @property
    def dropped_note(self) -> str:
        """:attr:`dropped_text` as a clause to append (``"; ..."``; empty: nothing)."""
        return f"; {self.dropped_text}" if self.plain_dropped else ""

    @property
    def spent(self) -> float:
        """Planned optimizer steps over the plain run's (the compute spent, in full-batch steps), both
        counted from where the plan joined the run."""
        plain = self.own_plain_steps
        return self.own_steps / plain if plain > 0 else 1.0


def epoch_steps(batches: float, accumulate: int) -> int | None:
    """Optimizer steps in an epoch of ``batches`` batches, ``accumulate`` batches a step (a short last window
    steps too); ``None`` for an epoch of unknown length (an infinite DataLoader)."""
    return math.ceil(batches / accumulate) if math.isfinite(batches) else None


def loader_epoch_steps(loader: Any, accumulate: int) -> int | None:
    """:func:`epoch_steps` of a pass over ``loader`` (``None`` for one without a length)."""
    try:
        batches = len(loader)
    except TypeError:  # no __len__, or a DataLoader whose sampler has none (which its __len__ reads)
        batches = math.inf
    return epoch_steps(batches, accumulate)


def clock_epoch_steps(batches: float, accumulate: int) -> float | None:
    """:func:`epoch_steps` as :meth:`~lightning_pulse.phase.PhaseClock.advance` takes an epoch's length
    (``steps_per_epoch``): a float, or ``None`` for an epoch of unknown length or of no steps."""
    steps = epoch_steps(batches, accumulate)
    return float(steps) if steps else None


def window_size(batch_size: int, fraction: float) -> int:
    """Raw samples fetched for one light-phase batch of ``batch_size`` trained samples."""
    return max(batch_size, round(batch_size / fraction))


# a run whose spans near the crossing take at most this many simulated steps in all has every one tried
SCANNED_STEPS = 50_000


def plan_steps(
    clock: PhaseClock | None,
    light_phases: Iterable[str],
    batch_size: int,
    fraction: float,
    samples_per_epoch: int,
    max_epochs: int | None,
    max_steps: int | None,
    accumulate: int = 1,
    drop_last: bool = False,
    start_epoch: int = 0,
    start_samples: int = 0,
    start_step: int = 0,
    total_steps: int | None = None,
    start_trained: int | None = None,
    planned_plain_steps: int | None = None,
    start_batches: int = 0,
) -> StepPlan:
    """Play the run forward and return its batches.

    Args:
        clock: the run's phase clock, in its current state (it is copied, not advanced); ``None`` means every
            step is in a light phase (no PulseCycle).
        light_phases: the phases whose batches are selected.
        batch_size: samples per trained batch ``B``.
        fraction: the replay fraction ``f``: a light batch is chosen from ``round(B / f)`` raw samples.
        samples_per_epoch: raw samples in one pass of the sampler (one rank's shard under DDP).
        max_epochs: the run's epochs (``None``: unbounded, ``max_steps`` ends it).
        max_steps: the plain run's optimizer steps cap (``None``: none). The plan spends the data those
            steps would see.
        accumulate: batches per optimizer step.
        drop_last: whether the sampler drops a short last batch.
        start_epoch, start_samples, start_step: where the run stands (a resume: the epoch, the raw samples of
            it already trained, the global step).
        total_steps: the run's total steps, when already fixed (a resume); solved otherwise.
        start_trained: raw samples the run trained before ``start_step`` (``None``: ``start_epoch`` plain
            passes and ``start_samples``). With ``drop_last`` a planned pass may train more than a plain one
            (a light window takes a short rest the plain pass drops), so a resume gives the count it saved.
        planned_plain_steps: the plain run's steps ``total_steps`` was planned for (``None``: these). A resume
            to a run of another length (``max_epochs`` raised or lowered) keeps the steps taken and plans the
            rest again: ``total_steps`` is solved for the new run, warm-up and anneal are shares of it.
        start_batches: the batches of ``start_epoch``'s pass already trained. Lightning closes an accumulation
            window every ``accumulate`` batches of an epoch, so a resume saved inside a window (at a batch that
            took no optimizer step) first finishes that window at ``start_step``, with its batches left.

    Raises:
        ValueError: for a run with neither ``max_epochs`` nor ``max_steps``.
    """
    if max_epochs is None and max_steps is None:
        raise ValueError("a step plan needs a finite max_epochs or max_steps")
    plain_epoch_batches = _batches(samples_per_epoch, batch_size, drop_last)
    plain_epoch_steps = math.ceil(plain_epoch_batches / accumulate) if plain_epoch_batches else 0
    plain = math.inf if max_epochs is None else max_epochs * plain_epoch_steps
    if max_steps is not None:
        plain = min(plain, max_steps)
    plain_steps = int(plain)
    if planned_plain_steps is not None and planned_plain_steps != plain_steps:
        total_steps = None  # the saved total and the span the clock was pinned to belong to the old run
    # the samples the plain run trains: whole epochs, then the steps of a last, partial one
    epoch_samples = plain_epoch_batches * batch_size if drop_last else samples_per_epoch
    whole, rest = divmod(plain_steps, plain_epoch_steps) if plain_epoch_steps else (0, 0)
    plain_samples = whole * epoch_samples + min(epoch_samples, rest * accumulate * batch_size)
    light = frozenset(Phase(name) for name in light_phases)
    args = (
        clock,
        light,
        batch_size,
        fraction,
        samples_per_epoch,
        plain_epoch_steps,
        plain_steps,
        plain_samples,
        accumulate,
    )
    if start_trained is None:
        start_trained = start_epoch * epoch_samples + start_samples
    start = (start_epoch, start_samples, start_step, start_trained, drop_last, start_batches % accumulate)
    if total_steps is not None:  # a resume keeps its total, also where the planned batches fall short of it
        # a clock pinned by the plan that saved the run places warm-up and anneal as that plan did
        span = clock.span if clock is not None and clock.span is not None else total_steps
        plan = _simulate(*args, *start, span)
        if plan.total_steps >= total_steps:
            return replace(plan, phase_steps=span)
        return replace(plan, total_steps=total_steps, data_steps=plan.total_steps, phase_steps=span)
    # warm-up and anneal are shares of the total the plan computes: iterate to the fixed point
    if clock is not None and clock.span is not None:  # pinned by the plan of a run of another length
        clock = clock.copy()
        clock.pin_span(None)
        args = (clock, *args[1:])
    guess, seen = plain_steps, {}
    closest: tuple[int, int, StepPlan] | None = None  # the reached span's (steps over, -span, plan)

    def simulated(candidate: int) -> StepPlan:
        nonlocal closest
        plan = _simulate(*args, *start, candidate)
        seen[candidate] = plan.total_steps
        over = plan.total_steps - candidate
        if over >= 0 and (closest is None or (over, -candidate) < closest[:2]):
            closest = (over, -candidate, plan)
        return plan

    for _ in range(12):
        plan = simulated(guess)
        if plan.total_steps == guess:
            return plan
        if plan.total_steps in seen:
            break
        guess = plan.total_steps
    # no exact fixed point: moving the anneal's start by one step moves a phase boundary, and the data's steps
    # jump past the span (typically span s gives s + 1 steps and s + 1 gives s). Warm-up and anneal are pinned
    # to the span whose data's steps reach it most closely, so the run is exactly its data's steps (every
    # epoch one pass, max_epochs kept) and its anneal is at least its share, never cut short. The tries circle
    # the crossing (spans the data reaches below it, spans it falls short of above): the closest pair that
    # brackets it is bisected to adjacent spans, a whole-run simulation (~3 us a step) each, rather than every
    # span from the first tries on tried (a long run's first tries land hundreds of steps below the crossing)
    low, high = min(seen), max(max(seen), max(seen.values()))
    if (min(high, low + 64) - low + 1) * plain_steps <= SCANNED_STEPS:  # a short run: every span tried
        for candidate in range(low, min(high, low + 64) + 1):
            if candidate not in seen:
                simulated(candidate)
        span = low
        while closest is None and span > 0 and simulated(span).total_steps < span:
            span -= 1  # a span of 0 (all burst) is reached by the plain run's steps
        low = high = span
    else:  # a long run: the closest pair of tried spans around the crossing is bisected
        # (a span of 0, all burst, is reached by the plain run's steps)
        low = max((span for span, steps in seen.items() if steps >= span), default=0)
        high = min((span for span, steps in seen.items() if steps < span and span > low), default=low)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if simulated(middle).total_steps >= middle else (low, middle)
    if closest is None:
        return replace(_simulate(*args, *start, low), phase_steps=low)
    return replace(closest[2], phase_steps=-closest[1])


def _plain_sizes(samples: int, batch_size: int, drop_last: bool) -> list[int]:
    whole, rest = divmod(samples, batch_size)
    return [batch_size] * whole + ([rest] if rest and not drop_last else [])


def _batches(samples: int, batch_size: int, drop_last: bool) -> int:
    return samples // batch_size if drop_last else math.ceil(samples / batch_size)


def _simulate(
    clock: PhaseClock | None,
    light: frozenset[Phase],
    batch_size: int,
    fraction: float,
    samples_per_epoch: int,
    plain_epoch_steps: int,
    plain_steps: int,
    plain_samples: int,
    accumulate: int,
    epoch: int,
    samples_done: int,
    step: int,
    trained_before: int,
    drop_last: bool,
    window_done: int,
    total_steps: int,
) -> StepPlan:
    from_step = step
    sim = None if clock is None else clock_started_at(clock, step, total_steps)
    window = window_size(batch_size, fraction)
    # the plain run's samples not yet trained
    data_left = plain_samples - trained_before
    epochs: list[list[int]] = []
    light_steps = 0
    sizes: list[int] = []
    remaining = samples_per_epoch - samples_done
    first_epoch = epoch
    while data_left > 0:  # the data decides the length; `total_steps` only places warm-up and anneal
        phase_is_light = sim is None or sim.phase in light
        per_batch = window if phase_is_light else batch_size
        # one optimizer step; an epoch's end closes its window early, and a resume inside a window (its first
        # `window_done` batches trained before the checkpoint) finishes it: else every later window of the
        # pass was one batch off Lightning's, phases fell on other batches and an odd rest lost a step
        for _ in range(accumulate - window_done):
            size = min(per_batch, remaining)
            if size <= 0 or (drop_last and size < min(per_batch, batch_size)):
                break
            sizes.append(size)
            remaining -= size
            data_left -= size
        window_done = 0
        step += 1
        light_steps += phase_is_light
        if sim is not None:
            sim.advance(
                steps=1, seconds=0.0, steps_per_epoch=plain_epoch_steps or None, total_steps=total_steps
            )
        if remaining <= 0 or (drop_last and remaining < batch_size):
            epochs.append(sizes)
            sizes, remaining, epoch = [], samples_per_epoch, epoch + 1
    if sizes:
        epochs.append(sizes)
    return StepPlan(first_epoch, epochs, step, plain_steps, light_steps, from_step=from_step)


def clock_started_at(clock: PhaseClock, step: int, total_steps: int) -> PhaseClock:
    """A copy of ``clock`` as it runs from optimizer ``step`` on. One not started yet is placed there
    (:meth:`~lightning_pulse.phase.PhaseClock.begin_at`, as PulseCycle starts it at ``trainer.global_step``)
    and started: a PulseCycle added on a resume, placed already from the checkpoint, or to a second fit of the
    Trainer, placed only at train start, after the plan."""
    sim = clock.copy()
    if sim.stage == "pending":
        sim.begin_at(step)
        sim.start(total_steps)
    return sim


def replay_steps_for_budget(
    budget: float,
    fraction: float,
    full_steps: float,
    other_light_steps: float,
    warmup: float,
    anneal: float,
) -> float:
    """The replay-phase length (steps) that makes a run spend ``budget`` of the plain run's steps.

    Per cycle, ``full_steps`` steps train plain batches and the light steps (``other_light_steps`` plus the
    replay phase ``r``) each stand for ``1 / fraction`` batches of data; warm-up and anneal (shares of the
    run's steps) train plain batches.

    Raises:
        ValueError: when no replay length reaches the budget (it is below what ``fraction`` allows, or so
            close to 1 that the other phases already spend less).
    """
    # the cycled part must spend `ratio` of its data, so that with warm-up and anneal the run spends `budget`
    edges = warmup + anneal
    ratio = (1 - edges) * budget / (1 - edges * budget)
    floor = _lowest_budget(fraction, edges)
    if ratio <= fraction:
        raise ValueError(
            f"`budget`={budget:g} is below what a replay fraction of {fraction:g} can reach with warmup + anneal "
            f"= {edges:g} (the run cannot spend less than {floor:.3g}); raise `budget` or lower replay_fraction."
        )
    numerator = full_steps * (1 - ratio) + other_light_steps * (1 - ratio / fraction)
    replay = numerator / (ratio / fraction - 1)
    if replay <= 0:
        ceiling = _spent(fraction, full_steps, other_light_steps, 0.0, edges)
        raise ValueError(
            f"`budget`={budget:g} is above what the cycle spends with no replay phase at all ({ceiling:.3g}); "
            "lower `budget`, or shorten the other light phases."
        )
    return replay


def replay_duration_for_budget(
    clock: PhaseClock,
    budget: float,
    fraction: float,
    light_phases: Iterable[str],
    plain_epoch_steps: float | None,
) -> Duration:
    """The replay-phase :class:`~lightning_pulse.phase.Duration` (steps) that makes ``clock``'s run spend
    ``budget`` of the plain run's steps; the other phases keep their durations (epochs count plain epochs).

    Raises:
        ValueError: for a clock in seconds or without a replay phase, or a budget no replay length reaches.
    """
    if clock.uses_wall_clock or Phase.REPLAY not in clock.order:
        raise ValueError(
            f"`budget`={budget:g} sets the replay phase's length in steps, so the cycle needs a replay phase and "
            "durations in steps or epochs; drop `budget` or give the durations in steps."
        )
    light = {Phase(name) for name in light_phases}
    full = other_light = 0.0
    for phase, duration in clock.durations.items():
        if phase is Phase.REPLAY:
            continue
        steps = duration.amount * (plain_epoch_steps or 0) if duration.kind == "epochs" else duration.amount
        if phase in light:
            other_light += steps
        else:
            full += steps
    replay = replay_steps_for_budget(budget, fraction, full, other_light, clock.warmup, clock.anneal)
    return Duration("steps", max(1, round(replay)))


def _lowest_budget(fraction: float, edges: float) -> float:
    # every cycled step light: the cycled part spends `fraction`; solve ratio = fraction for budget
    return fraction / (1 - edges + edges * fraction)


def _spent(fraction: float, full: float, light: float, replay: float, edges: float) -> float:
    steps, data = full + light + replay, full + (light + replay) / fraction
    ratio = steps / data
    return ratio / (1 - edges + edges * ratio)


def spent_summary(plan: StepPlan, global_step: int, budget: float | None) -> tuple[float, str]:
    """The share of the plain run's steps the run took, and the line that says it. After epochs cut short
    (:attr:`StepPlan.epochs_cut`) the share is of the plain steps over the same data, and the line says so."""
    asked = "" if budget is None else f" (budget {budget:g})"
    # after epochs cut short: the plain run over the data this run trained, not the plain run of the module
    same_data = " over the same data" if plan.epochs_cut else ""
    dropped = f" ({plan.dropped_text})" if plan.plain_dropped else ""
    cut = f" {plan.cut_note}" if plan.epochs_cut else ""
    before = plan.steps_before
    plain = plan.own_plain_steps
    if before:  # steps trained before HardSampleReplay was added saved nothing: this fit's share is its own
        spent = (global_step - before) / plain if plain > 0 else 1.0
        return spent, (
            f"the run took {global_step - before} optimizer steps from step {before} on (where "
            f"HardSampleReplay joined it), {spent:.3f} of the plain run's {plain} from there{same_data}"
            f"{dropped}{asked}.{cut}"
        )
    spent = global_step / plain if plain > 0 else 1.0
    text = f"the run took {global_step} optimizer steps, {spent:.3f} of the plain run's {plain}{same_data}"
    return spent, f"{text}{dropped}{asked}.{cut}"


#: how far above its budget a plan may spend: the replay length is solved for whole cycles, so a run ending
#: inside a cycle lands near the budget, not on it
BUDGET_TOLERANCE = 0.05


def budget_shortfall(plan: StepPlan, budget: float | None, resumed_changed: bool = False) -> str | None:
    """Why ``plan`` does not meet ``budget`` (it spends more than ``budget + BUDGET_TOLERANCE``), or ``None``.
    ``resumed_changed``: the plan was remade on a resume with other settings, whose steps before it spent
    what the checkpoint's settings did."""
    if budget is None or plan.spent <= budget + BUDGET_TOLERANCE:
        return None
    reachable = math.ceil(100 * plan.spent) / 100
    way_out = f"raise `budget` to at least {reachable:g}" if reachable < 1 else "drop `budget`"
    before = plan.from_step - plan.steps_before if resumed_changed else 0
    resumed = (
        f"its first {before} trained before the resume, with the checkpoint's settings, and "
        if before
        else ""
    )
    joined = f" from step {plan.steps_before} on" if plan.steps_before else ""
    return (
        f"`budget`={budget:g} is not met on this run: its plan takes {plan.own_steps} of the plain run's "
        f"{plan.own_plain_steps} optimizer steps{joined} ({plan.spent:.3f}), since {resumed}warm-up, bursts "
        "and anneal train full batches and a short run ends inside its first cycles. Train for more steps, "
        f"shorten `burst` or `warmup`, or {way_out}."
    )


def chooses_nothing(plan: StepPlan, batch_size: int) -> bool:
    """Whether ``plan`` has light steps but none of them can choose: no window it draws holds more than a batch
    of ``batch_size`` (a window ends at its epoch's end, and each epoch is one batch: full-batch training)."""
    return bool(plan.light_steps) and all(size <= batch_size for sizes in plan.batch_sizes for size in sizes)


def nothing_to_choose_note(
    plan: StepPlan, batch_size: int, fraction: float, samples_per_epoch: int
) -> str | None:
    """What to warn of when ``plan``'s light steps can choose nothing (:func:`chooses_nothing`): the run then
    trains every sample of every window, in as many steps as the plain run, and its end would otherwise say
    only that nothing was selected. ``None`` when they can, or for ``fraction`` 1.0 (whole batches on purpose:
    a control run)."""
    if fraction >= 1 or not chooses_nothing(plan, batch_size):
        return None
    window = window_size(batch_size, fraction)
    head = (
        f"mode='steps' can select nothing in this run: a light step trains {batch_size} samples chosen from a "
        f"window of {window} (batch_size / replay_fraction, rounded)"
    )
    if window <= batch_size:
        return (
            f"{head}, no more than it trains, so every window is a batch trained whole. Use a lower "
            "replay_fraction or a larger batch_size, or mode='batch'."
        )
    return (
        f"{head}, a window ends at its epoch's end, and an epoch holds {samples_per_epoch} samples (one "
        "batch: full-batch training), so every window is a batch trained whole, in as many steps as without "
        "HardSampleReplay. Use mode='batch', which cuts each batch to its hardest replay_fraction share, or a "
        f"batch_size well below the epoch's {samples_per_epoch} samples, so that a window holds more samples "
        "than a step trains."
    )


def plan_summary(
    plan: StepPlan,
    budget: float | None,
    run_steps: int | None = None,
    batch_size: int | None = None,
    scores_kept: bool = False,
) -> str:
    """One line for the log: the planned steps against plain, and the budget if one was asked for.
    ``run_steps``: the steps the run takes, where ``max_epochs`` ends it before ``plan.total_steps`` (see
    :meth:`StepPlan.run_steps`); the line states what the run will do, not the checkpoint's total.
    ``batch_size``: the batches' ``B``, to say when no light step can choose (:func:`chooses_nothing`).
    ``scores_kept``: a plan that joins the run at ``plan.steps_before`` because the checkpoint's plan was
    made on another number of processes (its sample scores restored), not a HardSampleReplay added on a
    resume (no state of its own from before)."""
    nothing = batch_size is not None and chooses_nothing(plan, batch_size)
    if run_steps is not None and run_steps != plan.total_steps:
        plan = replace(plan, total_steps=run_steps, data_steps=None)
    light = f"{plan.light_steps} in light phases"
    if nothing:
        light += ", none of which can choose: no window holds more samples than its batch"
    if plan.from_step > plan.steps_before:  # a resume plans the rest of the run: its light steps
        rest = plan.total_steps - plan.from_step
        light = f"{plan.light_steps} of the {rest} from step {plan.from_step} on in light phases"
    # HardSampleReplay added on a resume (or re-planned): the rest of the run is its plan
    if plan.steps_before:
        head = (
            f"HardSampleReplay(mode='steps') planned this run again from step {plan.steps_before} on, with "
            "the sample scores it restored"
            if scores_kept
            else f"HardSampleReplay(mode='steps') joined this run at step {plan.steps_before}, with no state "
            "of its own from before"
        )
        text = (
            f"{head}: the rest of the run's data, from there on, takes {plan.own_steps} "
            f"optimizer steps instead of {plan.own_plain_steps} ({plan.spent:.3f}x; {light}"
            f"{plan.dropped_note})"
        )
        return text if budget is None else text + f", for a budget of {budget:g}"
    text = (
        f"the run's data takes {plan.total_steps} optimizer steps instead of {plan.own_plain_steps} "
        f"({plan.spent:.3f}x; {light}{plan.dropped_note})"
    )
    if budget is not None:
        text += f", for a budget of {budget:g}"
    return text


def plan_settings(
    clock: PhaseClock | None, budget: float | None, fraction: float, light_phases: Iterable[str]
) -> dict[str, Any]:
    """The settings a step plan is made of, besides the run's length and data: HardSampleReplay's replay
    fraction and light phases, and the PulseCycle's phase lengths (the replay one as its ``budget`` set it),
    warm-up, anneal and budget. Saved with the plan, so that a resume with other settings plans anew."""
    settings: dict[str, Any] = {
        "replay_fraction": float(fraction),
        "phases": sorted(Phase(name).value for name in light_phases),
    }
    if clock is not None:
        settings |= {phase.value: str(duration) for phase, duration in clock.durations.items()}
        settings |= {"warmup": clock.warmup, "anneal": clock.anneal, "budget": budget}
    return settings


def settings_change(saved: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """The settings that differ between a checkpoint's plan (``saved``, ``None``: a checkpoint saved before
    they were) and this run's, each with both values; ``None`` where none does, or where a PulseCycle was
    added or removed (said on its own: :func:`resumed_plan_change`)."""
    if saved is None or ("warmup" in saved) != ("warmup" in now):
        return None
    changed = [name for name in now if saved.get(name) != now[name]]
    by_budget = "budget" in changed and now.get("budget") is not None
    parts = []
    for name in changed:
        owner = "HardSampleReplay" if name in ("replay_fraction", "phases") else "PulseCycle"
        if name == "replay" and by_budget:
            continue  # said with the budget that set it
        part = f"{owner}'s `{name}` {_setting(saved.get(name))} -> {_setting(now[name])}"
        if name == "replay" and now.get("budget") is not None:  # the same budget, on another epoch length
            budget = f"`budget`={now['budget']:g}"
            part = f"PulseCycle's replay phase, set by {budget}, {saved.get(name)} -> {now[name]}"
        if name == "budget" and by_budget and "replay" in changed:
            part += f" (its replay phase {saved.get('replay')} -> {now['replay']})"
        parts.append(part)
    return ", ".join(parts) or None


def _setting(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


#: what a stream's restored state says about the fit's checkpoint (its resume's lines and checks): kept as they
#: are when an epoch cut short plans the rest again (:meth:`StepSavingStream.cut_pass`)
_CHECKPOINT_FACTS = (
    "saved_total_steps",
    "saved_with_cycle",
    "dropped_pass_rest",
    "resumed_at_pass_end",
    "resumed_after_cut",
    "replanned_for_another_length",
    "changed_settings",
)


class StepSavingStream:
    """Where a step-saving run stands in its data: the plan, the pass under way and what of it trained.

    The adapter (:class:`~lightning_pulse.HardSampleReplay`) calls :meth:`make_plan` at fit start,
    :meth:`sizes_for_pass` when the DataLoader starts a pass and :meth:`drawn` for every batch. The state
    (epoch, raw samples of it trained, global step, planned total and the plain run's steps it was planned
    for) goes into checkpoints, so a resume mid-epoch skips what trained and follows the same plan, and a
    resume to a run of another length plans the rest again. A batch drawn whose step never ran through (an
    exception inside ``training_step``, saved by ``OnExceptionCheckpoint``) did not train: the adapter says so
    at :meth:`checkpoint` and the state leaves it out, so the resume trains it.
    """

    def __init__(self) -> None:
        self.plan: StepPlan | None = None
        self.epoch = 0
        self.samples = 0  # raw samples of this epoch's trained batches
        self.batches = 0  # this epoch's trained batches
        # the step the pass started at and the score prior then: what a sampler choosing ahead reads
        self.pass_step = 0
        self.pass_prior = math.nan
        # a resumed pass's first cuts, made before a rollback and saved (StepSavingLoader.checkpoint)
        self.given_cuts: list[Any] = []
        # under DDP, every rank's such cuts (rank r's at [r]); None in a checkpoint that holds rank 0's only
        self.given_cuts_of_ranks: list[list[Any]] | None = None
        # a resumed pass's scores as they stood at its start, of the samples it trained before the checkpoint
        # (SampleScoreTable.pass_start_state; None: none saved)
        self.given_pass_scores: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None
        self._first_pass = True
        self._plain_pass: list[int] = []
        self.resumed_at_pass_end = False  # the checkpoint was saved on the last batch of a pass
        # the pass was cut short and the rest of the run planned again (cut_pass), and no pass began since;
        # a checkpoint saved then (in the cut epoch's end hooks) says so: its resume closes that epoch
        self.cut_pending = False
        self.resumed_after_cut = False
        self.replanned_for_another_length = False  # a resume to another run length remade the saved plan
        # the plan's settings (plan_settings), and those that differ from the checkpoint's: the saved plan
        # is remade for them (see settings_change)
        self.settings: dict[str, Any] | None = None
        self.changed_settings: str | None = None
        # the checkpoint's planned total and whether a PulseCycle's clock planned it (None: no checkpoint, or
        # one saved before it was recorded), and whether one plans this run: see resumed_plan_change
        self.saved_total_steps: int | None = None
        self.saved_with_cycle: bool | None = None
        self.with_cycle = False
        self.trained_samples = 0  # raw samples of the run's trained batches, all epochs
        self.latest = 0  # raw samples of this pass's latest batch drawn (0: none drawn yet)
        # a restored or final state, while no pass runs: what a checkpoint saves then (see checkpoint)
        self.held: dict[str, Any] | None = None
        self._joined_at: tuple[int, int] | None = None  # (epoch, step): see join_at
        self._joined_epoch: int | None = None  # the epoch a plan joined the run at, saved with its state
        self.dropped_pass_rest: tuple[int, int] | None = None  # see _drop_rest_of_pass
        # the raw samples of the pass under way (None: none began), and a data pass's (samples, batch size,
        # drop_last): a pass the plan ends short of the data's is saved with its length (_short_pass_state)
        self.pass_samples: int | None = None
        self._data_pass: tuple[int, int, bool] | None = None
        # the processes the plan's counts are of (each plans its own share of the data): saved with the state,
        # so a resume on another number reads none of them as its own (see StepSavingLoader.follow_world_size)
        self.world_size: int | None = None

    @property
    def resumed_after_pass(self) -> bool:
        """Whether the checkpoint was saved where its pass had ended: on its last batch, or at the end of
        an epoch cut short (after the rest of the run was planned again), so the resume goes on with the
        next pass and Lightning's restored epoch is closed."""
        return self.resumed_at_pass_end or self.resumed_after_cut

    def scheduler_steps(self, frequency: int, accumulate: int, steps: int) -> int:
        """The steps Lightning gives a per-step LR scheduler of ``frequency`` over the plan's next ``steps``
        optimizer steps from where the fit stands (:func:`epoch_scheduler_steps` over each planned pass, the
        first from the batch the resume stands at), then over plain passes past the planned data."""
        assert self.plan is not None
        done = int((self._resume or {}).get("batches", 0))
        passes = [(done, done + len(sizes)) for sizes in self.plan.batch_sizes[:1]]
        passes += [(0, len(sizes)) for sizes in self.plan.batch_sizes[1:]]
        return run_scheduler_steps(passes, len(self._plain_pass), frequency, accumulate, steps)

    def pass_scheduler_steps(
        self, plan: StepPlan, done: int, batches: int, frequency: int, accumulate: int, steps: int
    ) -> int:
        """As :meth:`scheduler_steps`, over ``plan``'s next ``steps`` optimizer steps from batch ``done`` of
        the pass under way (of ``batches``) on, then its later passes: what an epoch ended early would have
        trained had it gone on."""
        later = plan.batch_sizes[max(0, self.epoch + 1 - plan.first_epoch) :]
        passes = [(done, batches), *((0, len(sizes)) for sizes in later)]
        return run_scheduler_steps(passes, len(self._plain_pass), frequency, accumulate, steps)

    @property
    def has_restored_state(self) -> bool:
        """Whether a checkpoint's stream state was restored (the plan goes on from it)."""
        return self._resume is not None

    @property
    def saved_world_size(self) -> int | None:
        """The processes the restored state's counts are of (``None``: none restored, or a checkpoint saved
        before they were recorded, taken as this fit's)."""
        return None if self._resume is None else self._resume.get("world_size")

    def forget_restored(self) -> None:
        """Drop the restored state (a plan of another number of processes): the fit plans as if the checkpoint
        held none, and saves its own."""
        self._resume = self.held = None

    def join_at(self, epoch: int, step: int) -> None:
        """Plan from the start of ``epoch`` at optimizer ``step``, where the fit goes on from a checkpoint
        that holds no stream state (a HardSampleReplay added on a resume): only the epochs left are planned,
        and the steps before count as plain ones, not as the plan's."""
        self._joined_at = (int(epoch), int(step))

    def make_plan(
        self,
        clock: PhaseClock | None,
        light_phases: Iterable[str],
        settings: dict[str, Any] | None = None,
        lightning_epoch: int | None = None,
        whole_pass: bool = False,
        keep_total: bool = False,
        **run: int | bool | None,
    ) -> StepPlan:
        """Plan the run from where it stands (a restored state, or its start). ``run`` holds
        :func:`plan_steps`' ``batch_size``, ``fraction``, ``samples_per_epoch``, ``max_epochs``, ``max_steps``,
        ``accumulate`` and ``drop_last``; ``settings`` the plan's :func:`plan_settings`. A resume whose
        settings differ from the checkpoint's plans the rest of the run again, from where it stands: the
        saved total and span belong to the old settings (a budget added kept the old length, and the run ended
        its data inside a replay phase, its anneal never reached). ``lightning_epoch``: the epoch Lightning's
        restored loops go on with (:meth:`_drop_rest_of_pass`; ``whole_pass``: also a pass that trained no
        batch, as :meth:`cut_pass` drops one; ``keep_total``: the saved total and span stay, even so)."""
        samples_per_epoch, batch_size = int(run["samples_per_epoch"] or 0), int(run["batch_size"] or 1)
        self._plain_pass = _plain_sizes(samples_per_epoch, batch_size, bool(run["drop_last"]))
        self._data_pass = (samples_per_epoch, batch_size, bool(run["drop_last"]))
        joined = self._resume is None and self._joined_at is not None
        if joined:  # the plain epochs before it trained their every sample
            epoch, step = self._joined_at  # type: ignore[misc]
            trained = epoch * sum(self._plain_pass)
            self._resume = {"epoch": epoch, "samples": 0, "batches": 0, "step": step, "trained": trained}
        resume = self._resume
        self.resumed_at_pass_end = False
        self.resumed_after_cut = bool((resume or {}).get("after_cut"))
        # a pass the plan ended short of the data's (the run's last, or one planned after an epoch cut short
        # under max_steps) ends at its own length: not a stop inside the epoch
        pass_samples = samples_per_epoch if resume is None else resume.get("pass_samples", samples_per_epoch)
        if resume is not None and _pass_ended(resume["samples"], pass_samples, batch_size, run["drop_last"]):
            # saved at an epoch's end: the run resumes at the next epoch's start
            self.resumed_at_pass_end = resume["batches"] > 0  # on the pass's last batch, not after the epoch
            resume.update(epoch=resume["epoch"] + 1, samples=0, batches=0)
        accumulate = max(1, int(run["accumulate"] or 1))
        self.dropped_pass_rest = self._drop_rest_of_pass(
            lightning_epoch, samples_per_epoch, accumulate, whole_pass
        )
        resume = resume or {}
        saved_total, saved_cycle = resume.get("total_steps"), resume.get("pulse_cycle")
        self.saved_total_steps = None if saved_total is None else int(saved_total)
        self.saved_with_cycle = None if saved_cycle is None else bool(saved_cycle)
        self.with_cycle = clock is not None
        self.settings = settings
        saved_settings = resume.get("settings")
        self.changed_settings = None if settings is None else settings_change(saved_settings, settings)
        # a joined plan: the steps before the join in this fit's plain epochs (the earlier fit may have taken
        # another number an epoch); max_steps, a global step, counts the steps the earlier fit really took
        steps_before = resume["step"] if joined else resume.get("steps_before", 0)
        joined_epoch = self._joined_at[0] if joined else resume.get("joined_epoch")  # type: ignore[index]
        plain_epoch_steps = math.ceil(len(self._plain_pass) / accumulate)
        plain_before = steps_before if joined_epoch is None else int(joined_epoch) * plain_epoch_steps
        if steps_before and run["max_steps"] is not None:
            run = {**run, "max_steps": int(run["max_steps"]) - steps_before + plain_before}
        self._joined_epoch = joined_epoch if steps_before else None
        self.plan = plan_steps(
            clock,
            light_phases,
            start_epoch=resume.get("epoch", 0),
            start_samples=resume.get("samples", 0),
            start_step=resume.get("step", 0),
            total_steps=None
            if (self.changed_settings or self.dropped_pass_rest) and not keep_total
            else resume.get("total_steps"),
            start_trained=resume.get("trained"),
            planned_plain_steps=resume.get("plain_steps"),
            start_batches=resume.get("batches", 0),
            **run,  # type: ignore[arg-type]
        )
        if steps_before:
            self.plan = replace(self.plan, steps_before=steps_before, plain_before=plain_before)
        if plain_dropped := int(resume.get("plain_dropped", 0)):
            self.plan = replace(self.plan, plain_dropped=plain_dropped)
        if epochs_cut := int(resume.get("epochs_cut", 0)):
            self.plan = replace(
                self.plan, epochs_cut=epochs_cut, sampler_cuts=int(resume.get("sampler_cuts", 0))
            )
        saved_plain_steps = resume.get("plain_steps")
        self.replanned_for_another_length = saved_plain_steps not in (None, self.plan.plain_steps)
        # a checkpoint of an older version holds no count: its plain passes' samples, as plan_steps reckons
        passes = resume.get("epoch", 0) * sum(self._plain_pass) + resume.get("samples", 0)
        self.trained_samples = resume.get("trained", passes)
        self._first_pass = True
        return self.plan

    def _drop_rest_of_pass(
        self,
        lightning_epoch: int | None,
        samples_per_epoch: int,
        accumulate: int = 1,
        whole_pass: bool = False,
    ) -> tuple[int, int] | None:
        """``(epoch, batches trained of its pass)`` of a resumed pass that Lightning does not go on with,
        else ``None``. A checkpoint saved at a stop mid-epoch (``max_time``, ``trainer.should_stop``) in or
        after the epoch's end hooks (``ModelCheckpoint(save_last=True)``, ``trainer.save_checkpoint`` after
        the fit) marks the epoch finished, so Lightning resumes at the next one and drops the rest of it, as a
        plain run does. The plan goes on from that epoch too, with the dropped samples counted as spent (the
        plain run's data for the epochs left is what remains), and its steps from here are planned again: had
        the pass gone on under the next epoch, the plan's last pass and its anneal never trained, while its
        lines promised them. The plain run's steps over the dropped samples (its epoch's steps less those that
        reach the samples trained) are counted in ``plain_dropped``: the plan's ratios leave them out."""
        resume = self._resume
        if resume is None or not (resume["samples"] or whole_pass) or lightning_epoch != resume["epoch"] + 1:
            return None
        dropped = (resume["epoch"], resume["batches"])
        # the plain batches that reach the samples trained
        sums = list(itertools.accumulate(self._plain_pass))
        reached = min(bisect.bisect_left(sums, resume["samples"]) + 1, len(sums)) if resume["samples"] else 0
        plain_left = math.ceil(len(self._plain_pass) / accumulate) - math.ceil(reached / accumulate)
        resume["plain_dropped"] = resume.get("plain_dropped", 0) + plain_left
        rest = samples_per_epoch - resume["samples"]
        trained = resume.get("trained", resume["epoch"] * samples_per_epoch + resume["samples"])
        resume.update(epoch=lightning_epoch, samples=0, batches=0, trained=trained + rest)
        for key in _PASS_UNDER_WAY:  # of the dropped pass
            resume.pop(key, None)
        return dropped

    def cut_pass(
        self,
        clock: PhaseClock | None,
        light_phases: Iterable[str],
        step: int,
        latest_untrained: bool,
        too_long: Callable[[StepPlan], bool] | None = None,
        **run: int | bool | None,
    ) -> tuple[StepPlan, bool]:
        """Plan the rest of the run again at the end of an epoch that Lightning ended before its planned pass
        did (the module's ``on_train_batch_start`` returned -1, or the sampler ran out): the next pass starts at
        optimizer ``step``, not at the step the plan gave it, so its batches, planned for other phases, would have trained in
        these (replay windows in a burst, plain batches in the replay phase). ``latest_untrained``: the pass's
        latest batch was drawn and did not train (the one the hook returned -1 for; else the sampler ran out,
        which :attr:`StepPlan.sampler_cuts` counts). ``run``: as
        :meth:`make_plan` takes it.

        Where ``max_epochs`` bounds the run, the rest of the pass is dropped as a resume from a stop inside an
        epoch drops it (:meth:`_drop_rest_of_pass`): its samples count as spent, its plain steps are left out
        of the ratios, and the run's total and warm-up and anneal are solved again. Where ``max_steps`` alone
        bounds it, the plain run also takes ``max_steps`` steps: the samples not trained stay in the run's
        data (later epochs train them), and the total stays. The state moves to the next pass's start, so a
        checkpoint saved now resumes this plan.

        Solved again, the run may take a step or two more than planned (its anneal moved earlier, over replay
        steps); a plan that ``too_long`` rejects (it would step a per-step LR scheduler past its end) is made
        again on the old total and span instead: from here on the phases are the old plan's, over less data,
        so the run takes no more steps than planned, and its anneal stays where it was placed. Returns the
        plan and whether it kept the old total so."""
        # what describes the fit's checkpoint (its resume's lines and checks), not this cut
        kept = {name: getattr(self, name) for name in _CHECKPOINT_FACTS}
        state = self.state_dict(step, latest_untrained)
        bounded_by_epochs = run.get("max_epochs") is not None
        if not bounded_by_epochs:
            state.update(epoch=self.epoch + 1, samples=0, batches=0)
        self.load_state_dict(state)
        next_epoch = self.epoch + 1 if bounded_by_epochs else None
        plan = self.make_plan(clock, light_phases, self.settings, next_epoch, whole_pass=True, **run)
        kept_total = too_long is not None and too_long(plan)
        if kept_total:
            self.load_state_dict(state)
            plan = self.make_plan(
                clock, light_phases, self.settings, next_epoch, whole_pass=True, keep_total=True, **run
            )
            if bounded_by_epochs:  # max_epochs ends the run where its data does, short of the old total
                self.plan = plan = replace(plan, total_steps=plan.run_steps(True), data_steps=None)
        if self.dropped_pass_rest is not None:  # no batch left untrained: the sampler ran out
            cuts, by_sampler = plan.epochs_cut + 1, plan.sampler_cuts + int(not latest_untrained)
            self.plan = plan = replace(plan, epochs_cut=cuts, sampler_cuts=by_sampler)
        for name, value in kept.items():
            setattr(self, name, value)
        assert self._resume is not None
        self.epoch, self.samples, self.batches, self.latest = int(self._resume["epoch"]), 0, 0, 0
        self.cut_pending, self.pass_samples = True, None
        return plan, kept_total

    def sizes_for_pass(
        self, epoch: int, step: int = 0, prior: float = math.nan, accumulate: int = 1
    ) -> tuple[int, list[int], int]:
        """``(skip, sizes, batches)`` of the pass that starts now, at optimizer ``step`` with score ``prior``:
        raw indices already trained, the raw sizes of the batches to yield, and the epoch's batch count in all.
        The first pass of a fit is the resumed epoch (``epoch`` may not be restored yet when Lightning starts
        it), whose start step and prior come from the checkpoint."""
        assert self.plan is not None
        skip, done = 0, 0
        self.held = None  # a pass runs: the stream moves on from the restored state
        self.pass_step, self.pass_prior, self.given_cuts = int(step), float(prior), []
        self.given_cuts_of_ranks = self.given_pass_scores = None
        if self._first_pass and self._resume is not None:
            resume = self._resume
            epoch, skip, done = resume["epoch"], resume["samples"], resume["batches"]
            if resume["samples"]:  # mid-epoch: the pass began earlier
                self.pass_step = int(resume.get("pass_step", resume["step"] - done // accumulate))
                self.pass_prior = float(resume.get("pass_prior", prior))
                self.given_cuts = list(resume.get("fixed_cuts", []))
                self.given_cuts_of_ranks = resume.get("fixed_cuts_of_ranks")
                self.given_pass_scores = resume.get("pass_scores")
        self._first_pass = self.cut_pending = False
        self.epoch, self.samples, self.batches, self.latest = epoch, skip, done, 0
        sizes = self.plan.sizes_of(epoch)
        if not sizes and not skip:
            # past the plan (a resume whose saved total its data no longer fills, or a run longer than
            # planned): plain batches, so the run goes on to max_steps while its epochs allow and never loops
            # on empty epochs. A pass that ends the run is cut to its remaining steps: its last batch then
            # ends an epoch, validated where a plain epoch's end is
            sizes = list(self._plain_pass)
            remaining = self.plan.total_steps - self.pass_step
            if 0 < remaining * accumulate < len(sizes):
                sizes = sizes[: remaining * accumulate]
        self.pass_samples = skip + sum(sizes)
        return skip, sizes, done + len(sizes)

    def drawn(self, raw_samples: int) -> None:
        """Count a batch of ``raw_samples`` as the pass's next one, drawn to train now."""
        self.samples += raw_samples
        self.batches += 1
        self.trained_samples += raw_samples
        self.latest = raw_samples

    def state_dict(self, global_step: int, latest_untrained: bool = False) -> dict[str, Any]:
        """The position to resume from; ``latest_untrained``: the latest batch drawn never trained (its step
        did not run through), so it is left out and the resume draws it again, as Lightning's batch progress
        counts it out too."""
        left_out = self.latest if latest_untrained and self.batches > 0 else 0
        total = -1 if self.plan is None else self.plan.total_steps
        return (
            {
                "plain_steps": -1 if self.plan is None else self.plan.plain_steps,
                "epoch": self.epoch,
                "samples": self.samples - left_out,
                "batches": self.batches - (1 if left_out else 0),
                "step": int(global_step),
                "total_steps": total,
                "pass_step": self.pass_step,
                "pass_prior": self.pass_prior,
                "trained": self.trained_samples - left_out,
                "pulse_cycle": int(self.with_cycle),  # the plan depends on it: a resume without it plans anew
            }
            | ({} if self.world_size is None else {"world_size": self.world_size})
            | self._joined_state()
            | self._settings_state()
            | self._dropped_state()
            | self._short_pass_state()
            | ({"after_cut": 1} if self.cut_pending else {})
        )

    def _short_pass_state(self) -> dict[str, int]:
        """The raw samples of a pass the plan ends short of a pass over the data, so that a resume from its
        last batch or its epoch's end reads the pass as ended, not as stopped inside the epoch; nothing for a
        whole pass (its checkpoints are as they were)."""
        if (
            self.pass_samples is None
            or self._data_pass is None
            or _pass_ended(self.pass_samples, *self._data_pass)
        ):
            return {}
        return {"pass_samples": self.pass_samples}

    def _dropped_state(self) -> dict[str, int]:
        """The plain steps over a stopped epoch's dropped rest (``StepPlan.plain_dropped``), so a later resume
        keeps them out of the ratios, and the epochs cut short (``StepPlan.epochs_cut``); nothing where none
        were dropped (its checkpoints are as they were)."""
        if self.plan is None or not (self.plan.plain_dropped or self.plan.epochs_cut):
            return {}
        return (
            {"plain_dropped": self.plan.plain_dropped}
            | ({"epochs_cut": self.plan.epochs_cut} if self.plan.epochs_cut else {})
            | ({"sampler_cuts": self.plan.sampler_cuts} if self.plan.sampler_cuts else {})
        )

    def _joined_state(self) -> dict[str, int]:
        """The plain steps before a plan that joined the run (:meth:`join_at`), so its resume keeps counting
        them as plain; nothing for a plan from the run's start (its checkpoints are as they were)."""
        if self.plan is None or not self.plan.steps_before:
            return {}
        state = {"steps_before": self.plan.steps_before}
        return state if self._joined_epoch is None else state | {"joined_epoch": self._joined_epoch}

    def _settings_state(self) -> dict[str, Any]:
        """The settings the plan was made of (:func:`plan_settings`): a resume with others plans anew."""
        return {} if self.settings is None else {"settings": dict(self.settings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("total_steps", -1) < 0:
            self._resume = None
            return
        self._resume = {k: _resumed_value(k, v) for k, v in state.items()}

    def restore(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's state (``None``: it holds none): :attr:`held` until a pass runs, so that a fit with
        nothing left to train, or a checkpoint saved at a resumed fit's start (before its first pass: the
        stream stands at no restored position yet), saves it again as it came, and loaded for the next plan
        (:meth:`load_state_dict`)."""
        self.held = state
        if state is not None:
            self.load_state_dict(state)

    def hold(self, global_step: int) -> None:
        """At a fit's end: hold the state at ``global_step`` unless one is held, so that a checkpoint saved
        after the fit resumes it."""
        if self.held is None:
            self.held = self.state_dict(global_step)

    def checkpoint(self, global_step: int | None, latest_untrained: bool = False) -> dict[str, Any] | None:
        """What a checkpoint saves: the :attr:`held` state, else the state at ``global_step`` (``None``: none
        to give, as no fit plans this stream now), leaving out the latest batch if ``latest_untrained``."""
        if self.held is not None or global_step is None:
            return self.held
        return self.state_dict(global_step, latest_untrained)


DROPPED_PASS_REST = (
    "the checkpoint was saved at a stop inside epoch {epoch}, after {batches} batches of its pass, and "
    "Lightning resumes at epoch {next_epoch}: the rest of epoch {epoch} is not trained, as in a run without "
    "these callbacks"
)


def resumed_plan_change(stream: StepSavingStream, run_steps: int) -> str | None:
    """What changed a resumed run's length from the plan its checkpoint saved (``run_steps``: the steps this
    run takes in all): ``None`` where it did not, else the old and new lengths and the cause. Within a plan
    each step's phase decides its batch, so the plan of another callback set, or of another run length, is
    another run."""
    saved = stream.saved_total_steps
    if saved is None or saved < 0 or saved == run_steps:
        return None
    if stream.saved_with_cycle is not None and stream.saved_with_cycle != stream.with_cycle:
        cause = (
            "a PulseCycle was added since"
            if stream.with_cycle
            else "the PulseCycle it was saved with is gone"
        )
    elif stream.dropped_pass_rest is not None:
        epoch, batches = stream.dropped_pass_rest
        dropped = DROPPED_PASS_REST.format(epoch=epoch, batches=batches, next_epoch=epoch + 1)
        from_step = stream.plan.from_step if stream.plan is not None else 0
        cause = f"{dropped}; the rest of the run was planned again from step {from_step} on"
    elif stream.changed_settings:
        length = " and the run's max_epochs or max_steps" if stream.replanned_for_another_length else ""
        cause = (
            f"{stream.changed_settings}{length}; the rest of the run was planned again from step "
            f"{stream.plan.from_step if stream.plan is not None else 0} on, for them"
        )
    elif stream.replanned_for_another_length:
        cause = "the run's max_epochs or max_steps changed"
    else:  # a checkpoint saved before the settings were
        cause = (
            "the callbacks' settings changed since (PulseCycle's phase lengths, warm-up, anneal or budget, "
            "or HardSampleReplay's replay_fraction or phases)"
        )
    return f"the checkpoint's plan was {saved} optimizer steps, this run plans {run_steps}: {cause}"


def epoch_scheduler_steps(done: int, stop: int, batches: int, frequency: int, accumulate: int) -> int:
    """The steps Lightning gives a per-step LR scheduler of ``frequency`` (its config's ``"frequency"``)
    over batches ``done + 1`` to ``stop`` of an epoch of ``batches``. Lightning steps it after a batch that
    takes an optimizer step (it closes an accumulation window: every ``accumulate``-th batch of the epoch,
    and the epoch's last) whose number in the epoch is a multiple of ``frequency``: its count restarts each
    epoch, and under accumulation it counts batches, not optimizer steps (``"frequency": 2`` with
    ``accumulate_grad_batches=2`` steps it at every optimizer step)."""
    every = math.lcm(max(1, accumulate), max(1, frequency))
    steps = max(0, stop // every - done // every)
    if done < stop == batches and batches % max(1, frequency) == 0 and batches % max(1, accumulate):
        steps += 1  # the epoch's last batch closes a short window
    return steps


def run_scheduler_steps(
    passes: Iterable[tuple[int, int]], plain_batches: int, frequency: int, accumulate: int, steps: int
) -> int:
    """The steps Lightning gives a per-step LR scheduler of ``frequency`` over a run's next ``steps``
    optimizer steps: over ``passes`` (each ``(batches trained before, batches)`` of an epoch), then over
    passes of ``plain_batches`` (a run past its planned data), up to where the steps run out."""
    accumulate, counted = max(1, accumulate), 0
    plain = itertools.repeat((0, plain_batches)) if plain_batches > 0 else ()
    for done, batches in itertools.chain(passes, plain):
        if steps <= 0:
            break
        windows = -(-batches // accumulate) - done // accumulate  # optimizer steps from batch `done` on
        stop = batches if windows <= steps else (done // accumulate + steps) * accumulate
        counted += epoch_scheduler_steps(done, stop, batches, frequency, accumulate)
        steps -= max(0, windows)
    return counted


def scheduler_end(configs: Iterable[Any], kept: Callable[[int], int]) -> list[tuple[str, int, int, int]]:
    """``(name, length, steps left, frequency)`` of each per-step LR scheduler (Lightning's scheduler configs)
    whose course (:func:`schedule_course`) the plan under way keeps within its length: ``kept(frequency)``,
    the steps Lightning gives a scheduler of that ``frequency`` over the rest of that plan
    (:meth:`StepSavingStream.pass_scheduler_steps`), are no more than its steps left (built for the plan, or
    longer: one shorter runs out anyway). Lightning also steps such a scheduler for a batch the module's
    ``on_train_batch_start`` skipped (returned -1), with no optimizer step: one built for the plan then has a
    step fewer left than the plan has optimizer steps."""
    ends = []
    for config in configs:
        course = schedule_course(config.scheduler)
        if config.interval != "step" or course is None:
            continue
        every, (length, left) = max(1, int(config.frequency or 1)), course
        if kept(every) <= max(0, left):
            ends.append((type(config.scheduler).__name__, length, max(0, left), every))
    return ends


def scheduler_outrun(
    ends: Iterable[tuple[str, int, int, int]], steps: Callable[[int], int]
) -> tuple[str, int, int, int, int] | None:
    """``(name, length, steps left, frequency, steps given)`` of the first of :func:`scheduler_end`'s
    schedulers that ``steps(frequency)`` scheduler steps (a new plan's, as Lightning counts them) would step
    past its end; ``None`` where none."""
    for name, length, left, every in ends:
        if (given := steps(every)) > left:
            return name, length, left, every, given
    return None


def scheduler_overrun(
    configs: Iterable[Any], steps: Callable[[int], int]
) -> tuple[str, int, int, int] | None:
    """``(name, length, steps it is given, frequency)`` of the first per-step LR scheduler (Lightning's
    scheduler configs) that raises past its end (:func:`raises_past_end`) and that its steps so far plus
    ``steps(frequency)`` (the steps Lightning gives it over the run's rest, as it counts them) would step
    past its :func:`schedule_course`'s length; ``None`` where none. The plain run overruns such a length too
    (``"frequency": 2`` under ``accumulate_grad_batches=2`` steps it at every optimizer step): the fit
    crashed mid-run ("Tried to step 13 times") where the count was known at fit start (a review)."""
    for config in configs:
        course = schedule_course(config.scheduler)
        if config.interval != "step" or course is None or not raises_past_end(config.scheduler):
            continue
        every, (length, left) = max(1, int(config.frequency or 1)), course
        if (given := steps(every)) > left:
            return type(config.scheduler).__name__, length, length - left + given, every
    return None


def raises_past_end(scheduler: Any) -> bool:
    """Whether stepping an LR scheduler past its course's end raises (``OneCycleLR``; a ``ChainedScheduler``
    holding one; a ``SequentialLR`` whose last scheduler does): others go on past it (a cosine turns back
    up, a linear decay holds), as the user may mean."""
    if type(scheduler).__name__ == "OneCycleLR":
        return True
    inner = getattr(scheduler, "_schedulers", None) or ()
    if _milestones(scheduler) is not None:
        return bool(inner) and raises_past_end(inner[-1])
    return any(raises_past_end(child) for child in inner)


def scheduler_past_end(
    configs: Iterable[Any],
    step: int,
    saved_total: int,
    run_steps: int,
    scheduler_steps: Callable[[int, int], int] | None = None,
) -> tuple[str, int] | None:
    """``(name, length)`` of a restored per-step LR scheduler (Lightning's scheduler configs: ``interval``,
    ``frequency``, ``scheduler``) that the saved plan of ``saved_total`` steps stepped within its length
    and a resumed run of ``run_steps`` steps, at optimizer ``step`` now, steps past it (``OneCycleLR``
    raises there mid-run); ``None`` where none does. Its length and steps so far are its
    :func:`schedule_course`'s. ``scheduler_steps(frequency, steps)``: the steps Lightning gives a scheduler
    of that ``frequency`` over the run's next ``steps`` optimizer steps (:meth:`StepSavingStream.
    scheduler_steps`: per epoch, as Lightning counts); ``None``: one per ``frequency`` optimizer steps of the
    run (a run whose epochs are not known here). The saved plan's epochs are not in the checkpoint: its
    steps are counted over the first ``saved_total`` steps of this run's."""
    if scheduler_steps is None:

        def scheduler_steps(every: int, steps: int) -> int:
            return (step + steps) // every - step // every

    for config in configs:
        course = schedule_course(config.scheduler)
        if config.interval != "step" or course is None:
            continue
        every, (length, left) = max(1, int(config.frequency or 1)), course
        position = length - left  # its steps so far
        saved, run = (scheduler_steps(every, total - step) for total in (saved_total, run_steps))
        if position + saved <= length < position + run:
            return type(config.scheduler).__name__, length
    return None


def resumed_without_plan(
    configs: Iterable[Any], step: int, saved_total: int | None, run_steps: float
) -> str | None:
    """A PulseCycle resumed from a checkpoint a step-saving plan of ``saved_total`` steps made (``None``: none
    did), with no such plan now (the HardSampleReplay left out): a warning where the run's ``run_steps``
    differ, ``None`` where they do not.

    Raises:
        PulseRefusal: where a restored per-step scheduler (``configs``, at optimizer ``step``) would be
            stepped past its end.
    """
    if saved_total is None or not math.isfinite(run_steps) or int(run_steps) == saved_total:
        return None
    change = (
        f"the checkpoint's step-saving plan was {saved_total} optimizer steps, this run without a "
        f"HardSampleReplay(mode='steps') takes {int(run_steps)}"
    )
    if past := scheduler_past_end(configs, step, saved_total, int(run_steps)):
        raise PulseRefusal(
            f"PulseCycle: the per-step {past[0]} restored from the checkpoint spans {past[1]} steps, and "
            f"this run would step it past its end ({change}). Resume with the HardSampleReplay the "
            "checkpoint was saved with, or start a new run."
        )
    return f"PulseCycle: {change}; the resumed run is not the one the checkpoint saved."


#: what a checkpoint saves of the pass under way, for a resume inside it
_PASS_UNDER_WAY = ("pass_step", "pass_prior", "fixed_cuts", "fixed_cuts_of_ranks", "pass_scores")


def _resumed_value(name: str, value: Any) -> Any:
    if name == "settings":
        return dict(value)
    if name == "fixed_cuts":
        return list(value)
    if name == "fixed_cuts_of_ranks":
        return [list(cuts) for cuts in value]
    if name == "pass_scores":
        return dict(value)
    return float(value) if name == "pass_prior" else int(value)


def _pass_ended(samples: int, samples_per_epoch: int, batch_size: int, drop_last: Any) -> bool:
    """Whether a pass that trained ``samples`` raw samples is over: all of them, or with ``drop_last`` too few
    left for a batch (as ``_simulate`` ends a planned pass; a light window may take a short rest a plain pass
    drops, so a pass can end anywhere in that last batch's reach)."""
    left = samples_per_epoch - samples
    return left <= 0 or (bool(drop_last) and left < batch_size)


def schedule_lengths(scheduler: Any) -> set[int]:
    """The run lengths an LR scheduler says it was built for: ``total_steps`` (OneCycleLR), ``T_max``
    (CosineAnnealingLR), ``total_iters`` (LinearLR, PolynomialLR), the ints a ``LambdaLR``'s functions read,
    and those of the schedulers inside a ``SequentialLR`` or ``ChainedScheduler``. A SequentialLR restarts
    each scheduler at its milestone, so it also reads, on its own count, the milestone plus each length that
    ends by the next milestone, and for the last scheduler each length: its span. A warm-up and a cosine
    (``milestones=[5]``, ``T_max=59``) read 5, 59 and 64, the run they were built for. A periodic scheduler
    (``CosineAnnealingWarmRestarts``, ``StepLR``) has none.

    A function reads the ints it was given or closes over (Hugging Face's schedules are partials holding
    ``num_training_steps``), the ints held by the attributes its code names on the objects it closes over or
    is bound to (``lambda s: 1 - s / self.total`` reads the module's ``total``; so does a method reading
    ``self.total``), the module globals it names, and a callable object's own int attributes. An attribute
    read at each call from the trainer (``self.trainer.estimated_stepping_batches``) is not read: it follows
    the plan."""
    found = _ints(getattr(scheduler, name, None) for name in ("total_steps", "T_max", "total_iters"))
    for function in getattr(scheduler, "lr_lambdas", None) or ():
        found |= _function_lengths(function)
    inner = getattr(scheduler, "_schedulers", None) or ()
    milestones = _milestones(scheduler)
    for index, child in enumerate(inner):
        lengths = schedule_lengths(child)
        found |= lengths
        if milestones is not None and index:
            start = milestones[index - 1]
            stop = milestones[index] if index < len(milestones) else math.inf
            found |= {start + length for length in lengths if start + length <= stop}
    return found


def sequential_part(scheduler: Any, length: int) -> tuple[str, int, int] | None:
    """``(name, milestone, own length)`` of the scheduler inside a ``SequentialLR`` whose course ends at
    ``length`` on the SequentialLR's count (as :func:`schedule_lengths` reads it: the milestone plus one of
    its lengths, else one of its lengths alone), the latest to start where several do: the one that ends the
    decay, which a held floor (a ``ConstantLR``, a constant ``LambdaLR``) may follow. ``None``: none, or not
    a SequentialLR."""
    milestones, found = _milestones(scheduler), None
    if milestones is None:
        return None
    for shifted in (True, False):
        for index, child in enumerate(getattr(scheduler, "_schedulers", None) or ()):
            start = milestones[index - 1] if index else 0
            for own in schedule_lengths(child):
                if length == own + start * shifted:
                    found = (type(child).__name__, start, own)
        if found is not None:
            return found
    return None


def schedule_course(scheduler: Any) -> tuple[int, int] | None:
    """``(length, steps left)`` of an LR scheduler's course on its own count of steps: where it ends (the
    longest of :func:`schedule_lengths`; a ``SequentialLR``'s, where its last scheduler's does, that
    scheduler restarted at the last milestone; a ``ChainedScheduler``'s, where the first of its schedulers to end
    does) and the steps from where it stands to there (below 0: stepped past it). ``None`` for a scheduler
    without an end: no length (periodic, or constant after a warm-up), or a SequentialLR whose last scheduler
    has none (a warm-up, then ``CosineAnnealingWarmRestarts``)."""
    position = schedule_position(scheduler)
    left = _steps_left(scheduler)
    return None if left is None else (position + left, left)


def schedule_position(scheduler: Any) -> int:
    """The steps an LR scheduler has taken: its ``last_epoch``; a ``ChainedScheduler`` keeps none, and
    steps each of its schedulers once a step: theirs."""
    position = getattr(scheduler, "last_epoch", None)
    if isinstance(position, int):
        return position
    return max(
        (schedule_position(child) for child in getattr(scheduler, "_schedulers", None) or ()), default=0
    )


def _steps_left(scheduler: Any) -> int | None:
    inner = getattr(scheduler, "_schedulers", None) or ()
    if not inner:
        lengths = schedule_lengths(scheduler)
        return max(lengths) - schedule_position(scheduler) if lengths else None
    milestones = _milestones(scheduler)
    if milestones is None:  # a ChainedScheduler: its schedulers step together, and the first to end ends it
        # (a OneCycleLR raises at its own end whatever its siblings' lengths: a review)
        return min((left for child in inner if (left := _steps_left(child)) is not None), default=None)
    last, start = inner[-1], milestones[-1] if milestones else 0
    left = _steps_left(last)
    position = schedule_position(scheduler)
    if left is None or position >= start:
        return left
    # not started: the SequentialLR restarts it at step 0 of its own count at the milestone
    return start - position + schedule_position(last) + left


def _milestones(scheduler: Any) -> list[int] | None:
    """A ``SequentialLR``'s milestones (``None``: not one)."""
    milestones = getattr(scheduler, "_milestones", None)
    return [int(m) for m in milestones] if milestones is not None else None


def _ints(values: Iterable[Any]) -> set[int]:
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


def _named_attributes(owner: Any, names: Iterable[str]) -> set[int]:
    """The ints ``owner`` holds under ``names`` (properties are not run: reading one may compute anything)."""
    found: set[int] = set()
    for name in names:
        try:
            value = inspect.getattr_static(owner, name)
        except AttributeError:
            continue
        found |= _ints([value])
    return found


def _function_lengths(function: Any) -> set[int]:
    found: set[int] = set()
    if isinstance(function, functools.partial):
        found |= _ints((*function.args, *function.keywords.values()))
        function = function.func
    bound_to = getattr(function, "__self__", None)
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object: the ints it holds
        return found | _ints(vars(function).values() if hasattr(function, "__dict__") else ())
    names = code.co_names
    if bound_to is not None:
        found |= _named_attributes(bound_to, names)
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        found |= _ints([value]) or _named_attributes(value, names)
    globals_ = getattr(function, "__globals__", {})
    found |= _ints(globals_.get(name) for name in names)
    return found
