"""GPU check: NVML's total-energy counter against integrated power sampling, and EnergyLogger on a real GPU.

On a machine with an NVIDIA GPU this script

1. runs a load with a rhythm (matmul bursts and idle gaps, like pulse training) on one GPU for about
   ``--seconds`` while ``NvmlCounterMeter`` (the counter) and ``NvmlPowerMeter`` (``nvmlDeviceGetPowerUsage``
   integrated with the trapezoidal rule) are read side by side by the same sampling loop, and checks that
   the two energies agree within ``--tolerance`` (5% by default). ``nvmlDeviceGetPowerUsage`` is a 1 s
   average on Ampere and newer, so the load starts and ends with idle time for the average to settle;
2. fits a small classifier on scikit-learn's digits on the GPU with ``EnergyLogger(gpu="auto")`` and
   checks that the GPU figure comes from the counter, is labelled *measured*, and is not zero; beside it, the
   counter read around the whole ``fit`` call (setup included, so a little more than EnergyLogger's
   share, which starts at ``on_fit_start``).

It writes ``benchmarks/results/gpu_energy_check.json`` and ``.md`` and exits with status 0 when both checks
pass, 1 when one fails. Without a GPU (no NVML library, no device, or a CPU-only torch) it prints why and
exits with status 0, writing nothing.

It needs torch with CUDA, lightning, torchmetrics, nvidia-ml-py and scikit-learn, not codecarbon or
mnist1d (EnergyLogger meters the GPU only here: ``cpu="none"``, ``ram="none"``), so it runs as it is under
the Python of a CUDA image that holds those. It takes about ``--seconds`` plus half a minute.

Run: ``python -m benchmarks.gpu_energy_check``
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"


def gpu_unavailable_reason() -> str | None:
    """Why this machine cannot run the check, or ``None`` when it can."""
    try:
        import pynvml
    except ImportError:
        return "the nvidia-ml-py package (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return f"NVML is not available ({error}): no NVIDIA driver on this machine"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return "NVML sees no GPU"
    finally:
        pynvml.nvmlShutdown()
    import torch

    if not torch.cuda.is_available():
        return "torch has no CUDA device (CPU-only build or no visible GPU)"
    return None


def rhythmic_load(seconds: float, stop: threading.Event, device: Any, size: int) -> int:
    """Matmul bursts and idle gaps: idle 15%, then 3 s busy / 1 s idle, idle 15% at the end."""
    import torch

    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    start = time.monotonic()
    idle_edge = 0.15 * seconds
    products = 0
    while not stop.is_set():
        elapsed = time.monotonic() - start
        if elapsed >= seconds:
            break
        busy = idle_edge <= elapsed < seconds - idle_edge and (elapsed - idle_edge) % 4.0 < 3.0
        if busy:
            for _ in range(8):
                a = torch.tanh(a @ b)
            torch.cuda.synchronize(device)
            products += 8
        else:
            stop.wait(0.02)
    return products


def check_counter_against_power(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lightning_pulse.energy.nvml import NvmlCounterMeter, NvmlPowerMeter, nvml_devices_for_cuda

    device = torch.device("cuda", args.device)
    selectors = nvml_devices_for_cuda([args.device])
    counter, power = NvmlCounterMeter(selectors), NvmlPowerMeter(selectors)
    now = time.monotonic()
    counter.start(now)
    power.start(now)
    stop = threading.Event()
    readings: list[tuple[float, float, float]] = []

    def sample() -> None:
        while not stop.wait(args.period):
            t = time.monotonic()
            readings.append((t, counter.read_joules(t), power.read_joules(t)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    products = rhythmic_load(args.seconds, stop, device, args.size)
    stop.set()
    sampler.join()
    end = time.monotonic()
    counter_j, power_j = counter.read_joules(end), power.read_joules(end)
    names = counter.device_names
    counter.close()
    power.close()
    difference = abs(power_j - counter_j) / counter_j if counter_j > 0 else float("inf")
    return {
        "device": names[0] if names else str(selectors[0]),
        "selector": str(selectors[0]),
        "seconds": end - now,
        "sampling_period_s": args.period,
        "readings": len(readings),
        "matmuls": products,
        "counter_j": counter_j,
        "power_sampling_j": power_j,
        "average_w": counter_j / (end - now),
        "relative_difference": difference,
        "tolerance": args.tolerance,
        "agree": difference <= args.tolerance,
    }


def check_energy_logger_on_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import lightning.pytorch as pl

    from examples.digits import DigitsClassifier, DigitsDataModule
    from lightning_pulse import EnergyLogger
    from lightning_pulse.energy import MeterConfig
    from lightning_pulse.energy.nvml import NvmlCounterMeter, nvml_devices_for_cuda

    pl.seed_everything(0)
    around = NvmlCounterMeter(nvml_devices_for_cuda([args.device]))
    with tempfile.TemporaryDirectory() as report_dir:
        energy = EnergyLogger(
            report_dir=report_dir,
            cpu="none",
            ram="none",
            carbon_intensity=args.intensity,
            meters=MeterConfig(sampling_period=0.2),
        )
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=[args.device],
            max_epochs=args.epochs,
            callbacks=[energy],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        around.start(time.monotonic())
        trainer.fit(DigitsClassifier(), DigitsDataModule())
        around_j = around.read_joules(time.monotonic())
        around.close()
        report = energy.report or {}
    total = report.get("total", {})
    gpu = report.get("meters", {}).get("gpu", {})
    gpu_kwh = total.get("energy_kwh_by_component", {}).get("gpu")
    return {
        "gpu_meter": gpu.get("meter"),
        "gpu_method": total.get("methods", {}).get("gpu"),
        "gpu_kwh": gpu_kwh,
        "counter_around_fit_kwh": around_j / 3.6e6,
        "share_of_counter_around_fit": (gpu_kwh or 0.0) * 3.6e6 / around_j if around_j > 0 else None,
        "total_kwh": total.get("energy_kwh"),
        "duration_s": total.get("duration_s"),
        "steps": total.get("steps"),
        "events": report.get("events", []),
        "ok": gpu.get("meter") == "nvml-counter"
        and total.get("methods", {}).get("gpu") == "measured"
        and (total.get("energy_kwh_by_component", {}).get("gpu") or 0) > 0,
    }


def _g(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def write(result: dict[str, Any], command: str) -> tuple[Path, Path]:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path, md_path = RESULTS_DIR / "gpu_energy_check.json", RESULTS_DIR / "gpu_energy_check.md"
    json_path.write_text(json.dumps({"command": command, **result}, indent=2))
    agreement, logger = result["counter_vs_power"], result["energy_logger"]
    lines = [
        "# gpu_energy_check",
        "",
        f"Command: `{command}`",
        "",
        f"GPU: {agreement['device']}; driver {result['driver']}; {result['date']}.",
        "",
        "| check | figure | result |",
        "|---|---|---|",
        f"| NVML counter vs integrated power, {agreement['seconds']:.0f} s rhythmic load | counter "
        f"{agreement['counter_j']:.1f} J, power sampling {agreement['power_sampling_j']:.1f} J "
        f"({agreement['readings']} readings every {agreement['sampling_period_s']} s), difference "
        f"{agreement['relative_difference']:.2%} | {'pass' if agreement['agree'] else 'FAIL'} (<= {agreement['tolerance']:.0%}) |",
        f"| EnergyLogger on the GPU (digits classifier, {logger['steps']} steps, {_g(logger['duration_s'])} s) "
        f"| GPU meter {logger['gpu_meter']}, {logger['gpu_method']}, {_g(logger['gpu_kwh'])} kWh; the counter "
        f"around the whole `fit` call: {_g(logger['counter_around_fit_kwh'])} kWh | "
        f"{'pass' if logger['ok'] else 'FAIL'} (counter, measured, > 0) |",
        "",
    ]
    md_path.write_text("\n".join(lines))
    return json_path, md_path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the rhythmic load")
    parser.add_argument("--period", type=float, default=0.1, help="sampling period of both meters")
    parser.add_argument("--size", type=int, default=4096, help="matrix size of the load")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the EnergyLogger fit")
    parser.add_argument("--intensity", type=float, default=400.0, help="gCO2/kWh for the fit's CO2 figure")
    args = parser.parse_args()
    reason = gpu_unavailable_reason()
    if reason is not None:
        print(
            f"gpu_energy_check: not run: {reason}. Nothing written; run it on a machine with an NVIDIA GPU."
        )
        return 0
    import pynvml
    import torch

    pynvml.nvmlInit()
    driver = pynvml.nvmlSystemGetDriverVersion()
    pynvml.nvmlShutdown()
    agreement = check_counter_against_power(args)
    print(json.dumps(agreement, indent=2))
    logger = check_energy_logger_on_gpu(args)
    print(json.dumps(logger, indent=2))
    result = {
        "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "counter_vs_power": agreement,
        "energy_logger": logger,
    }
    command = "python -m benchmarks.gpu_energy_check " + " ".join(sys.argv[1:])
    json_path, md_path = write(result, command.strip())
    print(f"wrote {json_path} and {md_path}")
    return 0 if agreement["agree"] and logger["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
