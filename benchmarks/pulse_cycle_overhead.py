"""PulseCycle's own cost: a plain Trainer vs the same Trainer with PulseCycle, in one run.

Two views of the same question:

* end to end: training CPU time with PulseCycle / without, paired by seed (noisy at the 1% level on a shared
  machine, so it is reported but not the only figure); arm order rotates from seed to seed, and a second
  plain arm measures the noise floor of that ratio;
* in-hook: the seconds spent inside PulseCycle's per-step hook, as a share of the run's training time
  (precise, and what the "< 1% of step time" target is about). The maintain probe is an evaluation the
  user asked for, so it is measured separately (`probe` arm) and reported as its own share.

Run: ``python -m benchmarks.pulse_cycle_overhead``
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness import Arm, run_arms, write_results
from lightning_pulse import PulseCycle


class TimedPulseCycle(PulseCycle):
    """PulseCycle that accumulates the wall time of its per-step work."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hook_seconds = 0.0
        self.probe_seconds = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        start = time.perf_counter()
        probe_before = self.probe_seconds
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.hook_seconds += time.perf_counter() - start - (self.probe_seconds - probe_before)

    def _run_probe(self, trainer, pl_module) -> None:
        start = time.perf_counter()
        super()._run_probe(trainer, pl_module)
        self.probe_seconds += time.perf_counter() - start

    def benchmark_metrics(self) -> dict[str, float]:
        return {"hook_seconds": self.hook_seconds, "probe_seconds": self.probe_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    args = parser.parse_args()
    cadence = dict(burst=20, replay=10, maintain=5)
    arms = [
        Arm("plain"),
        Arm("pulse_cycle", callbacks=lambda seed: [TimedPulseCycle(**cadence, maintain_eval="none")]),
        Arm("pulse_cycle+probe", callbacks=lambda seed: [TimedPulseCycle(**cadence, maintain_eval="probe")]),
        # the same plain run again, last: the spread between the two plain arms is the order/noise floor
        Arm("plain_again"),
    ]
    result = run_arms(
        "mnist1d-cnn",
        arms,
        seeds=args.seeds,
        trainer_kwargs={"max_epochs": args.epochs},
        flops="none",
        rotate_arms=True,
    )
    for name in ("pulse_cycle", "pulse_cycle+probe"):
        runs = [run for run in result["runs"] if run["arm"] == name]
        shares = sorted(run["extra"]["hook_seconds"] / run["train_wall_s"] for run in runs)
        probe_shares = sorted(run["extra"]["probe_seconds"] / run["train_wall_s"] for run in runs)
        result["summary"][name]["hook_share_of_train_time"] = shares[len(shares) // 2]
        result["summary"][name]["probe_share_of_train_time"] = probe_shares[len(probe_shares) // 2]
    lines = [
        f"Noise floor: plain_again / plain CPU ratio = {result['summary']['plain_again']['cpu_ratio']:.4f} "
        "(the same configuration run twice; end-to-end ratios within this spread are not overhead).",
        "",
        "In-hook share of training wall time (median over seeds):",
        "",
        "| arm | PulseCycle hook share | probe share | end-to-end CPU ratio |",
        "|---|---|---|---|",
    ]
    for name in ("pulse_cycle", "pulse_cycle+probe"):
        row = result["summary"][name]
        lines.append(
            f"| {name} | {row['hook_share_of_train_time']:.3%} | {row['probe_share_of_train_time']:.3%} | "
            f"{row['cpu_ratio']:.4f} |"
        )
    command = "python -m benchmarks.pulse_cycle_overhead " + " ".join(
        ["--epochs", str(args.epochs), "--seeds", *map(str, args.seeds)]
    )
    json_path, md_path = write_results(result, "pulse_cycle_overhead", command, notes="\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
