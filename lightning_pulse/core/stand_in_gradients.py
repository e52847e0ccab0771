"""Zero gradients that stand in for frozen parameters' missing ones until the optimizer step. Plain torch.

GradientCache freezes a parameter with ``requires_grad_(False)``: backward leaves its ``grad`` at ``None``, and
torch's optimizers skip it. Code that touches every parameter's gradient between the backward and the step
(gradient noise ``p.grad.add_(...)``, zeroing rows of an embedding's gradient, clipping by hand) then fails on
``None``, at the first freeze, hundreds of steps into a run. :class:`StandInGradients` gives such parameters a
zero gradient after each backward and takes it away (``None`` again) where the optimizer's ``step`` is about
to update them: a zero gradient would still move a parameter under weight decay or momentum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_pulse.core.snapshots import hook_around_steps


class StandInGradients:
    """Zero gradients for parameters without one, from a backward until the optimizer updates.

    Off (costs nothing) until :meth:`start` names the code that reads the gradients (``readers``). Then

    * :meth:`give` after each backward: a zero ``grad`` for each parameter given that has none, and again for
      those given one in this step that lost it since (a freezer drops frozen units' gradients);
    * as a step of an attached optimizer begins (torch's step pre hook, or a wrapped instance ``step`` through
      :func:`~lightning_pulse.core.snapshots.hook_around_steps`): where it gets a closure (Lightning's, which
      runs the backward, the hooks and the clipping), the closure is wrapped to :meth:`take_back` the zeros
      when it returns, before the update; without one the gradients are final already (AMP's ``GradScaler``
      and a closure called by hand run it before the step), so they are taken back at once;
    * :meth:`take_back` also at each batch end, for a step that never came (an AMP skip, a module stepping
      every other batch): a parameter released meanwhile starts from ``None``, not from a stand-in.

    Example::

        stand_in = StandInGradients()
        stand_in.start(["Noisy.on_before_optimizer_step"], [optimizer])
        loss.backward()
        stand_in.give(frozen_parameters)   # zeros: the user's hook may call p.grad.add_(...)
        optimizer.step()                   # frozen_parameters' grad is None again when it updates
    """

    def __init__(self) -> None:
        self.readers: list[str] = []  # the hooks that read every gradient; empty: off
        self._given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (parameter, its zero grad)
        self._hooks: dict[int, list[Any]] = {}  # optimizer id -> its step hooks' handles

    def start(
        self,
        readers: Sequence[str],
        optimizers: Iterable[torch.optim.Optimizer],
        info: Callable[[str], None] | None = None,
    ) -> None:
        """Give zero gradients from now on where ``readers`` (``"Class.hook"`` names) is not empty, taking them
        back at each step of ``optimizers``; ``info`` says so once."""
        self.detach()
        self.readers = list(readers)
        self.attach(optimizers)
        if self.readers and info is not None:
            info(f"GradientCache: {note(self.readers)}.")

    def attach(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Take the zeros back at the steps of ``optimizers`` too (a recipe may make new ones mid-fit)."""
        for optimizer in optimizers if self.readers else ():
            if id(optimizer) not in self._hooks:
                self._hooks[id(optimizer)] = hook_around_steps(optimizer, self)

    def detach(self) -> None:
        """Take the zeros back and remove the step hooks (the fit's end)."""
        self.take_back()
        for handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks = {}

    def give(self, params: Iterable[torch.Tensor] = ()) -> None:
        """A zero ``grad`` for each of ``params`` that has none, and again for those given one since the last
        :meth:`take_back` that lost it. Nothing while off."""
        if not self.readers:
            return
        for param, zero in self._given.values():
            if param.grad is None:
                param.grad = zero
        for param in params:
            if param.grad is None:
                zero = torch.zeros_like(param)
                param.grad = zero
                self._given[id(param)] = (param, zero)

    def take_back(self) -> None:
        """``grad=None`` again on every parameter given a zero one, so the optimizer skips it."""
        for param, _ in self._given.values():
            param.grad = None
        self._given = {}

    def _enter(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):  # the gradients are final: nothing runs between here and the update
            self.take_back()
            return None
        wrapped = _ThenTakeBack(closure, self)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (wrapped, *args[1:]), kwargs

    def _leave(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.take_back()  # a step that never evaluated its closure leaves no zeros behind

    def __getstate__(self) -> dict[str, Any]:  # pickled for spawning strategies and deep-copied: no tensors
        return {**self.__dict__, "_given": {}, "_hooks": {}}


class _ThenTakeBack:
    """A closure that runs ``closure`` and then :meth:`StandInGradients.take_back`: the backward and every hook
    that reads gradients ran, the update has not."""

    def __init__(self, closure: Callable[[], Any], stand_in: StandInGradients) -> None:
        self.closure, self.stand_in = closure, stand_in

    def __call__(self) -> Any:
        result = self.closure()
        self.stand_in.take_back()
        return result


def note(readers: Sequence[str]) -> str:
    """What the user's gradient hooks ``readers`` get for frozen parameters, and why they stay still."""
    shown = ", ".join(f"`{name}`" for name in readers[:3]) + (" and more" if len(readers) > 3 else "")
    return (
        f"{shown} may read every parameter's gradient, so the frozen units' parameters get a zero gradient "
        "from each backward until the optimizer step, which runs with `grad=None` for them, so they stay still"
    )
