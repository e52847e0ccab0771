"""PulseCycle's compute ``budget``: the replay length that meets it, a fit without a plan, what was spent.

A ``budget`` is met by taking fewer optimizer steps, which only a step-saving
:class:`~lightning_pulse.HardSampleReplay` does: at fit start it asks for the replay length
(:func:`fit_replay_to_budget`) and hands its plan over; a fit without a plan refuses the budget
(:func:`start_without_plan`). At fit end :func:`spent_report` says what the run took; the callback logs it.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_pulse.core.step_plan import StepPlan, replay_duration_for_budget, spent_summary
from lightning_pulse.errors import PulseRefusal, refusing
from lightning_pulse.phase import Phase, PhaseClock


def fit_replay_to_budget(
    clock: PhaseClock,
    budget: float | None,
    fraction: float,
    light_phases: Iterable[str],
    plain_epoch_steps: float | None,
) -> None:
    """Set ``clock``'s replay phase to the length (steps) that makes its run spend ``budget`` of the plain
    run's steps, light-phase steps standing for ``1 / fraction`` batches of data
    (:func:`~lightning_pulse.core.step_plan.replay_duration_for_budget`). Nothing without a ``budget``.

    Raises:
        PulseRefusal: for a clock in seconds or without a replay phase, or a budget no replay length reaches.
    """
    if budget is not None:
        with refusing("PulseCycle"):
            clock.durations[Phase.REPLAY] = replay_duration_for_budget(
                clock, budget, fraction, light_phases, plain_epoch_steps
            )


def start_without_plan(clock: PhaseClock, budget: float | None) -> None:
    """Set ``clock`` up for a fit with no step plan (no step-saving HardSampleReplay, or a steps-mode
    checkpoint resumed in batch mode): warm-up and anneal are shares of the run's length again, not of a
    pinned span.

    Raises:
        PulseRefusal: for a ``budget``, which is met by taking fewer steps: that needs the plan.
    """
    clock.pin_span(None)
    if budget is not None:
        raise PulseRefusal(
            f"PulseCycle: `budget`={budget:g} is met by taking fewer steps, which needs a HardSampleReplay "
            "in mode='steps' (its default) next to this PulseCycle; add one or drop `budget`."
        )


def spent_report(plan: StepPlan, taken: int, budget: float | None) -> tuple[float, str]:
    """The share of the plain run's steps a run of ``plan`` spent in the ``taken`` optimizer steps it took,
    and the line that says it (:func:`~lightning_pulse.core.step_plan.spent_summary`); a run that stopped
    before the plan's end (EarlyStopping, max_time: a share of a plain run it did not finish) also says what
    was planned. ``plan.plain_steps`` must not be 0."""
    spent, message = spent_summary(plan, taken, budget)
    if taken < plan.total_steps:
        joined = f" from step {plan.steps_before} on" if plan.steps_before else ""
        message += f" It stopped early: {plan.own_steps} steps{joined} ({plan.spent:.3f}) were planned."
    return spent, message
