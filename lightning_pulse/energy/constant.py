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
        name: the meter's name in warnings and the report.
        source: where ``watts`` comes from, for the report (e.g. codecarbon's generic CPU).

    Raises:
        ValueError: if ``watts`` is not a finite non-negative number.
    """

    method = ESTIMATED
    name = "constant"

    def __init__(
        self, component: str, watts: float, name: str = "constant", source: str | None = None
    ) -> None:
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
        self.name = name
        self.source = source
        self._start = 0.0

    def start(self, now: float) -> None:
        self._start = now

    def read_joules(self, now: float) -> float:
        return self.watts * max(now - self._start, 0.0)

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "watts": self.watts}
        if self.source:
            described["source"] = self.source
        return described


#: the name of the CPU's last fallback when no `meters.cpu_watts` is configured
CODECARBON_DEFAULT = "codecarbon-default"


def codecarbon_default_cpu_watts() -> tuple[float, str]:
    """codecarbon's own power for a CPU it cannot identify: its generic TDP (``POWER_CONSTANT``, 85 W) x the
    share of TDP it assumes is drawn on average (``CONSUMPTION_PERCENTAGE_CONSTANT``, 0.5); with its
    source."""
    try:
        from codecarbon.external.hardware import CONSUMPTION_PERCENTAGE_CONSTANT, POWER_CONSTANT

        tdp, share = float(POWER_CONSTANT), float(CONSUMPTION_PERCENTAGE_CONSTANT)
    except Exception:  # codecarbon moved them: its documented values
        tdp, share = 85.0, 0.5
    return tdp * share, f"codecarbon's generic CPU: {tdp:g} W TDP x {share:g}"
