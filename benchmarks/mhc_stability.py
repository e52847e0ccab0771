"""Stability of a deep hyper-connected stack at high learning rates: plain residual vs HC vs mHC.

The stdlib char LM (``examples.charlm``) with 16 transformer blocks, i.e. 32 residual branches, each wrapped
by the residual kind under test (``n_streams=4`` for HC and mHC), trained with AdamW at 1e-2 and 3e-2.
Arms: ``plain``, ``hc``, ``mhc`` (20 Sinkhorn-Knopp iterations, the paper's value) and ``mhc_it60`` (60
iterations, to isolate what the truncated projection costs). Per run it records:

* the composite gain of the ``H_res`` product over all 32 layers (forward: max absolute row sum, backward:
  max absolute column sum, max over tokens), measured every 10 steps by ``HyperConnectionMonitor``; a plain
  residual's composite mapping is the identity, gain 1 by construction;
* activation scale: the largest RMS of any layer's output streams, and the RMS of the residual stream
  leaving the last block (every arm, plain included);
* divergence: a non-finite training loss at any step, or a mean loss over the last 20 steps above the mean
  over the first 5 (i.e. back above the untrained model);
* training and validation loss, CPU time (harness), and training FLOPs per step (one counted step per arm).

Run: ``python -m benchmarks.mhc_stability`` (about 13 wall minutes on the busy 2-core machine), inside
``flock /tmp/lp-bench.lock``: the CPU-ratio column is a timing.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.harness import Arm, run_arms, write_results
from benchmarks.workloads import get_workload
from lightning_pulse import HyperConnectionMonitor

# arm name -> model overrides
ARMS: dict[str, dict[str, Any]] = {
    "plain": {"model__residual": "plain"},
    "hc": {"model__residual": "hc"},
    "mhc": {"model__residual": "mhc"},
    "mhc_it60": {"model__residual": "mhc", "model__sinkhorn_iters": 60},
}
MEASURE_EVERY = 10


class LossTrace(Callback):
    """Per-step training loss, for the divergence figures of :func:`stability_metrics`."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


class TopOfStackScale(Callback):
    """Every few steps, the RMS of the residual stream(s) leaving the last block: comparable across arms."""

    def __init__(self) -> None:
        self.rms: list[float] = []
        self._handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step % MEASURE_EVERY == 0 and self._handle is None:
            self._handle = pl_module.blocks.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        self.rms.append(float(output.detach().float().pow(2).mean().sqrt()))
        self._handle.remove()
        self._handle = None


def divergence_figures(losses: list[float]) -> dict[str, Any]:
    """Non-finite steps, start / final training loss (mean of the first 5 / last 20 steps), and the verdict."""
    finite = [v for v in losses if math.isfinite(v)]
    nonfinite = len(losses) - len(finite)
    start = statistics.fmean(losses[:5]) if len(losses) >= 5 else math.nan
    end = statistics.fmean(losses[-20:]) if len(losses) >= 20 else math.nan
    return {
        "nonfinite_steps": nonfinite,
        "start_train_loss": start,
        "final_train_loss": end,
        "diverged": bool(nonfinite or not end <= start),
    }


def gain_figures(monitor: HyperConnectionMonitor) -> dict[str, Any]:
    """Run-level figures read from the monitor's public ``history``: the largest and the last gains, the
    largest stream RMS, the last off-diagonal mass and the whole gain trajectory (empty for no measurement)."""
    history = monitor.history
    if not history:
        return {}
    return {
        "max_forward_gain": max(entry["forward_gain"] for entry in history),
        "max_backward_gain": max(entry["backward_gain"] for entry in history),
        "last_forward_gain": history[-1]["forward_gain"],
        "last_backward_gain": history[-1]["backward_gain"],
        "max_stream_rms": max(entry["stream_rms"] for entry in history),
        "last_off_diagonal_mass": history[-1]["off_diagonal_mass"],
        "gain_trajectory": [
            (entry["step"], entry["forward_gain"], entry["backward_gain"]) for entry in history
        ],
    }


def stability_metrics(callbacks: list[Callback], trainer: pl.Trainer) -> dict[str, Any]:
    """The run's ``extra`` figures (an ``Arm.metrics`` function): divergence from :class:`LossTrace`, the
    top-of-stack RMS from :class:`TopOfStackScale`, gains from the :class:`HyperConnectionMonitor` (HC / mHC)."""
    metrics: dict[str, Any] = {}
    for callback in callbacks:
        if isinstance(callback, LossTrace):
            metrics.update(divergence_figures(callback.losses))
        elif isinstance(callback, TopOfStackScale):
            metrics["max_top_rms"] = max(callback.rms, default=math.nan)
        elif isinstance(callback, HyperConnectionMonitor):
            metrics.update(gain_figures(callback))
    return metrics


def flops_per_step(arm: str, workload_kwargs: dict[str, Any]) -> float:
    """Training FLOPs (forward + backward) of one batch, counted with ``FlopCounterMode``."""
    torch.manual_seed(0)
    module, data = get_workload("charlm").build(**workload_kwargs, **ARMS[arm])
    data.setup("fit")
    tokens, targets = next(iter(data.train_dataloader()))
    with FlopCounterMode(display=False) as counter:
        logits = module(tokens)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    return float(counter.get_total_flops())


def arms() -> list[Arm]:
    def callbacks(name: str):
        if name == "plain":
            return lambda seed: [LossTrace(), TopOfStackScale()]
        return lambda seed: [
            LossTrace(),
            TopOfStackScale(),
            HyperConnectionMonitor(every_n_steps=MEASURE_EVERY),
        ]

    # Each run's figures come from stability_metrics(callbacks, trainer), the Arm's metrics function.
    return [
        Arm(name, callbacks=callbacks(name), workload_kwargs=overrides, metrics=stability_metrics)
        for name, overrides in ARMS.items()
    ]


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarise_stability(result: dict[str, Any], lr: float, flops: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for name in ARMS:
        runs = [run for run in result["runs"] if run["arm"] == name]
        extra = [run["extra"] for run in runs]

        def median_of(
            key: str, plain_value: float = math.nan, name: str = name, extra: list = extra
        ) -> float:
            return plain_value if name == "plain" else _median([e[key] for e in extra])

        rows.append(
            {
                "lr": lr,
                "arm": name,
                "max_forward_gain": median_of("max_forward_gain", 1.0),
                "max_backward_gain": median_of("max_backward_gain", 1.0),
                "final_forward_gain": median_of("last_forward_gain", 1.0),
                "final_backward_gain": median_of("last_backward_gain", 1.0),
                "max_layer_rms": median_of("max_stream_rms"),
                "max_top_rms": _median([e["max_top_rms"] for e in extra]),
                "diverged_runs": sum(bool(e["diverged"]) for e in extra),
                "runs": len(runs),
                "final_train_loss": _median([e["final_train_loss"] for e in extra]),
                "final_val_loss": result["summary"][name]["final_val_loss"],
                "cpu_ratio": result["summary"][name]["cpu_ratio"],
                "flops_per_step": flops[name],
                "flops_ratio": flops[name] / flops["plain"],
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def fmt(value: float) -> str:
        return "n/a" if isinstance(value, float) and math.isnan(value) else f"{value:.3g}"

    gain_keys = ("max_forward_gain", "max_backward_gain", "final_forward_gain", "final_backward_gain")
    lines = [
        "| lr | arm | max fwd gain | max bwd gain | final fwd gain | final bwd gain | max layer RMS | "
        "max top-of-stack RMS | diverged | final train loss | final val loss | CPU ratio | FLOPs/step ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        gains = ["1 (identity)"] * 4 if row["arm"] == "plain" else [fmt(row[k]) for k in gain_keys]
        cells = [
            f"{row['lr']:g}",
            row["arm"],
            *gains,
            fmt(row["max_layer_rms"]),
            fmt(row["max_top_rms"]),
            f"{row['diverged_runs']}/{row['runs']}",
            fmt(row["final_train_loss"]),
            fmt(row["final_val_loss"]),
            fmt(row["cpu_ratio"]),
            fmt(row["flops_ratio"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-2, 3e-2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--layers", type=int, default=16, help="transformer blocks (2 residual branches each)"
    )
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()
    workload_kwargs = {
        "model__d_model": args.width,
        "model__n_layers": args.layers,
        "model__n_heads": 4,
        "model__n_streams": 4,
        "data__seq_len": 32,
        "data__batch_size": 8,
        "data__max_chars": 200_000,
    }
    trainer_kwargs = {
        "max_steps": args.steps,
        "val_check_interval": args.steps // 2,
        "limit_val_batches": 10,
        "limit_test_batches": 10,
    }
    pl.seed_everything(0, verbose=False)
    flops = {name: flops_per_step(name, workload_kwargs) for name in ARMS}
    results, rows = [], []
    for lr in args.lrs:
        result = run_arms(
            "charlm",
            arms(),
            seeds=args.seeds,
            trainer_kwargs=trainer_kwargs,
            workload_kwargs={**workload_kwargs, "model__lr": lr},
            flops="none",
        )
        result["stability"] = summarise_stability(result, lr, flops)
        results.append(result)
        rows += result["stability"]
    table = markdown(rows)
    notes = "\n".join(
        [
            f"Char LM on the stdlib source: {args.layers} transformer blocks = {2 * args.layers} residual "
            f"branches, width {args.width}, 4 streams for HC/mHC, AdamW, {args.steps} steps, batch 8 x 32 "
            f"tokens; mhc_it60 is mHC with 60 Sinkhorn-Knopp iterations instead of 20. Medians over seeds "
            f"{args.seeds}. Gains: the composite H_res product over all {2 * args.layers} layers, max over "
            f"tokens, measured every {MEASURE_EVERY} steps; 'max' is the largest measurement of the run, 'final' "
            "the last. Max layer RMS: the largest RMS of any layer's output streams; top-of-stack RMS: the "
            "residual stream(s) leaving the last block, for every arm. Diverged: a non-finite loss, or the mean "
            "loss of the last 20 steps above that of the first 5. FLOPs/step counted on one training batch.",
            "",
            table,
        ]
    )
    command = "python -m benchmarks.mhc_stability " + " ".join(
        ["--steps", str(args.steps), "--lrs", *map(str, args.lrs), "--seeds", *map(str, args.seeds)]
        + ["--layers", str(args.layers), "--width", str(args.width)]
    )
    write_results(results, "mhc_stability", command, notes=notes)
    print(table)


if __name__ == "__main__":
    main()
