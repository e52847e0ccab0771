"""The tensor state a module's validation starts from, so that an evaluation outside Lightning's validation loop
(PulseCycle's and ScheduledPrune's probe) starts from it too. Plain torch.

A stateful RNN trained with truncated backpropagation keeps its hidden state on the module
(``self.state = tuple(s.detach() for s in state)``) and sets it for validation in its own
``on_validation_epoch_start`` (``self._train_state, self.state = self.state, None``, or zeros of the
validation batch's size). A probe calls none of the module's validation hooks as they are (an
``on_validation_epoch_end`` may write to the logger, an ``on_validation_epoch_start`` may swap EMA weights in
until that end hook swaps them back), so it found the training stream's state in place: a validation batch of
another size crashed in the LSTM (``Expected hidden[0] size (1, 16, 32), got [1, 8, 32]``) at the first probe,
one of the same size was measured from a state no validation starts from.

:class:`ValidationStart` runs the module's own ``on_validation_start`` and ``on_validation_epoch_start`` once a
fit, where it overrides them, with everything they do undone by the caller (and the parameters given back
here: a swap of EMA weights into the model), and keeps only what they set the module's carried tensor state
(:func:`~lightning_pulse.core.carried_state.carried_tensors`) to. Every probe then sets that state so (fresh
copies), and the caller's ``kept_carried_state`` gives the training stream's back afterwards. A module whose
hooks leave that state alone (or that has none) is evaluated from the state it carries, as Lightning's
validation is; the probe still evaluates the weights being trained, not an EMA copy the hook swaps in.

Example::

    start = ValidationStart("PulseCycle", 'maintain_eval="none"')
    with undone(module):  # what the hooks write comes back (the probe's contexts)
        warning = start.learn(module)
    with undone(module):
        start.apply(module)  # module.state as the module's validation starts it
        for i, b in enumerate(batches):
            module.validation_step(b, i)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_pulse.core.carried_state import _to, carried_tensors

#: the module's hooks that run before its first validation batch, in Lightning's order
START_HOOKS = ("on_validation_start", "on_validation_epoch_start")


def overridden_start_hooks(module: nn.Module) -> list[str]:
    """The names of :data:`START_HOOKS` that ``module``'s class overrides (Lightning's own do nothing)."""
    import lightning.pytorch as pl

    return [
        name
        for name in START_HOOKS
        if getattr(type(module), name, None) is not getattr(pl.LightningModule, name, None)
    ]


class ValidationStart:
    """The carried tensor state a module's validation starts from (see the module docstring), learnt by
    :meth:`learn` and set by :meth:`apply`. ``owner`` and ``off_switch``: the callback and its argument that
    turns the probe off, for the messages."""

    def __init__(self, owner: str, off_switch: str) -> None:
        self.owner = owner
        self.off_switch = off_switch
        self.state: dict[str, Any] | None = (
            None  # dotted attribute path -> its value at the start; None: unlearnt
        )

    def reset(self) -> None:
        """Learn again at the next probe (a new fit)."""
        self.state = None

    def apply(self, module: nn.Module) -> None:
        """Set the learnt attributes of ``module`` to fresh copies of their validation-start values."""
        for dotted, value in (self.state or {}).items():
            owner_name, _, name = dotted.rpartition(".")
            try:
                owner = module.get_submodule(owner_name) if owner_name else module
            except AttributeError:  # the module changed since: nothing of it to set
                continue
            setattr(owner, name, _to(value, None))

    def learn(self, module: nn.Module) -> str | None:
        """Run the module's overridden validation-start hooks once and keep what they set its carried tensor
        state to; the caller undoes the rest, the parameters are given back here. Returns a warning where a
        hook raises (the probe then evaluates from the state it finds, as before it learnt)."""
        self.state = {}
        hooks = overridden_start_hooks(module)
        if not hooks:
            return None
        before = carried_tensors(module)
        parameters = [(parameter, parameter.detach().clone()) for parameter in module.parameters()]
        try:
            for name in hooks:
                getattr(module, name)()
        except Exception as error:
            return (
                f"{self.owner}: the module's `{name}` raised {error!r} when the evaluation probe ran it to learn "
                "the state its validation starts from (a stateful RNN's, reset there); the probe evaluates from "
                "the state it finds instead. Let the hook run outside Lightning's loop, or turn the probe off "
                f"with `{self.off_switch}`."
            )
        finally:
            with torch.no_grad():  # a hook that swaps EMA weights in: the probe evaluates the trained ones
                for parameter, kept in parameters:
                    if parameter.shape == kept.shape and not torch.equal(parameter, kept):
                        parameter.copy_(kept)
        after = carried_tensors(module)
        # the state training carried that the hooks set anew; not what they put in attributes of their own (the
        # training state set aside, `self._train_state = self.state`, or a copy of the weights an EMA swap keeps)
        self.state = {
            dotted: _to(after[dotted], None)
            for dotted, value in before.items()
            if dotted in after and after[dotted] is not value
        }
        return None
