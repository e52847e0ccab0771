"""Are the examples real? Plain training of each example at its YAML configuration, 3 seeds.

The MNIST-1D CNN should land near the published ~94% test accuracy (Greydanus 2020: logistic 32%, MLP 68%,
CNN 94%, GRU 91%) at the default size (4000 train / 1000 test; 10% of train held out for validation here).

Run: ``python -m benchmarks.example_accuracy``
"""

from __future__ import annotations

import argparse

from benchmarks.harness import Arm, run_arms, write_results

MNIST1D = {"model__lr": 0.03, "model__weight_decay": 5e-4, "model__scheduler": "onecycle"}
CONFIGS = {
    "mnist1d-cnn": (MNIST1D, 40),
    "mnist1d-mlp": (MNIST1D, 40),
    "digits": ({}, 30),
    "charlm": ({}, 3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workloads", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    results = []
    for workload in args.workloads:
        overrides, epochs = CONFIGS[workload]
        results.append(
            run_arms(
                workload,
                [Arm("plain")],
                seeds=args.seeds,
                trainer_kwargs={"max_epochs": epochs},
                workload_kwargs=overrides,
                flops="none",
            )
        )
    command = "python -m benchmarks.example_accuracy --seeds " + " ".join(map(str, args.seeds))
    command += " --workloads " + " ".join(args.workloads)
    json_path, md_path = write_results(results, "example_accuracy", command)
    print(md_path.read_text())


if __name__ == "__main__":
    main()
