"""Which tensor state a module's ``validation_step`` carries from one validation batch to the next, so that an
evaluation outside Lightning's validation loop (PulseCycle's and ScheduledPrune's probe) starts it fresh, as
the held-out streams start. Plain torch.

A stateful RNN trained with truncated backpropagation keeps its hidden state on the module
(``self.state = tuple(s.detach() for s in state)``) and sets it aside for validation in its own
``on_validation_epoch_start`` (``self._train_state, self.state = self.state, None``): Lightning's validation
starts the held-out streams from no state. A probe calls none of the module's validation hooks (an
``on_validation_epoch_end`` may write to the logger, an ``on_validation_epoch_start`` may swap EMA weights in
until that end hook swaps them back), so it found the training stream's state in place: a validation batch of
another size crashed in the LSTM (``Expected hidden[0] size (1, 16, 32), got [1, 8, 32]``) at the first
probe, one of the same size was measured from a state no validation starts from.

:class:`ValidationStreams` learns, once a fit, with a trial ``validation_step`` on the probe's first batch
whose effects the caller undoes, which of the module's plain tensor attributes (:func:`carried_tensors`)
``validation_step`` replaces with a tensor of the batch's size: its streams' state. Every probe then sets that
state aside (``None``: the fresh state ``nn.LSTM``/``nn.GRU`` take, and the one the hook above leaves) for its
batches; the caller's ``kept_carried_state`` gives the training stream's state back afterwards. What is written
in place (a running centre), read and never replaced (a table built once) or replaced with no batch-sized
tensor (a feature centre ``(1, D)``) stays as it is, as Lightning's validation finds it. A trial that raises
where a replaced state was looked at (the shape check of a validation batch of another size) is tried again
with what it looked at set aside; failing again, the probe is switched off with a warning that says why.

Example::

    streams = ValidationStreams("PulseCycle", 'maintain_eval="none"')
    with undone(module):  # everything the trial writes comes back (the probe's contexts)
        warning = streams.learn(module, lambda: module.validation_step(batch, 0), batch_size=len(batch[0]))
    with undone(module):
        streams.set_aside(module)  # module.state is None for the probe's batches
        for i, b in enumerate(batches):
            module.validation_step(b, i)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_pulse.core.carried_state import _attribute, _ReadWatch, carried_tensors, tensors_in


class StreamsCannotStart(RuntimeError):
    """:meth:`ValidationStreams.learn` cannot start the validation streams fresh: the message names the
    callback, the state, both errors and the way out; the probe switches itself off."""


class ValidationStreams:
    """The state a module's ``validation_step`` carries between validation batches (see the module
    docstring), learnt by :meth:`learn` and set aside by :meth:`set_aside`. ``owner`` and ``off_switch``: the
    callback and its argument that turns the probe off, for the messages."""

    def __init__(self, owner: str, off_switch: str) -> None:
        self.owner = owner
        self.off_switch = off_switch
        self.names: tuple[str, ...] | None = None  # dotted attribute paths; None: not learnt yet

    def reset(self) -> None:
        """Learn again at the next probe (a new fit)."""
        self.names = None

    def set_aside(self, module: nn.Module, names: tuple[str, ...] | None = None) -> None:
        """Set each of ``names`` (the learnt ones by default) that ``module`` holds to ``None``."""
        for dotted in (self.names or ()) if names is None else names:
            owner_name, _, name = dotted.rpartition(".")
            try:
                owner = module.get_submodule(owner_name) if owner_name else module
            except AttributeError:  # the module changed since: nothing of it to set aside
                continue
            if name in vars(owner):
                setattr(owner, name, None)

    def learn(self, module: nn.Module, step: Callable[[], Any], batch_size: int | None) -> str | None:
        """Learn the streams' state from ``step`` (``validation_step`` on the probe's first batch, of
        ``batch_size`` samples where known), run once or twice: the caller undoes what it writes. Returns a
        warning when ``validation_step`` replaces such state but fails when it starts from ``None`` (the probe
        then evaluates from the state it finds, which only a module whose validation hooks keep it matches);
        raises :class:`StreamsCannotStart` when it fails both from the state found and with what it looked at
        set aside (an evaluation is a measurement: it never ends a run that Lightning's validation passes)."""
        entry = {name: tensors_in(value) for name, value in carried_tensors(module).items()}
        watch = _ReadWatch({id(tensor) for tensors in entry.values() for tensor in tensors}, looks=True)
        try:
            with watch:
                step()
        except Exception as error:
            looked = tuple(
                name for name, tensors in entry.items() if any(id(t) in watch.read for t in tensors)
            )
            if not looked:
                raise  # not the state's doing: the probe's own run raises it as it is
            self.set_aside(module, looked)
            try:
                step()
            except Exception as again:
                raise StreamsCannotStart(
                    f"{self.owner}: the module's `validation_step` raised {error!r} in the evaluation probe, "
                    f"from the state training left in {_quoted(looked)}, and {again!r} with that set aside "
                    "(`None`, as a reset in `on_validation_epoch_start` leaves a stateful RNN's), so the probe "
                    "cannot start the validation streams fresh; it calls none of the module's validation hooks. "
                    "The probe is off for this fit (Lightning's validation is not affected). Let "
                    f"`validation_step` start from `None`, or turn the probe off with `{self.off_switch}`."
                ) from error
            self.names = looked
            return None
        self.names = tuple(
            name
            for name, tensors in entry.items()
            if (now := tensors_in(_attribute(module, name)))
            and {id(t) for t in now} != {id(t) for t in tensors}
            and (batch_size is None or any(batch_size in t.shape for t in now))
        )
        if not self.names:
            return None
        self.set_aside(module)
        try:
            step()
        except Exception as error:
            names, self.names = self.names, ()
            return (
                f"{self.owner}: the module's `validation_step` replaces {_quoted(names)} at every batch, as a "
                "stateful RNN's state carried from batch to batch; the evaluation probe calls none of the "
                "module's validation hooks and starts such state fresh (`None`, as a reset in "
                f"`on_validation_epoch_start` leaves it), but from `None` it raised {error!r}. The probe "
                "evaluates from the state training left there instead, which Lightning's validation does only "
                "if the module's validation hooks keep it. Let `validation_step` start from `None`, or turn the "
                f"probe off with `{self.off_switch}`."
            )
        return None


def _quoted(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{name}`" for name in names)
