"""The energy report: ``energy_report.json`` (the data), ``energy_report.md`` and ``energy_report.png``.

The JSON is the source of truth. EnergyLogger writes it and the Markdown at the end of fit;
:func:`render_report` re-renders the Markdown and draws the PNG from it (this is what
``lightning-pulse report DIR`` runs). Every file is written atomically: to a temporary file in the same
directory, then renamed over the target, so a reader never sees half a report.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lightning_pulse.energy.carbon import Rate
from lightning_pulse.energy.ledger import J_PER_KWH, STARTUP_KEY, figures, grouped_figures
from lightning_pulse.energy.meter import COMPONENTS, NONE, PARTIAL
from lightning_pulse.energy.rate_parts import UNCOUNTED_FIELD, parts_line, uncounted_steps

#: the status of a ``fast_dev_run``'s report (EnergyLogger's and GreenWindow's, kept in ``.report``): a few
#: batches that check the code, not a run (``core.green_window.run_status``; ``compare`` gives it no ratio)
SMOKE_TEST = "smoke_test"

JSON_NAME = "energy_report.json"
MARKDOWN_NAME = "energy_report.md"
PNG_NAME = "energy_report.png"
SCHEMA = "lightning-pulse/energy-report/1"
PHASE_COLOURS = {"burst": "#d62728", "replay": "#1f77b4", "maintain": "#2ca02c"}
COMPONENT_COLOURS = {"gpu": "#9467bd", "cpu": "#ff7f0e", "ram": "#8c564b"}


# ---------------------------------------------------------------------- assembling
def assemble_report(
    snapshot: Mapping[str, Any],
    *,
    status: str = "complete",
    world_size: int = 1,
    num_nodes: int = 1,
    sampling_period_s: float | None = None,
    resumed_runs: int = 0,
    from_step: int | None = 0,
    rate_parts: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    meters: Mapping[str, Any] | None = None,
    intensity: Rate | None = None,
    price: Rate | None = None,
    currency: str = "EUR",
    prediction: Mapping[str, Any] | None = None,
    counting: Mapping[str, str] | None = None,
    disabled: str | None = None,
) -> dict[str, Any]:
    """The JSON-ready report of a run snapshot (all ranks, all resumed parts already combined): its figures
    count from optimizer step ``from_step`` (past 0: EnergyLogger's run began there), its CO2 and cost
    with the ``rate_parts`` (:mod:`~lightning_pulse.energy.rate_parts`)."""
    buckets = snapshot.get("buckets", {})
    groups = grouped_figures(buckets, intensity is not None, price is not None)
    startup = buckets.get(STARTUP_KEY)
    parts = rate_parts or {}
    total = buckets.get("total", {})
    described = {
        name: _rate_described(rate, parts.get(name, ()), total.get(UNCOUNTED_FIELD[name], 0.0))
        for name, rate in (("intensity", intensity), ("price", price))
    }
    return {
        "schema": SCHEMA,
        "status": status,
        "created_utc": utc_now(),
        "world_size": world_size,
        "num_nodes": num_nodes,
        "sampling_period_s": sampling_period_s,
        "resumed_runs": resumed_runs,
        "figures_from_step": from_step,
        "disabled": disabled,
        "meters": dict(meters or {}),
        "carbon_intensity": described["intensity"],
        "price": None if price is None else {**described["price"], "currency": currency},
        "currency": currency,
        "counting": dict(counting or {}),
        **groups,
        # the wait for a meter still starting in the background (at the first epoch end or the end of
        # training): the instrumentation's cost, kept out of every figure above
        "meter_startup": None
        if startup is None
        else figures(startup, intensity is not None, price is not None),
        "prediction": None if prediction is None else dict(prediction),
        "timeline": snapshot.get("timeline", {}),
        "phase_segments": snapshot.get("phase_segments", []),
        "events": snapshot.get("events", []),
    }


def _rate_described(
    rate: Rate | None, parts: Sequence[Mapping[str, Any]], uncounted_j: float
) -> dict[str, Any] | None:
    """``rate.describe()``, with the ``parts`` of the run when a resume changed the rate, and the energy no
    rate counted (``uncounted_kwh``) when part of the run had none."""
    if rate is None:
        return None
    described = rate.describe()
    if len(parts) > 1:
        described["parts"] = [dict(part) for part in parts]
    if uncounted_j > 0:
        described["uncounted_kwh"] = uncounted_j / J_PER_KWH
    return described


# ---------------------------------------------------------------------- atomic files
def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then rename it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    tmp = Path(tmp_name)
    try:
        # mkstemp creates the file private (0600); give it the permissions a plain open() would
        os.chmod(tmp, 0o666 & ~_umask())
        write(tmp)
        with open(tmp, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (``os.umask`` is process-global)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replaced_run_line(path: str | Path, run: str | None, who: str) -> str | None:
    """The warning for a report about to be written over ``path`` where the report there names another run
    (its ``run`` field) than ``run``; ``None`` where there is no such file, it names no run (written without
    a logger, or before runs were named) or the same run (a resume replacing its own interrupted report)."""
    try:
        recorded = json.loads(Path(path).read_text(encoding="utf-8")).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    if recorded is None or recorded == run:
        return None
    return (
        f"{who}: {path} holds the report of another run ({recorded}); this run ({run}) replaces it. To keep "
        "each run's report, give each run its own report folder, or a logger that names each run (a version)."
    )


# ---------------------------------------------------------------------- writing and rendering
def write_report(report: Mapping[str, Any], directory: str | Path, chart: bool = True) -> list[Path]:
    """Write the JSON and Markdown of ``report`` into ``directory``, and the PNG with ``chart``; return the
    paths written."""
    directory = Path(directory)
    written = [write_text_atomic(directory / JSON_NAME, json.dumps(report, indent=2, default=_json_default))]
    written += _render(report, directory, chart)
    return written


def render_report(directory: str | Path, field: str | None = None) -> list[Path]:
    """Re-render ``energy_report.md`` and ``energy_report.png`` next to the run's ``energy_report.json``.

    Args:
        directory: the JSON file itself, a directory holding it, or a log root with exactly one report below
            it (found as ``compare`` finds a run: :func:`~lightning_pulse.energy.compare.find_report`).
        field: the name errors start with (``"DIR"`` for the command line).

    Returns:
        The files written.

    Raises:
        FileNotFoundError: if there is no ``energy_report.json`` there or below it.
        ValueError: if the JSON is not an energy report, or a log root holds more than one.
    """
    from lightning_pulse.energy.compare import find_report  # compare imports this module

    json_path = find_report(directory, field)
    try:
        report = json.loads(json_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:  # a truncated or hand-edited file
        raise ValueError(f"{json_path} is not a lightning-pulse energy report (not JSON: {error}).") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"{json_path} is not a lightning-pulse energy report (schema {SCHEMA!r}).")
    for key, shape in _SECTION_SHAPES.items():  # a hand-edited section would fail deep in the renderer
        if key in report and not isinstance(report[key], shape):
            kind = "a mapping" if shape is dict else "a list"
            raise ValueError(
                f"{json_path}: `{key}`={report[key]!r} is not {kind}, as EnergyLogger writes it; not a "
                "lightning-pulse energy report."
            )
    return _render(report, json_path.parent)


#: the sections of a report the renderer walks, with the container EnergyLogger writes each as
_SECTION_SHAPES = {
    **dict.fromkeys(
        ("meters", "total", "counting", "phases", "cycles", "epochs", "stages", "timeline"), dict
    ),
    **dict.fromkeys(("phase_segments", "events"), list),
}


def _render(report: Mapping[str, Any], directory: Path, chart: bool = True) -> list[Path]:
    written = [write_text_atomic(directory / MARKDOWN_NAME, report_markdown(report))]
    png = write_plot(report, directory / PNG_NAME) if chart else None
    if png is not None:
        written.append(png)
    return written


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


# ---------------------------------------------------------------------- Markdown
def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        if value == 0:
            return "0"
        return f"{value:.{digits}g}"
    return str(value)


def _with_method(value: Any, method: str, digits: int = 4, unit: str = "") -> str:
    if method == NONE or value is None:
        return "— (none)"
    unit = f" {unit}" if unit else ""
    return f"{_num(value, digits)}{unit} ({method})"


def _is_empty(row: Mapping[str, Any]) -> bool:
    return not row.get("duration_s") and not row.get("energy_kwh") and not row.get("samples")


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "—"
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    hours, rest = divmod(int(round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _share(value: Any) -> str:
    return "—" if value is None else f"{100 * float(value):.1f}%"


def _table(title: str, rows: Mapping[str, Mapping[str, Any]], currency: str, first: str) -> list[str]:
    if not rows:
        return []
    lines = [
        f"## {title}",
        "",
        f"| {first} | duration | energy (kWh) | avg power (W) | CO2 (kg) | cost ({currency}) | samples | "
        "J / sample | J / token | data-loader stall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if _is_empty(row):
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    str(name),
                    _duration(row.get("duration_s")),
                    _with_method(row.get("energy_kwh"), row.get("energy_method", NONE)),
                    _with_method(row.get("avg_power_w"), row.get("energy_method", NONE)),
                    _with_method(row.get("co2_kg"), row.get("co2_method", NONE)),
                    _with_method(row.get("cost"), row.get("cost_method", NONE)),
                    _num(row.get("samples")),
                    _with_method(row.get("energy_per_sample_j"), row.get("per_sample_method", NONE)),
                    _with_method(row.get("energy_per_token_j"), row.get("per_sample_method", NONE)),
                    _share(row.get("stall_share")),
                ]
            )
            + " |"
        )
    return lines + [""]


def _held_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per rate series the run read outside of: the value held there instead of data, or the year it
    wrapped back to."""
    lines = []
    for key, label in (("carbon_intensity", "Carbon intensity"), ("price", "Price")):
        rate = report.get(key) or {}
        for side, held in (rate.get("held") or {}).items():
            after = side == "after"
            lines.append(
                f"- {label}: the run read {rate.get('source')} "
                f"{'after its end' if after else 'before its start'} (at {held.get('series_time_utc')}), "
                f"so its {'last' if after else 'first'} value, "
                f"{_num(held.get('value'))} {rate.get('unit')}, is held from {held.get('from_utc')} UTC"
                f"{' on' if after else ' while the run reads before the series'}."
            )
        if gaps := rate.get("gaps"):
            first, count = gaps[0], rate.get("gap_count", len(gaps))
            lines.append(
                f"- {label}: {rate.get('source')} has {count} gap{'s' if count != 1 else ''} (rows missing); "
                f"the value before each is held across it, the first from {first.get('from_utc')} to "
                f"{first.get('to_utc')} UTC ({_num(first.get('value'))} {rate.get('unit')})."
            )
        if wraps := rate.get("wraps"):
            years = wraps.get("years")
            lines.append(
                f"- {label}: the run reads {rate.get('source')} at the same time of year and goes on past its "
                f"end ({wraps.get('at_utc')}) at {wraps.get('to_utc')}, {years} year{'s' if years != 1 else ''} "
                "back."
            )
    return lines


def _joined_lines(report: Mapping[str, Any]) -> list[str]:
    """The line that says the figures start at a step past the run's first (where EnergyLogger began)."""
    step = report.get("figures_from_step")
    if not step:
        return []
    return [
        f"**Figures from step {step} on only**: EnergyLogger's figures start there (it was added on a resume "
        "of a checkpoint saved without it, or a later `fit` of a Trainer started there with no checkpoint: a "
        f"new run), so the run's first {step} steps are in none of them.",
        "",
    ]


def _uncounted_text(method: Any, rate: Mapping[str, Any], name: str) -> str:
    """After a partial CO2 or cost (a rate given on a resume): what it leaves out."""
    if method != PARTIAL or not rate.get("uncounted_kwh"):
        return ""
    where = f" at {uncounted_steps(rate['parts'])}" if rate.get("parts") else ""
    return (
        ", over the part of the run it counts only: not the whole run's, the "
        f"{_num(rate['uncounted_kwh'], 4)} kWh used{where} had no {name}"
    )


def _parts_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per rate a resume changed: the rate of each part of the run."""
    lines = []
    for key, label in (("carbon_intensity", "Carbon intensity"), ("price", "Price")):
        parts = (report.get(key) or {}).get("parts")
        if parts:
            lines.append(f"- {label} by part of the run (changed on a resume): {parts_line(parts)}.")
    return lines


def process_ram(report: Mapping[str, Any]) -> tuple[float | None, float | None] | None:
    """``(share of the energy, watts)`` of the RAM figure where codecarbon metered RAM in ``"process"`` mode
    (either ``None`` where the report cannot give it), else ``None``. codecarbon 3 prices the process's
    memory as if a machine held that much (``codecarbon.external.ram.RAM._calculate_ram_power`` on the
    process's RSS): a DIMM count with a floor of two, 5 W each on x86 (3 W in all on ARM), so 10 W for any
    process up to 16 GB, whatever it holds or does (codecarbon 2: 3/8 W per GB of the RSS). Its energy is that
    power times wall time; the watts given are the report's own mean, RAM energy over wall time."""
    meter = (report.get("meters") or {}).get("ram")
    if not isinstance(meter, Mapping) or meter.get("meter") != "codecarbon":
        return None
    if meter.get("tracking_mode") != "process":
        return None
    total = report.get("total") or {}
    ram, energy, duration = (
        (total.get("energy_kwh_by_component") or {}).get("ram"),
        total.get("energy_kwh"),
        total.get("duration_s"),
    )
    if not all(isinstance(value, (int, float)) for value in (ram, energy, duration)):
        return None, None
    return (ram / energy if energy > 0 else None), (ram * J_PER_KWH / duration if duration > 0 else None)


def process_ram_note(report: Mapping[str, Any]) -> list[str]:
    """The Meters section's note on a RAM figure from codecarbon's ``"process"`` mode (:func:`process_ram`);
    none for any other RAM meter."""
    found = process_ram(report)
    if found is None:
        return []
    share, watts = found
    cpu_meter = (report.get("meters") or {}).get("cpu") or {}
    cpu = (
        "; the CPU row (codecarbon: the TDP times this process's CPU time as a share of all cores) is what "
        "follows the work"
        if isinstance(cpu_meter, Mapping) and cpu_meter.get("meter") == "codecarbon"
        else ""
    )
    figures = (
        f" Here {_num(watts, 3)} W over the whole run, {_share(share)} of the energy."
        if share is not None and watts is not None
        else ""
    )
    return [
        "RAM is codecarbon's `process`-mode estimate: a power priced by the size of the process's memory "
        "times wall time, not this process's share of the node's memory power and not its work (codecarbon 3 "
        "prices it as a machine holding that much memory, with a floor of two DIMMs; codecarbon 2 by the "
        "gigabytes the process holds)."
        f"{figures} Two such runs' energy compares about as their wall times do, time spent waiting for other "
        f"processes included{cpu}.",
        "",
    ]


def report_markdown(report: Mapping[str, Any]) -> str:
    """The Markdown report: summary, meters, then one table per phase / cycle / epoch / stage."""
    total = report.get("total", {})
    currency = (report.get("price") or {}).get("currency") or report.get("currency") or "cost"
    intensity = report.get("carbon_intensity")
    lines = [
        "# Energy report",
        "",
        f"Status: **{report.get('status', 'complete')}**; world size {report.get('world_size', 1)}; "
        f"{report.get('resumed_runs', 0)} resume(s); created {report.get('created_utc', '?')} UTC.",
        "",
        *_joined_lines(report),
        "Every figure carries its method: *measured* (NVML counter or power sensor, RAPL), *estimated* "
        "(codecarbon's model, a configured constant, a carbon intensity), *partial* (an undercount: a meter "
        "was lost part-way and nothing took over, or a CO2 or cost whose rate was given on a resume only) or "
        "*none* (not available). "
        f"`lightning-pulse report DIR` draws {PNG_NAME} (power over time, energy per phase) from the JSON.",
        "",
        "## Summary",
        "",
        f"- Energy: {_with_method(total.get('energy_kwh'), total.get('energy_method', NONE), 6, 'kWh')} over "
        f"{_duration(total.get('duration_s'))}, average "
        f"{_with_method(total.get('avg_power_w'), total.get('energy_method', NONE), 4, 'W')}.",
        "- CO2: "
        + (
            f"{_with_method(total.get('co2_kg'), total.get('co2_method', NONE), 6, 'kg')} at "
            f"{_num(total.get('g_co2_per_kwh'))} gCO2eq/kWh on average ({intensity.get('source')})"
            f"{_uncounted_text(total.get('co2_method'), intensity, 'carbon intensity')}."
            if intensity
            else "— (none: no carbon intensity configured)."
        ),
        "- Cost: "
        + (
            f"{_with_method(total.get('cost'), total.get('cost_method', NONE), 6, currency)}"
            f"{_uncounted_text(total.get('cost_method'), report.get('price') or {}, 'price')}."
            if report.get("price")
            else "— (none: no price configured)."
        ),
        f"- Per sample: {_with_method(total.get('energy_per_sample_j'), total.get('per_sample_method', NONE), 4, 'J')}"
        f" over {_num(total.get('samples'))} samples; per token: "
        f"{_with_method(total.get('energy_per_token_j'), total.get('per_sample_method', NONE), 4, 'J')}.",
        f"- Data-loader stall: {_share(total.get('stall_share'))} of training-loop time.",
        *_held_lines(report),
        *_parts_lines(report),
        "",
        "## Meters",
        "",
        "| component | meter | method | energy (kWh) | counted on |",
        "|---|---|---|---|---|",
    ]
    meters = report.get("meters", {})
    by_component = total.get("energy_kwh_by_component", {})
    methods = total.get("methods", {})
    for component in COMPONENTS:
        meter = meters.get(component, {})
        lines.append(
            f"| {component} | {meter.get('meter', 'none')} | {methods.get(component, NONE)} | "
            f"{_num(by_component.get(component), 6)} | {meter.get('counted_on', '—')} |"
        )
    lines.append("")
    lines += process_ram_note(report)
    if report.get("disabled"):
        lines += [f"Metering stopped early: {report['disabled']}.", ""]
    startup = report.get("meter_startup")
    if startup and startup.get("duration_s"):
        lines += [
            "Meter start-up, not counted in any figure of this report: "
            f"{_duration(startup.get('duration_s'))} "
            "waiting for a meter still starting in the background (codecarbon's hardware detection; at the "
            "first epoch end or the end of training; under DDP, the slowest rank's), "
            f"{_with_method(startup.get('energy_kwh'), startup.get('energy_method', NONE), 6, 'kWh')}.",
            "",
        ]
    events = report.get("events", [])
    if events:
        lines += ["Fallbacks and corrections during the run:", ""]
        for event in events:
            if event.get("kind") == "corrected":
                lines.append(
                    f"- {event.get('component')}: '{event.get('failed')}' corrected after "
                    f"{_duration(event.get('elapsed_s'))}: {event.get('reason')}."
                )
                continue
            lines.append(
                f"- {event.get('component')}: '{event.get('failed')}' failed after {_duration(event.get('elapsed_s'))} "
                f"({event.get('reason')}); then '{event.get('next')}'."
            )
        lines.append("")
    lines += _table("Per phase", report.get("phases", {}), currency, "phase")
    lines += _table("Per cycle", report.get("cycles", {}), currency, "cycle")
    lines += _table("Per epoch", report.get("epochs", {}), currency, "epoch")
    lines += _table("Per stage", report.get("stages", {}), currency, "stage")
    prediction = report.get("prediction")
    if prediction:
        lines += [
            "## Prediction after the first epoch",
            "",
            f"{prediction.get('basis')}; forecast for {_num(prediction.get('total_steps'))} steps: "
            f"{_num(prediction.get('energy_kwh'), 6)} kWh, {_duration(prediction.get('duration_s'))}, "
            f"CO2 {_num(prediction.get('co2_kg'), 6)} kg. Actual: {_num(total.get('energy_kwh'), 6)} kWh, "
            f"{_duration(total.get('duration_s'))}.",
            "",
        ]
    comparison = report.get("comparison")
    if comparison:
        from lightning_pulse.energy.compare import comparison_markdown

        lines += [comparison_markdown(comparison, title="## Against the baseline")]
    notes = report.get("counting", {})
    if notes:
        lines += (
            ["## How counts are taken", ""] + [f"- {name}: {text}" for name, text in notes.items()] + [""]
        )
    if intensity:
        # the parts and the energy no rate counted have their own lines above
        left_out = ("parts", "uncounted_kwh")
        described = ", ".join(f"{k}={v}" for k, v in intensity.items() if v is not None and k not in left_out)
        lines += [f"Carbon intensity: {described}.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------- PNG
def write_plot(report: Mapping[str, Any], path: str | Path) -> Path | None:
    """Power over time (stacked by component, phase bands behind) and energy per phase. ``None`` without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    timeline = report.get("timeline", {})
    starts = list(timeline.get("start_wall", []))
    ends = list(timeline.get("end_wall", []))
    origin = float(starts[0]) if starts else 0.0
    figure = Figure(figsize=(11, 4.2), constrained_layout=True)
    power_axes, phase_axes = figure.subplots(1, 2, gridspec_kw={"width_ratios": [2.4, 1]})

    for segment in report.get("phase_segments", []):
        start = segment.get("start_wall")
        end = segment.get("end_wall") or (ends[-1] if ends else start)
        if start is None or end is None:
            continue
        power_axes.axvspan(
            (start - origin) / 60,
            (end - origin) / 60,
            color=PHASE_COLOURS.get(segment.get("phase"), "#cccccc"),
            alpha=0.12,
            linewidth=0,
        )
    if starts:
        middles = [((s + e) / 2 - origin) / 60 for s, e in zip(starts, ends)]
        widths = [max(e - s, 1e-9) for s, e in zip(starts, ends)]
        stacks, labels, colours = [], [], []
        for component in COMPONENTS:
            joules = timeline.get(f"{component}_j", [])
            if joules and any(value > 0 for value in joules):
                stacks.append([j / w for j, w in zip(joules, widths)])
                labels.append(component)
                colours.append(COMPONENT_COLOURS[component])
        if stacks:
            power_axes.stackplot(middles, *stacks, labels=labels, colors=colours, alpha=0.85, step="mid")
            power_axes.legend(loc="upper right", fontsize=8)
    power_axes.set_xlabel("minutes since start")
    power_axes.set_ylabel("power (W)")
    power_axes.set_title("Power over time (bands: burst red, replay blue, maintain green)", fontsize=9)

    phases = report.get("phases", {})
    names = list(phases)
    bottoms = [0.0] * len(names)
    for component in COMPONENTS:
        values = [
            (phases[name].get("energy_kwh_by_component", {}).get(component) or 0.0) * 1000 for name in names
        ]
        if any(values):
            phase_axes.bar(names, values, bottom=bottoms, color=COMPONENT_COLOURS[component], label=component)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    for index, name in enumerate(names):
        method = phases[name].get("energy_method", NONE)
        phase_axes.annotate(method, (index, bottoms[index]), ha="center", va="bottom", fontsize=7)
    phase_axes.set_ylabel("energy (Wh)")
    phase_axes.set_title("Energy per phase", fontsize=9)
    if not names:
        phase_axes.text(
            0.5, 0.5, "no training phases", ha="center", va="center", transform=phase_axes.transAxes
        )
    return write_atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
