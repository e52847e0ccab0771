"""Settings placed as shares of a run, and the run's length they were placed on (:class:`PlacedShares`).

Lightning reads a run's length (``estimated_stepping_batches``) as ``max_epochs`` times the current epoch's
batches. A training DataLoader rebuilt each epoch (``reload_dataloaders_every_n_epochs``) at another length, a
growing curriculum, moves that length at every epoch, and a share placed at fit start lands elsewhere than
asked (the anneal of the last 20% of a 28-step run, read as 16 steps, never came). No later epoch's length is
known ahead, so nothing can place them right: :class:`PlacedShares` says so, once, naming each one. What is
read again at each epoch (EnergyLogger's forecast) is named apart: it follows each epoch's length, but cannot
see the epochs still to come. So does an epoch the module's ``on_train_batch_start`` ends early (it returned
-1): Lightning's length still counts whole epochs, and the run is shorter by what no epoch says ahead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


def shares_named(**settings: object) -> str:
    """The ``settings`` given as shares of the run (a ``float``; ``0.0`` places nothing), as a warning names
    them: ``"`warmup`=0.1, `anneal`=0.2"``; ``""`` when none is."""
    shares = [f"`{name}`={value!r}" for name, value in settings.items() if isinstance(value, float) and value]
    return ", ".join(shares)


@dataclass
class PlacedShares:
    """One fit's settings placed on the run's length, by the callback that placed them, and that length:
    ``steps`` optimizer steps, read while an epoch held ``batches`` batches of the DataLoader ``loader``
    refers to (weakly; the fit's first: a note of another fit, another DataLoader, starts a new record).

    Attributes:
        placed: what each callback placed (``"PulseCycle"``: ``"`warmup`=0.1, `anneal`=0.2"``).
        in_steps: the callbacks whose settings also take int optimizer steps (a way out the warning names).
        in_durations: the callbacks whose settings also take a duration (``"12h"``: another way out).
        rereads: the callbacks that read the run's length again at each epoch's end (EnergyLogger's forecast):
            not placed once, only blind to the later epochs' lengths.
        warned: whether this fit's warning was given.
        by_epochs: whether ``max_epochs`` gave ``steps`` (whole epochs, not a ``max_steps`` reached first).
    """

    loader: Callable[[], object | None]
    batches: float
    steps: float
    by_epochs: bool = False
    placed: dict[str, str] = field(default_factory=dict)
    in_steps: list[str] = field(default_factory=list)
    in_durations: list[str] = field(default_factory=list)
    rereads: list[str] = field(default_factory=list)
    warned: bool = False

    def place(
        self, owner: str, what: str, in_steps: bool, in_duration: bool = False, rereads: bool = False
    ) -> None:
        """Note that ``owner`` placed ``what`` on this length (``in_steps``: its settings take steps too;
        ``in_duration``: a duration; ``rereads``: it reads the run's length again at each epoch's end)."""
        self.placed[owner] = what
        if in_steps and owner not in self.in_steps:
            self.in_steps.append(owner)
        if in_duration and owner not in self.in_durations:
            self.in_durations.append(owner)
        if rereads and owner not in self.rereads:
            self.rereads.append(owner)

    def moved(self, epoch: int, batches: float, steps: float) -> str | None:
        """The warning, once, when epoch ``epoch`` holds ``batches`` batches and the run's length read now is
        ``steps``, not the one the settings were placed on; ``None`` otherwise, also where only the epoch's
        length moved (``max_steps`` alone bounds the run: its length is the same)."""
        if self.warned or not self.placed or batches == self.batches or steps == self.steps:
            return None
        self.warned = True
        read, now, held = _count(self.steps), _count(steps), _count(self.batches)
        return (
            f"{', '.join(self.placed)}: the training DataLoader rebuilt for epoch {epoch} "
            f"(`reload_dataloaders_every_n_epochs`) holds {_count(batches)} batches, where the epoch the "
            f"run's length was read from held {held}: the run, read as {read} optimizer steps ({now} now), "
            "has no length known ahead when its epochs change length (Lightning counts `max_epochs` times "
            f"the current epoch's batches).{self._named()} Set Trainer(max_steps=N) and leave `max_epochs` "
            f"unset, so that the run's length is known{self._ways_out()}."
        )

    def cut_short(self) -> str | None:
        """The warning, once, after an epoch ended early because the module's ``on_train_batch_start``
        returned -1, in a run whose length ``max_epochs`` gave (whole epochs); ``None`` otherwise (a run
        ``max_steps`` bounds takes its steps however its epochs end)."""
        if self.warned or not self.placed or not self.by_epochs:
            return None
        self.warned = True
        read = _count(self.steps)
        return (
            f"{', '.join(self.placed)}: an epoch ended early (the module's `on_train_batch_start` returned "
            "-1, which skips the rest of the epoch), so the run is shorter than the "
            f"{read} optimizer steps of whole epochs its length was read as (Lightning counts `max_epochs` "
            f"times the DataLoader's {_count(self.batches)} batches; no epoch says ahead where it ends)."
            f"{self._named()} Set Trainer(max_steps=N) to the run's length and leave `max_epochs` unset, so "
            f"that it is known (max_steps ends the run however its epochs end){self._ways_out()}."
        )

    def _named(self) -> str:
        """The settings placed, as the warnings name them: those placed once, and those read again."""
        read = _count(self.steps)
        named = {o: f"{o} ({what})" for o, what in self.placed.items()}
        once = [named[o] for o in named if o not in self.rereads]  # placed at fit start, never again
        again = [named[o] for o in named if o in self.rereads]  # the length read anew each epoch: no end seen
        placed = (
            f" These were placed as shares of {read} steps and will not land where asked: {', '.join(once)}."
        )
        reread = (
            " Read again at each epoch's end as `max_epochs` times that epoch's batches, so blind to the "
            f"lengths of the epochs still to come: {', '.join(again)}."
        )
        return (placed if once else "") + (reread if again else "")

    def _ways_out(self) -> str:
        """The ways out besides ``max_steps``: settings in steps, or a duration."""
        in_steps = " and ".join(f"{owner}'s" for owner in self.in_steps)
        in_steps = f"; or give {in_steps} settings as int optimizer steps" if in_steps else ""
        in_durations = " and ".join(f"{owner}'s" for owner in self.in_durations)
        return in_steps + (f'; or give {in_durations} settings as a duration ("12h")' if in_durations else "")


def _count(value: float) -> str:
    """``16`` for ``16.0``; ``inf`` (a DataLoader without a length) as it is."""
    return str(int(value)) if math.isfinite(value) and value == int(value) else str(value)
