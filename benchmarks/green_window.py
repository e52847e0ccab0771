"""GreenWindow on the real 2020 grid series: CO2 saved by waiting for clean hours, forecast against oracle.

Pure simulation (numpy, no training): a job needs ``L`` hours of compute at constant power, starts at one
of 100 moments spread over 2020 and may wait up to a delay budget (a share of ``L``), so it must finish by
``start + L * (1 + budget)``. Each arm runs the job through the library's own
:class:`~lightning_pulse.core.green_window.GreenWindowPolicy` on a
:class:`~lightning_pulse.core.green_window.SimulatedClock`, one-hour slots, pausing draws nothing:

* ``agnostic``: runs at once, the counterfactual every saving is measured against;
* ``forecast``: the default rule (adaptive: "now is among the cleanest slots the remaining work needs")
  with the default :class:`~lightning_pulse.energy.forecast.SeasonalBlendForecast`, which reads only the past;
* ``oracle``: the same rule with the series' own future (the upper bound);
* ``naive``: the same rule with "same hour on the last day" (context: what the issue calls naive).

``reference`` is the direct computation: the mean of the cleanest ``L`` hourly means of the window against
the first ``L``; the oracle arm must reproduce it. Grids: Germany (DE) and Great Britain (GB), with France
(FR, low-carbon nuclear) as the control, compared in g/kWh saved. The forecast's error (MAE, MAPE by
horizon) is measured on the same series.

The default forecast's two parameters were chosen on GB alone (``--tune`` re-runs that grid and writes
``results/green_window_tuning.{json,md}``); DE and FR are out of sample for them.

Run: ``python -m benchmarks.green_window`` (about 10 minutes on 2 shared cores). The 2020 series are read
from ``../shared/data/carbon-intensity/`` next to the repository (or in an enclosing folder), or ``--data DIR``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import RESULTS_DIR, environment
from lightning_pulse.core.green_window import GreenWindowPolicy, simulate_job, write_schedule_plot
from lightning_pulse.energy.carbon import TimeSeries, parse_timestamp
from lightning_pulse.energy.forecast import (
    DAY_S,
    OracleForecast,
    SeasonalBlendForecast,
    forecast_error,
    slot_means,
)

ROOT = Path(__file__).resolve().parents[1]
COUNTRIES = ("de", "gb", "fr")
LENGTHS_H = (12, 24, 72)
BUDGETS = (0.0, 0.25, 0.5, 1.0, 2.0)
STARTS = 100
HORIZONS_H = (1, 3, 6, 12, 24, 48, 72, 144)
YEAR_START = parse_timestamp("2020-01-01 00:00:00")
# the issue's direct cleanest-hours reference, median of 100 starts, per (country, L, budget)
ISSUE_REFERENCE = {
    ("de", 72, 1.0): "15-19%",
    ("gb", 72, 1.0): "20-22%",
    ("de", 24, 1.0): "9-10%",
    ("gb", 24, 1.0): "10-15%",
}
TUNE_GRID = {"days": (7, 14, 21), "decay_hours": (24.0, 48.0, 96.0)}


class SameHourYesterday:
    """The naive forecast: each slot is the same time of day on the most recent past day."""

    reads_future = False

    def predict(self, series: TimeSeries, now: float, starts: np.ndarray, slot_s: float) -> np.ndarray:
        ahead = starts - now
        back = np.ceil((ahead + slot_s) / DAY_S - 1e-9) * DAY_S
        forecast = slot_means(series, starts - back, slot_s)
        forecast[0] = series.value_at(now)
        return forecast


class Persistence:
    """The last value, held: every slot is the value observed now."""

    reads_future = False

    def predict(self, series: TimeSeries, now: float, starts: np.ndarray, slot_s: float) -> np.ndarray:
        return np.full(np.shape(starts), series.value_at(now))


def data_dir(given: str | None) -> Path:
    # `../shared/` next to the repository; a git worktree elsewhere finds it in an enclosing folder
    found = [Path(given)] if given else [up / "shared" / "data" / "carbon-intensity" for up in ROOT.parents]
    candidates = found if given else [c for c in found if c.is_dir()] or found[:1]
    for candidate in candidates:
        if all((candidate / f"{c}_2020.csv").is_file() for c in COUNTRIES):
            return candidate
    raise SystemExit(
        f"benchmarks.green_window: the 2020 series ({', '.join(f'{c}_2020.csv' for c in COUNTRIES)}) are not "
        f"in {candidates[0]}; pass --data DIR (the folder of the Wiesner et al. 2021 series)."
    )


def start_times() -> list[float]:
    """100 hour-aligned starts spread over 2020 (every 87.84 h, so every hour of the day comes up)."""
    return [YEAR_START + 3600.0 * round(k * 366 * 24 / STARTS) for k in range(STARTS)]


def reference_saving(series: TimeSeries, start: float, length_h: int, budget: float) -> float:
    """The cleanest ``L`` hourly means of the window against the first ``L``, in %."""
    window = int(round(length_h * (1 + budget)))
    hours = slot_means(series, start + 3600.0 * np.arange(window), 3600.0)
    return 100.0 * (1.0 - np.sort(hours)[:length_h].sum() / hours[:length_h].sum())


def quartiles(values: list[float]) -> dict[str, float]:
    p25, p50, p75 = np.percentile(values, [25, 50, 75])
    return {"median": float(p50), "p25": float(p25), "p75": float(p75)}


def run_cell(series: TimeSeries, arms: dict[str, Any], length_h: int, budget: float) -> dict[str, Any]:
    """Every arm on the 100 starts of one (series, L, budget)."""
    work, slack = 3600.0 * length_h, 3600.0 * length_h * budget
    cell: dict[str, Any] = {"arms": {}}
    per_start: dict[str, dict[str, list[float]]] = {}
    for name, forecast in arms.items():
        policy = GreenWindowPolicy(forecast)
        rows: dict[str, list[float]] = {"saving_pct": [], "g_per_kwh": [], "waited_h": [], "late_s": []}
        for start in start_times():
            deadline = start + work + slack
            result = simulate_job(policy, series, start, work, slack, deadline=deadline)
            rows["saving_pct"].append(result["saving_pct"])
            rows["g_per_kwh"].append(result["saving_per_kwh"])
            rows["waited_h"].append(result["waited_s"] / 3600.0)
            rows["late_s"].append(max(0.0, result["finished_at"] - deadline))
        per_start[name] = rows
        cell["arms"][name] = {
            "saving_pct": quartiles(rows["saving_pct"]),
            "g_per_kwh": quartiles(rows["g_per_kwh"]),
            "waited_h": quartiles(rows["waited_h"]),
            "deadlines_missed": int(sum(late > 1e-6 for late in rows["late_s"])),
        }
    reference = [reference_saving(series, start, length_h, budget) for start in start_times()]
    cell["reference_pct"] = quartiles(reference)
    if "oracle" in per_start:
        gap = np.abs(np.array(per_start["oracle"]["saving_pct"]) - np.array(reference))
        cell["oracle_vs_reference_max_abs_pp"] = float(gap.max())
    oracle, forecast = (
        cell["arms"]["oracle"]["saving_pct"]["median"],
        cell["arms"]["forecast"]["saving_pct"]["median"],
    )
    cell["forecast_share_of_oracle"] = forecast / oracle if oracle > 1e-9 else None
    cell["per_start"] = {
        arm: {key: [round(v, 4) for v in values] for key, values in rows.items()}
        for arm, rows in per_start.items()
    }
    return cell


def run(
    countries: tuple[str, ...], lengths: tuple[int, ...], budgets: tuple[float, ...], data: Path
) -> dict[str, Any]:
    arms = {"forecast": SeasonalBlendForecast(), "oracle": OracleForecast(), "naive": SameHourYesterday()}
    result: dict[str, Any] = {
        "cells": {},
        "forecast_error": {},
        "arms": {k: repr(v) for k, v in arms.items()},
    }
    origins = [YEAR_START + 6 * 3600.0 * k for k in range(4 * 366 - 40)]
    for country in countries:
        series = TimeSeries.from_csv(data / f"{country}_2020.csv")
        began = time.perf_counter()
        result["forecast_error"][country] = {
            name: forecast_error(series, forecast, origins, HORIZONS_H)
            for name, forecast in (
                ("forecast", arms["forecast"]),
                ("naive", arms["naive"]),
                ("persistence", Persistence()),
            )
        }
        for length in lengths:
            for budget in budgets:
                key = f"{country}/{length}h/{int(budget * 100)}%"
                result["cells"][key] = run_cell(series, arms, length, budget)
                shares = result["cells"][key]["forecast_share_of_oracle"]
                print(
                    f"{key}: forecast {result['cells'][key]['arms']['forecast']['saving_pct']['median']:.1f}% "
                    f"oracle {result['cells'][key]['arms']['oracle']['saving_pct']['median']:.1f}% "
                    f"share {'n/a' if shares is None else f'{shares:.2f}'} "
                    f"({time.perf_counter() - began:.0f} s)",
                    flush=True,
                )
    return result


def tune(data: Path) -> dict[str, Any]:
    """The grid the default forecast's parameters came from, on GB only: mean and minimum share of the
    oracle's median saving over L in 12/24/72 h and budgets 25-200%."""
    series = TimeSeries.from_csv(data / "gb_2020.csv")
    rows = []
    oracle = {}
    for length in LENGTHS_H:
        for budget in BUDGETS[1:]:
            savings = [reference_saving(series, start, length, budget) for start in start_times()]
            oracle[(length, budget)] = float(np.median(savings))
    for days in TUNE_GRID["days"]:
        for decay in TUNE_GRID["decay_hours"]:
            shares = []
            forecast = SeasonalBlendForecast(days=days, decay_hours=decay)
            for length in LENGTHS_H:
                for budget in BUDGETS[1:]:
                    policy = GreenWindowPolicy(forecast)
                    savings = [
                        simulate_job(
                            policy,
                            series,
                            s,
                            3600.0 * length,
                            3600.0 * length * budget,
                            deadline=s + 3600.0 * length * (1 + budget),
                        )["saving_pct"]
                        for s in start_times()
                    ]
                    shares.append(float(np.median(savings)) / oracle[(length, budget)])
            rows.append(
                {
                    "days": days,
                    "decay_hours": decay,
                    "mean_share": float(np.mean(shares)),
                    "min_share": float(np.min(shares)),
                }
            )
            print(rows[-1], flush=True)
    return {"country": "gb", "grid": rows}


# ---------------------------------------------------------------------------- write-up
def _pct(q: dict[str, float]) -> str:
    return f"{q['median']:.1f}% [{q['p25']:.1f}, {q['p75']:.1f}]"


def _g(q: dict[str, float]) -> str:
    return f"{q['median']:.1f} [{q['p25']:.1f}, {q['p75']:.1f}]"


def targets(result: dict[str, Any]) -> dict[str, Any]:
    shares = {
        key: cell["forecast_share_of_oracle"]
        for key, cell in result["cells"].items()
        if not key.startswith("fr/") and cell["forecast_share_of_oracle"] is not None
    }
    worst = min(shares, key=shares.get) if shares else None
    best72 = {
        country: result["cells"][f"{country}/72h/100%"]["arms"]["forecast"]["saving_pct"]["median"]
        for country in ("de", "gb")
        if f"{country}/72h/100%" in result["cells"]
    }
    return {
        "share_of_oracle_min": None if worst is None else shares[worst],
        "share_of_oracle_worst_cell": worst,
        "share_of_oracle_met": bool(shares) and min(shares.values()) >= 0.6,
        "forecast_72h_100pct": best72,
        "fifteen_pct_met": bool(best72) and max(best72.values()) >= 15.0,
    }


def _target_lines(goal: dict[str, Any]) -> list[str]:
    """The targets' lines, each said only where the run has its cells (``--countries``/``--lengths`` that
    leave out DE and GB, or the 72 h job, leave a target unmeasured: said so, not a crash)."""
    lines = []
    if goal["share_of_oracle_worst_cell"] is None:
        lines.append(
            "- Forecast keeps >= 60% of the oracle's median saving (DE, GB): not measured in this run."
        )
    else:
        lines.append(
            f"- Forecast keeps >= 60% of the oracle's median saving at every budget (DE, GB; budget 0 has nothing "
            f"to save): worst {goal['share_of_oracle_min']:.2f} at `{goal['share_of_oracle_worst_cell']}`: "
            f"**{'met' if goal['share_of_oracle_met'] else 'missed'}**."
        )
    best72 = goal["forecast_72h_100pct"]
    if not best72:
        lines.append("- >= 15% on DE or GB for a 72 h job at a 100% budget: not measured in this run.")
        return lines
    best = max(best72.values())
    lines.append(
        "- >= 15% on DE or GB for a 72 h job at a 100% budget with the forecast: "
        + ", ".join(f"{c.upper()} {v:.1f}%" for c, v in best72.items())
        + f": **{'met' if goal['fifteen_pct_met'] else 'missed'}**."
    )
    lines.append(
        f"- Moonshot, the published ~19% with the forecast: best {best:.1f}%"
        + (
            ": met."
            if best >= 19
            else f", missed by {19 - best:.1f} pp: the forecast's error grows to a quarter of the signal a day "
            "ahead (table below), and a 72 h job at 100% ranks slots up to 144 h ahead."
        )
    )
    return lines


def markdown(result: dict[str, Any], command: str) -> str:
    goal = result["targets"]
    lines = [
        "# GreenWindow on the 2020 grid series",
        "",
        f"Command: `{command}` ({result['seconds']:.0f} s). Pure simulation on the real 2020 series of Wiesner "
        "et al. 2021 (`../shared/data/carbon-intensity/`): a job of L hours of compute at constant power, 100 "
        "starts spread over 2020, a delay budget as a share of L (the job must finish by start + L x (1 + "
        "budget)), one-hour slots, a paused job draws nothing. Every arm runs the library's "
        "`GreenWindowPolicy` (adaptive rule) on a `SimulatedClock`; savings are against the carbon-agnostic "
        "run started at the same moment. Cells: median [p25, p75] over the 100 starts.",
        "",
        f"- forecast: `{result['arms']['forecast']}`, reads only the past; parameters chosen on GB alone "
        "(`results/green_window_tuning.md`), so DE and FR are out of sample.",
        "- oracle: the series' own future (the upper bound); `reference`: the direct cleanest-hours computation.",
        "- naive: same hour on the last day, with the current value observed (context).",
        "",
        "## Targets",
        "",
        *_target_lines(goal),
        "- France (the control) is outside the 60% target: "
        + ", ".join(
            f"{key.split('/', 1)[1]} {cell['forecast_share_of_oracle']:.2f}"
            for key, cell in result["cells"].items()
            if key.startswith("fr/") and cell["forecast_share_of_oracle"] is not None
        )
        + "; its grams per kWh, below, are what the control is about.",
        "",
        "## CO2 saved (%), time waited",
        "",
        "| grid | job | budget | forecast | oracle | reference | naive | forecast / oracle | forecast waited (h) | deadlines missed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, cell in result["cells"].items():
        country, length, budget = key.split("/")
        arms = cell["arms"]
        share = cell["forecast_share_of_oracle"]
        missed = sum(arm["deadlines_missed"] for arm in arms.values())
        lines.append(
            f"| {country.upper()} | {length} | {budget} | {_pct(arms['forecast']['saving_pct'])} | "
            f"{_pct(arms['oracle']['saving_pct'])} | {_pct(cell['reference_pct'])} | "
            f"{_pct(arms['naive']['saving_pct'])} | {'n/a' if share is None else f'{share:.2f}'} | "
            f"{_g(arms['forecast']['waited_h'])} | {missed} |"
        )
    lines += [
        "",
        "## The control: grams saved per kWh",
        "",
        "France's grid is low-carbon and flat in absolute terms, so its shares can look large while the grams "
        "are small. g/kWh saved, median [p25, p75]:",
        "",
        "| job | budget | "
        + " | ".join(f"{c.upper()} forecast | {c.upper()} oracle" for c in COUNTRIES)
        + " |",
        "|---|---|" + "---|---|" * len(COUNTRIES),
    ]
    for length in LENGTHS_H:
        for budget in BUDGETS[1:]:
            cells = [result["cells"].get(f"{c}/{length}h/{int(budget * 100)}%") for c in COUNTRIES]
            if any(cell is None for cell in cells):
                continue
            row = " | ".join(
                f"{_g(cell['arms']['forecast']['g_per_kwh'])} | {_g(cell['arms']['oracle']['g_per_kwh'])}"
                for cell in cells
            )
            lines.append(f"| {length} h | {int(budget * 100)}% | {row} |")
    lines += [
        "",
        "## Oracle against the direct computation",
        "",
        "Largest per-start gap between the oracle arm and the reference, over all cells: "
        f"{max(c.get('oracle_vs_reference_max_abs_pp', 0.0) for c in result['cells'].values()):.2e} pp. The "
        "issue's own reference: "
        + ", ".join(
            f"{c.upper()} {L} h / {int(b * 100)}%: {text} (here "
            f"{result['cells'][f'{c}/{L}h/{int(b * 100)}%']['reference_pct']['median']:.1f}%)"
            for (c, L, b), text in ISSUE_REFERENCE.items()
            if f"{c}/{L}h/{int(b * 100)}%" in result["cells"]
        )
        + ".",
        "",
        "## Forecast error by horizon",
        "",
        "Every 6 h of 2020 as the origin; the error of the hourly mean h hours ahead. MAE in gCO2eq/kWh, MAPE in %.",
        "",
        "| grid | forecast | " + " | ".join(f"{h} h" for h in HORIZONS_H) + " |",
        "|---|---|" + "---|" * len(HORIZONS_H),
    ]
    for country, by_arm in result["forecast_error"].items():
        for arm, errors in by_arm.items():
            cells = " | ".join(
                f"{errors[f'{h}h']['mae']:.1f} ({errors[f'{h}h']['mape_pct']:.0f}%)" for h in HORIZONS_H
            )
            lines.append(f"| {country.upper()} | {arm} | {cells} |")
    lines += ["", "PNG: `green_window.png` (medians by budget) and `green_window_schedule.png` (one DE job)."]
    return "\n".join(lines) + "\n"


def write_plots(result: dict[str, Any], data: Path, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return
    figure = Figure(figsize=(12, 3.6), constrained_layout=True)
    axes = figure.subplots(1, len(COUNTRIES), sharey=True)
    for ax, country in zip(np.atleast_1d(axes), COUNTRIES):
        for length, style in zip(LENGTHS_H, ("-", "--", ":")):
            keys = [f"{country}/{length}h/{int(b * 100)}%" for b in BUDGETS]
            if not all(k in result["cells"] for k in keys):
                continue
            for arm, colour in (("forecast", "#2ca02c"), ("oracle", "#7f7f7f")):
                ax.plot(
                    [100 * b for b in BUDGETS],
                    [result["cells"][k]["arms"][arm]["saving_pct"]["median"] for k in keys],
                    style,
                    color=colour,
                    label=f"{arm} {length} h",
                )
        ax.set_title(country.upper())
        ax.set_xlabel("delay budget (% of job length)")
    np.atleast_1d(axes)[0].set_ylabel("median CO2 saved (%)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    figure.savefig(out / "green_window.png", dpi=110)

    series = TimeSeries.from_csv(data / "de_2020.csv")
    start, length, budget = parse_timestamp("2020-03-09 00:00:00"), 72, 1.0
    policy = GreenWindowPolicy(SeasonalBlendForecast())
    from lightning_pulse.core.green_window import ScheduleLedger, SimulatedClock

    clock, ledger, decisions = SimulatedClock(start), ScheduleLedger(series.mean), []
    remaining, left, first = 3600.0 * length, 3600.0 * length * budget, None
    while remaining > 0:
        now = clock.time()
        decision, starts, forecast = policy.decide(
            series, now, remaining, left, start + 3600.0 * length * (1 + budget)
        )
        first = first or (starts, forecast)
        decisions.append({"wall": now, "clean_below": decision.clean_below})
        if decision.run:
            clock.advance(3600.0)
            ledger.add("run", now, now + 3600.0, 1.0)
            remaining -= 3600.0
        else:
            clock.sleep(3600.0)
            ledger.add("wait", now, now + 3600.0, 0.0)
            left -= 3600.0
    grid = start + 3600.0 * np.arange(int(length * (1 + budget)))
    write_schedule_plot(
        out / "green_window_schedule.png",
        (grid, slot_means(series, grid, 3600.0)),
        first,
        ledger.segments,
        decisions,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="folder of de_2020.csv, gb_2020.csv, fr_2020.csv")
    parser.add_argument("--countries", nargs="+", default=list(COUNTRIES), choices=COUNTRIES)
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS_H))
    parser.add_argument("--tune", action="store_true", help="re-run the GB grid behind the default forecast")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args()
    data, out = data_dir(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    if args.tune:
        tuned = tune(data)
        tuned["seconds"] = time.perf_counter() - began
        (out / "green_window_tuning.json").write_text(json.dumps(tuned, indent=2))
        rows = ["| days | decay (h) | mean share of oracle | min share |", "|---|---|---|---|"]
        rows += [
            f"| {r['days']} | {r['decay_hours']:g} | {r['mean_share']:.3f} | {r['min_share']:.3f} |"
            for r in tuned["grid"]
        ]
        (out / "green_window_tuning.md").write_text(
            "# The default forecast's parameters, chosen on GB 2020 alone\n\nCommand: `python -m benchmarks."
            f"green_window --tune` ({tuned['seconds']:.0f} s). Share of the oracle's median saving kept by the "
            "forecast arm, over L = 12/24/72 h and budgets 25-200%, 100 starts each.\n\n"
            + "\n".join(rows)
            + "\n"
        )
        return
    result = run(tuple(args.countries), tuple(args.lengths), BUDGETS, data)
    result["seconds"] = time.perf_counter() - began
    result["targets"] = targets(result)
    result["environment"] = environment()
    command = "python -m benchmarks.green_window"
    if args.countries != list(COUNTRIES) or args.lengths != list(LENGTHS_H):
        command += f" --countries {' '.join(args.countries)} --lengths {' '.join(map(str, args.lengths))}"
    (out / "green_window.json").write_text(json.dumps(result, default=float))  # per-start rows: one line
    (out / "green_window.md").write_text(markdown(result, command))
    write_plots(result, data, out)
    print((out / "green_window.md").read_text())


if __name__ == "__main__":
    main()
