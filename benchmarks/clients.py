"""What the shipped suite costs and saves on client models nobody here designed for (Hugging Face GPT-2 and
BERT, built from configs: ``tests/clients.py``).

Arms: plain, and the full suite exactly as ``examples/mnist1d/pulse.yaml`` ships it, with the baseline in the
same run; seeds 0 1 2; FLOPs from a second counted pass. The suite was not tuned for these models: the
figures say what a user gets from the defaults.

Run: ``python -m benchmarks.clients`` (a few minutes on 2 cores); ``--per-callback --workloads hf-bert`` runs
each group of the suite's callbacks alone too, to find which one moves the metric.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import Arm, run_arms, write_results
from benchmarks.overhead import shipped_suite

#: ``--per-callback``: the shipped suite's callbacks in groups, each alone (the replay needs the cycle's phases)
GROUPS = {
    "pulse_cycle+hard_sample_replay": ("PulseCycle", "HardSampleReplay"),
    "gradient_cache": ("GradientCache",),
    "stability_guard": ("StabilityGuard",),
}


def part_of_suite(names: tuple[str, ...]):
    return lambda seed: [callback for callback in shipped_suite(seed) if type(callback).__name__ in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["hf-gpt2", "hf-bert"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--per-callback",
        action="store_true",
        help="also each group of the suite's callbacks alone, to find which one moves the metric (no FLOPs)",
    )
    args = parser.parse_args()
    arms = [Arm("plain"), Arm("full_suite", callbacks=shipped_suite)]
    if args.per_callback:
        arms[1:1] = [Arm(name, callbacks=part_of_suite(names)) for name, names in GROUPS.items()]
    results = [
        run_arms(
            workload,
            arms,
            seeds=args.seeds,
            trainer_kwargs={"max_epochs": args.epochs},
            flops="none" if args.per_callback else "separate",
            rotate_arms=True,
        )
        for workload in args.workloads
    ]
    name = "clients_per_callback" if args.per_callback else "clients"
    write_results(results, name, ("python -m benchmarks.clients " + " ".join(sys.argv[1:])).strip())


if __name__ == "__main__":
    main()
