"""The suite's own cost per step, timed from outside: each callback's hook CPU as a share of training CPU.

Arms on each workload: plain; PulseCycle, StabilityGuard and EnergyLogger each alone; and the full suite as
shipped in ``examples/mnist1d/pulse.yaml`` (its ``trainer.callbacks``, built from the YAML). Every callback
is wrapped by :class:`benchmarks.harness.HookTimer`, so the library carries no timer of its own.

What the shares count: CPU seconds inside the callbacks' training-loop hooks (and the pulse contracts) over
the run's training CPU seconds (validation excluded); start-up and shut-down hooks are reported apart, in
seconds, since a longer run amortises them. What they do not: a loss function a callback wraps, a
forward hook it registers, or EnergyLogger's sampling thread; the end-to-end CPU ratio against the plain
arm of the same seed holds those, and the machine's noise.

A timed call inside another (PulseCycle telling a listener of a phase change) counts for the inner callback
only. PulseCycle's maintain probe (an evaluation the shipped YAML asks for) is timed apart.

In the full-suite arm the light phases change the work itself (smaller replay batches, frozen layers), so
its end-to-end ratio is a saving or a cost, not overhead; its hook share is the overhead figure.

Run: ``python -m benchmarks.overhead`` (about 10 minutes on 2 cores); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness import Arm, instantiate_callbacks, run_arms, write_results
from lightning_pulse import EnergyLogger, PulseCycle, StabilityGuard

SUITE_YAML = Path(__file__).parents[1] / "examples" / "mnist1d" / "pulse.yaml"
CADENCE = dict(burst=36, replay=72, maintain=4, warmup=0.1, anneal=0.1)


def shipped_suite(seed: int) -> list:
    config = yaml.safe_load(SUITE_YAML.read_text())
    return instantiate_callbacks(config["trainer"]["callbacks"])


def arms() -> list[Arm]:
    return [
        Arm("plain"),
        Arm("pulse_cycle", callbacks=lambda seed: [PulseCycle(**CADENCE, maintain_eval="none")]),
        Arm("stability_guard", callbacks=lambda seed: [StabilityGuard()]),
        Arm("energy_logger", callbacks=lambda seed: [EnergyLogger(country_iso_code="DEU")]),
        # the maintain probe is an evaluation the shipped YAML asks for: timed apart, not counted as overhead
        Arm("full_suite", callbacks=shipped_suite, timed_apart={"PulseCycle": ("probe.logged_run",)}),
    ]


WORKLOADS = {
    # ~5 ms CPU steps: the toy step, where a fixed cost per hook weighs most
    "mnist1d-cnn": dict(trainer_kwargs={"max_epochs": 6}, workload_kwargs={"data__num_samples": 5000}),
    # the demo's workload (make demo): the same CNN at 128 channels, a step that is mostly compute
    "mnist1d-cnn-128": dict(
        workload="mnist1d-cnn",
        trainer_kwargs={"max_epochs": 6},
        workload_kwargs={"data__num_samples": 5000, "model__channels": 128},
    ),
    # ~40 ms CPU steps: the realistic step the targets are stated on
    "charlm": dict(
        trainer_kwargs={
            "max_steps": 300,
            "val_check_interval": 100,
            "check_val_every_n_epoch": None,
            "limit_val_batches": 10,
        },
        workload_kwargs={"data__max_chars": 200_000},
    ),
}


def shares(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Median over seeds of each callback's hook CPU share, and of their sum, per arm."""
    table: dict[str, dict[str, float]] = {}
    for arm in result["arms"]:
        runs = [run for run in result["runs"] if run["arm"] == arm]
        per_callback: dict[str, list[float]] = {}
        totals = []
        for run in runs:
            hooks = run["extra"].get("hook_cpu_s", {})
            for name, seconds in hooks.items():
                per_callback.setdefault(name, []).append(seconds / run["train_cpu_s"])
            totals.append(sum(hooks.values()) / run["train_cpu_s"])
        table[arm] = {name: statistics.median(values) for name, values in per_callback.items()}
        table[arm]["all"] = statistics.median(totals)
    return table


def markdown(result: dict[str, Any]) -> str:
    table = shares(result)
    steps = result["summary"]["plain"]["steps"]
    step_ms = 1000 * result["summary"]["plain"]["train_cpu_s"] / steps
    lines = [
        f"Plain step: {step_ms:.1f} ms of training CPU (median; {steps:.0f} steps).",
        "",
        "| arm | training-loop hook CPU share per callback | all | maintain probe | start-up + shut-down CPU s "
        "| end-to-end CPU ratio | wall ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in result["arms"]:
        cells = ", ".join(f"{name} {100 * share:.2f}%" for name, share in table[arm].items() if name != "all")
        runs = [run for run in result["runs"] if run["arm"] == arm]
        plain = {run["seed"]: run for run in result["runs"] if run["arm"] == "plain"}
        wall = statistics.median(run["train_wall_s"] / plain[run["seed"]]["train_wall_s"] for run in runs)
        one_time = statistics.median(sum(run["extra"]["one_time_hook_cpu_s"].values()) for run in runs)
        probe = statistics.median(
            sum(run["extra"]["apart_cpu_s"].values()) / run["train_cpu_s"] for run in runs
        )
        lines.append(
            f"| {arm} | {cells or '-'} | {100 * table[arm]['all']:.2f}% | {100 * probe:.2f}% | {one_time:.2f} | "
            f"{result['summary'][arm]['cpu_ratio']:.3f} | {wall:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="a few steps per arm, for a smoke run")
    parser.add_argument("--name", default="overhead")
    args = parser.parse_args()
    results, notes = [], []
    for workload in args.workloads:
        settings = WORKLOADS[workload]
        trainer_kwargs = dict(settings["trainer_kwargs"])
        if args.quick:
            trainer_kwargs = {"max_steps": 12, "limit_val_batches": 2, "val_check_interval": 6}
        result = run_arms(
            settings.get("workload", workload),
            arms(),
            seeds=args.seeds,
            trainer_kwargs=trainer_kwargs,
            workload_kwargs=settings["workload_kwargs"],
            flops="none",
            rotate_arms=True,
        )
        result["workload"] = workload  # the variant's name, for the tables
        result["hook_shares"] = shares(result)
        results.append(result)
        notes += [f"### {workload}: hook shares", "", markdown(result), ""]
    command = "python -m benchmarks.overhead " + " ".join(sys.argv[1:])
    if not args.quick:
        write_results(results, args.name, command.strip(), notes="\n".join(notes))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
