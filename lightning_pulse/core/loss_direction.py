"""Which way the optimizers move the loss a module returns: down, or up under torch's ``maximize=True``.

A module may return a reward and let the optimizer ascend it (``torch.optim.Adam(..., maximize=True)``: torch's
optimizers negate the gradient of every parameter of such a group). What a callback reads of the returned
value is then read negated, as the value the optimizers descend: StabilityGuard's spikes, HardSampleReplay's
per-sample part of the returned value, ScheduledPrune's distillation gradient added to the logits. Read at train
start: a resumed optimizer holds its checkpoint's groups by then. Plain torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_pulse.errors import PulseRefusal, first_names

#: what parameter groups that mix both directions make impossible, for StabilityGuard's refusal
SPIKE_HAS_NO_DIRECTION = (
    "a loss spike (a rise of a loss descended, a drop of one ascended) has no one direction"
)
#: the ways out a refusal names by default, after "Give every parameter group the same `maximize` ..."
LEAVE_OUT_GUARD = "or remove StabilityGuard from the callbacks"


def loss_directions(optimizers: Sequence[Any]) -> tuple[list[str], list[str]]:
    """``(ascending, descending)``: the parameter groups of ``optimizers`` that hold parameters and ascend the
    returned loss (``maximize=True``), and those that descend it (an optimizer without the flag descends it),
    named ``"group 0"`` (``"group 0 of optimizer 1"`` where there are several optimizers)."""
    several = len(optimizers) > 1
    found: dict[bool, list[str]] = {True: [], False: []}
    for index, optimizer in enumerate(optimizers):
        for position, group in enumerate(getattr(optimizer, "param_groups", None) or []):
            # a frozen group (no parameter needs a gradient) moves nothing either way
            if isinstance(group, Mapping) and any(
                getattr(p, "requires_grad", True) for p in group.get("params", ())
            ):
                which = f"group {position}" + (f" of optimizer {index}" if several else "")
                found[bool(group.get("maximize", False))].append(which)
    return found[True], found[False]


def maximizes_loss(
    optimizers: Sequence[Any],
    who: str = "StabilityGuard",
    consequence: str = SPIKE_HAS_NO_DIRECTION,
    ways_out: str = LEAVE_OUT_GUARD,
) -> bool:
    """Whether ``optimizers`` ascend the loss the module returns: torch's ``maximize=True`` in every parameter
    group that holds trainable parameters (:func:`loss_directions`). ``who`` then reads the negated loss, the
    value they descend. Several optimizers (manual optimization) each of one direction, not all the same, each
    step a loss of their own: the returned loss is then read as it is (``False``).

    Raises:
        PulseRefusal: for groups that mix ``maximize=True`` with ``False`` within one optimizer (or with one
            optimizer): the loss is ascended by some parameters and descended by others. The message names ``who``, the groups, the ``consequence``
            for ``who`` and its ``ways_out``.
    """
    directions = [loss_directions([optimizer]) for optimizer in optimizers]
    if len(directions) > 1 and not any(up and down for up, down in directions):
        # several optimizers (manual optimization), each one way: each steps a loss of its own (a GAN's players,
        # one descending a cross-entropy, one ascending a reward), so no one direction is the returned loss's;
        # it is read as the module returns it, as before the direction was read (a review)
        ups = [bool(up) for up, _ in directions if up or _]
        if len(set(ups)) > 1:
            return False
    ascending, descending = loss_directions(optimizers)
    if ascending and descending:
        raise PulseRefusal(
            f"{who} cannot tell which way this run's loss should go: parameter {first_names(ascending, 4)} "
            f"ascend it (`maximize=True`) and {first_names(descending, 4)} descend it, so {consequence}. "
            "Give every parameter group the same `maximize` (for an adversarial part, a gradient reversal "
            f"layer lets its group descend the same loss), {ways_out}."
        )
    return bool(ascending)
