"""Study: does standalone step-saving replay (``mode="steps"``) do what ``mode="epoch"`` does, as well?

Both train full batches on a ``replay_fraction`` of each epoch's data without a PulseCycle, so epochs take fewer
steps. Epoch mode picks the hardest samples of the whole epoch when the epoch starts; steps mode picks the
hardest ``B`` of each window of ``B / replay_fraction``. If steps mode matches epoch mode in accuracy and time,
epoch mode exists twice and can go (issue 17: "what exists twice goes").

Setting: ``benchmarks/hard_sample_replay.py``'s committed ``mnist1d-cnn`` (10000 samples, 15 epochs of
OneCycleLR), arms at 0.7 with their random controls, baseline in the same run, 3 seeds, arms rotated.

Run: ``python -m benchmarks.studies.replay_steps_vs_epoch`` (about 3 minutes on 2 cores). Writes
``benchmarks/studies/results/replay_steps_vs_epoch.{json,md}``.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.hard_sample_replay import SETTINGS, make_arm
from benchmarks.harness import Arm, run_arms, write_results

RESULTS = Path(__file__).parent / "results"
ARMS = ("topk-epoch-0.7", "topk-steps-0.7", "random-epoch-0.7", "random-steps-0.7")


def main() -> None:
    setting = SETTINGS["mnist1d-cnn"]
    epochs = setting["trainer_kwargs"]["max_epochs"]
    arms = [Arm("baseline")] + [make_arm(name, epochs, setting["pulse"]) for name in ARMS]
    result = run_arms(
        "mnist1d-cnn",
        arms,
        seeds=[0, 1, 2],
        trainer_kwargs=setting["trainer_kwargs"],
        workload_kwargs=setting["workload_kwargs"],
        flops="none",
        rotate_arms=True,
    )
    write_results(
        result,
        "replay_steps_vs_epoch",
        "python -m benchmarks.studies.replay_steps_vs_epoch",
        results_dir=RESULTS,
    )


if __name__ == "__main__":
    main()
