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
``Expected hidden[0] size``), or for any other reason, switches the probe off for the fit with a warning that
names the error and, under DDP, the ranks it came from (:class:`ProbeFailed`), which every rank learns after
the batch that failed, instead of ending the run.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """The probe's ``validation_step`` raised: ``error`` is this rank's exception (``None`` where only another
    rank's raised), ``failures`` each failed rank's ``(rank, "Type: first line")`` (rank ``None`` in one
    process), the same on every rank."""

    #: the longest text of an error the warning quotes
    longest = 200

    def __init__(self, error: Exception | None, failures: Sequence[tuple[int | None, str]] = ()) -> None:
        self.error = error
        self.failures = list(failures) or ([] if error is None else [(None, self.said(error))])
        super().__init__("; ".join(text for _, text in self.failures) or "on another rank")

    @classmethod
    def said(cls, error: BaseException) -> str:
        """``error`` as the warning quotes it: its type and the first line of its text, cut to :attr:`longest`."""
        try:
            lines = str(error).strip().splitlines()
        except Exception:
            lines = []
        text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        return text if len(text) <= cls.longest else text[: cls.longest - 3] + "..."

    def _where(self) -> str:
        """Each error, with the ranks it came from where there are several processes."""
        ranks_of: dict[str, list[int]] = {}
        for rank, text in self.failures:
            ranks_of.setdefault(text, []).extend(() if rank is None else (rank,))
        parts = []
        for text, ranks in ranks_of.items():
            if not ranks:
                parts.append(f"`{text}`")
                continue
            named = [str(rank) for rank in ranks[:8]] + ([f"{len(ranks) - 8} more"] if len(ranks) > 8 else [])
            listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + f" and {named[-1]}"
            parts.append(f"`{text}` on rank{'s' if len(ranks) > 1 else ''} {listed}")
        if len(parts) > 3:  # an out-of-memory line names its device: one a rank on a large job
            parts = [*parts[:3], f"and {len(parts) - 3} more errors"]
        return "; ".join(parts) or "on another rank"

    def message(self, owner: str, off_switch: str) -> str:
        """The warning: what raised and where, that the probe is off for the fit, and the usual causes."""
        return (
            f"{owner}: the module's code raised in the evaluation probe (`validation_step`, a batch hook or a "
            f"metric's `compute`: {self._where()}), so the "
            "probe is off for this fit, which goes on (Lightning's own validation runs as before). "
            "The probe runs `validation_step` on a few validation batches during training, outside Lightning's "
            "loop: with training's memory in use, and from the state training leaves (it calls none of the "
            "module's validation hooks). Usual causes: an error in `validation_step` that Lightning's "
            "validation would meet too; running out of memory; a module that carries state between batches "
            "and resets it in its own validation hook (a validation batch of another size than training's "
            f"then fails). Fix the error named, or turn the probe off with `{off_switch}`."
        )
