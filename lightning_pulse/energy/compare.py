"""The savings ledger: two runs' energy reports side by side, with the ratios B/A.

``lightning-pulse compare RUN_A RUN_B`` and ``EnergyLogger(accounting=AccountingConfig(baseline=...))`` both
build a :func:`compare_runs` comparison: wall time, energy, CO2 and cost of each run (each with its method),
the final logged metrics of each, and the ratio B/A of every figure both runs hold. A run is an
``energy_report.json`` or a directory holding one (a logger's log directory, searched below it when the
report is not at its top). Its final metrics are the report's ``metrics`` (EnergyLogger records the
Trainer's final ``callback_metrics`` there), else the last value of each column of a CSVLogger
``metrics.csv`` next to the report.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from lightning_pulse.energy.meter import NONE, PARTIAL
from lightning_pulse.energy.metric_quality import (
    NONFINITE,
    ascended_loss_note,
    loss_maximized,
    metric_direction,
    mode_conflict,
    monitored_modes,
    pair_text,
    signed_difference,
    verdict,
    worse_line,
)
from lightning_pulse.energy.report import (
    JSON_NAME,
    SCHEMA,
    SMOKE_TEST,
    process_ram,
    write_atomic,
    write_report,
    write_text_atomic,
)
from lightning_pulse.errors import PulseRefusal

COMPARISON_JSON = "energy_comparison.json"
COMPARISON_MARKDOWN = "energy_comparison.md"
COMPARISON_PNG = "energy_comparison.png"
METRICS_CSV = "metrics.csv"
#: the figures compared: (key in the report's ``total``, label, unit, key of its method)
FIGURES = (
    ("duration_s", "wall time", "s", None),
    ("energy_kwh", "energy", "kWh", "energy_method"),
    ("co2_kg", "CO2", "kg", "co2_method"),
    ("cost", "cost", None, "cost_method"),
    ("steps", "optimizer steps", None, None),
    ("samples", "samples", None, None),
)
#: the figures that are costs of the run (coloured in the PNG; a run that did not finish undercounts them)
COST_FIGURES = ("duration_s", "energy_kwh", "co2_kg", "cost")
COMPLETE = "complete"
_NOT_METRICS = ("epoch", "step")


class NotAnEnergyReport(ValueError):
    """A path that is not, or does not hold, a lightning-pulse energy report."""


#: what a run argument may be, for error messages
EXPECTED_RUN = f"expected an {JSON_NAME} or a log directory holding one"


def find_report(path: str | Path, field: str | None = None) -> Path:
    """The ``energy_report.json`` that ``path`` names: the file itself, ``path/energy_report.json``, or the one
    report found below a directory. Raises :class:`FileNotFoundError` or :class:`NotAnEnergyReport`, whose
    message starts with ``field`` and the value when ``field`` is given (``"RUN_A"``,
    ``"accounting.baseline"``). An empty path is refused: it would search the whole current directory."""
    named = f"`{field}`={os.fspath(path)!r}: " if field else ""
    if not os.fspath(path).strip():
        raise NotAnEnergyReport(
            f"{named or repr(os.fspath(path)) + ': '}the path is empty (it would search the whole current "
            f"directory); {EXPECTED_RUN}."
        )
    path = Path(path)
    named = named or f"{path}: "
    if path.is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"{named}no such file or directory; {EXPECTED_RUN}.")
    if (path / JSON_NAME).is_file():
        return path / JSON_NAME
    found = sorted(path.rglob(JSON_NAME))
    if not found:
        raise FileNotFoundError(f"{named}no {JSON_NAME} in this directory or below it; {EXPECTED_RUN}.")
    if len(found) > 1:
        listed = ", ".join(str(p.parent.relative_to(path)) for p in found[:4])
        raise NotAnEnergyReport(
            f"{named}{len(found)} energy reports below it ({listed}{', ...' if len(found) > 4 else ''}); "
            "name the run's own directory or its energy_report.json."
        )
    return found[0]


def load_run(path: str | Path, field: str | None = None) -> dict[str, Any]:
    """A run to compare: its report (validated), the report's path, and its final metrics. Errors start with
    ``field`` and the value when ``field`` is given (see :func:`find_report`)."""
    json_path = find_report(path, field)
    named = f"`{field}`={os.fspath(path)!r}: " if field else ""
    try:
        report = json.loads(json_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise NotAnEnergyReport(
            f"{named}{json_path} is not a lightning-pulse energy report (not JSON: {error}); {EXPECTED_RUN}."
        ) from None
    if (
        not isinstance(report, dict)
        or report.get("schema") != SCHEMA
        or not isinstance(report.get("total"), dict)
    ):
        raise NotAnEnergyReport(
            f"{named}{json_path} is not a lightning-pulse energy report (schema {SCHEMA!r}); {EXPECTED_RUN}."
        )
    _refuse_malformed(report, f"{named}{json_path}")
    metrics = report.get("metrics")
    source = "report"
    if not metrics:
        metrics, source = csv_metrics(json_path.parent), METRICS_CSV
    return {
        "path": str(json_path),
        "report": report,
        "metrics": _with_nonfinite(metrics, report),
        "metrics_source": source,
    }


def _with_nonfinite(metrics: Mapping[str, Any] | None, report: Mapping[str, Any]) -> dict[str, Any]:
    """A run's final metrics with those that were not finite (a diverged run), recorded in its report's
    ``nonfinite_metrics``, as ``"nan"`` / ``"inf"`` / ``"-inf"``."""
    return {**(report.get("nonfinite_metrics") or {}), **(metrics or {})}


def _refuse_malformed(report: Mapping[str, Any], where: str) -> None:
    """A report edited by hand into other types (a metric list, a figure as text) is refused, naming the file
    and the entry, instead of failing later with an unrelated message or printing text as a figure."""

    def number_or_null(value: Any) -> bool:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))

    def refuse(entry: str, value: Any, expected: str) -> NoReturn:
        raise NotAnEnergyReport(f"{where}: `{entry}`={value!r} is not {expected}; {EXPECTED_RUN}.")

    total = report["total"]
    for key, _, _, method_key in FIGURES:
        if not number_or_null(total.get(key)):
            refuse(f"total.{key}", total.get(key), "a number or null")
        if method_key is not None and not isinstance(total.get(method_key, NONE), str):
            refuse(f"total.{method_key}", total.get(method_key), "a method name")
    if not isinstance(report.get("status") or COMPLETE, str):
        refuse("status", report.get("status"), "a status such as 'complete'")
    metrics = report.get("metrics")
    if metrics is not None and not isinstance(metrics, Mapping):
        refuse("metrics", metrics, "a mapping of metric names to numbers")
    for name, value in (metrics or {}).items():
        if not number_or_null(value):
            refuse(f"metrics.{name}", value, "a number or null")
    modes = report.get("metric_modes")
    if modes is not None and not isinstance(modes, Mapping):
        refuse("metric_modes", modes, "a mapping of metric names to 'min' or 'max'")
    for name, mode in (modes or {}).items():
        if mode not in ("min", "max"):
            refuse(f"metric_modes.{name}", mode, "'min' or 'max'")
    if not isinstance(report.get("loss_maximized", False), bool):
        refuse("loss_maximized", report.get("loss_maximized"), "true or false")
    nonfinite = report.get("nonfinite_metrics")
    if nonfinite is not None and not isinstance(nonfinite, Mapping):
        refuse("nonfinite_metrics", nonfinite, "a mapping of metric names to 'nan', 'inf' or '-inf'")
    for name, value in (nonfinite or {}).items():
        if value not in NONFINITE:
            refuse(f"nonfinite_metrics.{name}", value, "'nan', 'inf' or '-inf'")
    price = report.get("price")
    if price is not None and not isinstance(price, Mapping):
        refuse("price", price, "a mapping or null")


def csv_metrics(directory: str | Path) -> dict[str, float]:
    """The last logged value of every column of a CSVLogger ``metrics.csv`` in ``directory`` ({} if none)."""
    path = Path(directory) / METRICS_CSV
    if not path.is_file():
        return {}
    last: dict[str, float] = {}
    with open(path, newline="", encoding="utf-8") as stream:
        for row in csv.DictReader(stream):
            for name, value in row.items():
                if name in _NOT_METRICS or name is None or value in (None, ""):
                    continue
                try:
                    last[name] = float(value)
                except ValueError:
                    continue
    return last


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or isinstance(a, bool):
        return None
    if a == 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return float(b) / float(a)


def _currency(report: Mapping[str, Any]) -> str | None:
    if not report.get("price"):
        return None
    return (report.get("price") or {}).get("currency") or report.get("currency")


def compare_runs(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison of run ``b`` against the baseline ``a`` (both as :func:`load_run` returns them)."""
    totals = a["report"]["total"], b["report"]["total"]
    currencies = _currency(a["report"]), _currency(b["report"])
    figures = []
    # CO2 and cost are the energy times a rate: an undercounted energy undercounts them too
    energy_partial = PARTIAL in [total.get("energy_method", NONE) for total in totals]
    metered_apart = tracking_modes_differ(a["report"], b["report"])
    unfinished = _unfinished_note(a["report"], b["report"])
    # a fast_dev_run's few batches against a run: no ratio means anything (the note says why)
    smoke = SMOKE_TEST in (a["report"].get("status"), b["report"].get("status"))
    for key, label, unit, method_key in FIGURES:
        if key == "cost":
            unit = currencies[1] or currencies[0]
        values = [total.get(key) for total in totals]
        methods = [total.get(method_key, NONE) if method_key else None for total in totals]
        ratio = _ratio(*values)
        note = None
        if key == "cost" and currencies[0] != currencies[1] and None not in currencies:
            ratio, note = None, f"currencies differ ({currencies[0]} / {currencies[1]})"
        if method_key and NONE in methods:
            ratio = None
        elif method_key and metered_apart:  # one run's figure covers the whole machine, the other's a share
            ratio, note = None, f"not comparable: {metered_apart}"
        elif method_key and energy_partial:  # an undercount (a meter lost mid-run)
            ratio, note = None, "partial: a meter was lost mid-run, so the figure undercounts"
        elif method_key and PARTIAL in methods:  # a rate given on a resume only
            rate = "price" if key == "cost" else "carbon intensity"
            ratio, note = None, f"partial: part of the run had no {rate}"
        withheld = smoke and key in COST_FIGURES and values != [None, None]
        ratio = None if withheld else ratio
        if key in COST_FIGURES and unfinished is not None and values != [None, None]:  # less work done
            per_step = _ratio(*(_per_step(value, total) for value, total in zip(values, totals)))
            per_step_text = (
                "" if ratio is None or per_step is None else f"; per optimizer step {per_step:.3f}x"
            )
            note = "; ".join(
                filter(None, (note, unfinished + per_step_text, "no ratio" if withheld else None))
            )
        figures.append(
            {
                "figure": key,
                "label": label,
                "unit": unit,
                "a": values[0],
                "b": values[1],
                "method_a": methods[0],
                "method_b": methods[1],
                "ratio": ratio,
                "note": note,
            }
        )
    # the energy figures are compared above; EnergyLogger's own logged columns would repeat them
    names = sorted(name for name in set(a["metrics"]) | set(b["metrics"]) if not name.startswith("energy/"))
    modes = a["report"].get("metric_modes"), b["report"].get("metric_modes")
    ascended = [label for label, run in (("A", a), ("B", b)) if run["report"].get("loss_maximized")]
    metrics = []
    for name in names:
        value_a, value_b = a["metrics"].get(name), b["metrics"].get(name)
        direction = metric_direction(name, *modes, ascended=ascended)
        note = mode_conflict(name, *modes, ascended=ascended) or ascended_loss_note(name, ascended, *modes)
        metrics.append(
            {
                "metric": name,
                "a": value_a,
                "b": value_b,
                "ratio": _ratio(value_a, value_b),
                "difference": signed_difference(value_a, value_b),
                "better": direction,
                "verdict": verdict(value_a, value_b, direction),
                "note": note,
            }
        )
    return {
        **{
            name: {
                "path": run["path"],
                "status": run["report"].get("status"),
                "metrics_source": run["metrics_source"],
                "figures_from_step": run["report"].get("figures_from_step"),
            }
            for name, run in (("a", a), ("b", b))
        },
        "figures": figures,
        "metrics": metrics,
        "worse": worse_line(metrics),
        "unfinished": unfinished,
        "not_comparable": None if metered_apart is None else _not_comparable_line(metered_apart),
        "ram_note": None
        if metered_apart is not None
        else process_ram_line(a["report"], b["report"], figures),
    }


def tracking_modes_differ(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """``"codecarbon tracking mode 'machine' in A, 'process' in B (cpu, ram)"`` when codecarbon metered a
    component of the two runs in different tracking modes (recorded in each report's ``meters``), else
    ``None``. ``machine`` counts the whole node, ``process`` this process's CPU time and codecarbon's RAM
    floor for a process (:func:`process_ram_line`):
    the same work read 0.59x in ``process`` mode, a saving nobody made."""
    differing: dict[tuple[str, str], list[str]] = {}
    meters_a, meters_b = a.get("meters"), b.get("meters")
    if not isinstance(meters_a, Mapping) or not isinstance(meters_b, Mapping):
        return None
    for component, described_a in meters_a.items():
        described_b = meters_b.get(component)
        if not isinstance(described_a, Mapping) or not isinstance(described_b, Mapping):
            continue
        modes = described_a.get("tracking_mode"), described_b.get("tracking_mode")
        if None not in modes and modes[0] != modes[1]:
            differing.setdefault((str(modes[0]), str(modes[1])), []).append(str(component))
    if not differing:
        return None
    return "; ".join(
        f"codecarbon tracking mode {mode_a!r} in A, {mode_b!r} in B ({', '.join(components)})"
        for (mode_a, mode_b), components in differing.items()
    )


def _not_comparable_line(metered_apart: str) -> str:
    return (
        f"The energy, CO2 and cost of A and B are not comparable: {metered_apart}. 'machine' counts the "
        "whole node, 'process' this process's CPU time and codecarbon's per-process RAM floor, so the same "
        "work reads as less energy in 'process' mode. "
        "Meter both runs with the same `meters.codecarbon_tracking_mode`."
    )


def process_ram_line(a: Mapping[str, Any], b: Mapping[str, Any], figures: list[dict[str, Any]]) -> str | None:
    """Where codecarbon metered RAM in ``"process"`` mode (:func:`~lightning_pulse.energy.report.process_ram`:
    a power set by the process's memory size times wall time), the line that says so, with the RAM's mean
    watts and share of each run's energy as measured, the
    energy and wall-time ratios and the CPU part's own ratio; ``None`` otherwise. On CPU-only fits the RAM was
    82-96% of every figure (a held-out sweep), so the energy ratio was about the wall-time ratio: 0.275x for
    runs whose CPU time was 0.524x, their baselines having waited for other processes on a loaded machine."""
    found = {name: process_ram(report) for name, report in (("A", a), ("B", b))}
    shares = [
        f"{got[1]:.3g} W on average, {got[0]:.0%} of {name}'s energy"
        for name, got in found.items()
        if got and None not in got
    ]
    if all(got is None for got in found.values()):
        return None
    ratios = {row["figure"]: row["ratio"] for row in figures}
    cpu = _ratio(*((report["total"].get("energy_kwh_by_component") or {}).get("cpu") for report in (a, b)))
    named = {"energy": ratios.get("energy_kwh"), "wall time": ratios.get("duration_s"), "the CPU part": cpu}
    compared = ", ".join(f"{name} {ratio:.3f}x" for name, ratio in named.items() if ratio is not None)
    return (
        "RAM is codecarbon's `process`-mode estimate, a power priced by the size of the process's memory "
        "times wall time, whatever the process does"
        f"{' (' + '; '.join(shares) + ')' if shares else ''}: that part of the energy follows wall time, time "
        f"spent waiting for other processes included, not the work{'; ' + compared if compared else ''}."
    )


def _unfinished_note(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """``"A is interrupted: unequal work (A: 20 steps, B: 48)"`` when either run did not complete or counts
    from a step past its first (EnergyLogger added on a resume), else ``None``."""
    parts = [f"{name} {why}" for name, report in (("A", a), ("B", b)) if (why := _part_only(report))]
    if not parts:
        return None
    return (
        f"{', '.join(parts)}: unequal work (A: {a['total'].get('steps')} steps, B: {b['total'].get('steps')})"
    )


def _part_only(report: Mapping[str, Any]) -> str | None:
    """Why a report (or a comparison's side) covers only part of its run's work: ``"is interrupted"`` (not
    complete; ``"is a fast_dev_run smoke test"``), ``"counts from step 30 on"`` (an EnergyLogger added on a
    resume); ``None`` when it is whole."""
    if report.get("status") == SMOKE_TEST:
        return "is a fast_dev_run smoke test"
    if not _complete(report):
        return f"is {report.get('status')}"
    if report.get("figures_from_step"):
        return f"counts from step {report['figures_from_step']} on"
    return None


def _complete(report: Mapping[str, Any]) -> bool:
    """Whether a report (or a comparison's side) is of a run that completed; one without a status is."""
    return report.get("status") in (None, COMPLETE)


def _per_step(value: Any, total: Mapping[str, Any]) -> float | None:
    steps = total.get("steps")
    if not isinstance(value, (int, float)) or not isinstance(steps, (int, float)) or not steps:
        return None
    return float(value) / float(steps)


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite scalars among a Trainer's ``callback_metrics`` (tensors or numbers), by name."""
    return {name: number for name, number in _scalars(metrics) if math.isfinite(number)}


def _scalars(metrics: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(name, value)`` of the one-element tensors and numbers among ``metrics``, sorted by name."""
    scalars = []
    for name, value in metrics.items():
        try:
            if hasattr(value, "numel") and value.numel() != 1:
                continue
            scalars.append((str(name), float(value)))
        except (TypeError, ValueError, RuntimeError):
            continue
    return sorted(scalars)


def final_metric_fields(trainer: Any) -> dict[str, Any]:
    """What EnergyLogger records of the Trainer's results in its report: ``metrics``, the final
    ``callback_metrics`` (:func:`scalar_metrics`), ``metric_modes``, the ``mode`` of each metric a
    ``ModelCheckpoint`` or ``EarlyStopping`` monitors (:func:`monitored_modes`), which says which way it is
    better in a comparison, and ``loss_maximized``, whether an optimizer ascends the value the module returns
    (:func:`~lightning_pulse.energy.metric_quality.loss_maximized`), which a metric named as a loss then may
    hold."""
    return {
        "metrics": scalar_metrics(trainer.callback_metrics),
        "nonfinite_metrics": nonfinite_metrics(trainer.callback_metrics),
        "metric_modes": monitored_modes(trainer),
        "loss_maximized": loss_maximized(trainer),
    }


def nonfinite_metrics(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The scalars among a Trainer's ``callback_metrics`` that are not finite (a run that diverged), as
    ``"nan"``, ``"inf"`` or ``"-inf"`` by name (JSON holds no NaN): a comparison calls them worse than a
    finite baseline's."""
    return {
        name: "nan" if math.isnan(number) else "inf" if number > 0 else "-inf"
        for name, number in _scalars(metrics)
        if not math.isfinite(number)
    }


def comparison_line(comparison: Mapping[str, Any] | None) -> str | None:
    """The fit-end line of a run compared against its baseline: its wall-time and energy ratios (with the
    reason where a run did unequal work or was metered apart) next to each final metric whose better direction
    is known, B against A with the difference and the verdict, so that a saving is never read without what it
    cost in result; ``None`` without a comparison."""
    if not comparison:
        return None
    ratios = [
        f"{row['label']} {row['ratio']:.3f}x"
        if row["ratio"] is not None
        else f"{row['label']} ({row['note']})"
        for row in comparison["figures"]
        if row["figure"] in ("duration_s", "energy_kwh")
        and (row["ratio"] is not None or str(row.get("note") or "").startswith("not comparable"))
    ]
    compared = ", ".join(ratios) or "no time or energy ratio"
    if comparison.get("unfinished"):
        compared += f", not a saving: {comparison['unfinished']}"
    words = {"worse": "worse than the baseline", "better": "better than the baseline", "equal": "equal"}
    judged = []
    for row in comparison["metrics"]:
        if row.get("verdict") in words:
            difference = "not finite" if row["difference"] is None else f"{row['difference']:+.4g}"
            judged.append(f"{row['metric']} {pair_text(row, False)} ({difference}, {words[row['verdict']]})")
        elif row.get("better") and row.get("a") is not None and row.get("b") is None:
            judged.append(f"B has no {row['metric']} (A: {row['a']:.4g})")
        elif row.get("better") and row.get("b") is not None and row.get("a") is None:
            judged.append(f"the baseline has no {row['metric']}")
        elif row.get("better"):
            judged.append(f"{row['metric']} {pair_text(row)}")
    quality = "; ".join(judged) or (
        "no final metric whose better direction is known (a held-out metric named as a loss or accuracy, "
        "such as val_loss, or a monitor's `mode`): see B - A in the report"
    )
    return f"EnergyLogger: against the baseline, {compared}; {quality}."


def add_comparison(report: dict[str, Any], baseline: str | Path | None, path: str | Path, warn: Any) -> None:
    """Put the comparison of ``report`` (to be written at ``path``) against the ``baseline`` run into it, as
    ``report["comparison"]``; a baseline that cannot be read any more is one warning, never an error."""
    if baseline is None:
        return
    this = {
        "path": str(path),
        "report": report,
        "metrics": _with_nonfinite(report.get("metrics"), report),
        "metrics_source": "report",
    }
    try:
        report["comparison"] = compare_runs(load_run(baseline), this)
    except Exception as error:  # a baseline that went away must not cost the run its report
        warn(f"EnergyLogger: no comparison with the baseline ({error}).")


def refuse_overwriting_baseline(
    baseline: str | Path | None, report_dir: str | None, run_folder: Callable[[], str]
) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` at fit start when this run's report, written at the
    end of fit into ``report_dir`` (else the run's own folder, ``run_folder()``: a collective under DDP, read
    on every rank; see :func:`~lightning_pulse.loggers.run_folder`), would replace the ``baseline`` run's
    own ``energy_report.json``: the comparison would be written over the report it compares against, and the
    baseline lost. This happens when both runs write into one folder: ``logger=False`` (both write into
    ``default_root_dir``), one ``report_dir``, or one logger run continued."""
    if baseline is None:
        return
    target = Path(report_dir or run_folder()) / JSON_NAME
    try:
        same = find_report(baseline).resolve() == target.resolve()
    except (OSError, ValueError):  # a baseline gone since construction: the comparison at the end warns
        return
    if same:
        raise PulseRefusal(
            f"EnergyLogger: `accounting.baseline`={os.fspath(baseline)!r} is {target}, the file this run's own "
            "report would be written to at the end of fit, replacing the baseline. Give this run its own folder: "
            "set `report_dir`, or attach a logger that starts a new run (each run gets its own folder), or "
            "copy the baseline's report elsewhere and point `accounting.baseline` at the copy."
        )


def write_report_compared(
    report: dict[str, Any], directory: str | Path, baseline: str | Path | None, warn: Callable[[str], None]
) -> list[Path]:
    """Write ``report`` into ``directory`` with its comparison against the ``baseline`` run (see
    :func:`add_comparison`); returns the paths written, none when writing failed (one warning).

    No PNG: rendering it took 0.4 s of every fit, and 1.6 s of a process's first (matplotlib's import and
    fonts), longer than a short run's training; ``lightning-pulse report DIR`` renders it from the JSON."""
    add_comparison(report, baseline, Path(directory) / JSON_NAME, warn)
    try:
        return write_report(report, directory, chart=False)
    except Exception as error:  # a report that cannot be written must not fail a finished run
        warn(f"EnergyLogger: could not write the energy report to {directory} ({error}).")
        return []


def baseline_ratios(comparison: Mapping[str, Any] | None) -> dict[str, float]:
    """The ratios this run / baseline of time, energy, CO2 and cost, as ``energy/vs_baseline_<figure>``
    metrics for the run's own loggers ({} without a comparison)."""
    if not comparison:
        return {}
    wanted = ("duration_s", "energy_kwh", "co2_kg", "cost")
    return {
        f"energy/vs_baseline_{row['figure']}": row["ratio"]
        for row in comparison["figures"]
        if row["figure"] in wanted and row["ratio"] is not None
    }


def ratio_of(comparison: Mapping[str, Any], figure: str) -> float | None:
    """The ratio B/A of one figure (``"duration_s"``, ``"energy_kwh"``, ...) or of a metric."""
    for row in comparison.get("figures", []):
        if row["figure"] == figure:
            return row["ratio"]
    for row in comparison.get("metrics", []):
        if row["metric"] == figure:
            return row["ratio"]
    raise KeyError(figure)


# ---------------------------------------------------------------------- rendering
def _cell(value: Any, method: str | None = None) -> str:
    if value is None:
        return "n/a"  # ASCII: `lightning-pulse compare` prints it, to a stdout of any encoding
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"{text} ({method})" if method else text


def _ratio_cell(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.3f}x"


def _difference_cell(row: Mapping[str, Any]) -> str:
    """``"-0.0448 (worse than the baseline; higher is better)"``: B - A and, where the metric has a direction
    (:mod:`~lightning_pulse.energy.metric_quality`), what it means; why a metric a monitor names is not
    judged."""
    difference = row.get("difference")
    better = {"max": "higher is better", "min": "lower is better"}.get(row.get("better") or "")
    said = {"worse": "worse than the baseline", "better": "better than the baseline"}.get(
        row.get("verdict") or ""
    )
    if difference is None and not said:
        return "n/a" + (f" (not judged: {row['note']})" if row.get("note") else "")
    text = "n/a, not finite" if difference is None else f"{difference:+.4g}"
    if row.get("note"):
        return f"{text} (not judged: {row['note']})"
    return text + (f" ({said}; {better})" if said else f" ({better})" if better else "")


def comparison_markdown(comparison: Mapping[str, Any], title: str = "# Energy comparison") -> str:
    """The comparison as Markdown: figures, then metrics, each with A, B and B/A."""
    a, b = comparison["a"], comparison["b"]
    lines = [
        title,
        "",
        f"A (baseline): `{a['path']}` ({a.get('status')}); B: `{b['path']}` ({b.get('status')}).",
        "",
        *([f"**{comparison['not_comparable']}**", ""] if comparison.get("not_comparable") else []),
        *([f"**{comparison['worse']}**", ""] if comparison.get("worse") else []),
        *([comparison["ram_note"], ""] if comparison.get("ram_note") else []),
        "| figure | A | B | B/A |",
        "|---|---|---|---|",
    ]
    for row in comparison["figures"]:
        unit = f" ({row['unit']})" if row["unit"] else ""
        ratio = _ratio_cell(row["ratio"]) + (f" ({row['note']})" if row.get("note") else "")
        lines.append(
            f"| {row['label']}{unit} | {_cell(row['a'], row['method_a'])} | {_cell(row['b'], row['method_b'])} "
            f"| {ratio} |"
        )
    lines.append("")
    if comparison["metrics"]:
        lines += [
            f"Final logged metrics (A from its {a['metrics_source']}, B from its {b['metrics_source']}):",
            "",
            "| metric | A | B | B/A | B - A |",
            "|---|---|---|---|---|",
        ]
        for row in comparison["metrics"]:
            lines.append(
                f"| {row['metric']} | {_cell(row['a'])} | {_cell(row['b'])} | {_ratio_cell(row['ratio'])} "
                f"| {_difference_cell(row)} |"
            )
    else:
        lines.append(
            "No logged metrics in either run (no `metrics` in the reports, no metrics.csv next to them)."
        )
    lines.append("")
    return "\n".join(lines)


def write_comparison_plot(comparison: Mapping[str, Any], path: str | Path) -> Path | None:
    """Bars of B/A for every figure and metric with a ratio (1 = the baseline). ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    # costs (time, energy, CO2, money) are green below the baseline and red above (grey against a run that did
    # not finish: its costs undercount), and metrics with a direction green where better and red where worse;
    # steps, samples and the other metrics stay grey, as whether more is better is not known for them
    unfinished = [name for name in ("a", "b") if _part_only(comparison[name])]
    grey, green, red = "#7f7f7f", "#2ca02c", "#d62728"
    rows = [
        (row["label"], row["ratio"], grey if unfinished or row["figure"] not in COST_FIGURES else None)
        for row in comparison["figures"]
        if row["ratio"] is not None
    ]
    verdicts = {"better": green, "worse": red}
    rows += [
        (row["metric"], row["ratio"], verdicts.get(row.get("verdict") or "", grey))
        for row in comparison["metrics"]
        if row["ratio"] is not None
    ]
    figure = Figure(figsize=(8, 0.45 * max(len(rows), 2) + 1.2), constrained_layout=True)
    axes = figure.subplots()
    rows = rows[::-1]
    values = [value for _, value, _ in rows]
    colours = [colour or (grey if value == 1 else green if value < 1 else red) for _, value, colour in rows]
    axes.barh([name for name, _, _ in rows], values, color=colours)
    axes.axvline(1.0, color="black", linewidth=1)
    for index, value in enumerate(values):
        axes.annotate(
            f"{value:.3f}x",
            (value, index),
            va="center",
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
        )
    axes.set_xlim(0, 1.15 * max([1.0, *values]))  # room for the labels
    axes.set_xlabel("B / A (A: baseline)")
    axes.set_title(chart_title(comparison), fontsize=9)
    if not rows:
        axes.text(0.5, 0.5, "no figure both runs hold", ha="center", va="center", transform=axes.transAxes)
    return write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))


def chart_title(comparison: Mapping[str, Any]) -> str:
    """The PNG's title: the two runs, and a line for each that did not complete."""
    title = f"B: {_run_name(comparison['b']['path'])}  against  A: {_run_name(comparison['a']['path'])}"
    for name in ("a", "b"):
        if why := _part_only(comparison[name]):
            title += f"\n{name.upper()} {why}: its totals cover only part of the run"
    return title


def _run_name(path: str) -> str:
    return "/".join(Path(path).parent.parts[-3:])


def write_comparison(comparison: Mapping[str, Any], directory: str | Path) -> list[Path]:
    """``energy_comparison.{json,md,png}`` in ``directory``; the paths written."""
    directory = Path(directory)
    written = [
        write_text_atomic(directory / COMPARISON_JSON, json.dumps(comparison, indent=2)),
        write_text_atomic(directory / COMPARISON_MARKDOWN, comparison_markdown(comparison)),
    ]
    png = write_comparison_plot(comparison, directory / COMPARISON_PNG)
    if png is not None:
        written.append(png)
    return written
