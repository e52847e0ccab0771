"""The dead branches of a forward: weighted layers that run but whose outputs never reach the model's output
(a WaveNet's last residual conv, ``x + self.res(z)`` computed and discarded while only the skips reach the
head).

Plain torch. torch-pruning builds its dependency graph from the autograd graph of the output it is handed, so
it never sees such a layer: the layer keeps its input width while the layer feeding it is cut, and the next
forward fails. :func:`recording_outputs` records every module call's output in a forward; :func:`find` names
the dead layers among them and gives the outputs that, handed to torch-pruning beside the model's, put them in
its graph (it then counts them as outputs, whose channels are never cut).

Structured pruning traces them only where the ordinary trace's trial cut fails
(:attr:`~lightning_pulse.core.pruning.Pruner.trace_dead_branches`), and only those outputs whose autograd
history holds a dead layer's: a loss the forward computes and discards (HF DETR's, with its box matching)
holds none, and handed to the search it kept it from finishing within its time limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_pulse.core.prune_targets import hooks_on, tensors_in


@dataclass
class DeadBranches:
    """What :func:`find` found in one forward.

    Attributes:
        layers: names of the modules holding parameters of their own whose output the model's output does not
            reach, in call order.
        outputs: the module call outputs to hand to torch-pruning beside the model's, one per unreached
            subgraph holding a dead layer, the outermost call's (a block's ``x + res(z)``, not ``res(z)``):
            the discarded add is traced too, so the channels it ties to the dead output are never cut.
    """

    layers: list[str] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)


@contextmanager
def recording_outputs(model: nn.Module) -> Iterator[list[tuple[nn.Module, Any]]]:
    """Every call of ``model``'s modules inside the block, with its output, in the order the calls end (a
    forward hook on each module, removed after; a ``torch.jit.script``'ed module refuses hooks and is left
    out)."""
    produced: list[tuple[nn.Module, Any]] = []

    def record(module: nn.Module, args: Any, output: Any) -> None:
        produced.append((module, output))

    with hooks_on(model.modules(), lambda module: module.register_forward_hook(record)):
        yield produced


def _walk(roots: Iterable[Any], *stops: set[Any]) -> set[Any]:
    """The autograd nodes reached from ``roots`` along ``next_functions``, not going through those in
    ``stops``."""
    seen: set[Any] = set()
    stack = [root for root in roots if root is not None]
    while stack:
        node = stack.pop()
        if node in seen or any(node in stop for stop in stops):
            continue
        seen.add(node)
        stack.extend(n for n, _ in getattr(node, "next_functions", ()) if n is not None)
    return seen


def find(
    output: Any, produced: Sequence[tuple[nn.Module, Any]], names: Mapping[nn.Module, str]
) -> DeadBranches:
    """The dead layers among the module calls ``produced`` in the forward that gave ``output`` (calls of a
    module holding parameters of its own none of whose outputs ``output`` reaches), and the outputs that put
    them in a trace (:class:`DeadBranches`; empty where there are none). ``names``: each module's qualified
    name. A layer's output without autograd history (run under ``no_grad``) is no trace's to see, and is not
    counted."""
    reached = _walk(t.grad_fn for t in tensors_in(output))
    dead: set[Any] = set()
    layers: list[str] = []
    for module, value in produced:
        if not any(parameter is not None for parameter in module._parameters.values()):
            continue
        # a call none of whose outputs is reached: a GRU's unused `h_n` beside its used output is no dead branch
        nodes = {tensor.grad_fn for tensor in tensors_in(value) if tensor.grad_fn is not None}
        if nodes and not nodes & reached:
            dead |= nodes
            name = names.get(module, type(module).__name__)
            if name not in layers:
                layers.append(name)
    if not dead:
        return DeadBranches()
    outputs: list[torch.Tensor] = []
    clean: set[Any] = set()  # unreached nodes whose history holds no dead layer's output (a discarded loss's)
    # the outermost call ends last: its output (a block's `x + res(z)`) holds the inner ones' (`res(z)`)
    for _, value in reversed(produced):
        for tensor in tensors_in(value):
            if tensor.grad_fn is None or tensor.grad_fn in reached or tensor.grad_fn in clean:
                continue
            history = _walk([tensor.grad_fn], reached, clean)
            if any(node in dead for node in history):
                outputs.append(tensor)
                reached |= history
            else:
                clean |= history
    return DeadBranches(layers, outputs)
