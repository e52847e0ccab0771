"""The carbon intensity and price each part of a resumed run was counted with.

EnergyLogger's checkpoint state keeps, for each rate, its *parts*: the rate in force from a step on
(source, constant value, unit; ``None`` source: not counted), one part more at each resume that changes it.
The ledger's buckets keep the joules no rate counted (``co2_uncounted_j``, ``cost_uncounted_j``). So a
resume that

* adds a rate the run lacked reports its CO2 or cost as *partial* (not the whole run's), with one warning;
* changes a rate adds the parts, each at its own rate, and says so in one line and in the report;
* drops a rate reports no CO2 or cost, and says so;
* changes the currency of a counted cost is refused: two currencies do not add up.

Plain Python, no Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_pulse.energy.carbon import Rate
from lightning_pulse.errors import PulseRefusal

#: rate name -> (the EnergyLogger argument that sets it, the figure it gives)
RATES = {"intensity": ("carbon_intensity", "CO2"), "price": ("price_per_kwh", "cost")}
#: rate name -> the ledger bucket's field of the joules no such rate counted
UNCOUNTED_FIELD = {"intensity": "co2_uncounted_j", "price": "cost_uncounted_j"}


def rate_part(rate: Rate | None, from_step: int) -> dict[str, Any]:
    """The part of the run from optimizer step ``from_step`` on, counted with ``rate`` (``None``: not)."""
    return {
        "from_step": int(from_step),
        "source": None if rate is None else rate.source,
        "value": None if rate is None or rate.constant is None else float(rate.constant),
        "unit": None if rate is None else rate.unit,
    }


def same_rate(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a.get(key) == b.get(key) for key in ("source", "value", "unit"))


def shown(part: Mapping[str, Any]) -> str:
    """``"none"``, ``"constant 400 gCO2eq/kWh"`` or ``"series:de_2020.csv (gCO2eq/kWh)"``."""
    if part.get("source") is None:
        return "none"
    if part.get("value") is not None:
        return f"{part['source']} {part['value']:g} {part['unit']}"
    return f"{part['source']} ({part['unit']})"


def parts_line(parts: Sequence[Mapping[str, Any]]) -> str:
    """``"steps 0-30: none; from step 30: constant 400 gCO2eq/kWh"``."""
    pieces = []
    for index, part in enumerate(parts):
        if index + 1 < len(parts):
            where = f"steps {part['from_step']}-{parts[index + 1]['from_step']}"
        else:
            where = f"from step {part['from_step']}"
        pieces.append(f"{where}: {shown(part)}")
    return "; ".join(pieces)


def uncounted_steps(parts: Sequence[Mapping[str, Any]]) -> str:
    """The steps of the run no rate counted: ``"steps 0-30"``, ``"steps 0-10 and 20-30"``."""
    ranges = [
        f"{part['from_step']}-{parts[index + 1]['from_step']}"
        for index, part in enumerate(parts[:-1])
        if part.get("source") is None
    ]
    return "steps " + " and ".join(ranges) if ranges else "no steps"


def extend_parts(
    parts: list[dict[str, Any]], name: str, rate: Rate | None, step: int, uncounted_kwh: float
) -> tuple[str, str] | None:
    """Add the part from ``step`` on, counted with ``rate``, when it differs from the last of ``parts`` (the
    run before this fit: at least one part); ``name`` is a key of :data:`RATES`, ``uncounted_kwh`` the run's
    energy no rate counted. Returns what to say about the change, ``("warn" | "info", line)``, or ``None``."""
    part = rate_part(rate, step)
    before = parts[-1]
    if same_rate(before, part):
        return None
    parts.append(part)
    field, figure = RATES[name]
    if before["source"] is None:
        return "warn", (
            f"EnergyLogger: `{field}` is given on this resume (step {step}) but the run had none at "
            f"{uncounted_steps(parts)}, so its {figure} leaves out the {uncounted_kwh:.4g} kWh used there: "
            f"the report labels it partial, not the whole run's. To count the whole run, give `{field}` from "
            "its start."
        )
    if rate is None:
        return "info", (
            f"EnergyLogger: no `{field}` on this resume (step {step}); the run before counted its {figure} "
            f"with {shown(before)}: the report has no {figure}."
        )
    return "info", (
        f"EnergyLogger: `{field}` changed on this resume (step {step}): {shown(before)} before, "
        f"{shown(part)} from here; the run's {figure} adds the parts, each at its own rate (the report lists "
        "them)."
    )


def refuse_changed_currency(parts: Sequence[Mapping[str, Any]], price: Rate | None) -> None:
    """A resume that counts its cost in another currency than a part of the run before did is refused: the
    carried cost would be added to the new one under the new label."""
    if price is None:
        return
    for part in parts:
        if part.get("source") is not None and part.get("unit") != price.unit:
            old, new = _currency(part["unit"]), _currency(price.unit)
            raise PulseRefusal(
                f"EnergyLogger: `currency`={new!r} on this resume, but the checkpoint's run counted its cost "
                f"in {old!r}, and the two do not add up. Resume with `currency`={old!r} (and `price_per_kwh` "
                f"in {old}), leave `price_per_kwh` out (no cost), or start a new run."
            )


def _currency(unit: str) -> str:
    return unit.removesuffix("/kWh")
