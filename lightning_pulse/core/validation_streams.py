"""What an evaluation outside Lightning's validation loop (PulseCycle's and ScheduledPrune's probe) says about a
module that carries tensor state from batch to batch. Plain torch.

A stateful RNN trained with truncated backpropagation keeps its hidden state on the module
(``self.state = tuple(s.detach() for s in state)``) and sets it for validation in its own
``on_validation_epoch_start`` (``self._train_state, self.state = self.state, None``, or zeros of the validation
batch's size). The probe calls none of the module's validation hooks: an ``on_validation_epoch_end`` may log, an
``on_validation_epoch_start`` may swap EMA weights or submodules in, freeze the model, register forward hooks or
set flags that ``training_step`` reads, until the end hook undoes them. Running them outside the loop was tried
(pass 46) and left such changes in training (a review: a swapped submodule trained, a flag stayed set, a frozen
model crashed the next backward, a capture hook grew every step). So the probe evaluates from the state training
carries, and says so once a fit where the module resets that state for validation (:func:`state_reset_note`);
a ``validation_step`` that fails from it (a validation batch of another size than training's: torch's
``Expected hidden[0] size``) switches the probe off for the fit with a warning (:class:`ProbeFailed`), which
every rank learns, instead of ending the run.
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch import nn

from lightning_pulse.core.carried_state import carried_tensors, tensors_in

#: the module's hooks that run before its first validation batch, in Lightning's order
START_HOOKS = ("on_validation_start", "on_validation_epoch_start")


def overridden_start_hooks(module: nn.Module) -> list[str]:
    """The names of :data:`START_HOOKS` that ``module``'s class overrides (Lightning's own do nothing)."""
    return [
        name
        for name in START_HOOKS
        if getattr(type(module), name, None) is not getattr(pl.LightningModule, name, None)
    ]


def state_reset_note(module: nn.Module, owner: str, off_switch: str) -> str | None:
    """The note for a module that carries tensor state between batches (:func:`carried_tensors`, holding
    tensors now) and has validation-start hooks of its own, where it may reset that state: the probe evaluates
    from the training stream's state, so its figures may differ from Lightning's validation. ``None`` for any
    other module (the probe's figures are the validation's)."""
    carried = [name for name, value in carried_tensors(module).items() if tensors_in(value)]
    hooks = overridden_start_hooks(module)
    if not carried or not hooks:
        return None
    names = ", ".join(f"`{name}`" for name in carried[:3]) + (
        f" and {len(carried) - 3} more" if len(carried) > 3 else ""
    )
    return (
        f"{owner}: the module carries tensor state from batch to batch ({names}) and has its own "
        f"`{hooks[-1]}`, where a stateful model resets that state for validation; the evaluation probe calls "
        "none of the module's validation hooks (they may swap weights, freeze the model or set flags until their "
        "end hooks undo it), so it evaluates from the state training carries, and its figures may differ from "
        f"Lightning's validation. Said once a fit; `{off_switch}` turns the probe off."
    )


class ProbeFailed(Exception):
    """The probe's ``validation_step`` raised, on this rank (``error``) or on another (``None``)."""

    def __init__(self, error: Exception | None) -> None:
        super().__init__(repr(error))
        self.error = error

    def message(self, owner: str, off_switch: str) -> str:
        """The warning: what raised, why it may have (carried state), and that the probe is off for the fit."""
        raised = "on another rank" if self.error is None else f"{self.error!r}"
        return (
            f"{owner}: the module's `validation_step` raised in the evaluation probe ({raised}), so the probe is "
            "off for this fit, which goes on (Lightning's validation is not affected). The probe runs "
            "`validation_step` outside Lightning's loop and calls none of the module's validation hooks: a "
            "stateful model whose `on_validation_epoch_start` resets the state it carries between batches is "
            "probed from the training stream's state (a validation batch of another size fails there). Give "
            f"validation batches the training batches' size, or turn the probe off with `{off_switch}`."
        )
