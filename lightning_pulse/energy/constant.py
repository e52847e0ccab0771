"""A configured constant power, for hardware nothing can measure: energy = watts x time. *Estimated*."""

from __future__ import annotations

import math
from typing import Any

from lightning_pulse.energy.meter import COMPONENTS, ESTIMATED, EnergyMeter


class ConstantPowerMeter(EnergyMeter):
    """Energy of a component assumed to draw ``watts`` all the time.

    Args:
        component: ``"gpu"``, ``"cpu"`` or ``"ram"``.
        watts: the assumed average draw, e.g. a CPU's TDP times a typical load.

    Raises:
        ValueError: if ``watts`` is not a finite non-negative number.
    """

    method = ESTIMATED
    name = "constant"

    def __init__(self, component: str, watts: float) -> None:
        if component not in COMPONENTS:
            raise ValueError(f"`component`={component!r} is not one of {list(COMPONENTS)}.")
        if (
            isinstance(watts, bool)
            or not isinstance(watts, (int, float))
            or not math.isfinite(watts)
            or watts < 0
        ):
            raise ValueError(f"`watts`={watts!r} must be a finite number of watts >= 0.")
        self.component = component
        self.watts = float(watts)
        self._start = 0.0

    def start(self, now: float) -> None:
        self._start = now

    def read_joules(self, now: float) -> float:
        return self.watts * max(now - self._start, 0.0)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "watts": self.watts}
