"""Backward FLOPs per frozen-prefix length, measured once each with ``torch.utils.flop_counter``. Plain torch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


def check_measure_flops(measure_flops: bool) -> bool:
    """``measure_flops``, checked.

    Raises:
        ValueError: naming ``measure_flops``, for anything but a bool.
    """
    if not isinstance(measure_flops, bool):
        raise ValueError(f"`measure_flops`={measure_flops!r} must be a bool.")
    return measure_flops


class BackwardFlopLedger:
    """Backward FLOPs per frozen-prefix length, and the FLOPs that freezing skipped.

    Each distinct prefix length is measured once, on a real backward, with torch's FLOP formulas
    (:class:`ExactFlopCounter`, see :meth:`measuring`); length 0 (nothing frozen) is the reference. Every
    later backward adds ``flops[0] - flops[length]`` to the skipped total. Backwards of a different batch size
    than the measured one are counted at the measured size.
    """

    def __init__(self) -> None:
        self.flops_by_prefix: dict[int, float] = {}
        self.skipped = 0.0
        self.reference = 0.0
        self.backwards = 0
        self.step_skipped = 0.0  # since the last :meth:`new_step`
        self._counter: Any = None
        self._prefix = 0

    def needs(self, prefix: int) -> bool:
        return prefix not in self.flops_by_prefix

    @contextmanager
    def measuring(self, prefix: int) -> Iterator[None]:
        """Count the FLOPs of the backward run inside the block as the cost of ``prefix`` frozen units."""
        self.begin_backward(prefix)
        try:
            yield
        finally:
            self.close()

    def begin_backward(self, prefix: int) -> None:
        """Before a backward with ``prefix`` frozen units: count its FLOPs if that length is not measured yet."""
        self._prefix = prefix
        if self._counter is None and self.needs(prefix):
            self._counter = ExactFlopCounter()
            self._counter.__enter__()

    def end_backward(self) -> None:
        """After the backward: store a measurement, and add what the backward skipped to the totals."""
        self.close()
        self.step_skipped += self.account(self._prefix) or 0.0

    def close(self) -> None:
        """Stop counting (also when the backward never came)."""
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.flops_by_prefix[self._prefix] = float(counter.total)

    def remeasure(self) -> None:
        """Forget the per-length measurements (the model's shapes or the units changed); the totals stay."""
        self.close()
        self.flops_by_prefix = {}

    def new_step(self) -> None:
        self.step_skipped = 0.0

    def account(self, prefix: int) -> float | None:
        """Record one backward with ``prefix`` frozen units; return the FLOPs it skipped, if known."""
        reference = self.flops_by_prefix.get(0)
        cost = self.flops_by_prefix.get(prefix)
        if reference is None or cost is None:
            return None
        self.backwards += 1
        self.reference += reference
        skipped = max(reference - cost, 0.0)
        self.skipped += skipped
        return skipped

    @property
    def skipped_share(self) -> float | None:
        return self.skipped / self.reference if self.reference else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "flops_by_prefix": {str(k): v for k, v in self.flops_by_prefix.items()},
            "skipped": self.skipped,
            "reference": self.reference,
            "backwards": self.backwards,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.flops_by_prefix = {int(k): float(v) for k, v in state["flops_by_prefix"].items()}
        self.skipped = float(state["skipped"])
        self.reference = float(state["reference"])
        self.backwards = int(state["backwards"])


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
