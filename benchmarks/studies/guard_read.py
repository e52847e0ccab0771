"""Study: StabilityGuard's per-step read of the loss and gradient norm, three ways, in the same fits.

* ``two_ops``, the read up to the fourteenth pass: the per-tensor norms (``torch._foreach_norm``) stacked and
  normed on the device, then the loss and that norm stacked and brought to the host.
* ``one_stack``, the read now (:func:`lightning_pulse.core.grad_norm.step_loss_and_grad_norm`): the loss and
  the per-tensor norms in one stack and one transfer; the last sum of squares is done on the host.
* ``per_value``, tried in the twenty-fifth pass and not kept: on the CPU each value read where it lies
  (``.item()``, no stack), the norm by ``math.hypot``. It saved 6 µs of a 260 µs read on the char LM and 5 µs
  on the demo's CNN (``results/guard_read.md``): not worth a second path for CPU tensors.

A fit with no guard times one read per optimizer step in ``on_before_optimizer_step``, right after backward
(the first torch call after backward pays for code that backward pushed out of the CPU's caches, so only the
first call of a step is representative): the three in turn, step by step. The machine's load then falls on
all alike. Thread CPU time, median over the fit's steps after the first ten.

Run: ``python -m benchmarks.studies.guard_read`` (about 2 minutes on 2 cores). Writes
``benchmarks/studies/results/guard_read.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.harness import QUIET_TRAINER, environment
from benchmarks.workloads import get_workload
from lightning_pulse.core.grad_norm import grad_norm, step_loss_and_grad_norm

RESULTS = Path(__file__).parent / "results"
FITS = {
    "charlm": ({"data__max_chars": 200_000}, {"max_steps": 200, "limit_val_batches": 0}),
    "mnist1d-cnn-128": ({"data__num_samples": 5000, "model__channels": 128}, {"max_steps": 300}),
}


def per_value_read(param_groups: Any, losses: list[torch.Tensor]) -> tuple[float, float]:
    """The variant not kept: each value read where it lies on the CPU, the norm by ``math.hypot``."""
    grads = [p.grad for group in param_groups for p in group["params"] if p.grad is not None]
    read = [value.item() for value in (losses[0].detach().float(), *torch._foreach_norm(grads, 2.0))]
    return read[0], math.hypot(*read[1:])


def two_ops_read(param_groups: Any, losses: list[torch.Tensor]) -> tuple[float, float]:
    """The earlier single-process read: the norm on the device, then a stack of the loss and the norm."""
    grads = [p.grad for group in param_groups for p in group["params"] if p.grad is not None]
    norm = grad_norm(grads)
    loss, total = torch.stack([losses[0].detach().float(), norm.float()]).tolist()
    return loss, total


READS = {"two_ops": two_ops_read, "one_stack": step_loss_and_grad_norm, "per_value": per_value_read}


class ReadTimer(Callback):
    def __init__(self) -> None:
        self.loss: list[torch.Tensor] = []
        self.micros: dict[str, list[float]] = {name: [] for name in READS}

    def on_before_backward(self, trainer, pl_module, loss):
        self.loss = [loss.detach()]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        name = list(READS)[trainer.global_step % len(READS)]
        read = READS[name]
        start = time.thread_time_ns()
        read(optimizer.param_groups, self.loss)
        self.micros[name].append((time.thread_time_ns() - start) / 1e3)


def run(workload: str, seed: int) -> dict[str, float]:
    build, trainer_kwargs = FITS[workload]
    pl.seed_everything(seed, verbose=False)
    module, data = get_workload(workload.replace("-128", "")).build(**build)
    timer = ReadTimer()
    kwargs = {**QUIET_TRAINER, "default_root_dir": tempfile.mkdtemp(), **trainer_kwargs}
    pl.Trainer(callbacks=[timer], **kwargs).fit(module, data)
    medians = {name: statistics.median(values[5:]) for name, values in timer.micros.items()}
    return {**medians, "saved_us": medians["one_stack"] - medians["per_value"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {name: [run(name, seed) for seed in args.seeds] for name in FITS}
    summary = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rows.items()
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"seeds": args.seeds, "runs": rows, "medians": summary, "environment": environment()}
    (RESULTS / "guard_read.json").write_text(json.dumps(payload, indent=2))
    lines = [
        "# StabilityGuard's read: two ops, one stack, per value",
        "",
        "Command: `python -m benchmarks.studies.guard_read`. Thread CPU µs per read, the first torch call after "
        f"backward; median over steps, then over seeds {args.seeds}; both reads in the same fits.",
        "",
        "| workload | two_ops µs | one_stack µs | per_value µs | saved by per_value over one_stack µs |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {m['two_ops']:.1f} | {m['one_stack']:.1f} | {m['per_value']:.1f} | {m['saved_us']:.1f} |"
            for name, m in summary.items()
        ),
        "",
        f"Environment: {payload['environment']}.",
    ]
    text = "\n".join(lines) + "\n"
    (RESULTS / "guard_read.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
