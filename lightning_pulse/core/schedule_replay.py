"""StabilityGuard and a spike its rollbacks replay from the LR schedule. Plain Python and torch optimizers.

A rollback with ``rewind_lr_schedule=True`` returns the LR schedulers to the snapshot with the model. Where the
spike came from the schedule itself (a per-step ``LambdaLR`` that is x100 for five steps, a warm restart), the
rewound schedule leads the run back into it: a digits MLP rolled back 3 times to the same snapshot in 300 steps
(182 of them lost) and a longer run stopped. :class:`ScheduleReplay` reads the learning rates and scheduler
positions at flagged steps only (never per step) and tells, at a rollback, whether its incident came back at
the schedule position of an incident a rewinding rollback already returned from, with the rate far above the
snapshot's: that rollback keeps the schedule where it is, so it moves past the spike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: the learning rate at an incident's flagged steps at least this many times the snapshot's is "far above"
#: it: the schedule raised the rate since (a x100 typo, a warm restart, a warm-up's first steps). A decay or a
#: plateau cut lowers it; a linear warm-up past its first snapshot period raises it about 2x at most between
#: the snapshot and an incident ``snapshot_every + rollback_margin`` steps later
LR_RAISED_FACTOR = 4.0
#: rewinding rollbacks whose incidents' schedule positions are kept: a schedule spiking at several positions
REWOUND_KEPT = 8


def group_rates(optimizers: Sequence[Any]) -> list[list[float | None]]:
    """The learning rate of each parameter group of each optimizer (``None``: a group without a number
    ``lr``); a tensor rate (capturable optimizers) read as a float. Read at flagged steps only."""
    return [[_rate(group.get("lr")) for group in optimizer.param_groups] for optimizer in optimizers]


def saved_rates(state: Mapping[str, Any], plateau: Sequence[Any] | None = None) -> list[float | None]:
    """The learning rates of the groups in an optimizer's saved ``state_dict`` (one nesting torch's, as
    Lookahead's ``"inner"``, read inside), or ``plateau``'s where a ``ReduceLROnPlateau`` set them after the
    snapshot (what a restore sets)."""
    if plateau:
        return [_rate(rate) for rate in plateau]
    groups = state.get("param_groups")
    if groups is None:
        groups = next(
            (v["param_groups"] for v in state.values() if isinstance(v, Mapping) and "param_groups" in v), []
        )
    return [_rate(group.get("lr")) for group in groups]


def _rate(value: Any) -> float | None:
    try:
        rate = float(value)
    except (TypeError, ValueError, RuntimeError):  # a missing rate, or a tensor of several elements
        return None
    return rate if math.isfinite(rate) else None


def schedule_positions(schedulers: Sequence[Any]) -> list[int | None]:
    """Each LR scheduler's position: the steps it was stepped (torch's ``last_epoch``, the index of the rate
    it set for the coming step); ``None`` for one that keeps none."""
    positions = [getattr(scheduler, "last_epoch", None) for scheduler in schedulers]
    return [p if isinstance(p, int) and not isinstance(p, bool) else None for p in positions]


@dataclass(frozen=True)
class RateRise:
    """The highest ratio of a group's learning rate at an incident's flagged steps to the snapshot's."""

    ratio: float  # inf where the snapshot's rate was 0
    flagged: float
    snapshot: float

    @property
    def far(self) -> bool:
        return self.ratio >= LR_RAISED_FACTOR

    def said(self) -> str:
        times = "far above" if math.isinf(self.ratio) else f"{self.ratio:.3g}x"
        return f"{self.flagged:.3g} at the flagged steps, {times} the snapshot's {self.snapshot:.3g}"


def rate_rise(
    flagged: Iterable[Sequence[Sequence[float | None]]], snapshot: Sequence[Sequence[float | None]]
) -> RateRise | None:
    """The group whose learning rate at the flagged steps (``flagged``: :func:`group_rates` of each) rose the
    most above ``snapshot``'s (:func:`saved_rates` of each optimizer); ``None`` where no group compares
    (another layout, no number)."""
    best: RateRise | None = None
    for rates in flagged:
        if len(rates) != len(snapshot):
            continue
        for now_groups, then_groups in zip(rates, snapshot):
            if len(now_groups) != len(then_groups):
                continue
            for now, then in zip(now_groups, then_groups):
                if now is None or then is None or now <= 0 or then < 0:
                    continue
                ratio = now / then if then > 0 else math.inf
                if best is None or ratio > best.ratio:
                    best = RateRise(ratio, now, then)
    return best


def position_recurs(
    positions: Sequence[int | None], span: tuple[Sequence[int | None], Sequence[int | None]], margin: int
) -> bool:
    """Whether ``positions`` (an incident's first flagged step's) fall within ``span`` (the first and last
    flagged steps' positions of an incident a rewinding rollback returned from) give or take ``margin``, for
    every scheduler that keeps one (at least one must)."""
    first, last = span
    if not (len(positions) == len(first) == len(last)):
        return False
    known = [(p, a, b) for p, a, b in zip(positions, first, last) if None not in (p, a, b)]
    return bool(known) and all(a - margin <= p <= b + margin for p, a, b in known)  # type: ignore[operator]


class ScheduleReplay:
    """The books of :func:`rate_rise` and :func:`position_recurs` for StabilityGuard's rollbacks: the open
    incident's flagged steps (their rates and scheduler positions, :meth:`note`), and the positions of the
    incidents rewinding rollbacks returned from. Deterministic in all-reduced readings: DDP ranks agree."""

    def __init__(self) -> None:
        self.flagged: dict[int, tuple[list[list[float | None]], list[int | None]]] = {}
        self.rewound: list[tuple[list[int | None], list[int | None]]] = []  # (first, last) positions
        self.rise: RateRise | None = None  # the last rollback's or stop's (:meth:`decide`)
        self.kept = False  # it kept the schedule where it was (an incident the schedule replayed)

    def note(self, step: int, optimizers: Sequence[Any], schedulers: Sequence[Any], memory: int) -> None:
        """Keep the rates and scheduler positions of flagged step ``step`` (those ``memory`` steps older go)."""
        for old in [s for s in self.flagged if step - s >= memory]:
            del self.flagged[old]
        self.flagged[step] = (group_rates(optimizers), schedule_positions(schedulers))

    def decide(self, incident: Sequence[int], snapshot: Any, rewind: bool, margin: int) -> bool:
        """At a rollback or stop of ``incident`` (its flagged steps) to ``snapshot`` (``None``: none), with
        ``rewind`` (``rewind_lr_schedule``): whether to rewind the schedule. Not where the incident came
        back within ``margin`` of the schedule position of one a rewinding rollback returned from, with the
        learning rate at its flagged steps far above the snapshot's (:attr:`kept`, :attr:`rise`)."""
        noted = [self.flagged[s] for s in incident if s in self.flagged]
        self.rise = None
        if snapshot is not None and noted:
            plateau = snapshot.plateau_rates
            then = [saved_rates(state, plateau.get(i)) for i, state in enumerate(snapshot.optimizers)]
            self.rise = rate_rise((rates for rates, _ in noted), then)
        recurs = any(position_recurs(noted[0][1], span, margin) for span in self.rewound) if noted else False
        self.kept = bool(rewind and recurs and self.rise is not None and self.rise.far)
        return rewind and not self.kept

    def rolled_back(self, incident: Sequence[int], rewound: bool, restored: bool = True) -> None:
        """Book a rollback (or stop) from ``incident`` that ``restored`` a snapshot (``False``: none fitted,
        nothing changed), with the schedule ``rewound`` or not: a rewound one's first and last positions are
        kept, to tell its replay. The incident's notes go."""
        noted = [self.flagged[s] for s in incident if s in self.flagged]
        self.kept = self.kept and restored
        if rewound and restored and noted:
            self.rewound = [*self.rewound, (noted[0][1], noted[-1][1])][-REWOUND_KEPT:]
        for step in incident:
            self.flagged.pop(step, None)

    def mark(self, event: dict[str, Any]) -> None:
        """Mark the rollback's or stop's ``event`` (``EscalationPolicy.events``) that kept the schedule."""
        if self.kept:
            event["lr_schedule"] = "kept"

    def rollback_note(self) -> str:
        """What a rollback's warning adds where it kept the schedule (:meth:`decide`); else ``""``."""
        if not self.kept or self.rise is None:
            return ""
        return (
            f" The spikes came back where the rewound LR schedule brought the run again (the schedule position "
            f"of an earlier rollback's flagged steps), and the learning rate was {self.rise.said()}: this "
            "rollback keeps the LR schedule where it is, so it moves on past those steps, and returns the "
            "model and optimizer state only. The schedule is the likely cause: check it around the flagged "
            "steps (`rewind_lr_schedule=False` keeps it at every rollback)."
        )

    def stop_note(self) -> str:
        """What a stop's message adds where the learning rate at its flagged steps was far above the
        snapshot's; else ``""``."""
        if self.rise is None or not self.rise.far:
            return ""
        holds = (
            "the checkpoint keeps the schedule where it was, past the flagged steps"
            if self.kept
            else "the checkpoint holds the snapshot's schedule, which leads a resumed run back to those steps"
        )
        return (
            f" The learning rate was {self.rise.said()}: the likely cause is the learning rate schedule (or "
            f"what else sets the rate), not the data or the loss level; {holds}. Fix the schedule before "
            "training on."
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "flagged": {step: [rates, positions] for step, (rates, positions) in self.flagged.items()},
            "rewound": [[list(first), list(last)] for first, last in self.rewound],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.flagged = {int(s): (list(r), list(p)) for s, (r, p) in state.get("flagged", {}).items()}
        self.rewound = [(list(first), list(last)) for first, last in state.get("rewound", [])]
