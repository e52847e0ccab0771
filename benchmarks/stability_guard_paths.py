"""StabilityGuard's per-step hook CPU by read path and verdict path, compared inside the same fits.

The guard's fault-free cost on a small CPU model is a few dozen microseconds per optimizer step, less than the
drift of this shared machine between runs. So the native pieces are compared the way the overhead benchmark's
paired figure is: within each fit, every optimizer step draws one of three configurations with a seeded coin,
and the CPU time of the guard's ``on_before_optimizer_step`` is recorded per configuration:

* ``ctypes + python``: the gradient read through ctypes (the fallback where the extension cannot be built),
  the detector's quiet step in Python;
* ``extension + python``: the read by the C++ extension module, the quiet step in Python;
* ``extension + native``: both in the extension module (the guard's default where it is built).

All three read the same values and judge them the same way, so the detector's windows do not depend on the
draw. Medians over steps (the first epoch left out), then over seeds. Hook CPU only: what the work costs the
rest of the step is in the overhead benchmark's paired figure.

Run: ``python -m benchmarks.stability_guard_paths`` (MNIST-1D MLP and CNN, seeds 0 1 2, 10 epochs; about 30
seconds). Results: ``benchmarks/results/stability_guard_paths.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.harness import RESULTS_DIR, environment
from benchmarks.stability_guard import fit_reference
from lightning_pulse import _native
from lightning_pulse.callbacks.stability_guard import StabilityGuard

CONFIGURATIONS = ("ctypes + python", "extension + python", "extension + native")


class PathSampler(StabilityGuard):
    """``StabilityGuard`` whose every optimizer step takes one of :data:`CONFIGURATIONS`, drawn by a coin."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._coin = random.Random(seed)
        self.hook_ns: dict[str, list[int]] = {name: [] for name in CONFIGURATIONS}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._extension_read = self._host_reader
        self._ctypes_read = self._host_reader._read_with_ctypes
        self._native_quiet = self._native_quiet_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        name = self._coin.choice(CONFIGURATIONS)
        self._host_reader = self._ctypes_read if name.startswith("ctypes") else self._extension_read
        self._native_quiet_step = self._native_quiet if name.endswith("native") else None
        started = time.thread_time_ns()
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.hook_ns[name].append(time.thread_time_ns() - started)


def measure(workload: str, seeds: Sequence[int], epochs: int) -> dict[str, Any]:
    per_seed = []
    for seed in seeds:
        sampler = PathSampler(seed)
        trainer = fit_reference(workload, seed, epochs, [sampler])
        skip = trainer.num_training_batches // len(CONFIGURATIONS)  # about the first epoch, per configuration
        row = {name: statistics.median(ns[skip:]) / 1e3 for name, ns in sampler.hook_ns.items()}
        row["spikes"] = sampler.spikes_detected
        per_seed.append({"seed": seed, **row})
        print(f"[{workload}] seed={seed}: " + ", ".join(f"{n} {row[n]:.1f} µs" for n in CONFIGURATIONS))
    medians = {name: statistics.median(r[name] for r in per_seed) for name in CONFIGURATIONS}
    return {
        "workload": workload,
        "seeds": list(seeds),
        "epochs": epochs,
        "per_seed": per_seed,
        "median_us": medians,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    if _native.step_reader() is None:
        sys.exit(f"the extension module cannot be built here: {_native.step_reader_error}")
    torch.set_num_threads(1)
    results = [measure(workload, args.seeds, args.epochs) for workload in ("mnist1d-mlp", "mnist1d-cnn")]
    command = "python -m benchmarks.stability_guard_paths" + (
        f" --seeds {' '.join(map(str, args.seeds))} --epochs {args.epochs}"
        if (args.seeds, args.epochs) != ([0, 1, 2], 10)
        else ""
    )
    payload = {"command": command, "environment": environment(), "results": results}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "stability_guard_paths.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "# stability_guard_paths",
        "",
        f"Command: `{command}`",
        "",
        "CPU time of StabilityGuard's `on_before_optimizer_step` per configuration, drawn per step inside the "
        "same fits (medians over steps after the first epoch, then over seeds). Same values read and judged in "
        "every configuration.",
        "",
        "| workload | " + " | ".join(CONFIGURATIONS) + " | native saves |",
        "|---|" + "---|" * (len(CONFIGURATIONS) + 1),
    ]
    for result in results:
        medians = result["median_us"]
        saved = medians[CONFIGURATIONS[0]] - medians[CONFIGURATIONS[-1]]
        lines.append(
            f"| {result['workload']} | "
            + " | ".join(f"{medians[name]:.1f} µs" for name in CONFIGURATIONS)
            + f" | {saved:.1f} µs |"
        )
    lines += ["", "Per seed:", ""]
    for result in results:
        for row in result["per_seed"]:
            lines.append(
                f"- {result['workload']} seed {row['seed']}: "
                + ", ".join(f"{name} {row[name]:.1f} µs" for name in CONFIGURATIONS)
                + f"; spikes flagged {row['spikes']}"
            )
    (RESULTS_DIR / "stability_guard_paths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
