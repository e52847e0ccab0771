"""Study: one callback's hook CPU per char-LM step, for A/B runs of two source trees interleaved by seed.

``benchmarks/overhead.py`` runs every arm of one tree in a row; between two such runs of the same code the
shares move by a few tenths of a percent, more than a small change. This runs one arm, one seed, in the tree
on ``PYTHONPATH``: run it alternately in the two trees (seed 0 in each, then seed 1, ...) and compare the
figures paired by seed. The callback's hooks are timed from outside by :class:`benchmarks.harness.HookTimer`.

Run, for each seed in turn and each tree::

    PYTHONPATH=<tree> python <this repo>/benchmarks/studies/hook_ab.py --callback StabilityGuard --seed 0

It prints ``RESULT <hook µs per step> <training CPU ms per step>``.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch

STEPS = 300


def main() -> None:
    import lightning_pulse
    from benchmarks.harness import HookTimer
    from benchmarks.workloads import get_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--callback", default="StabilityGuard", help="a lightning_pulse callback, default args"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    model, data = get_workload("charlm").build(data__max_chars=200000)
    callback = getattr(lightning_pulse, args.callback)()
    timer = HookTimer()
    timer.install(callback)
    started: list[float] = []
    clock = pl.Callback()
    clock.on_train_start = lambda trainer, module: started.append(time.process_time())  # type: ignore[method-assign]
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=[callback, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, data)
    training_ms = (time.process_time() - started[0]) / STEPS * 1e3
    print("RESULT", round(timer.cpu_s[args.callback] / STEPS * 1e6, 1), round(training_ms, 2))


if __name__ == "__main__":
    main()
