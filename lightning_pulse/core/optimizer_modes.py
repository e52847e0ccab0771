"""Optimizers that train at one point and evaluate at another (schedule-free). Plain torch.

A schedule-free optimizer (``schedulefree.SGDScheduleFree``, ``AdamWScheduleFree``, their wrappers) keeps the
parameters at a training point ``y`` while it trains and asks for ``optimizer.eval()`` before any evaluation,
which moves them to the evaluation point ``x``, and ``optimizer.train()`` after it. An evaluation run outside
Lightning's validation loop (a probe) calls none of the module's validation hooks, where a module does that,
so it has to switch the optimizers itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

Result = TypeVar("Result")


def has_evaluation_mode(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a schedule-free one: ``eval()`` and ``train()`` methods and schedule-free's
    ``train_mode`` flag (in its parameter groups, or on the optimizer in older releases). The flag is asked
    for because the two method names alone say nothing: a custom optimizer's ``train(steps)`` or an optimizer
    that is also an ``nn.Module`` must not be switched (torch's own optimizers have neither method)."""
    if not (callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None))):
        return False
    groups = getattr(optimizer, "param_groups", None) or []
    return any(isinstance(group, dict) and "train_mode" in group for group in groups) or isinstance(
        getattr(optimizer, "train_mode", None), bool
    )


def in_evaluation_mode(optimizer: Any) -> bool:
    """Whether ``optimizer`` says it is in evaluation mode already: schedule-free's ``train_mode`` flag (in
    its parameter groups, or on the optimizer in older releases) is ``False``. Unknown: training mode."""
    groups = getattr(optimizer, "param_groups", None) or []
    flags = [group["train_mode"] for group in groups if isinstance(group, dict) and "train_mode" in group]
    flag = flags[0] if flags else getattr(optimizer, "train_mode", True)
    return flag is False


@contextmanager
def evaluation_point(optimizers: Iterable[Any]) -> Iterator[list[Any]]:
    """Inside, every optimizer of ``optimizers`` with an evaluation mode (:func:`has_evaluation_mode`) that is
    training is in evaluation mode (``eval()``), so a forward sees the weights it would be evaluated at; on
    the way out each is put back (``train()``), also after an exception, and its parameters are copied back
    from before the switch: schedule-free moves them with in-place interpolations whose round trip is not
    exact (a review measured 6e-8), and a run with a probe must train as the same run without it. Yields the
    optimizers it switched. The copy is of the switched optimizers' parameters only, once per probe."""
    switched: list[Any] = []
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for optimizer in optimizers:
            if has_evaluation_mode(optimizer) and not in_evaluation_mode(optimizer):
                params = [param for group in optimizer.param_groups for param in group["params"]]
                saved += [(param, param.detach().clone()) for param in params]
                optimizer.eval()
                switched.append(optimizer)
        yield switched
    finally:
        for optimizer in reversed(switched):
            optimizer.train()
        with torch.no_grad():
            for param, value in saved:
                param.copy_(value)


def at_evaluation_point(optimizers: Iterable[Any], function: Callable[..., Result], *args: Any) -> Result:
    """``function(*args)`` inside :func:`evaluation_point` of ``optimizers``: an evaluation outside
    Lightning's validation loop (PulseCycle's maintain probe) sees the weights a schedule-free optimizer
    evaluates at."""
    with evaluation_point(optimizers):
        return function(*args)
