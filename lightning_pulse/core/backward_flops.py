"""Backward FLOPs per frozen-prefix length, measured once each with ``torch.utils.flop_counter`` and scaled to
each batch by the size of its first unit's output. Plain torch."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

if TYPE_CHECKING:
    from lightning_pulse.core.freeze_units import FreezeUnit


def check_measure_flops(measure_flops: bool) -> bool:
    """``measure_flops``, checked.

    Raises:
        ValueError: naming ``measure_flops``, for anything but a bool.
    """
    if not isinstance(measure_flops, bool):
        raise ValueError(f"`measure_flops`={measure_flops!r} must be a bool.")
    return measure_flops


def _add_output_size(total: list[int], module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook: add the elements of ``output``'s first tensor (a tuple's, a mapping's, a
    ``PackedSequence``'s data) to ``total[0]``; nothing under ``no_grad`` (no backward follows)."""
    for _ in range(3):
        if isinstance(output, Mapping):
            output = next(iter(output.values()), None)
        elif isinstance(output, (tuple, list)):
            output = output[0] if output else None
        else:
            break
    if isinstance(output, torch.Tensor) and torch.is_grad_enabled():
        total[0] += output.numel()


class BackwardFlopLedger:
    """Backward FLOPs per frozen-prefix length, and the FLOPs that freezing skipped.

    Each distinct prefix length is measured once, on a real backward, with torch's FLOP formulas
    (:class:`ExactFlopCounter`, see :meth:`measuring`); length 0 (nothing frozen) is the reference. Every
    later backward adds ``flops[0] - flops[length]`` to the skipped total, each figure scaled from the size
    of the forward it was measured after to the size of this backward's forward: the elements of the units'
    outputs (:meth:`begin_forward`), which per-batch padding, length buckets, another image or batch size
    change. Exact for fixed shapes, another batch size, and backwards whose FLOPs grow in proportion to that
    size (linear layers and convolutions over more tokens or pixels); an estimate where they do not (an RNN's
    first step has no recurrent gradient: 0.5% off on a GRU tagger; self-attention's score matmuls grow with
    the square of the sequence length). :attr:`scaled_backwards` counts the backwards figured at a size other
    than their measurements'. Without :meth:`begin_forward`, or with no unit that is a module, nothing is
    scaled.
    """

    def __init__(self) -> None:
        self.flops_by_prefix: dict[int, float] = {}
        self.size_by_prefix: dict[int, float] = {}  # the forward's size at each measurement (0: unknown)
        self.skipped = 0.0
        self.reference = 0.0
        self.backwards = 0
        self.scaled_backwards = 0
        self.step_skipped = 0.0  # since the last :meth:`new_step`
        self._counter: Any = None
        self._prefix = 0
        self._hooks: list[Any] = []
        self._hooked: tuple[Any, ...] | None = None  # the model and unit names the hooks are on
        self._forward_size = [0]  # added to by the hooks :meth:`begin_forward` puts on the units
        self._sized = False  # whether a forward was watched since the last backward began
        self._size = 0.0  # the size of the forward the backward under way belongs to (0: unknown)

    def needs(self, prefix: int) -> bool:
        return prefix not in self.flops_by_prefix

    def begin_forward(self, model: nn.Module, units: Sequence[FreezeUnit]) -> None:
        """Before a training forward: count the elements of the output of the first of ``units``' modules in
        ``model`` that takes a hook (the first tensor of each call; none under ``no_grad``) until
        :meth:`begin_backward` takes the count as the backward's size. One forward hook, not one per unit:
        what a batch's shape changes (its rows, tokens or pixels) scales every unit's output alike, and the
        hook's cost is paid every step (a unit named by a parameter, the rest of the model or a
        ``torch.jit.script``-ed module takes none). It stays until the units change or :meth:`close`."""
        hooked = (id(model), id(units), len(units))
        if hooked != self._hooked:
            self._unhook()
            self._hooked = hooked
            add = functools.partial(_add_output_size, self._forward_size)
            for unit in units:
                try:
                    self._hooks.append(model.get_submodule(unit.name).register_forward_hook(add))
                except (AttributeError, RuntimeError):
                    continue
                break
        self._forward_size[0], self._sized = 0, True

    def _unhook(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._hooked = [], None

    @contextmanager
    def measuring(self, prefix: int) -> Iterator[None]:
        """Count the FLOPs of the backward run inside the block as the cost of ``prefix`` frozen units."""
        self.begin_backward(prefix)
        try:
            yield
        finally:
            self.close()

    def begin_backward(self, prefix: int) -> None:
        """Before a backward with ``prefix`` frozen units: count its FLOPs if that length is not measured yet.
        Its size is that of the forward watched since :meth:`begin_forward` (a second backward of the same
        forward keeps it)."""
        if self._sized:
            self._size, self._sized = float(self._forward_size[0]), False
        self._prefix = prefix
        if self._counter is None and self.needs(prefix):
            self._counter = ExactFlopCounter()
            self._counter.__enter__()

    def end_backward(self) -> None:
        """After the backward: store a measurement, and add what the backward skipped to the totals."""
        self._stop_counting()
        self.step_skipped += self.account(self._prefix) or 0.0

    def close(self) -> None:
        """Stop counting (also when the backward never came) and take the hooks off the units' modules."""
        self._unhook()
        self._stop_counting()

    def _stop_counting(self) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.flops_by_prefix[self._prefix] = float(counter.total)
            self.size_by_prefix[self._prefix] = self._size

    def remeasure(self) -> None:
        """Forget the per-length measurements (the model's shapes or the units changed); the totals stay."""
        self.close()
        self.flops_by_prefix, self.size_by_prefix = {}, {}

    def new_step(self) -> None:
        self.step_skipped = 0.0

    def account(self, prefix: int) -> float | None:
        """Record one backward with ``prefix`` frozen units; return the FLOPs it skipped, if known."""
        reference, scaled = self._at_size(0)
        cost, cost_scaled = self._at_size(prefix)
        if reference is None or cost is None:
            return None
        self.backwards += 1
        self.scaled_backwards += scaled or cost_scaled
        self.reference += reference
        skipped = max(reference - cost, 0.0)
        self.skipped += skipped
        return skipped

    def _at_size(self, prefix: int) -> tuple[float | None, bool]:
        """``prefix``'s measured FLOPs at the size of the backward under way, and whether that was scaled."""
        flops, measured_at = self.flops_by_prefix.get(prefix), self.size_by_prefix.get(prefix, 0.0)
        if flops is None or not measured_at or not self._size or measured_at == self._size:
            return flops, False
        return flops * self._size / measured_at, True

    @property
    def skipped_share(self) -> float | None:
        return self.skipped / self.reference if self.reference else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "flops_by_prefix": {str(k): v for k, v in self.flops_by_prefix.items()},
            "size_by_prefix": {str(k): v for k, v in self.size_by_prefix.items()},
            "skipped": self.skipped,
            "reference": self.reference,
            "backwards": self.backwards,
            "scaled_backwards": self.scaled_backwards,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # a checkpoint from before sizes were kept: its measurements are taken again, at known sizes
        sizes = state.get("size_by_prefix")
        flops = state["flops_by_prefix"] if sizes is not None else {}
        self.flops_by_prefix = {int(k): float(v) for k, v in flops.items()}
        self.size_by_prefix = {int(k): float(v) for k, v in (sizes or {}).items()}
        self.skipped = float(state["skipped"])
        self.reference = float(state["reference"])
        self.backwards = int(state["backwards"])
        self.scaled_backwards = int(state.get("scaled_backwards", 0))


class ExactFlopCounter(TorchDispatchMode):
    """Counts the FLOPs of the ops run inside it with ``torch.utils.flop_counter``'s formulas (matmuls,
    convolutions, attention), running every op exactly as called.

    Not ``FlopCounterMode``: it breaks an op without a formula into smaller ops (``aten.silu_backward``),
    which changes the gradients it measures in their last bits, so a measured step of a SiLU model (Llama,
    Mamba) no longer matched the plain run's. An op without a formula counts zero here, as the elementwise ops
    it decomposes into do there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out
