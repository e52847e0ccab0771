"""The headline table: does the pulse save wall time and energy at the same accuracy?

Workloads: the MNIST-1D CNN at the paper's width (25 channels), its compute-bound 128-channel variant, and the
character LM. Arms, each with an EnergyLogger as the meter (estimated kWh and CO2 from codecarbon's offline
model; it is in every arm, so it is not what differs):

* ``plain``: the baseline, in the same run;
* each callback alone at its defaults: ``hard_sample_replay``, ``gradient_cache``, ``scheduled_prune``,
  ``stability_guard`` (PulseCycle alone changes no batch and EnergyLogger is in every arm);
* ``suite``: the full suite exactly as shipped in the workload's ``examples/*/pulse.yaml``;
* ``random``: the suite's PulseCycle with a step-saving HardSampleReplay on a uniform random subset: the same
  steps and samples as the suite's replay, without the selection (the control at the same compute);
* ``infobatch``: HardSampleReplay's InfoBatch rule as InfoBatch runs it (standalone, every step, ``r=0.5``).

Per arm, medians of 5 seeds (identical fits differ by up to 10% in wall time on this machine, so 3 left the
medians several points apart from run to run), with ratios paired by seed against ``plain``: the final test
metric; wall and CPU time for the whole fit and to the baseline's final validation metric; optimizer steps;
estimated kWh and CO2.
FLOPs come from a second, counted pass of seed 0 (counting slows a step about 3x, so timed passes count
nothing). Writes ``benchmarks/results/headline.{json,md,png}``.

Run: ``python -m benchmarks.headline`` (about 30 minutes on 2 cores; each workload in its own process);
``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness import (
    RESULTS_DIR,
    Arm,
    _median,
    environment,
    instantiate_callbacks,
    run_arms,
    warm_up,
)
from lightning_pulse import (
    EnergyLogger,
    GradientCache,
    HardSampleReplay,
    MeterConfig,
    ScheduledPrune,
    StabilityGuard,
)

ROOT = Path(__file__).resolve().parents[1]
METER = dict(country_iso_code="DEU", meters=MeterConfig(codecarbon_tracking_mode="process"))


def _yaml(path: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / path).read_text())


def _model_and_data(config: dict[str, Any]) -> dict[str, Any]:
    overrides = {f"model__{k}": v for k, v in config["model"].get("init_args", {}).items() if k != "arch"}
    overrides.update({f"data__{k}": v for k, v in config["data"].get("init_args", {}).items()})
    return overrides


MNIST = _yaml("examples/mnist1d/pulse.yaml")
CHARLM = _yaml("examples/charlm/pulse.yaml")
WORKLOADS: dict[str, dict[str, Any]] = {
    "mnist1d-cnn": dict(
        workload="mnist1d-cnn", config=MNIST, trainer={"max_epochs": 40}, overrides=_model_and_data(MNIST)
    ),
    "mnist1d-cnn-128": dict(
        workload="mnist1d-cnn",
        config=MNIST,
        trainer={"max_epochs": 40},
        overrides={**_model_and_data(MNIST), "model__channels": 128},
    ),
    "charlm": dict(
        workload="charlm", config=CHARLM, trainer={"max_epochs": 3}, overrides=_model_and_data(CHARLM)
    ),
}


def _suite_specs(config: dict[str, Any]) -> list[dict[str, Any]]:
    return list(config["trainer"]["callbacks"])


def _with_meter(callbacks: list[Any]) -> list[Any]:
    if not any(isinstance(c, EnergyLogger) for c in callbacks):
        callbacks.append(EnergyLogger(**METER))
    return callbacks


def _cycle_spec(config: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in _suite_specs(config) if s["class_path"].endswith("PulseCycle"))


def energy_metrics(callbacks: list[Any], trainer: Any) -> dict[str, Any]:
    meter = next((c for c in callbacks if isinstance(c, EnergyLogger)), None)
    total = (meter.report or {}).get("total", {}) if meter is not None else {}
    # a figure no meter counted is null in the report: NaN here, so medians and ratios skip it visibly
    return {
        "kwh": _or_nan(total.get("energy_kwh")),
        "co2_kg": _or_nan(total.get("co2_kg")),
    }


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def arms(config: dict[str, Any]) -> list[Arm]:
    suite = _suite_specs(config)

    def alone(factory):
        return lambda seed: _with_meter([factory()])

    return [
        Arm("plain", callbacks=lambda seed: _with_meter([]), metrics=energy_metrics),
        Arm("hard_sample_replay", callbacks=alone(HardSampleReplay), metrics=energy_metrics),
        Arm("gradient_cache", callbacks=alone(GradientCache), metrics=energy_metrics),
        Arm("scheduled_prune", callbacks=alone(ScheduledPrune), metrics=energy_metrics),
        Arm("stability_guard", callbacks=alone(StabilityGuard), metrics=energy_metrics),
        Arm(
            "suite", callbacks=lambda seed: _with_meter(instantiate_callbacks(suite)), metrics=energy_metrics
        ),
        Arm(
            "random",
            callbacks=lambda seed: _with_meter(
                [*instantiate_callbacks([_cycle_spec(config)]), HardSampleReplay(rule="random")]
            ),
            metrics=energy_metrics,
        ),
        Arm(
            "infobatch",
            callbacks=alone(lambda: HardSampleReplay(rule="infobatch", prune_ratio=0.5)),
            metrics=energy_metrics,
        ),
    ]


def _to_target(run: dict[str, Any], base: dict[str, Any], metric: str, mode: str, key: str) -> float:
    target = base["final_val"].get(metric)
    if target is None:
        return math.nan
    for point in run["curve"]:
        value = point.get(metric)
        if value is not None and ((mode == "max" and value >= target) or (mode == "min" and value <= target)):
            return point[key] / base[key]
    return math.nan


def headline_rows(result: dict[str, Any], flops: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per arm: medians and seed-paired ratios against the first arm."""
    metric, mode, test_metric = result["metric"], result["mode"], result["test_metric"]
    baseline = {run["seed"]: run for run in result["runs"] if run["arm"] == result["arms"][0]}
    flop_base = next(r for r in flops["runs"] if r["arm"] == flops["arms"][0])["train_flops"]
    rows: dict[str, dict[str, float]] = {}
    for arm in result["arms"]:
        own = [run for run in result["runs"] if run["arm"] == arm]

        def ratio(key: str, runs=own) -> float:
            return _median([r[key] / baseline[r["seed"]][key] for r in runs])

        def extra_ratio(key: str, runs=own) -> float:
            return _median([r["extra"][key] / baseline[r["seed"]]["extra"][key] for r in runs])

        flop_run = next(r for r in flops["runs"] if r["arm"] == arm)
        reached = [_to_target(r, baseline[r["seed"]], metric, mode, "train_wall_s") for r in own]
        reached_cpu = [_to_target(r, baseline[r["seed"]], metric, mode, "train_cpu_s") for r in own]
        rows[arm] = {
            test_metric: _median([r["test"][test_metric] for r in own]),
            f"delta_{test_metric}": _median(
                [r["test"][test_metric] - baseline[r["seed"]]["test"][test_metric] for r in own]
            ),
            "wall_ratio": ratio("fit_wall_s"),
            "cpu_ratio": ratio("train_cpu_s"),
            "seeds_reaching": sum(not math.isnan(v) for v in reached),
            "wall_to_target": _median(reached),
            "cpu_to_target": _median(reached_cpu),
            "steps": _median([r["steps"] for r in own]),
            "flops_ratio": flop_run["train_flops"] / flop_base if flop_base else math.nan,
            "kwh_ratio": extra_ratio("kwh"),
            "co2_ratio": extra_ratio("co2_kg"),
            "kwh": _median([r["extra"]["kwh"] for r in own]),
            "co2_kg": _median([r["extra"]["co2_kg"] for r in own]),
        }
    return rows


COLUMNS = [
    ("test metric", None),
    ("Δ vs plain", "delta"),
    ("wall", "wall_ratio"),
    ("kWh", "kwh_ratio"),
    ("CO2", "co2_ratio"),
    ("CPU", "cpu_ratio"),
    ("FLOPs", "flops_ratio"),
    ("steps", "steps"),
    ("seeds reaching plain's val", "seeds_reaching"),
    ("wall to plain's val", "wall_to_target"),
    ("CPU to plain's val", "cpu_to_target"),
]


def _cell(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 10:
        return f"{int(value)}"
    return f"{value:.3f}"


def markdown(name: str, result: dict[str, Any], rows: dict[str, dict[str, float]]) -> str:
    test_metric = result["test_metric"]
    lines = [
        f"## {name}",
        "",
        f"Seeds {result['seeds']}, medians; ratios paired by seed against `plain` in the same run (wall: the "
        f"whole fit; CPU: training steps). Trainer: {result['trainer_kwargs']}; workload: "
        f"{result['workload_kwargs']}.",
        "",
        "| arm | " + " | ".join(title if key else test_metric for title, key in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for arm, row in rows.items():
        cells = []
        for _, key in COLUMNS:
            if key is None:
                cells.append(_cell(row[test_metric]))
            elif key == "delta":
                cells.append(f"{row[f'delta_{test_metric}']:+.4f}")
            else:
                cells.append(_cell(row[key]))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, tuple[dict[str, Any], dict[str, dict[str, float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 8), squeeze=False)
    for column, (name, (result, rows)) in enumerate(results.items()):
        test_metric = result["test_metric"]
        for row_index, (key, label) in enumerate(
            (("wall_ratio", "wall time / plain"), ("kwh_ratio", "kWh / plain"))
        ):
            axis = axes[row_index][column]
            for arm, row in rows.items():
                axis.scatter(row[key], row[test_metric], label=arm)
                axis.annotate(arm, (row[key], row[test_metric]), fontsize=7)
            axis.set_xlabel(label)
            axis.set_ylabel(f"test {test_metric}")
            axis.set_title(name)
            axis.axvline(0.7, color="grey", linestyle=":", linewidth=1)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def time_arms(
    workload: str,
    arm_list: list[Arm],
    seeds: list[int],
    trainer: dict[str, Any],
    overrides: dict[str, Any],
) -> dict[str, Any]:
    """The arms' timed runs (rotated per seed, nothing counted), after one untimed fit: the process's one-time
    costs (imports, codecarbon's start) are no arm's."""
    warm_up(workload, arm_list[0], overrides)
    return run_arms(
        workload,
        arm_list,
        seeds=seeds,
        trainer_kwargs=trainer,
        workload_kwargs=overrides,
        flops="none",
        rotate_arms=True,
        log=lambda line: print(line, flush=True),
    )


def run_workload(name: str, seeds: list[int], quick: bool) -> dict[str, Any]:
    """One workload's timed arms (rotated per seed) and its FLOP-counted pass, with the table rows."""
    spec = WORKLOADS[name]
    trainer = {"max_epochs": 2} if quick else dict(spec["trainer"])
    overrides = dict(spec["overrides"])
    if quick:
        overrides.update(
            {"data__num_samples": 600} if name.startswith("mnist") else {"data__max_chars": 40_000}
        )
    arm_list = arms(spec["config"])
    timed = time_arms(spec["workload"], arm_list, seeds, trainer, overrides)
    counted = run_arms(
        spec["workload"],
        arm_list,
        seeds=seeds[:1],
        trainer_kwargs=trainer,
        workload_kwargs=overrides,
        flops="same",
        log=lambda line: print(line, flush=True),
    )
    return {"name": name, "timed": timed, "flops": counted, "rows": headline_rows(timed, counted)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--quick", action="store_true", help="a few steps per arm, for a smoke run")
    parser.add_argument("--name", default="headline")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: one workload's figures, to this file
    args = parser.parse_args()
    if args.part:
        part = run_workload(args.workloads[0], args.seeds, args.quick)
        Path(args.part).write_text(json.dumps(part, default=str))
        return
    # each workload in a fresh process: a workload measured after another in the same process ran up to
    # 0.15x slower in its pulsed arms (allocator and cache state), which no arm should carry
    payload = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.workloads:
            part_path = Path(scratch) / f"{name}.json"
            child = [
                sys.executable,
                "-m",
                "benchmarks.headline",
                "--workloads",
                name,
                "--part",
                str(part_path),
            ]
            child += ["--seeds", *map(str, args.seeds)] + (["--quick"] if args.quick else [])
            subprocess.run(child, check=True, cwd=ROOT)
            payload.append(json.loads(part_path.read_text()))
    results = {part["name"]: (part["timed"], part["rows"]) for part in payload}
    command = "python -m benchmarks.headline" + (" --quick" if args.quick else "")
    if args.workloads != list(WORKLOADS):
        command += " --workloads " + " ".join(args.workloads)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(
        json.dumps({"command": command, "results": payload}, indent=2, default=str)
    )
    parts = [f"# {args.name}", "", f"Command: `{command}`", "", NOTES, ""]
    parts += [markdown(name, result, rows) + "\n" for name, (result, rows) in results.items()]
    parts.append(f"Environment: {environment()}; python {sys.version.split()[0]}.")
    (RESULTS_DIR / f"{args.name}.md").write_text("\n".join(parts) + "\n")
    plot(results, RESULTS_DIR / f"{args.name}.png")
    print("\n".join(parts))


NOTES = (
    "Every arm carries an EnergyLogger (country DEU, process-share CPU tracking): kWh and CO2 are codecarbon's "
    "offline estimates on this machine, which has no RAPL or NVML. `suite` is the workload's "
    "`examples/*/pulse.yaml` callbacks as shipped (the char LM's ships PulseCycle alone: its studies found no "
    "selection that beats a random subset there). FLOPs: one counted pass of the first seed. Test metric: "
    "accuracy for MNIST-1D, loss for the char LM."
)


if __name__ == "__main__":
    main()
