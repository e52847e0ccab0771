"""The main job of ``make demo``: MNIST-1D trained twice, plain and with the pulse suite, side by side.

The pulse suite is whatever ``examples/mnist1d/pulse.yaml`` lists under ``trainer.callbacks``, so the demo
always shows the configuration a user would run with ``lightning-pulse fit``. Both runs use the same seed,
model, data and epochs; FLOPs are counted in a second pass with the same seed (see ``benchmarks/harness.py``).
Before the timed fits, a few untimed steps of the pulse arm (``benchmarks.harness.warm_up``, as the headline
benchmark does) pay the process's one-time costs, codecarbon's start among them, which would otherwise fall in
the plain arm's time since it runs first.

The CNN is the 128-channel variant by default (``--channels``; the YAML's model is the paper's 25 channels):
at 25 channels a CPU step is about 2.5 ms, mostly the fixed cost of a step (Python, Lightning's loop, the
optimizer over small tensors), so no method that saves compute can show in time there. At 128 channels most of
a step is the convolutions, as in real training, so the time and energy columns are honest.

Run: ``python -m examples.demo [--epochs N] [--seed S] [--channels C] [--config PATH]``
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback

import lightning_pulse
from benchmarks.harness import Arm, instantiate_callbacks, run_arms, warm_up

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "examples" / "mnist1d" / "pulse.yaml"


ENERGY_LOGGER = "EnergyLogger"
WORKLOAD = "mnist1d-cnn"


def pulse_methods(specs: list[dict[str, Any]]) -> list[str]:
    """The names of the lightning-pulse callbacks in ``specs`` that change training: every one but the
    EnergyLogger, which both arms carry as the measuring instrument."""
    names = [spec["class_path"].rpartition(".")[2] for spec in specs]
    return [
        name
        for name in names
        if name != ENERGY_LOGGER
        and isinstance(getattr(lightning_pulse, name, None), type)
        and issubclass(getattr(lightning_pulse, name), Callback)
    ]


class ArmCallbacks:
    """Builds an arm's callbacks for each pass; every pass writes its energy report to its own folder.

    Both arms get the YAML's EnergyLogger (it is the measuring instrument, not a pulse method), so their
    energy figures are comparable; only the pulse arm gets the rest of the suite.
    """

    def __init__(self, arm: str, specs: list[dict[str, Any]], with_suite: bool, output: Path) -> None:
        self.arm, self.output, self.passes = arm, output, 0
        self.specs = [s for s in specs if with_suite or s["class_path"].endswith(ENERGY_LOGGER)]

    def __call__(self, seed: int) -> list[Any]:
        self.passes += 1
        specs = []
        for spec in self.specs:
            if spec["class_path"].endswith(ENERGY_LOGGER):
                init_args = {**spec.get("init_args", {}), "report_dir": str(self.report_dir(self.passes))}
                spec = {**spec, "init_args": init_args}
            specs.append(spec)
        return instantiate_callbacks(specs)

    def report_dir(self, index: int = 1) -> Path:
        # pass 1 is the timed pass; pass 2 counts FLOPs and runs ~3x slower, so its energy is not the run's
        return self.output / self.arm / f"pass{index}"

    def energy(self) -> dict[str, Any] | None:
        path = self.report_dir(1) / "energy_report.json"
        return json.loads(path.read_text())["total"] if path.exists() else None


def _fmt(value: float, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if abs(value) >= 1e6:
        return f"{value:.3g}{unit}"
    return f"{value:.3f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    plain, pulse = result["runs"][0], result["runs"][1]
    rows = [
        ("test accuracy", _fmt(plain["test"]["test_acc"]), _fmt(pulse["test"]["test_acc"]), ""),
        ("final val accuracy", _fmt(plain["final_val"]["val_acc"]), _fmt(pulse["final_val"]["val_acc"]), ""),
        (
            "training FLOPs",
            _fmt(plain["train_flops"]),
            _fmt(pulse["train_flops"]),
            f"{pulse['train_flops'] / plain['train_flops']:.3f}x",
        ),
        (
            "training CPU time",
            _fmt(plain["train_cpu_s"], " s"),
            _fmt(pulse["train_cpu_s"], " s"),
            f"{pulse['train_cpu_s'] / plain['train_cpu_s']:.3f}x",
        ),
        (
            "fit wall time",
            _fmt(plain["fit_wall_s"], " s"),
            _fmt(pulse["fit_wall_s"], " s"),
            f"{pulse['fit_wall_s'] / plain['fit_wall_s']:.3f}x",
        ),
        ("samples trained on", str(plain["samples"]), str(pulse["samples"]), ""),
        ("optimizer steps", str(plain["steps"]), str(pulse["steps"]), ""),
    ]
    phases = pulse["steps_by_phase"]
    rows.append(
        (
            "steps burst/replay/maintain",
            str(plain["steps"]) + "/0/0",
            # a suite without PulseCycle has no phases: all its steps are burst steps, as in the harness
            "/".join(str(phases.get(p, 0)) for p in ("burst", "replay", "maintain")),
            "",
        )
    )
    return rows


#: the loggers whose per-fit banners the demo quiets
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric")


def quiet_lightning() -> None:
    """The demo prints one table; Lightning's per-fit banners and known warnings would bury it."""
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def energy_rows(plain: dict[str, Any], pulse: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The energy row and, where the EnergyLogger knows the grid (``country_iso_code``), the CO2 row: without
    it ``co2_kg`` is ``None``, and formatting it crashed the demo after both fits."""
    rows = []
    for key, label, method in (
        ("energy_kwh", "energy, kWh", "energy_method"),
        ("co2_kg", "CO2, kg", "co2_method"),
    ):
        if plain.get(key) is not None and pulse.get(key) is not None:
            ratio = f"{pulse[key] / plain[key]:.3f}x" if plain[key] else ""
            rows.append((f"{label} ({pulse[method]})", f"{plain[key]:.3g}", f"{pulse[key]:.3g}", ratio))
    return rows


def main() -> None:
    quiet_lightning()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="a lightning-pulse YAML with trainer.callbacks"
    )
    parser.add_argument("--epochs", type=int, default=None, help="defaults to the YAML's trainer.max_epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--channels", type=int, default=128, help="CNN channels: 128 makes a step mostly compute (see above)"
    )
    parser.add_argument("--output", default=str(ROOT / "demo_runs" / "demo_summary.json"))
    args = parser.parse_args()

    config = yaml.safe_load(Path(args.config).read_text())
    specs = config.get("trainer", {}).get("callbacks", [])
    if not pulse_methods(specs):
        # plain against plain + EnergyLogger compares nothing; refused before two fits are spent on it
        parser.error(
            f"--config {args.config} lists no pulse method under trainer.callbacks; the demo compares plain "
            "training with a pulse suite, so give a YAML with at least one lightning_pulse callback other "
            f"than EnergyLogger there (e.g. {DEFAULT_CONFIG.relative_to(ROOT)})."
        )
    epochs = args.epochs or config.get("trainer", {}).get("max_epochs", 40)
    names = [spec["class_path"].rpartition(".")[2] for spec in specs]
    print(
        f"MNIST-1D CNN ({args.channels} channels), {epochs} epochs, seed {args.seed}: plain vs pulse "
        f"({', '.join(names)})",
        flush=True,
    )
    # model and data arguments come from the same YAML, so the demo trains what `lightning-pulse fit` would
    overrides = {f"model__{k}": v for k, v in config["model"].get("init_args", {}).items() if k != "arch"}
    overrides["model__channels"] = args.channels
    overrides.update({f"data__{k}": v for k, v in config["data"].get("init_args", {}).items()})
    output_dir = Path(args.output).parent
    plain_callbacks = ArmCallbacks("plain", specs, with_suite=False, output=output_dir)
    pulse_callbacks = ArmCallbacks("pulse", specs, with_suite=True, output=output_dir)
    arms = [Arm("plain", callbacks=plain_callbacks), Arm("pulse", callbacks=pulse_callbacks)]
    # the whole suite with its EnergyLogger, so every one-time cost either arm would meet is paid here; its
    # report goes to its own folder, which nothing reads
    warm_up_callbacks = ArmCallbacks("warm-up", specs, with_suite=True, output=output_dir)
    warm_up(WORKLOAD, Arm("warm-up", callbacks=warm_up_callbacks), overrides)
    result = run_arms(
        WORKLOAD,
        arms,
        seeds=(args.seed,),
        trainer_kwargs={"max_epochs": epochs},
        workload_kwargs=overrides,
        flops="separate",
        log=lambda line: None,
    )

    rows = summary_rows(result)
    energies = plain_callbacks.energy(), pulse_callbacks.energy()
    if all(energies):
        rows += energy_rows(*energies)
    widths = [max(len(row[i]) for row in rows + [("", "plain", "pulse", "pulse/plain")]) for i in range(4)]
    header = ("", "plain", "pulse", "pulse/plain")
    print()
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2, default=str))
    table = ["| | plain | pulse | pulse/plain |", "|---|---|---|---|"]
    table += [f"| {' | '.join(row)} |" for row in rows]
    command = (
        f"python -m examples.demo --config {args.config} --epochs {epochs} --seed {args.seed} "
        f"--channels {args.channels}"
    )
    output.with_suffix(".md").write_text(f"# make demo\n\nCommand: `{command}`\n\n" + "\n".join(table) + "\n")
    print(f"\nfull figures: {output}")


if __name__ == "__main__":
    main()
