"""Step-time overhead of mHC (n=4) against the plain residual, on CPU, at widths 128, 256 and 512.

The stdlib char LM (``examples.charlm``), 4 transformer blocks (8 residual branches), batch 8 x 128 tokens,
AdamW. A micro-benchmark rather than a harness run: what matters is the time of one optimizer step
(forward, backward, step) once warm, so the script times single steps directly.

Method:

* per seed, the three models (plain, HC, mHC; same seed, same batches) are built side by side and their
  steps interleaved (plain, HC, mHC, plain, ...), so a drift of the shared machine hits every arm alike;
* each step is timed in process CPU seconds (``time.process_time``) with one torch thread, so the figure does
  not depend on how busy the other cores are; wall seconds are recorded too;
* per (arm, seed) the median over the timed steps after warm-up; ratios are paired by seed against plain,
  then the median over seeds is reported;
* FLOPs of one training step (forward + backward) per arm from ``torch.utils.flop_counter.FlopCounterMode``.

HC (unconstrained, no Sinkhorn) is included to separate the cost of widening the residual stream from the
cost of the Sinkhorn-Knopp projection. All arms run on torch ops (the layers have no other path).
``plain_compiled`` and ``mhc_compiled`` are the same models under ``torch.compile`` (``--backend``, inductor by
default); a compiled arm's ratio is against ``plain_compiled``, so it is the overhead of mHC when both
models are compiled. Compilation happens in the first warm-up step (its wall seconds are recorded as
``first_step_wall_s``); FLOPs of a compiled arm are those of its eager twin (the same arithmetic).

Run: ``python -m benchmarks.mhc_overhead`` (about 4 wall minutes on the busy 2-core machine), inside
``flock /tmp/lp-bench.lock`` so no other timing run overlaps it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.harness import RESULTS_DIR, environment
from examples.charlm import CharLMDataModule, CharTransformerLM

KINDS = ("plain", "hc", "mhc", "plain_compiled", "mhc_compiled")


def baseline_of(kind: str) -> str:
    """The arm a ratio is taken against: the plain model, compiled alike."""
    return "plain_compiled" if kind.endswith("_compiled") else "plain"


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    tokens, targets = batch
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def flops_per_step(model: CharTransformerLM, batch: tuple) -> float:
    """FLOPs of one forward + backward of the eager model."""
    tokens, targets = batch
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def measure_width(
    width: int, seeds: list[int], args: argparse.Namespace, batches: list[tuple]
) -> dict[str, Any]:
    runs = []
    flops: dict[str, float] = {}
    for seed in seeds:
        models = {}
        for kind in KINDS:
            torch.manual_seed(seed)
            model = CharTransformerLM(
                d_model=width,
                n_layers=args.layers,
                n_heads=8,
                seq_len=args.seq_len,
                residual=kind.removesuffix("_compiled"),
                n_streams=4,
            )
            if kind not in flops:
                flops[kind] = flops_per_step(model, batches[0])
            step_model = torch.compile(model, backend=args.backend) if kind.endswith("_compiled") else model
            models[kind] = (step_model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        cpu = {kind: [] for kind in KINDS}
        wall = {kind: [] for kind in KINDS}
        first_wall = {}
        for step in range(args.warmup + args.steps):
            batch = batches[(seed + step) % len(batches)]
            for kind, (model, optimizer) in models.items():
                cpu0, wall0 = time.process_time(), time.perf_counter()
                training_step(model, optimizer, batch)
                if step == 0:
                    first_wall[kind] = time.perf_counter() - wall0
                if step >= args.warmup:
                    cpu[kind].append(time.process_time() - cpu0)
                    wall[kind].append(time.perf_counter() - wall0)
        for kind in KINDS:
            runs.append(
                {
                    "width": width,
                    "seed": seed,
                    "arm": kind,
                    "step_cpu_s": statistics.median(cpu[kind]),
                    "step_wall_s": statistics.median(wall[kind]),
                    "step_cpu_s_all": cpu[kind],
                    "first_step_wall_s": first_wall[kind],
                }
            )
        print(
            f"width={width} seed={seed} "
            + " ".join(f"{r['arm']}={r['step_cpu_s'] * 1e3:.1f}ms" for r in runs if r["seed"] == seed),
            flush=True,
        )
    summary = {}
    for kind in KINDS:
        own = {run["seed"]: run for run in runs if run["arm"] == kind}
        base = {run["seed"]: run for run in runs if run["arm"] == baseline_of(kind)}
        summary[kind] = {
            "step_cpu_s": statistics.median(run["step_cpu_s"] for run in own.values()),
            "step_wall_s": statistics.median(run["step_wall_s"] for run in own.values()),
            "cpu_ratio": statistics.median(own[s]["step_cpu_s"] / base[s]["step_cpu_s"] for s in seeds),
            "wall_ratio": statistics.median(own[s]["step_wall_s"] / base[s]["step_wall_s"] for s in seeds),
            "flops_per_step": flops[kind],
            "flops_ratio": flops[kind] / flops["plain"],
            "first_step_wall_s": statistics.median(run["first_step_wall_s"] for run in own.values()),
        }
    return {"width": width, "runs": runs, "summary": summary}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| width | arm | step CPU ms | baseline | CPU ratio | overhead | wall ratio | FLOPs/step | FLOPs ratio "
        "| first step wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for kind in KINDS:
            row = result["summary"][kind]
            lines.append(
                f"| {result['width']} | {kind} | {row['step_cpu_s'] * 1e3:.1f} | {baseline_of(kind)} | "
                f"{row['cpu_ratio']:.3f} | {row['cpu_ratio'] - 1:+.1%} | {row['wall_ratio']:.3f} | "
                f"{row['flops_per_step']:.3g} | {row['flops_ratio']:.4f} | {row['first_step_wall_s']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled arms")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = CharLMDataModule(max_chars=200_000, seq_len=args.seq_len, batch_size=args.batch_size)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(8)]
    started = time.perf_counter()
    results = [measure_width(width, args.seeds, args, batches) for width in args.widths]
    command = "python -m benchmarks.mhc_overhead " + " ".join(
        ["--widths", *map(str, args.widths), "--seeds", *map(str, args.seeds), "--layers", str(args.layers)]
        + ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
        + ["--warmup", str(args.warmup), "--steps", str(args.steps), "--backend", args.backend]
    )
    payload = {
        "command": command,
        "config": vars(args) | {"n_streams": 4, "n_heads": 8, "threads": 1, "optimizer": "AdamW"},
        "results": results,
        "environment": environment(),
        "elapsed_s": time.perf_counter() - started,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "mhc_overhead.json").write_text(json.dumps(payload, indent=2))
    table = markdown(results)
    text = [
        "# mhc_overhead",
        "",
        f"Command: `{command}`",
        "",
        f"Char LM, {args.layers} transformer blocks ({2 * args.layers} residual branches), batch "
        f"{args.batch_size} x {args.seq_len} tokens, AdamW, one torch thread. Step = forward + backward + "
        f"optimizer step. Medians over {args.steps} timed steps (after {args.warmup} warm-up) per seed, ratios "
        f"paired by seed against the baseline arm, median over seeds {args.seeds}. HC: the same streams "
        "without the Sinkhorn projection. All arms run on torch ops; the *_compiled arms under "
        f"`torch.compile(backend={args.backend!r})`, compared with the compiled plain model. First step: "
        "wall seconds of the first warm-up step, compilation included for the compiled arms.",
        "",
        table,
        "",
        f"Environment: {payload['environment']}; python {sys.version.split()[0]}.",
    ]
    (RESULTS_DIR / "mhc_overhead.md").write_text("\n".join(text) + "\n")
    print(table)


if __name__ == "__main__":
    main()
