"""EnergyLogger's own cost: a plain Trainer vs the same Trainer with EnergyLogger, in one run.

Two views of the same question:

* end to end: training CPU time with EnergyLogger / without, paired by seed. Process CPU time includes the
  sampling thread and codecarbon's timer threads. Noisy at the 1% level on a shared machine, so it is
  reported beside the precise figure, not instead of it;
* in-process: the CPU seconds (``time.thread_time``) spent in EnergyLogger's training-loop hooks plus the
  CPU seconds its sampling thread spends reading the meters and codecarbon's own timer threads spend (its
  tracker monitors power every second), as a share of the training CPU time (torch runs on one thread, so
  training CPU time is step time). The threads hold the GIL while they run, so their time is an upper bound
  on what they take from the training thread. CPU time, unlike wall time, does not depend on
  how busy the machine's other processes keep the cores. This is the "<= 1% of step time" figure.
  One-time costs (starting the meters at fit start, writing the report at the end) are reported
  separately: they do not grow with the run. codecarbon's tracker starts on a thread of its own (its
  hardware detection, 1.5-3 s on a process's first fit, overlaps training): that thread's CPU time is
  reported next to the one-time hooks' (``start_thread_seconds``: that thread's own CPU; codecarbon's CPU
  detection also runs in a worker thread of its own and in a py-cpuinfo subprocess, about 1.1 s of wall time
  on a first fit here, which this figure does not include).

Whichever callback Lightning calls first after a training step (or after fetching a batch) runs on cold
CPU caches and pays a few microseconds more than the same code called later, even when it does nothing.
That cost is there with or without EnergyLogger (another callback pays it), so every arm, the plain one
included, starts its callback list with a timed no-op (:class:`FirstCallbackProbe`): it absorbs that cost
and measures it, and EnergyLogger, second, is timed for its own work. One more arm puts EnergyLogger first,
with no probe, so the figure as it comes out in that position is in the table too.

Meters are whatever this machine has (here: no GPU, no readable RAPL, so codecarbon's CPU and RAM model).

Run: ``python -m benchmarks.energy_overhead``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import types
from collections.abc import Callable

from lightning.pytorch.callbacks import Callback

from benchmarks.harness import Arm, run_arms, write_results
from lightning_pulse import EnergyLogger
from lightning_pulse.energy import MeterConfig
from lightning_pulse.energy.codecarbon_meter import CodecarbonSession
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
PROBED_HOOKS = LOOP_HOOKS[:-1]  # the Lightning hooks among them


def _time_background_starts() -> None:
    """Time codecarbon's background start (thread CPU) on each session, and tell the session's owner when the
    tracker runs (so its timer threads can be timed from then on). Patched here, never in the library."""
    start = CodecarbonSession._start_quietly
    if getattr(start, "timed", False):
        return

    def timed_start(session: CodecarbonSession, requested: float) -> None:
        began = time.thread_time()
        try:
            start(session, requested)
        finally:
            session.start_thread_seconds = time.thread_time() - began
            started = getattr(session, "on_started", None)
            if started is not None:
                started()

    timed_start.timed = True
    CodecarbonSession._start_quietly = timed_start


_time_background_starts()


def _timed(owner: object, names: tuple[str, ...], add: Callable[[float], None]) -> None:
    """Replace each hook ``names`` of ``owner`` by a wrapper adding its thread CPU seconds through ``add``."""
    for name in names:
        hook = getattr(owner, name)

        def timed(*args, _hook=hook, **kwargs):
            start = time.thread_time()
            try:
                return _hook(*args, **kwargs)
            finally:
                add(time.thread_time() - start)

        setattr(owner, name, timed)


class FirstCallbackProbe(Callback):
    """A timed no-op, first in every arm's callback list: it pays (and measures) what the first callback
    called after a training step pays anyway, so the callback after it is timed for its own work."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.batches = 0
        _timed(self, PROBED_HOOKS, self._add)

    def _add(self, seconds: float) -> None:
        self.seconds += seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pass

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        pass

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass

    def on_validation_start(self, trainer, pl_module) -> None:
        pass

    def on_validation_end(self, trainer, pl_module) -> None:
        pass


class TimedEnergyLogger(EnergyLogger):
    """EnergyLogger that accumulates the thread CPU time of its hooks, of its sampling thread's readings and
    of codecarbon's own timer threads."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loop_seconds = 0.0
        self.once_seconds = 0.0
        self.thread_seconds = 0.0
        self.thread_readings = 0
        self.timer_seconds = 0.0
        self.timer_runs = 0
        self.sessions: list[CodecarbonSession] = []
        self._timed_trackers: set[int] = set()
        self._lock = threading.Lock()
        _timed(self, LOOP_HOOKS, self._add_loop)
        _timed(self, ONCE_HOOKS, self._add_once)

    def _add_loop(self, seconds: float) -> None:
        self.loop_seconds += seconds

    def _add_once(self, seconds: float) -> None:
        self.once_seconds += seconds

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)
        sampler = self.account.sampler
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
        sessions = {
            id(s): s for c in self.account.chains if (s := getattr(c.meter, "session", None)) is not None
        }
        self.sessions = list(sessions.values())
        for session in self.sessions:  # the tracker starts in the background: time its timers once it runs
            session.on_started = self._time_codecarbon_timers
        self._time_codecarbon_timers()

    def _time_codecarbon_timers(self) -> None:
        """codecarbon's tracker runs timer threads of its own (a power monitor every second, whatever
        ``measure_power_secs`` is): their CPU time is EnergyLogger's cost too, so it is timed as well.

        The scheduler re-arms a ``threading.Timer`` on ``self._run`` at every firing; the timed ``_run`` stays a
        method of the scheduler, so EnergyLogger still finds and joins those timers when it stops.
        """
        trackers = {}
        with self._lock:
            for session in self.sessions:
                tracker = session.tracker
                if tracker is not None and id(tracker) not in self._timed_trackers:
                    self._timed_trackers.add(id(tracker))
                    trackers[id(tracker)] = tracker
        for tracker in trackers.values():
            for name in ("_scheduler", "_scheduler_monitor_power"):
                scheduler = getattr(tracker, name, None)
                if scheduler is None or not hasattr(scheduler, "_run"):
                    continue

                def timed_run(scheduler, _run=scheduler._run) -> None:
                    start = time.thread_time()
                    try:
                        _run()
                    finally:
                        with self._lock:
                            self.timer_seconds += time.thread_time() - start
                            self.timer_runs += 1

                scheduler._run = types.MethodType(timed_run, scheduler)
                if not scheduler._stopped:  # re-arm, so the first firing is timed too
                    scheduler.stop()
                    scheduler.start()


def probe_metrics(probe: FirstCallbackProbe) -> dict[str, float]:
    return {"probe_seconds": probe.seconds, "probe_batches": probe.batches}


def energy_metrics(energy: TimedEnergyLogger) -> dict[str, float]:
    """The timers of this script's wrapper, and what the callback's public state says about the run."""
    report = energy.report or {}
    ledger = energy.account.ledger
    return {
        "loop_hook_seconds": energy.loop_seconds,
        "once_hook_seconds": energy.once_seconds,
        "thread_seconds": energy.thread_seconds,
        "thread_readings": energy.thread_readings,
        "codecarbon_timer_seconds": energy.timer_seconds,
        "codecarbon_timer_runs": energy.timer_runs,
        "start_thread_seconds": sum(getattr(s, "start_thread_seconds", 0.0) for s in energy.sessions),
        "batches": ledger.buckets["total"].batches if ledger is not None and "total" in ledger.buckets else 0,
        "energy_kwh": (report.get("total") or {}).get("energy_kwh"),
        "cpu_meter": (report.get("meters") or {}).get("cpu", {}).get("meter"),
    }


def arm_metrics(callbacks: list[Callback], trainer: object = None) -> dict[str, float]:
    """``Arm.metrics(callbacks, trainer)``: this script's figures of one run, read from outside the library."""
    metrics: dict[str, float] = {}
    for callback in callbacks:
        if isinstance(callback, FirstCallbackProbe):
            metrics.update(probe_metrics(callback))
        elif isinstance(callback, TimedEnergyLogger):
            metrics.update(energy_metrics(callback))
    return metrics


def overhead_rows(result: dict, arms: list[Arm]) -> list[str]:
    """Add the in-process shares to ``result["summary"]`` and return the Markdown table rows."""
    rows = []
    for arm in arms:
        runs = [run for run in result["runs"] if run["arm"] == arm.name]
        row = result["summary"][arm.name]
        probed = [run for run in runs if run["extra"].get("probe_batches")]
        row["first_callback_us_per_batch"] = (
            statistics.median(
                [1e6 * r["extra"]["probe_seconds"] / r["extra"]["probe_batches"] for r in probed]
            )
            if probed
            else None
        )
        row["step_cpu_ms"] = statistics.median([1000 * run["train_cpu_s"] / run["steps"] for run in runs])
        probe = row["first_callback_us_per_batch"]
        probe_cell = "none (EnergyLogger is first)" if probe is None else f"{probe:.1f}"
        if "loop_hook_seconds" not in runs[0]["extra"]:
            rows.append(
                f"| {result['workload']} | {arm.name} | {row['step_cpu_ms']:.1f} | {probe_cell} | - | - | - | "
                "- | - | - | - | 1 |"
            )
            continue
        hooks = [run["extra"]["loop_hook_seconds"] / run["train_cpu_s"] for run in runs]
        thread = [
            (run["extra"]["thread_seconds"] + run["extra"]["codecarbon_timer_seconds"]) / run["train_cpu_s"]
            for run in runs
        ]
        share = [h + t for h, t in zip(hooks, thread)]
        per_reading = [
            1000 * run["extra"]["thread_seconds"] / run["extra"]["thread_readings"]
            for run in runs
            if run["extra"]["thread_readings"]
        ]
        batches = [max(run["extra"]["batches"], 1) for run in runs]
        row.update(
            loop_hook_us_per_batch=statistics.median(
                [1e6 * run["extra"]["loop_hook_seconds"] / n for run, n in zip(runs, batches)]
            ),
            loop_hook_share=statistics.median(hooks),
            thread_share=statistics.median(thread),
            overhead_share=statistics.median(share),
            thread_readings=statistics.median([run["extra"]["thread_readings"] for run in runs]),
            ms_per_reading=statistics.median(per_reading) if per_reading else float("nan"),
            once_seconds=statistics.median([run["extra"]["once_hook_seconds"] for run in runs]),
            start_thread_seconds=statistics.median(
                [run["extra"].get("start_thread_seconds", 0.0) for run in runs]
            ),
            cpu_meter=runs[0]["extra"]["cpu_meter"],
        )
        rows.append(
            f"| {result['workload']} | {arm.name} | {row['step_cpu_ms']:.1f} | {probe_cell} | "
            f"{row['loop_hook_us_per_batch']:.1f} | {row['loop_hook_share']:.3%} | {row['thread_share']:.3%} | "
            f"**{row['overhead_share']:.3%}** | {row['thread_readings']:.0f} | {row['ms_per_reading']:.2f} | "
            f"{row['once_seconds']:.2f} ({row['start_thread_seconds']:.2f}) | {row['cpu_ratio']:.4f} |"
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

    def energy_arm(period: float, first: bool = False) -> Arm:
        def callbacks(seed: int) -> list[Callback]:
            energy = TimedEnergyLogger(
                country_iso_code="DEU", report_dir=report_dir, meters=MeterConfig(sampling_period=period)
            )
            return [energy] if first else [FirstCallbackProbe(), energy]

        name = f"energy_logger@{period:g}s" + (", first callback" if first else "")
        return Arm(name, callbacks=callbacks, metrics=arm_metrics)

    plain = Arm("plain", callbacks=lambda seed: [FirstCallbackProbe()], metrics=arm_metrics)
    # tiny steps with short epochs (the worst case for per-step and per-epoch costs), at the default
    # period, ten times more often, and first in the callback list; then a char transformer LM with longer
    # steps, at the default period. Arm order rotates per seed, so no arm always runs first.
    plan = [
        ("mnist1d-cnn", args.epochs, [plain, energy_arm(1.0), energy_arm(0.1), energy_arm(1.0, first=True)])
    ]
    if args.charlm_epochs > 0:
        plan.append(("charlm", args.charlm_epochs, [plain, energy_arm(1.0)]))
    results, rows = [], []
    for workload, epochs, arms in plan:
        result = run_arms(
            workload,
            arms,
            seeds=args.seeds,
            trainer_kwargs={"max_epochs": epochs},
            flops="none",
            rotate_arms=True,
        )
        rows += overhead_rows(result, arms)
        results.append(result)
    lines = [
        "EnergyLogger's CPU time as a share of training CPU time (torch on one thread, so training CPU time is",
        "step time), median over seeds. Loop hooks: its per-batch, per-epoch and validation hooks (also given",
        "in microseconds per training batch, per-epoch work included); background threads: the meter readings",
        "of its sampling thread plus codecarbon's own timer threads (a power monitor every second); ms per reading",
        "is the sampling thread's alone (a reading at an epoch end runs in the epoch-end hook, so it is in",
        "the loop hooks). First callback: the timed no-op that every arm but one calls first (plain",
        "included); what it costs, a callback called first pays with or without EnergyLogger. In the",
        "'first callback' arm there is no probe, so EnergyLogger's hooks pay that too. One-time: starting the",
        "meters and writing the report, CPU s per fit (in brackets: the CPU s of the thread that starts",
        "codecarbon's tracker in the background, overlapping training). The end-to-end ratio (the harness's training CPU with /",
        "without, paired by seed) also contains the one-time report writing at the end of fit, and the noise",
        "of a shared machine.",
        "",
        "| workload | arm | step CPU ms | first callback µs/batch | loop hooks µs/batch | loop hooks | "
        "background threads | total share | readings | ms per reading | one-time s | end-to-end CPU ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
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
