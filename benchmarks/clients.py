"""What the shipped suite costs and saves on client models nobody here designed for (Hugging Face GPT-2 and
BERT, built from configs: ``tests/clients.py``).

Arms: plain, and the full suite exactly as ``examples/mnist1d/pulse.yaml`` ships it, with the baseline in the
same run; seeds 0 1 2; FLOPs from a second counted pass. The suite was not tuned for these models: the
figures say what a user gets from the defaults.

Run: ``python -m benchmarks.clients`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.harness import Arm, run_arms, write_results
from benchmarks.overhead import shipped_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["hf-gpt2", "hf-bert"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    arms = [Arm("plain"), Arm("full_suite", callbacks=shipped_suite)]
    results = [
        run_arms(
            workload, arms, seeds=args.seeds, trainer_kwargs={"max_epochs": args.epochs}, rotate_arms=True
        )
        for workload in args.workloads
    ]
    write_results(results, "clients", ("python -m benchmarks.clients " + " ".join(sys.argv[1:])).strip())


if __name__ == "__main__":
    main()
