"""GPU headline: plain against the shipped pulse suite on one GPU, in GPU-seconds and NVML-measured kWh.

For the device machine (an NVIDIA GPU with NVML); about 8 minutes at the defaults. One workload, the MNIST-1D
CNN made wide enough that a step is mostly GPU compute (``--channels 512``, 100,000 generated samples, batches
of 1,024, bf16 autocast), trained plain and with the callbacks of ``examples/mnist1d/pulse.yaml``, seeds
alternating plain / pulse. Both arms carry ``EnergyLogger(gpu="auto")``: the GPU figure comes from NVML's
total-energy counter (labelled *measured*). Per arm: test accuracy, fit wall seconds, GPU-busy seconds (the
fit's wall time while the device was held, i.e. GPU-seconds of a whole device), optimizer steps, the GPU kWh
with how it was obtained, and the whole run's kWh (GPU, CPU and RAM); ratios are paired by seed and reported as
medians, the kWh ratio on the GPU's figure.

One-time costs never fall inside a timed fit: before the timed runs, one short plain fit and one short pulse
fit (``--warmup-epochs``) load the CUDA kernels, the libraries and the meters, and are discarded. The arm
order alternates from seed to seed. Results are written after every fit, so a run stopped at ``--max-minutes``
(no new seed starts when the last pair would not fit) or killed keeps the pairs it finished.

``tests/test_gpu_headline.py`` runs the whole script on CPU at a tiny size (``--accelerator cpu``), so that a
device run does not spend its minutes on a mistake the CPU could have shown.

Without a GPU it prints why and exits 0, writing nothing. Everything else in the project passes without one.

Run: ``python -m benchmarks.gpu_headline [--seeds 0 1 2] [--epochs 8]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).parent / "results"


def gpu_unavailable_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as error:  # no driver, no library
        return f"NVML is not available ({error})"
    return None


def run(arm: str, seed: int, args: argparse.Namespace, epochs: int | None = None) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from benchmarks.harness import instantiate_callbacks
    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
    from lightning_pulse import EnergyLogger

    config = yaml.safe_load((ROOT / "examples" / "mnist1d" / "pulse.yaml").read_text())
    specs = [s for s in config["trainer"]["callbacks"] if not s["class_path"].endswith("EnergyLogger")]
    callbacks = instantiate_callbacks(specs) if arm == "pulse" else []
    report_dir = tempfile.mkdtemp(prefix=f"lp-gpu-{arm}-")
    meter = EnergyLogger(gpu="auto", country_iso_code="DEU", report_dir=report_dir)
    pl.seed_everything(seed, verbose=False)
    model_args = {k: v for k, v in config["model"]["init_args"].items() if k != "channels"}
    model = MNIST1DClassifier(**{**model_args, "channels": args.channels})
    data = MNIST1DDataModule(
        num_samples=args.num_samples, batch_size=args.batch_size, num_workers=args.num_workers
    )
    data.prepare_data()  # generated once, before the timed fit (about 16 s for 100k samples on one core)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision="bf16-mixed",
        max_epochs=args.epochs if epochs is None else epochs,
        callbacks=[*callbacks, meter],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=report_dir,
    )
    synchronize = torch.cuda.synchronize if args.accelerator == "gpu" else lambda: None
    synchronize()
    start = time.perf_counter()
    trainer.fit(model, data)
    synchronize()
    wall = time.perf_counter() - start
    test = trainer.test(model, data, verbose=False)[0]
    total = (meter.report or {}).get("total", {})
    return {
        "arm": arm,
        "seed": seed,
        "fit_wall_s": wall,
        "gpu_seconds": wall,  # one whole device held for the fit
        "steps": trainer.global_step,
        "test_acc": float(test["test_acc"]),
        "gpu_kwh": total.get("energy_kwh_by_component", {}).get("gpu"),
        "gpu_method": total.get("methods", {}).get("gpu"),
        "kwh": total.get("energy_kwh"),
        "energy_total": total,  # every component's figure and how it was obtained
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--num-samples", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers of every arm")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="epochs of each discarded warm-up fit")
    parser.add_argument(
        "--max-minutes", type=float, default=8.0, help="no seed starts past this, warm-up included"
    )
    parser.add_argument("--results-dir", type=Path, default=None, help="default: benchmarks/results")
    parser.add_argument("--accelerator", default="gpu", help=argparse.SUPPRESS)  # "cpu": the tests' dry run
    args = parser.parse_args(argv)
    reason = gpu_unavailable_reason() if args.accelerator == "gpu" else None
    if reason is not None:
        print(f"gpu_headline: not run: {reason}.")
        return 0
    args.results_dir = args.results_dir or RESULTS_DIR
    command = "python -m benchmarks.gpu_headline " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    warmups = []
    if args.warmup_epochs > 0:
        for arm in ("plain", "pulse"):
            warmups.append(
                {"arm": arm, "fit_wall_s": run(arm, args.seeds[0], args, args.warmup_epochs)["fit_wall_s"]}
            )
    runs: list[dict[str, Any]] = []
    last_pair_s = 0.0
    for index, seed in enumerate(args.seeds):
        if index > 0 and time.perf_counter() - started + last_pair_s > 60 * args.max_minutes:
            print(f"gpu_headline: seed {seed} not started: another pair would pass --max-minutes.")
            break
        pair_start = time.perf_counter()
        for arm in ("plain", "pulse") if index % 2 == 0 else ("pulse", "plain"):
            runs.append(run(arm, seed, args))
            _write(args, command, warmups, runs)
        last_pair_s = time.perf_counter() - pair_start
    print(_write(args, command, warmups, runs))
    return 0


def _write(args: argparse.Namespace, command: str, warmups: list[dict], runs: list[dict[str, Any]]) -> str:
    """Write the JSON and the table of the fits so far; ratios only over seeds where both arms finished."""
    import lightning
    import torch

    base = {r["seed"]: r for r in runs if r["arm"] == "plain"}
    paired = [r for r in runs if r["arm"] == "pulse" and r["seed"] in base]

    def ratio(key: str) -> float | None:
        if not paired or not all(r[key] and base[r["seed"]][key] for r in paired):
            return None  # a ratio of zeros or of missing figures is not reported
        return statistics.median(r[key] / base[r["seed"]][key] for r in paired)

    summary = {
        "seeds_paired": [r["seed"] for r in paired],
        "wall_ratio": ratio("fit_wall_s"),
        "gpu_kwh_ratio": ratio("gpu_kwh"),
        "kwh_ratio": ratio("kwh"),
        "steps_ratio": ratio("steps"),
        "test_acc_plain": _median([base[r["seed"]]["test_acc"] for r in paired]),
        "test_acc_pulse": _median([r["test_acc"] for r in paired]),
    }
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu"
    environment = {"device": device, "torch": torch.__version__, "lightning": lightning.__version__}
    options = {key: str(value) for key, value in vars(args).items()}
    record = {"command": command, "args": options, "environment": environment, "warmups": warmups}
    record |= {"runs": runs, "summary": summary}
    (args.results_dir / "gpu_headline.json").write_text(json.dumps(record, indent=2))
    lines = [
        "# gpu_headline",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {device}; torch {torch.__version__}; lightning {lightning.__version__}. "
        f"Discarded warm-up fits ({args.warmup_epochs} epoch each): "
        + ", ".join(f"{w['arm']} {w['fit_wall_s']:.1f} s" for w in warmups),
        "",
        "| arm | seed | test acc | fit wall s | steps | GPU kWh | GPU method | run kWh |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['arm']} | {r['seed']} | {r['test_acc']:.4f} | {r['fit_wall_s']:.1f} | {r['steps']} | "
        f"{_kwh(r['gpu_kwh'])} | {r['gpu_method']} | {_kwh(r['kwh'])} |"
        for r in runs
    ]
    lines += ["", f"Medians, pulse / plain paired by seed: {summary}"]
    table = "\n".join(lines) + "\n"
    (args.results_dir / "gpu_headline.md").write_text(table)
    return table


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _kwh(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


if __name__ == "__main__":
    sys.exit(main())
