"""Study: what HardSampleReplay's per-sample loss capture adds to a cross-entropy, small and language-model sized.

The capture gets per-sample losses from the loss a module already computes. Below
``SINGLE_PASS_ELEMENTS`` elements it makes a second, unreduced call under ``torch.no_grad()`` so that the
caller's value is torch's own to the last bit; from there on it evaluates the loss once, unreduced, and
reduces it for the caller. This study times ``F.cross_entropy`` forward, and forward plus backward, on the same
logits in three arms:

* ``plain``: no capture;
* ``second_call``: the capture forced onto the second-call path (what every size took before);
* ``capture``: the capture as shipped (one evaluation at the language-model size).

Sizes: a classifier's ``(100, 10)`` logits and a language model's ``(2048, 50257)`` (8 sequences of 256
tokens at GPT-2's vocabulary). Per size and seed the median of 7 repeats; the table gives the median over
3 seeds and the ratio to ``plain`` of the same seed. One thread, CPU.

Run: ``python -m benchmarks.studies.capture_cost`` (about 2 minutes on 2 cores). Writes
``benchmarks/studies/results/capture_cost.{json,md}``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import environment
from lightning_pulse.core import per_sample_loss
from lightning_pulse.core.per_sample_loss import LossCapture

RESULTS = Path(__file__).parent / "results"
SIZES = {"classifier (100 x 10)": (100, 10, 100), "language model (2048 x 50257)": (2048, 50257, 8)}
ARMS = ("plain", "second_call", "capture")
REPEATS, SEEDS = 7, (0, 1, 2)


def _time_one(arm: str, logits: torch.Tensor, targets: torch.Tensor, batch: int) -> tuple[float, float]:
    """Seconds of the forward and of forward plus backward of one cross-entropy call in ``arm``."""
    leaf = logits.detach().requires_grad_(True)
    start = time.perf_counter()
    if arm == "plain":
        loss = F.cross_entropy(leaf, targets)
    else:
        with LossCapture(batch_size=batch) as capture:
            loss = F.cross_entropy(leaf, targets)
        capture.per_sample()  # the split the replay reads later, so each arm does the same work
    forward = time.perf_counter() - start
    loss.backward()
    return forward, time.perf_counter() - start


def run_size(rows: int, vocab: int, batch: int) -> dict[str, Any]:
    per_seed: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    shipped = per_sample_loss.SINGLE_PASS_ELEMENTS
    for seed in SEEDS:
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(rows, vocab, generator=generator)
        targets = torch.randint(0, vocab, (rows,), generator=generator)
        for arm in ARMS:
            per_sample_loss.SINGLE_PASS_ELEMENTS = 1 << 62 if arm == "second_call" else shipped
            try:
                _time_one(arm, logits, targets, batch)  # warm-up
                times = [_time_one(arm, logits, targets, batch) for _ in range(REPEATS)]
            finally:
                per_sample_loss.SINGLE_PASS_ELEMENTS = shipped
            per_seed[arm].append(
                {
                    "forward_s": statistics.median(t[0] for t in times),
                    "forward_backward_s": statistics.median(t[1] for t in times),
                }
            )
    summary = {}
    for arm in ARMS:
        row: dict[str, float] = {}
        for key in ("forward_s", "forward_backward_s"):
            row[key] = statistics.median(s[key] for s in per_seed[arm])
            row[f"{key[:-2]}_ratio"] = statistics.median(
                s[key] / p[key] for s, p in zip(per_seed[arm], per_seed["plain"])
            )
        summary[arm] = row
    return {"rows": rows, "vocab": vocab, "batch": batch, "per_seed": per_seed, "summary": summary}


def main() -> None:
    torch.set_num_threads(1)
    results = {name: run_size(*size) for name, size in SIZES.items()}
    command = "python -m benchmarks.studies.capture_cost"
    payload = {"command": command, "environment": environment(), "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "capture_cost.json").write_text(json.dumps(payload, indent=2))
    lines = [
        "# capture cost: the per-sample loss capture on one cross-entropy call",
        "",
        f"Command: `{command}`. CPU, one thread; medians of {REPEATS} repeats per seed, then over seeds "
        f"{list(SEEDS)}; ratios against `plain` of the same seed. `second_call`: the capture forced onto its "
        "second-call path (every size before the single-pass path); `capture`: as shipped "
        f"(`SINGLE_PASS_ELEMENTS` = {per_sample_loss.SINGLE_PASS_ELEMENTS}).",
        "",
        "| logits | arm | forward ms | ratio | forward + backward ms | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for arm, row in result["summary"].items():
            lines.append(
                f"| {name} | {arm} | {row['forward_s'] * 1e3:.3f} | {row['forward_ratio']:.3f} | "
                f"{row['forward_backward_s'] * 1e3:.3f} | {row['forward_backward_ratio']:.3f} |"
            )
    lines += ["", f"Environment: {payload['environment']}."]
    (RESULTS / "capture_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
