"""GPU study: does a host read of the gradient norm before every optimizer step cost wall time on a GPU?

The question came from the first device run of ``benchmarks/gpu_headline.py``: the pulse arm took 0.634x of
plain's optimizer steps but 0.96x of its wall time, and StabilityGuard reads the step's loss and gradient norm
on the host before each optimizer step (one device synchronisation per step). If that read exposed the GPU's
step time, removing it would be the first saving to chase.

Arms, on the GPU headline's workload (MNIST-1D CNN, 512 channels, batches of 1,024, bf16, 8 epochs), all with
``EnergyLogger(gpu="auto")`` as in the headline:

- ``plain``;
- ``plain+sync``: plain with one callback that reads the gradient norm on the host before every optimizer
  step, the synchronisation StabilityGuard makes and nothing else;
- ``pulse``: the shipped suite (``examples/mnist1d/pulse.yaml``);
- ``pulse-no-guard``: the shipped suite without StabilityGuard.

Then ``plain``, ``plain+sync`` and ``pulse`` again with four DataLoader workers. One discarded one-epoch fit
per arm first, seeds 0 and 1, arms in a fixed order. Needs an NVIDIA GPU (``--accelerator cpu`` runs it on
CPU, for a dry run).

Run: ``python -m benchmarks.studies.gpu_sync_cost`` (about 3 minutes on an H200)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

import benchmarks.harness as harness
from benchmarks import gpu_headline

RESULTS_DIR = Path(__file__).parent / "results"


class ReadGradNormEveryStep(pl.Callback):
    """Reads the gradient norm on the host before every optimizer step: a guard's synchronisation, alone."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


_INSTANTIATE = harness.instantiate_callbacks  # the real one: main() swaps the harness's for each arm


def _suite(specs: list[dict]) -> list:
    return _INSTANTIATE(specs)


ARMS = {
    "plain": lambda specs: [],
    "plain+sync": lambda specs: [ReadGradNormEveryStep()],
    "pulse": _suite,
    "pulse-no-guard": lambda specs: _suite(
        [s for s in specs if not s["class_path"].endswith("StabilityGuard")]
    ),
}
SETTINGS = ((0, ("plain", "plain+sync", "pulse", "pulse-no-guard")), (4, ("plain", "plain+sync", "pulse")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    reason = gpu_headline.gpu_unavailable_reason() if args.accelerator == "gpu" else None
    if reason is not None:
        print(f"gpu_sync_cost: not run: {reason}.")
        return 0
    rows = []
    try:
        for workers, arms in SETTINGS:
            fit_args = argparse.Namespace(
                channels=args.channels, num_samples=100_000, batch_size=1024, epochs=8,
                accelerator=args.accelerator, num_workers=workers,
            )  # fmt: skip
            for arm in arms:  # one discarded fit per arm: kernels, libraries and meters loaded
                harness.instantiate_callbacks = lambda specs, arm=arm: ARMS[arm](specs)
                gpu_headline.run("pulse", 0, fit_args, epochs=1)
            for seed in args.seeds:
                for arm in arms:
                    harness.instantiate_callbacks = lambda specs, arm=arm: ARMS[arm](specs)
                    run = gpu_headline.run("pulse", seed, fit_args)  # the "pulse" arm builds ARMS[arm]
                    rows.append(
                        {"workers": workers, "seed": seed, "arm": arm, "wall_s": run["fit_wall_s"],
                         "steps": run["steps"], "test_acc": run["test_acc"], "gpu_kwh": run["gpu_kwh"]}
                    )  # fmt: skip
    finally:
        harness.instantiate_callbacks = _INSTANTIATE
    command = "python -m benchmarks.studies.gpu_sync_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    write(command, rows, args.results_dir)
    return 0


def write(command: str, rows: list[dict], directory: Path = RESULTS_DIR) -> None:
    """``gpu_sync_cost.json`` (every fit) and ``.md`` (the fits and the seed-paired ratios to plain)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gpu_sync_cost.json").write_text(json.dumps({"command": command, "runs": rows}, indent=2))
    plain = {(r["workers"], r["seed"]): r for r in rows if r["arm"] == "plain"}
    lines = [
        "# gpu_sync_cost",
        "",
        f"Command: `{command}`",
        "",
        "| workers | seed | arm | fit wall s | steps | test acc | GPU kWh | wall / plain | GPU kWh / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = plain[r["workers"], r["seed"]]
        measured = r["gpu_kwh"] and base["gpu_kwh"]
        kwh = f"{r['gpu_kwh']:.3g}" if r["gpu_kwh"] else "n/a"
        kwh_ratio = f"{r['gpu_kwh'] / base['gpu_kwh']:.3f}" if measured else "n/a"
        lines.append(
            f"| {r['workers']} | {r['seed']} | {r['arm']} | {r['wall_s']:.2f} | {r['steps']} | "
            f"{r['test_acc']:.4f} | {kwh} | {r['wall_s'] / base['wall_s']:.3f} | {kwh_ratio} |"
        )
    lines += ["", "Median wall / plain per arm and setting:", ""]
    for workers, arms in SETTINGS:
        for arm in arms[1:]:
            ratios = [
                r["wall_s"] / plain[workers, r["seed"]]["wall_s"]
                for r in rows
                if r["workers"] == workers and r["arm"] == arm
            ]
            if ratios:
                lines.append(f"- {workers} workers, {arm}: {statistics.median(ratios):.3f}")
    (directory / "gpu_sync_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
