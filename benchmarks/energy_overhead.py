"""EnergyLogger's own cost: a plain Trainer vs the same Trainer with EnergyLogger, in one run.

Two views of the same question:

* end to end: training CPU time with EnergyLogger / without, paired by seed. Process CPU time includes the
  sampling thread and codecarbon's timer threads. Noisy at the 1% level on a shared machine, so it is
  reported beside the precise figure, not instead of it;
* in-process: the CPU seconds (``time.thread_time``) spent in EnergyLogger's training-loop hooks plus the
  CPU seconds its sampling thread spends reading the meters, as a share of the training CPU time (torch runs
  on one thread, so training CPU time is step time). The thread holds the GIL while it reads, so its time is
  an upper bound on what it takes from the training thread. CPU time, unlike wall time, does not depend on
  how busy the machine's other processes keep the cores. This is the "<= 1% of step time" figure.
  One-time costs (starting the meters at fit start, writing the report at the end) are reported
  separately: they do not grow with the run.

Meters are whatever this machine has (here: no GPU, no readable RAPL, so codecarbon's CPU and RAM model).

Run: ``python -m benchmarks.energy_overhead``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

from benchmarks.harness import Arm, run_arms, write_results
from lightning_pulse import EnergyLogger
from lightning_pulse.energy.sampler import THREAD_NAME

LOOP_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_pulse_phase_change",
)
ONCE_HOOKS = ("on_fit_start", "on_train_start", "on_train_end", "on_fit_end")


class TimedEnergyLogger(EnergyLogger):
    """EnergyLogger that accumulates the wall time of its hooks and of its sampling thread's readings."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loop_seconds = 0.0
        self.once_seconds = 0.0
        self.thread_seconds = 0.0
        self.thread_readings = 0
        self._lock = threading.Lock()
        for name in LOOP_HOOKS + ONCE_HOOKS:
            self._time_hook(name, "loop_seconds" if name in LOOP_HOOKS else "once_seconds")

    def _time_hook(self, name: str, bucket: str) -> None:
        hook = getattr(self, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return hook(*args, **kwargs)
            finally:
                setattr(self, bucket, getattr(self, bucket) + time.thread_time() - start)

        setattr(self, name, timed)

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)
        sampler = self.sampler
        if sampler is None:
            return
        sample = sampler.sample

        def timed_sample() -> None:
            if threading.current_thread().name != THREAD_NAME:
                sample()  # synchronous readings happen inside hooks, which are timed already
                return
            start = time.thread_time()
            try:
                sample()
            finally:
                with self._lock:
                    self.thread_seconds += time.thread_time() - start
                    self.thread_readings += 1

        sampler.sample = timed_sample

    def benchmark_metrics(self) -> dict[str, float]:
        report = self.report or {}
        return {
            "loop_hook_seconds": self.loop_seconds,
            "once_hook_seconds": self.once_seconds,
            "thread_seconds": self.thread_seconds,
            "thread_readings": self.thread_readings,
            "energy_kwh": (report.get("total") or {}).get("energy_kwh"),
            "cpu_meter": (report.get("meters") or {}).get("cpu", {}).get("meter"),
        }


def overhead_rows(result: dict, arms: list[Arm]) -> list[str]:
    """Add the in-process shares to ``result["summary"]`` and return the Markdown table rows."""
    rows = []
    for arm in arms[1:]:
        runs = [run for run in result["runs"] if run["arm"] == arm.name]
        hooks = [run["extra"]["loop_hook_seconds"] / run["train_cpu_s"] for run in runs]
        thread = [run["extra"]["thread_seconds"] / run["train_cpu_s"] for run in runs]
        share = [h + t for h, t in zip(hooks, thread)]
        per_reading = [
            1000 * run["extra"]["thread_seconds"] / run["extra"]["thread_readings"]
            for run in runs
            if run["extra"]["thread_readings"]
        ]
        row = result["summary"][arm.name]
        row.update(
            loop_hook_share=statistics.median(hooks),
            thread_share=statistics.median(thread),
            overhead_share=statistics.median(share),
            thread_readings=statistics.median([run["extra"]["thread_readings"] for run in runs]),
            ms_per_reading=statistics.median(per_reading) if per_reading else float("nan"),
            once_seconds=statistics.median([run["extra"]["once_hook_seconds"] for run in runs]),
            step_cpu_ms=statistics.median([1000 * run["train_cpu_s"] / run["steps"] for run in runs]),
            cpu_meter=runs[0]["extra"]["cpu_meter"],
        )
        rows.append(
            f"| {result['workload']} | {arm.name} | {row['step_cpu_ms']:.1f} | {row['loop_hook_share']:.3%} | "
            f"{row['thread_share']:.3%} | **{row['overhead_share']:.3%}** | {row['thread_readings']:.0f} | "
            f"{row['ms_per_reading']:.2f} | {row['once_seconds']:.2f} | {row['cpu_ratio']:.4f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30, help="epochs of the MNIST-1D CNN workload")
    parser.add_argument(
        "--charlm-epochs", type=int, default=2, help="epochs of the char LM workload (0: skip)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    report_dir = tempfile.mkdtemp(prefix="energy-overhead-")

    def energy_arm(period: float) -> Arm:
        return Arm(
            f"energy_logger@{period:g}s",
            callbacks=lambda seed: [
                TimedEnergyLogger(sampling_period=period, country_iso_code="DEU", report_dir=report_dir)
            ],
        )

    # tiny steps with short epochs (the worst case for per-step and per-epoch costs), at the default
    # period and ten times more often; then a char transformer LM with longer steps, at the default period
    plan = [("mnist1d-cnn", args.epochs, [Arm("plain"), energy_arm(1.0), energy_arm(0.1)])]
    if args.charlm_epochs > 0:
        plan.append(("charlm", args.charlm_epochs, [Arm("plain"), energy_arm(1.0)]))
    results, rows = [], []
    for workload, epochs, arms in plan:
        result = run_arms(
            workload, arms, seeds=args.seeds, trainer_kwargs={"max_epochs": epochs}, flops="none"
        )
        rows += overhead_rows(result, arms)
        results.append(result)
    lines = [
        "EnergyLogger's CPU time as a share of training CPU time (torch on one thread, so training CPU time is",
        "step time), median over seeds. Loop hooks: its per-batch, per-epoch and validation hooks; sampling",
        "thread: the meter readings of its background thread. One-time: starting the meters and writing the",
        "report, CPU s per fit. The end-to-end ratio (the harness's training CPU with / without, paired by",
        "seed) also contains the one-time report writing at the end of fit, and the noise of a shared machine.",
        "",
        "| workload | arm | step CPU ms | loop hooks | sampling thread | total share | readings | ms per reading | "
        "one-time s | end-to-end CPU ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Meters on this machine: CPU '{results[0]['summary']['energy_logger@1s']['cpu_meter']}', RAM 'codecarbon', "
        "no GPU.",
    ]
    command = "python -m benchmarks.energy_overhead " + " ".join(
        [
            "--epochs",
            str(args.epochs),
            "--charlm-epochs",
            str(args.charlm_epochs),
            "--seeds",
            *map(str, args.seeds),
        ]
    )
    json_path, md_path = write_results(results, "energy_overhead", command, notes="\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
