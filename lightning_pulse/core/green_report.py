"""GreenWindow's report: JSON, Markdown and a PNG of the signal, the forecast and the schedule."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_pulse.core.green_window import (
    GreenSchedule,
    GreenWindowOptions,
    duration_text,
    write_schedule_plot,
)
from lightning_pulse.energy.report import replaced_run_line, write_text_atomic
from lightning_pulse.energy.signal import GreenSignal

REPORT_NAME = "green_window_report"


def energy_source(energy_logger: bool, watts: float | None) -> str | None:
    """Where the report's energy comes from: an attached EnergyLogger, else ``options.watts``, else nowhere."""
    if energy_logger:
        return "EnergyLogger"
    return "options.watts" if watts is not None else None


def report_record(
    status: str,
    when_dirty: str,
    schedule: GreenSchedule,
    signal: dict[str, Any] | None,
    energy_source: str | None,
    suspended: dict[str, Any] | None,
) -> dict[str, Any]:
    """What ``green_window_report.json`` holds: the mode, the policy's rule and forecast, the signal, the
    schedule's summary, every decision and every segment (GreenWindow adds the logger's ``run``)."""
    policy = schedule.policy
    return {
        "status": status,
        "when_dirty": when_dirty,
        "rule": policy.rule,
        "level": policy.level,
        "forecast": repr(policy.forecast),
        "signal": signal,
        "energy_source": energy_source,
        "summary": schedule.summary(),
        "suspended": suspended,
        "decisions": schedule.decisions,
        "segments": schedule.ledger.segments,
    }


def write_green_report(
    report: dict[str, Any],
    folder: Path,
    mean_signal: Callable[[float, float], float],
    first_forecast: tuple[list[float], list[float]] | None,
    options: GreenWindowOptions,
) -> list[Path]:
    """Write ``green_window_report.{json,md,png}`` into ``folder`` (the PNG only with matplotlib)."""
    written = [write_text_atomic(folder / f"{REPORT_NAME}.json", json.dumps(report, indent=1))]
    written.append(write_text_atomic(folder / f"{REPORT_NAME}.md", report_markdown(report)))
    segments = report["segments"]
    if segments:
        step = options.slot_s / 4
        count = int((segments[-1]["end"] - segments[0]["start"]) / step) + 1
        grid = [segments[0]["start"] + step * i for i in range(count)]
        values = [mean_signal(t, t + step) for t in grid]
        png = write_schedule_plot(
            folder / f"{REPORT_NAME}.png",
            (grid, values),
            first_forecast,
            segments,
            report["decisions"],
            options.unit,
        )
        written += [png] if png is not None else []
    return written


def write_report_safely(
    report: dict[str, Any],
    folder: Path | None,
    signal: GreenSignal,
    schedule: GreenSchedule,
    options: GreenWindowOptions,
) -> tuple[list[Path] | None, list[str]]:
    """Write ``report`` into ``folder`` (:func:`write_green_report`; ``None``: a fast_dev_run smoke test,
    which writes no files): the paths written (``None`` where none were), and the lines to warn: that it
    replaces another run's report, that the files could not be written (a report that cannot be written
    must not fail a finished run)."""
    if folder is None:
        return None, []
    replacing = replaced_run_line(folder / f"{REPORT_NAME}.json", report.get("run"), "GreenWindow")
    lines = [] if replacing is None else [replacing]
    try:
        return write_green_report(report, folder, signal.mean, schedule.first_forecast, options), lines
    except Exception as error:
        return None, [*lines, f"GreenWindow: could not write the report to {folder} ({error})."]


def money(amount: float | None, unit: str) -> tuple[str, float | None]:
    """A cost in kWh x ``unit`` (the signal a price per energy, such as ``EUR/MWh``) in money, with its name,
    where the unit says per what energy (``EUR/MWh`` -> ``EUR``, divided by 1000); else kWh x the unit."""
    currency, _, per = unit.partition("/")
    scale = {"Wh": 1000.0, "kWh": 1.0, "MWh": 1e-3, "GWh": 1e-6}.get(per.strip())
    if scale is None or not currency.strip():
        return f"kWh x {unit}", amount
    return currency.strip(), None if amount is None else amount * scale


def saving_line(summary: dict[str, Any], unit: str) -> str:
    """One line: the saving against the carbon-agnostic schedule (a loss says "more", its figures positive:
    "-0.0% less CO2 (-5.8e-05 kg)" read as a saving), the time waited (and its idle draw's CO2) and held
    light, and the step they count from where GreenWindow was added on a resume."""
    carbon = unit.startswith("gCO2")
    what = "CO2" if carbon else "cost"
    pct = summary.get("saving_pct") or 0.0
    sign = -1.0 if pct < 0 else 1.0
    if carbon:
        name, amount = "kg", summary.get("saving_kg")
    else:
        name, amount = money(summary.get("saving"), unit)
    shown = f" ({sign * amount:.4g} {name})" if amount is not None else ""
    idle = (
        f" ({summary['wait_kg']:.4g} kg CO2 idle draw, counted in the saving)"
        if summary.get("wait_kg")
        else ""
    )
    waited, light = summary.get("waited_s", 0) / 3600, summary.get("light_s", 0) / 3600
    away = summary.get("clock_away_s") or 0.0  # a forward step of the clock: booked as waited
    stepped = f" ({away / 3600:.1f} h of it a step of the clock)" if away >= 1.0 else ""
    joined = f", counted from step {summary['from_step']} on" if summary.get("from_step") else ""
    return (
        f"{abs(pct):.1f}% {'more' if pct < 0 else 'less'} {what}{shown} than the carbon-agnostic schedule; "
        f"waited {waited:.1f} h{stepped}{idle}, held light {light:.1f} h{joined}."
    )


def unmet_text(unmet: dict[str, Any] | None, cleared: dict[str, Any] | None = None) -> str:
    """The summary's ``deadline_unmet`` record as a report row: the outcome where the run's end settled it
    (``ended_at``), else the latest estimate; ``cleared``, an earlier out-of-reach finding that did not hold,
    is noted in brackets."""
    if unmet is None:
        text = "no"
    elif "ended_at" in unmet:  # settled at the run's end (GreenSchedule.finish)
        text = f"yes: the run ended {duration_text(unmet['ends_late_s'])} past it"
        if "estimated_late_s" in unmet:
            text += f" (estimated {duration_text(unmet['estimated_late_s'])} at {unmet['at']} (UTC))"
    else:
        text = (
            f"yes: at {unmet['at']} (UTC) about {duration_text(unmet['remaining_work_s'])} of work was left; "
            f"ends about {duration_text(unmet['ends_late_s'])} past it"
        )
    if cleared is None:
        return text
    how = "in reach again" if cleared.get("cleared_by") == "estimate" else "the run ended in time"
    return f"{text} (out of reach at {cleared['at']} (UTC), {how} at {cleared['cleared_at']} (UTC))"


def report_markdown(report: dict[str, Any]) -> str:
    summary = report["summary"]
    unit = str(summary.get("unit", "gCO2eq/kWh"))
    if unit.startswith("gCO2"):
        paused = ("CO2 while paused (kg)", summary.get("wait_kg"))
        saving = ("saving (kg CO2)", summary.get("saving_kg"))
    else:
        # the signal is a price per unit of energy: kWh times the signal, in money where its unit says per
        # what energy
        currency, cost = money(summary.get("wait_cost"), unit)
        paused = (f"cost while paused ({currency})", cost)
        saving = (f"saving ({currency})", money(summary.get("saving"), unit)[1])
    # a GreenWindow added on a resume (its figures are the rest of the run's): no row for a whole run
    joined = summary.get("from_step") or None
    failed = (report.get("signal") or {}).get("failed_readings")  # a live signal's, held (LiveSignal)
    rows = [
        ("status", report["status"]),
        ("counts from step", joined and f"{joined} (GreenWindow was added on a resume there)"),
        ("when dirty", report["when_dirty"]),
        ("rule", f"{report['rule']} {report['level'] if report['level'] is not None else ''}".strip()),
        ("forecast", report["forecast"]),
        ("energy from", report["energy_source"] or "none (time as a proxy)"),
        ("compute (h)", f"{summary.get('compute_s', 0) / 3600:.2f}"),
        ("waited (h)", f"{summary.get('waited_s', 0) / 3600:.2f}"),
        (
            "of it, clock steps (h)",
            f"{summary['clock_away_s'] / 3600:.2f}" if summary.get("clock_away_s") else None,
        ),
        ("held light (h)", f"{summary.get('light_s', 0) / 3600:.2f}"),
        (f"mean signal ({unit}), as run (compute)", summary.get("mean_signal_run")),
        (f"mean signal ({unit}), carbon-agnostic", summary.get("mean_signal_counterfactual")),
        ("energy while paused (kWh)", summary.get("wait_kwh")),
        paused,
        ("saving (%)", summary.get("saving_pct")),
        saving,
        ("decisions", summary.get("decisions")),
        ("live readings failed", f"{failed} (the last good reading held for each)" if failed else None),
        ("deadline (UTC)", summary.get("deadline") or "none"),
        ("deadline unmet", unmet_text(summary.get("deadline_unmet"), summary.get("deadline_cleared"))),
    ]
    rows = [(name, value) for name, value in rows if value is not None]  # unknown figures (no energy): no row
    lines = ["# GreenWindow report", "", "| | |", "|---|---|"]
    lines += [
        f"| {name} | {value if not isinstance(value, float) else f'{value:.4g}'} |" for name, value in rows
    ]
    lines += [
        "",
        "Counterfactual: the same energy spread evenly over the compute time from the same start. The energy "
        "while paused (idle draw) counts for the run, in its saving, and not for the counterfactual.",
        "",
    ]
    return "\n".join(lines)
