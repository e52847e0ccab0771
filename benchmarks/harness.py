"""The shared benchmark harness: arms x seeds in one process, FLOPs + CPU time, ratios vs a baseline.

Every benchmark in this folder builds a list of :class:`Arm` (the first is the baseline), calls
:func:`run_arms`, and commits what :func:`write_results` writes to ``benchmarks/results/``.

Measurement rules:

* Arms are interleaved per seed (seed 0: A, B, C; seed 1: A, B, C; ...), so slow drifts of the machine hit
  every arm alike. Ratios are paired by seed, then the median over seeds is reported.
* Training FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` active on training batches only
  (forward, backward and optimizer step). The counter slows a step about 3x, so with ``flops="separate"``
  it runs in a second pass with the same seed and never in a timed pass.
* The process's one-time costs (codecarbon's start, the first kernels' set-up) fall in the first timed fit.
  The headline and the demo call :func:`warm_up` (one short untimed fit) first, so they fall in no arm's
  time. The other benchmarks either pass ``rotate_arms=True``, so each seed starts at another arm and the
  median over seeds drops the one slow fit, or leave them in seed 0's baseline, where they would flatter the
  methods' CPU ratios: in the committed results without either (gradient_cache, scheduled_prune,
  mhc_stability) seed 0's baseline CPU time is within the spread of the other seeds'.
* CPU time is process CPU time (``time.process_time``) spent in training, validation excluded. Torch runs
  on ``threads`` intra-op threads (1 by default) so the figure does not depend on how busy the other core is.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.workloads import get_workload
from lightning_pulse import pulse_cycle_of

RESULTS_DIR = Path(__file__).parent / "results"
#: Trainer arguments of every benchmark fit: one CPU process, nothing written or printed, no sanity check.
QUIET_TRAINER: dict[str, Any] = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


@dataclass
class Arm:
    """One configuration to compare.

    Attributes:
        name: label in the tables.
        callbacks: ``seed -> list of fresh callbacks`` (called once per run, so no state leaks).
        trainer_kwargs: overrides of the Trainer arguments for this arm only.
        workload_kwargs: overrides of the workload (``model__x`` / ``data__y``) for this arm only.
        metrics: ``(callbacks, trainer) -> dict`` read after the fit, for figures the library does not log
            (it reads the callbacks' public state; library callbacks carry no benchmark hooks).
        timed_apart: ``{callback class name: method names}`` that :class:`HookTimer` times apart from the
            hooks they run in (work the user asked for, such as an evaluation).
    """

    name: str
    callbacks: Callable[[int], list[Callback]] = lambda seed: []
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    workload_kwargs: dict[str, Any] = field(default_factory=dict)
    metrics: Callable[[list[Callback], pl.Trainer], dict[str, Any]] | None = None
    timed_apart: dict[str, tuple[str, ...]] = field(default_factory=dict)


#: The hooks a callback can be called on: Lightning's, plus the pulse contracts (lightning_pulse.protocols).
_HOOK_NAMES = tuple(
    name
    for name in dir(Callback)
    if name.startswith(("on_", "setup", "teardown")) and callable(getattr(Callback, name))
) + ("on_pulse_phase_change", "on_pulse_parameters_replaced", "on_pulse_weights_changed")


class HookTimer:
    """Times callbacks from outside: CPU seconds spent inside each callback's hooks during a fit.

    :meth:`install` wraps every hook a callback overrides with an instance attribute that accumulates
    ``time.process_time()``; Lightning looks hooks up on the instance, so the callback's code is untouched.
    Each figure is the callback's own time: a timed call inside another (PulseCycle telling a listener of a
    phase change) counts for the inner callback only. Work a callback does outside its hooks is counted where
    :attr:`OFF_HOOK_WORK` names its method (step-saving replay's choice in the sampler); a loss function it
    wraps or a forward hook it registers on the module is not counted here, and the fit's CPU time against a
    same-run baseline is the figure that counts it.

    ``cpu_s`` holds the hooks of the training loop (per step, epoch and phase); ``one_time_cpu_s`` the
    start-up and shut-down hooks (:attr:`ONE_TIME_HOOKS`), which a longer run amortises; ``apart_cpu_s`` the
    methods named in ``install(..., apart=...)``, work the user asked for rather than overhead (PulseCycle's
    maintain probe is an evaluation).
    """

    #: hooks that run once or a few times per fit: start-up and shut-down, reported apart from per-step work
    ONE_TIME_HOOKS = frozenset(
        {"setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_exception"}
    )

    #: work a callback does on the training path outside its hooks, counted with its hooks: step-saving
    #: replay chooses each light batch inside the DataLoader's sampler, before the samples are loaded;
    #: StabilityGuard's step hooks on the optimizers (``StepChanges``) run inside ``optimizer.step()``, and its
    #: copy of each batch as ``training_step`` gets it inside the strategy's ``training_step``
    OFF_HOOK_WORK = {
        "HardSampleReplay": ("_choose",),
        "StabilityGuard": ("_changes._enter", "_changes._leave", "_entered"),
    }

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.one_time_cpu_s: dict[str, float] = {}
        self.apart_cpu_s: dict[str, float] = {}
        self._inner: list[float] = []  # per open timed call: the time of the timed calls inside it

    def install(self, callback: Callback, apart: tuple[str, ...] = ()) -> None:
        label = type(callback).__name__
        self.cpu_s.setdefault(label, 0.0)
        self.calls.setdefault(label, 0)
        self.one_time_cpu_s.setdefault(label, 0.0)
        for name in _HOOK_NAMES:
            method = getattr(callback, name, None)
            base = getattr(Callback, name, None)
            if method is None or getattr(type(callback), name, None) is base:
                continue
            totals = self.one_time_cpu_s if name in self.ONE_TIME_HOOKS else self.cpu_s
            setattr(callback, name, self._timed(label, method, totals))
        for path in self.OFF_HOOK_WORK.get(label, ()):
            *owners, name = path.split(".")
            owner = functools.reduce(getattr, owners, callback)  # set on the instance, before the fit
            setattr(owner, name, self._timed(label, getattr(owner, name), self.cpu_s, count=False))
        for path in apart:  # a method of the callback, or of an object it holds ("probe.logged_run")
            key = f"{label}.{path}"
            self.apart_cpu_s.setdefault(key, 0.0)
            *owners, name = path.split(".")
            owner = functools.reduce(getattr, owners, callback)
            setattr(owner, name, self._timed(key, getattr(owner, name), self.apart_cpu_s, count=False))

    def _timed(
        self, label: str, method: Callable[..., Any], totals: dict[str, float], count: bool = True
    ) -> Callable[..., Any]:
        clock = time.process_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = clock() - started
                totals[label] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed
                if count:
                    self.calls[label] += 1

        return timed


def instantiate_callbacks(specs: list[dict[str, Any]]) -> list[Callback]:
    """Build a YAML's ``trainer.callbacks`` entries exactly as LightningCLI does: jsonargparse resolves each
    ``class_path``/``init_args`` and turns nested mappings into the typed config objects (``meters:``,
    ``config:``) a callback declares."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[Callback])
    return parser.instantiate_classes(parser.parse_object({"callbacks": specs})).callbacks


class TrainingFlopCounter(Callback):
    """Counts FLOPs of training batches (forward, backward, optimizer) with ``FlopCounterMode``."""

    def __init__(self) -> None:
        self.total = 0
        self._mode: FlopCounterMode | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.total += self._mode.get_total_flops()
            self._mode = None


class CurveRecorder(Callback):
    """Records, at every validation, cumulative training CPU/wall seconds, training FLOPs and val metrics."""

    def __init__(self, flop_counter: TrainingFlopCounter | None) -> None:
        self.flop_counter = flop_counter
        self.curve: list[dict[str, float]] = []
        self.samples = 0
        self._cpu_start = self._wall_start = 0.0
        self._eval_cpu = self._eval_wall = 0.0
        self._eval_cpu_start = self._eval_wall_start = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._cpu_start, self._wall_start = time.process_time(), time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()), None)
        if isinstance(first, torch.Tensor):
            self.samples += int(first.shape[0])

    def on_validation_start(self, trainer, pl_module) -> None:
        self._eval_cpu_start, self._eval_wall_start = time.process_time(), time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._eval_cpu += time.process_time() - self._eval_cpu_start
        self._eval_wall += time.perf_counter() - self._eval_wall_start
        if trainer.sanity_checking:
            return
        point = {
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
            "train_cpu_s": self.train_cpu_s,
            "train_wall_s": self.train_wall_s,
            "train_flops": float(self.flop_counter.total) if self.flop_counter else math.nan,
        }
        point.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")})
        self.curve.append(point)

    @property
    def train_cpu_s(self) -> float:
        return time.process_time() - self._cpu_start - self._eval_cpu

    @property
    def train_wall_s(self) -> float:
        return time.perf_counter() - self._wall_start - self._eval_wall


def run_one(
    workload: str,
    arm: Arm,
    seed: int,
    trainer_kwargs: dict[str, Any],
    workload_kwargs: dict[str, Any],
    count_flops: bool,
) -> dict[str, Any]:
    """Train and test one (arm, seed); return its figures."""
    spec = get_workload(workload)
    pl.seed_everything(seed, workers=True, verbose=False)
    module, datamodule = spec.build(**{**workload_kwargs, **arm.workload_kwargs})
    # the dataset is on disk before the timed fit, as a real one is: a generator's first run (0.8 s for
    # MNIST-1D) would otherwise fall inside whichever arm comes first
    datamodule.prepare_data()
    flop_counter = TrainingFlopCounter() if count_flops else None
    recorder = CurveRecorder(flop_counter)
    callbacks = arm.callbacks(seed)
    hook_timer = HookTimer()
    for callback in callbacks:
        hook_timer.install(callback, apart=arm.timed_apart.get(type(callback).__name__, ()))
    kwargs = dict(QUIET_TRAINER)
    # a run's files (EnergyLogger's report, checkpoints) go to a scratch folder, not the working directory
    kwargs["default_root_dir"] = tempfile.mkdtemp(prefix="lp-bench-")
    kwargs.update(trainer_kwargs)
    kwargs.update(arm.trainer_kwargs)
    trainer = pl.Trainer(
        callbacks=[*callbacks, recorder, *([flop_counter] if flop_counter else [])], **kwargs
    )
    cpu0, wall0 = time.process_time(), time.perf_counter()
    trainer.fit(module, datamodule)
    fit_cpu, fit_wall = time.process_time() - cpu0, time.perf_counter() - wall0
    test = trainer.test(module, datamodule, verbose=False)[0]
    cycle = pulse_cycle_of(trainer)
    extra: dict[str, Any] = {
        "hook_cpu_s": dict(hook_timer.cpu_s),
        "one_time_hook_cpu_s": dict(hook_timer.one_time_cpu_s),
        "apart_cpu_s": dict(hook_timer.apart_cpu_s),
    }
    if arm.metrics is not None:
        extra.update(arm.metrics(callbacks, trainer))
    final = recorder.curve[-1] if recorder.curve else {}
    return {
        "arm": arm.name,
        "seed": seed,
        "steps": trainer.global_step,
        "samples": recorder.samples,
        "train_cpu_s": recorder.train_cpu_s,
        "train_wall_s": recorder.train_wall_s,
        "fit_cpu_s": fit_cpu,
        "fit_wall_s": fit_wall,
        "train_flops": float(flop_counter.total) if flop_counter else math.nan,
        "final_val": {k: v for k, v in final.items() if k.startswith("val")},
        "test": {k: float(v) for k, v in test.items()},
        "steps_by_phase": dict(cycle.clock.steps_by_phase) if cycle else {"burst": trainer.global_step},
        "curve": recorder.curve,
        "extra": extra,
    }


def run_arms(
    workload: str,
    arms: Sequence[Arm],
    seeds: Sequence[int] = (0, 1, 2),
    trainer_kwargs: dict[str, Any] | None = None,
    workload_kwargs: dict[str, Any] | None = None,
    flops: str = "separate",
    threads: int = 1,
    log: Callable[[str], None] = print,
    rotate_arms: bool = False,
) -> dict[str, Any]:
    """Run every arm on every seed and summarise against ``arms[0]``.

    Args:
        workload: a name from :mod:`benchmarks.workloads`.
        arms: configurations; the first is the baseline.
        seeds: training seeds (at least 3 for a reported figure).
        trainer_kwargs: Trainer arguments shared by all arms (e.g. ``max_epochs``).
        workload_kwargs: workload overrides shared by all arms.
        flops: ``"separate"`` (timed pass + counted pass per run), ``"same"`` (count in the timed pass; its
            times are then not comparable to uncounted runs) or ``"none"``.
        threads: torch intra-op threads.
        rotate_arms: start seed ``i``'s round at arm ``i % len(arms)``, so no arm always runs first or last
            (a run's position in the round shifts its CPU time by a few percent on a busy machine).
    """
    if flops not in ("separate", "same", "none"):
        raise ValueError(f"`flops`={flops!r} is not one of ['separate', 'same', 'none'].")
    if not arms:
        raise ValueError("`arms` must not be empty.")
    torch.set_num_threads(threads)
    trainer_kwargs = dict(trainer_kwargs or {})
    workload_kwargs = dict(workload_kwargs or {})
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    for round_index, seed in enumerate(seeds):
        shift = round_index % len(arms) if rotate_arms else 0
        for arm in [*arms[shift:], *arms[:shift]]:
            run = run_one(workload, arm, seed, trainer_kwargs, workload_kwargs, count_flops=flops == "same")
            if flops == "separate":
                counted = run_one(workload, arm, seed, trainer_kwargs, workload_kwargs, count_flops=True)
                run["train_flops"] = counted["train_flops"]
                for point, counted_point in zip(run["curve"], counted["curve"]):
                    point["train_flops"] = counted_point["train_flops"]
                run["flops_pass_final_val"] = counted["final_val"]
            runs.append(run)
            log(
                f"[{workload}] seed={seed} {arm.name}: steps={run['steps']} "
                f"cpu={run['train_cpu_s']:.1f}s flops={run['train_flops']:.3g} val={run['final_val']}"
            )
    spec = get_workload(workload)
    return {
        "workload": workload,
        "metric": spec.metric,
        "mode": spec.mode,
        "test_metric": spec.test_metric,
        "seeds": list(seeds),
        "arms": [arm.name for arm in arms],
        "trainer_kwargs": {
            k: repr(v) if not isinstance(v, (int, float, str, bool)) else v for k, v in trainer_kwargs.items()
        },
        "workload_kwargs": workload_kwargs,
        "flops_mode": flops,
        "threads": threads,
        "rotate_arms": rotate_arms,
        "runs": runs,
        "summary": summarise(runs, [arm.name for arm in arms], spec.metric, spec.mode, spec.test_metric),
        "environment": environment(),
        "elapsed_s": time.perf_counter() - started,
    }


#: the warm-up fit's seed, apart from the timed runs' seeds
WARM_UP_SEED = 99


def warm_up(
    workload: str,
    arm: Arm,
    workload_kwargs: dict[str, Any] | None = None,
    steps: int = 3,
    threads: int = 1,
) -> None:
    """One short fit of ``arm`` (``steps`` optimizer steps, then its test), neither timed nor reported, to run
    before the timed arms: the process's one-time costs (imports inside a fit, codecarbon's start, the first
    kernels' set-up) would otherwise fall in whichever arm runs first. ``arm`` should carry the meters the
    timed arms carry, so their start is paid here, and write its reports where no figure is read."""
    run_arms(
        workload,
        [arm],
        seeds=[WARM_UP_SEED],
        trainer_kwargs={"max_steps": steps},
        workload_kwargs=workload_kwargs,
        flops="none",
        threads=threads,
        log=lambda line: None,
    )


def _reached(curve: list[dict[str, float]], metric: str, target: float, mode: str) -> dict[str, float] | None:
    for point in curve:
        value = point.get(metric)
        if value is None:
            continue
        if (mode == "max" and value >= target) or (mode == "min" and value <= target):
            return point
    return None


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def summarise(
    runs: list[dict[str, Any]], arms: list[str], metric: str, mode: str, test_metric: str
) -> dict[str, Any]:
    """Per-arm medians and seed-paired ratios against ``arms[0]``."""
    baseline = {run["seed"]: run for run in runs if run["arm"] == arms[0]}
    summary: dict[str, Any] = {}
    for name in arms:
        own = [run for run in runs if run["arm"] == name]
        flops_ratio, cpu_ratio, to_target_flops, to_target_cpu = [], [], [], []
        reached = 0
        for run in own:
            base = baseline[run["seed"]]
            flops_ratio.append(run["train_flops"] / base["train_flops"] if base["train_flops"] else math.nan)
            cpu_ratio.append(run["train_cpu_s"] / base["train_cpu_s"])
            target = base["final_val"].get(metric)
            point = _reached(run["curve"], metric, target, mode) if target is not None else None
            if point is not None:
                reached += 1
                if base["train_flops"]:
                    to_target_flops.append(point["train_flops"] / base["train_flops"])
                to_target_cpu.append(point["train_cpu_s"] / base["train_cpu_s"])
        summary[name] = {
            f"final_{metric}": _median([run["final_val"].get(metric, math.nan) for run in own]),
            f"{test_metric}": _median([run["test"].get(test_metric, math.nan) for run in own]),
            f"delta_{test_metric}_vs_baseline": _median(
                [
                    run["test"].get(test_metric, math.nan)
                    - baseline[run["seed"]]["test"].get(test_metric, math.nan)
                    for run in own
                ]
            ),
            "train_flops": _median([run["train_flops"] for run in own]),
            "train_cpu_s": _median([run["train_cpu_s"] for run in own]),
            "steps": _median([run["steps"] for run in own]),
            "flops_ratio": _median(flops_ratio),
            "cpu_ratio": _median(cpu_ratio),
            "seeds_reaching_baseline_metric": reached,
            "flops_to_baseline_metric_ratio": _median(to_target_flops),
            "cpu_to_baseline_metric_ratio": _median(to_target_cpu),
            "steps_by_phase": {
                phase: _median([run["steps_by_phase"].get(phase, 0) for run in own])
                for phase in ("burst", "replay", "maintain")
            },
        }
    return summary


def environment() -> dict[str, Any]:
    import lightning

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.4g}"
    return str(value)


def markdown_table(result: dict[str, Any]) -> str:
    """A Markdown table of the summary, one row per arm."""
    metric, test_metric = result["metric"], result["test_metric"]
    columns = [
        (f"final {metric}", f"final_{metric}"),
        (test_metric, test_metric),
        (f"Δ {test_metric}", f"delta_{test_metric}_vs_baseline"),
        ("train FLOPs", "train_flops"),
        ("FLOPs ratio", "flops_ratio"),
        ("train CPU s", "train_cpu_s"),
        ("CPU ratio", "cpu_ratio"),
        ("seeds reaching baseline", "seeds_reaching_baseline_metric"),
        ("FLOPs to baseline metric", "flops_to_baseline_metric_ratio"),
        ("CPU to baseline metric", "cpu_to_baseline_metric_ratio"),
        ("steps b/r/m", None),
    ]
    lines = ["| arm | " + " | ".join(title for title, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for arm in result["arms"]:
        row = result["summary"][arm]
        cells = []
        for _, key in columns:
            if key is None:
                phases = row["steps_by_phase"]
                cells.append("/".join(_fmt(phases[p]) for p in ("burst", "replay", "maintain")))
            else:
                cells.append(_fmt(row[key]))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    results: dict[str, Any] | list[dict[str, Any]],
    name: str,
    command: str,
    notes: str = "",
    results_dir: Path = RESULTS_DIR,
) -> tuple[Path, Path]:
    """Write ``<results_dir>/<name>.json`` and ``.md`` (one section per workload result); ``results_dir`` is
    ``benchmarks/results/``, or ``benchmarks/studies/results/`` for a study."""
    results_dir.mkdir(parents=True, exist_ok=True)
    items = results if isinstance(results, list) else [results]
    json_path, md_path = results_dir / f"{name}.json", results_dir / f"{name}.md"
    payload = {"command": command, "results": items}
    json_path.write_text(json.dumps(payload, indent=2, default=str))
    parts = [f"# {name}", "", f"Command: `{command}`", ""]
    if notes:
        parts += [notes, ""]
    for result in items:
        parts += [
            f"## {result['workload']}",
            "",
            f"Seeds {result['seeds']}, medians; ratios are paired by seed against `{result['arms'][0]}` "
            f"in the same run. FLOPs: {result['flops_mode']}; torch threads: {result['threads']}; "
            f"trainer: {result['trainer_kwargs']}; workload: {result['workload_kwargs']}.",
            "",
            markdown_table(result),
            "",
        ]
    env = items[0]["environment"] if items else environment()
    parts.append(f"Environment: {env}; python {sys.version.split()[0]}.")
    md_path.write_text("\n".join(parts) + "\n")
    return json_path, md_path
