"""The energy account of a run: meters, sampler, ledger, batch counts, and the part of the run before a resume.

Plain Python, no Lightning: :class:`~lightning_pulse.EnergyLogger` maps trainer hooks onto an
:class:`EnergyAccount` and logs what it returns. The few collective calls a DDP run needs go through a
:class:`Collective` the caller provides (one broadcast and one all-gather per read-out, on every rank).

Nothing here raises into the caller's training loop on a metering problem: a meter that breaks falls back
inside its :class:`MeterChain`; a bug in the machinery itself stops metering (:meth:`EnergyAccount.disable`)
and keeps whatever was counted.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from lightning_pulse.energy.carbon import Rate
from lightning_pulse.energy.codecarbon_meter import CodecarbonMeter, CodecarbonSession
from lightning_pulse.energy.compare import baseline_ratios, comparison_line, write_report_compared
from lightning_pulse.energy.config import AccountingConfig, MeterConfig
from lightning_pulse.energy.constant import (
    CODECARBON_DEFAULT,
    ConstantPowerMeter,
    codecarbon_default_cpu_watts,
)
from lightning_pulse.energy.counting import BatchCounter
from lightning_pulse.energy.ledger import (
    BUCKET_FIELDS,
    J_PER_KWH,
    STARTUP_STAGE,
    EnergyLedger,
    combine_ranks,
    flatten_buckets,
    grouped_figures,
    merge_snapshots,
    predict_run,
    timeline_edges,
)
from lightning_pulse.energy.ledger import figures as bucket_figures
from lightning_pulse.energy.meter import COMPONENTS, NONE, MeterChain, MeterFactory
from lightning_pulse.energy.nvml import NvmlCounterMeter, NvmlPowerMeter, nvml_devices_for_cuda
from lightning_pulse.energy.rapl import RaplMeter
from lightning_pulse.energy.rate_parts import (
    RATES,
    UNCOUNTED_FIELD,
    extend_parts,
    rate_part,
    refuse_changed_currency,
)
from lightning_pulse.energy.report import JSON_NAME, assemble_report, replaced_run_line
from lightning_pulse.energy.sampler import EnergySampler
from lightning_pulse.energy.suspend_carry import carry_path, read_carry, write_carry
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import STEPS_BOUND_ONLY, UNKNOWN_STEPS_PER_BATCH
from lightning_pulse.step_rows import is_step_row, step_rows_every

GPU_MODES = ("auto", "none")
CPU_MODES = ("auto", "codecarbon", "constant", "none")
RAM_MODES = ("codecarbon", "none")
MODES = {"gpu": GPU_MODES, "cpu": CPU_MODES, "ram": RAM_MODES}
COUNTING_NOTES = {
    "samples": "dimension 0 of the first tensor of rank >= 1 of each training batch (every micro-batch, so "
    "accumulation is counted in full), summed over ranks.",
    "tokens": "non-zero `attention_mask` entries, else `input_ids` elements, else B*T of an integer (B, T) "
    "first tensor; unknown otherwise. Summed over ranks.",
    "data-loader stall": "time from on_train_batch_end to the next on_train_batch_start (fetching the next "
    "batch, plus any hook work in between) over the training loop's time (these waits plus each batch's own "
    "time from its start to its end); after a validation run, a phase change (PulseCycle's probe), a pause and "
    "each epoch's start hooks the wait is timed from their end, so it counts and they do not. Averaged over "
    "ranks.",
    "ddp": "GPU energy is metered on every rank (its own device) and summed, or, for `meters.gpu_devices`, "
    "once per node (local rank 0); CPU and RAM energy once per node (local rank 0; in codecarbon's process "
    "mode its process and child processes, which hold the node's other ranks).",
}
#: parent processes each rank names for the process-mode check (a rank Lightning's `strategy="ddp"` starts is
#: a direct child of local rank 0; a deeper chain than this reads as unrelated: refused, never miscounted)
ANCESTRY_DEPTH = 8


class Collective(Protocol):
    """The collectives a multi-process read-out needs; every rank calls them in the same order."""

    world_size: int

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""

    def all_gather(self, vector: np.ndarray) -> np.ndarray:
        """``(world_size, len(vector))``: every rank's float64 vector."""


class TensorCollective:
    """A :class:`Collective` over tensor collectives (a Lightning strategy's, in EnergyLogger): ``broadcast``
    gives rank 0's picklable value on every rank, ``gather`` stacks every rank's tensor to
    ``(world_size, *shape)``; the vectors travel as float64 tensors."""

    def __init__(
        self,
        world_size: int,
        broadcast: Callable[[Any], Any],
        gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.world_size, self.broadcast, self.gather = world_size, broadcast, gather

    def all_gather(self, vector: np.ndarray) -> np.ndarray:
        gathered = self.gather(torch.tensor(vector, dtype=torch.float64))
        return gathered.detach().cpu().numpy().reshape(self.world_size, -1)


def build_chains(
    config: MeterConfig,
    gpu_devices: Sequence[int | str],
    cpu: str,
    ram: str,
    country_iso_code: str | None,
    count_host: bool,
    warn: Callable[[str], None],
    info: Callable[[str], None],
) -> list[MeterChain]:
    """The meter chains of one process: NVML counter -> NVML power for ``gpu_devices``; and, when
    ``count_host`` (local rank 0), RAPL -> codecarbon -> ``config.cpu_watts`` for the CPU (as ``cpu``
    allows; codecarbon's generic-CPU power when ``cpu_watts`` is not set, so the CPU is never unmetered) and
    codecarbon for RAM. One codecarbon tracker serves CPU and RAM, built on first use. GPUs named in
    ``config.gpu_devices`` are required: NVML missing for them is a warning, not an info line. One failure
    shared by several meters (the codecarbon tracker, NVML) warns once."""
    chains: list[MeterChain] = []
    announced: set[str] = set()
    devices = list(gpu_devices)
    if devices:
        gpu_factories: list[tuple[str, MeterFactory]] = [
            ("nvml-counter", lambda: NvmlCounterMeter(devices)),
            ("nvml-power", lambda: NvmlPowerMeter(devices)),
        ]
        required = config.gpu_devices is not None
        chains.append(MeterChain("gpu", gpu_factories, warn, info, required=required, announced=announced))
    if not count_host:  # CPU and RAM are counted once per node
        return chains
    session: CodecarbonSession | None = None

    def codecarbon(component: str) -> MeterFactory:
        def build() -> CodecarbonMeter:
            nonlocal session
            if session is None:
                session = CodecarbonSession(
                    country_iso_code,
                    config.codecarbon_tracking_mode,
                    min_flush_interval=0.9 * config.sampling_period,
                    background=True,  # its first start (hardware detection, 1.5-3 s) overlaps training
                )
            return CodecarbonMeter(component, session)

        return build

    cpu_factories: list[tuple[str, MeterFactory]] = []
    if cpu == "auto":
        cpu_factories.append(("rapl", lambda: RaplMeter(config.rapl_root)))
    if cpu in ("auto", "codecarbon"):
        cpu_factories.append(("codecarbon", codecarbon("cpu")))
    if cpu != "none" and config.cpu_watts is not None:
        watts = config.cpu_watts
        cpu_factories.append(("constant", lambda: ConstantPowerMeter("cpu", watts)))
    elif cpu in ("auto", "codecarbon"):
        # what codecarbon itself assumes for a CPU it cannot identify: a labelled estimate rather than no
        # figure
        default_watts, source = codecarbon_default_cpu_watts()
        cpu_factories.append(
            (
                CODECARBON_DEFAULT,
                lambda: ConstantPowerMeter("cpu", default_watts, name=CODECARBON_DEFAULT, source=source),
            )
        )
    if cpu_factories:
        chains.append(MeterChain("cpu", cpu_factories, warn, info, announced=announced))
    if ram == "codecarbon":
        chains.append(MeterChain("ram", [("codecarbon", codecarbon("ram"))], warn, info, announced=announced))
    return chains


def process_row(node_rank: int, local_rank: int) -> np.ndarray:
    """This process's row for :func:`ranks_outside_local_zero`: node, local rank, pid, then the pids of its
    parent processes (up to :data:`ANCESTRY_DEPTH`, -1 after them; none when psutil cannot tell)."""
    try:
        import psutil  # codecarbon's dependency: installed wherever codecarbon meters

        parents = [parent.pid for parent in psutil.Process().parents()][:ANCESTRY_DEPTH]
    except Exception:  # unknown parents: the rank reads as outside local rank 0 (a refusal, not a guess)
        parents = []
    padding = [-1] * (ANCESTRY_DEPTH - len(parents))
    return np.array([node_rank, local_rank, os.getpid(), *parents, *padding], dtype=np.float64)


def ranks_outside_local_zero(rows: np.ndarray) -> list[int]:
    """The global ranks (row indices of every rank's :func:`process_row`) whose process is neither local rank
    0 of its node nor one of its descendants: what a codecarbon process-mode tracker on local rank 0 does not
    see (it follows its process and its children, recursively)."""
    heads = {int(row[0]): int(row[2]) for row in rows if int(row[1]) == 0}
    outside = []
    for rank, row in enumerate(rows):
        head = heads.get(int(row[0]))
        if int(row[1]) != 0 and (head is None or head not in row[3:].astype(np.int64).tolist()):
            outside.append(rank)
    return outside


def refuse_uncounted_processes(
    config: MeterConfig, cpu: str, ram: str, collective: Collective, node_rank: int, local_rank: int
) -> None:
    """Refuse (every rank alike, from one ``all_gather``) a DDP run whose CPU or RAM codecarbon may meter in
    ``"process"`` mode (``cpu="auto"`` too: codecarbon is its fallback after RAPL) while a rank runs outside
    local rank 0's process tree (``ddp_spawn``, torchrun, a cluster launcher). CPU and RAM are metered on
    local rank 0 only, as machine mode needs (it sees the whole node); in process mode that tracker sees its
    own process and its children only, so such a rank's energy would be silently missing (about half of it
    on two ranks). Metering each rank and summing is not done:
    the CPU chain's RAPL and constant meters are per node, and a rank whose codecarbon fell back to one
    would count the node once more. Under Lightning's `strategy="ddp"` from a script the other ranks are
    children of rank 0: counted, and allowed."""
    codecarbon_meters = cpu in ("auto", "codecarbon") or ram == "codecarbon"
    if config.codecarbon_tracking_mode != "process" or not codecarbon_meters or collective.world_size <= 1:
        return
    outside = ranks_outside_local_zero(collective.all_gather(process_row(node_rank, local_rank)))
    if outside:
        raise PulseRefusal(
            "EnergyLogger: `meters.codecarbon_tracking_mode`='process' under DDP meters CPU and RAM with one "
            "codecarbon tracker on local rank 0, which sees its own process and its child processes only; "
            f"rank(s) {outside} run in processes of their own (ddp_spawn, torchrun or a cluster launcher), "
            "so their CPU and RAM energy would be missing. Set `meters.codecarbon_tracking_mode` to "
            "'machine' (the whole node, metered once per node), or launch with `strategy=\"ddp\"` from a "
            "script (its ranks are child processes of rank 0)."
        )


def gpu_devices_of(
    device: torch.device, gpu: str, config: MeterConfig, local_rank: int = 0
) -> list[int | str]:
    """The NVML devices a process meters: none for ``gpu="none"``; ``config.gpu_devices`` (each once) on
    ``local_rank`` 0 and none on the node's other ranks; else the NVML index of the process's CUDA ``device``
    (none off CUDA). NVML indices and UUIDs name the node's physical devices, the same in every process of
    the node: metered on every rank, each listed GPU would be counted once per rank."""
    if gpu == "none":
        return []
    if config.gpu_devices is not None:
        return list(dict.fromkeys(config.gpu_devices)) if local_rank == 0 else []
    if device.type != "cuda":
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return nvml_devices_for_cuda([index])


def trainer_chains(
    trainer: Any, settings: Any, warn: Callable[[str], None], info: Callable[[str], None]
) -> list[MeterChain]:
    """The meter chains of a Trainer's process (:func:`build_chains`) for an EnergyLogger's ``settings`` (its
    ``meters``, ``gpu``, ``cpu``, ``ram`` and ``country_iso_code``): the GPU of the process's
    ``trainer.strategy.root_device`` (:func:`gpu_devices_of`; ``meters.gpu_devices`` on local rank 0 only),
    and the CPU and RAM on local rank 0 only (:func:`refuse_uncounted_processes` refuses, before, a process
    mode that would miss a rank)."""
    return build_chains(
        settings.meters,
        gpu_devices_of(trainer.strategy.root_device, settings.gpu, settings.meters, trainer.local_rank),
        settings.cpu,
        settings.ram,
        settings.country_iso_code,
        count_host=trainer.local_rank == 0,
        warn=warn,
        info=info,
    )


def report_folder(report_dir: str | None, trainer: Any, ended: bool, log_dir: Callable[[], str]) -> str:
    """Where EnergyLogger writes the report: ``report_dir``, else the run's own folder, ``log_dir()``
    (:func:`~lightning_pulse.loggers.run_folder`), else the Trainer's ``default_root_dir``. ``log_dir()``
    is a collective under DDP (a broadcast): it is read only when every rank ``ended`` its training (complete,
    suspended or stopped; not interrupted) or in a single process, never after an exception on one rank."""
    directory = report_dir
    if directory is None:
        directory = log_dir() if ended or trainer.world_size == 1 else None
    return directory or trainer.default_root_dir


def write_fit_report(
    report: dict[str, Any],
    directory: str,
    baseline: str | None,
    *,
    smoke_test: bool,
    writes: bool,
    info: Callable[[str], None],
    warn: Callable[[str], None],
) -> list[Path]:
    """Write EnergyLogger's ``report`` into ``directory``, compared against the ``baseline`` run
    (:func:`~lightning_pulse.energy.compare.write_report_compared`), where this process ``writes`` (the
    global rank 0); the paths written. With a baseline, one info line sets the time and energy ratios beside
    each final metric B against A (:func:`~lightning_pulse.energy.compare.comparison_line`). One warning
    where it replaces the report of another run than its
    ``run`` (the logger's run, :func:`~lightning_pulse.loggers.logger_run`). Under a ``smoke_test``
    (``fast_dev_run``) Lightning suppresses logging and checkpointing, so no file is written either (the
    report stays in EnergyLogger's ``.report``)."""
    if smoke_test:
        info("EnergyLogger: fast_dev_run: the energy report is not written (kept in `.report`).")
        return []
    if not writes:
        return []
    if (
        replacing := replaced_run_line(Path(directory) / JSON_NAME, report.get("run"), "EnergyLogger")
    ) is not None:
        warn(replacing)
    written = write_report_compared(report, directory, baseline, warn)
    if (compared := comparison_line(report.get("comparison"))) is not None:
        info(compared)
    return written


def guarded_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Run a hook of an object holding an :class:`EnergyAccount` as ``account`` (the EnergyLogger) so that a
    bug in the metering warns once and never fails the training run."""

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, *args, **kwargs)
        except Exception as error:
            self.account.warn_once(
                hook.__name__, f"EnergyLogger: {hook.__name__} failed ({type(error).__name__}: {error})."
            )
            return None

    guarded.__name__ = hook.__name__
    guarded.__qualname__ = hook.__qualname__
    guarded.__doc__ = hook.__doc__
    return guarded


def final_metrics(report: dict[str, Any]) -> dict[str, float]:
    """What is logged at the end of fit from the whole run's ``report``: ``energy/final_<figure>``, and the
    ratios against the baseline run as ``energy/vs_baseline_<figure>``; figures without a value are left out."""
    total = report["total"]
    names = {"final_kwh": "energy_kwh", "final_co2_kg": "co2_kg", "final_cost": "cost"}
    metrics = {f"energy/{name}": total[key] for name, key in names.items()}
    metrics["energy/final_duration_s"] = total["duration_s"]
    metrics.update(baseline_ratios(report.get("comparison")))
    return {k: float(v) for k, v in metrics.items() if v is not None}


def no_forecast_line(total_steps: float, optimizers: int) -> str | None:
    """Why a run whose batches make an unknown number of optimizer steps (manual optimization with
    ``optimizers`` > 1) gets no forecast of its energy when its length in steps is unknown too
    (``total_steps`` infinite); ``None`` when it is known."""
    if math.isfinite(total_steps):
        return None
    reason = UNKNOWN_STEPS_PER_BATCH.format(count=optimizers)
    return f"EnergyLogger: no forecast of the run's energy: {reason}; to get one, {STEPS_BOUND_ONLY}."


def forecast_message(forecast: dict[str, Any]) -> str:
    """The one line that announces :func:`~lightning_pulse.energy.ledger.predict_run`'s forecast."""
    co2 = f", {forecast['co2_kg']:.4g} kg CO2" if forecast["co2_kg"] is not None else ""
    run = f"the run from step {forecast['from_step']} on" if forecast.get("from_step") else "the whole run"
    return (
        f"EnergyLogger: forecast from {forecast['basis']}: {run} ({int(forecast['total_steps'])} "
        f"steps) needs about {forecast['energy_kwh']:.4g} kWh, {forecast['duration_s'] / 60:.1f} min{co2}."
    )


class EnergyAccount:
    """Energy, time, counts, CO2 and cost of one run, attributed to phases, cycles, epochs and stages.

    Args:
        intensity: carbon intensity, or ``None`` (no CO2).
        price: electricity price, or ``None`` (no cost).
        sampling_period: seconds between readings of the sampling thread.
        accounting: the sample and token counters.
        warn: called with one line per problem (each kind once).
        clock: monotonic seconds (injectable for tests).
        wall_clock: Unix seconds, for intensity and price.

    A fit is :meth:`start` ... :meth:`stop`; :meth:`state_dict` carries the whole run so far, so a resumed run
    reports all of it.
    """

    def __init__(
        self,
        intensity: Rate | None,
        price: Rate | None,
        sampling_period: float = 1.0,
        accounting: AccountingConfig | None = None,
        warn: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        accounting = accounting or AccountingConfig()
        self.intensity, self.price = intensity, price
        self.sampling_period = float(sampling_period)
        self.sample_counter, self.token_counter = accounting.sample_counter, accounting.token_counter
        self.warn = warn
        self.clock, self.wall_clock = clock, wall_clock
        self.carried: dict[str, Any] | None = None  # the whole run before this fit (from a checkpoint)
        self.resumed_runs = 0
        # the run's step this account's figures count from: 0, or where a new run's first fit started past 0
        # (added on a resume of a checkpoint saved without it, or a later fit of a Trainer, no checkpoint);
        # None until a new run's training starts (join_run)
        self.from_step: int | None = None
        # the carbon intensity and price each part of the run was counted with (see rate_parts)
        self.rate_parts: dict[str, list[dict[str, Any]]] = {name: [] for name in RATES}
        self._uncounted_before: tuple[str, ...] = ()  # the rates an old checkpoint's run had none of
        self._restored = False  # a checkpoint was loaded for the next fit (not during one)
        self._layouts_told_before: list[dict[str, Any]] = []  # the run's sample layouts, from a checkpoint
        self._settled_once = False
        self.prediction: dict[str, Any] | None = None
        self.ledger: EnergyLedger | None = None
        self.sampler: EnergySampler | None = None
        self.chains: list[MeterChain] = []
        self.disabled_reason: str | None = None
        self.global_zero = True
        self.fit_start_progress = (0, 0)  # (optimizer steps, batches) taken when this fit's training began
        self._logged_step, self._log_every = 0, 1  # the last step seen by due_step_metrics, its interval
        self._cycle: int | None = None  # the pulse cycle the training is in, for change_phase
        self._warned: set[str] = set()
        self._counter = BatchCounter()  # how each batch type's samples are counted, by the training loader(s)
        self._saved_total: dict[str, Any] | None = None  # the `total` bucket the latest state_dict held
        self._suspend_saved: tuple[str, dict[str, Any] | None] | None = None  # see saved_for_suspend
        self._reset()

    # ------------------------------------------------------------------ a fit
    def start(
        self,
        chains: Sequence[MeterChain] | Callable[[], Sequence[MeterChain]],
        global_zero: bool = True,
    ) -> None:
        """Start metering a fit with ``chains`` (or what calling it builds: a failure to build them then
        disables metering instead of raising); ``global_zero``: this process reports the carried run.

        A fit with no checkpoint loaded before it is a new run: the carried run, the forecast and the resume
        count of an earlier fit of this account are dropped (a second ``fit`` of the same EnergyLogger)."""
        if not self._restored:
            self.carried, self.prediction, self.resumed_runs = None, None, 0
            self.from_step, self.rate_parts = None, {name: [] for name in RATES}
            self._layouts_told_before = []
            for rate in (self.intensity, self.price):
                if rate is not None:
                    rate.run_start = None  # anchored again below, at this run's start
        self._restored = False
        self._settled_once = False  # the wait for a meter still starting, at an epoch end (once a fit)
        self._total_seen = False  # an epoch end had a figure of the run's energy (no wait needed after it)
        self._reset()
        self._warned, self._counter = set(), BatchCounter()
        self._suspend_saved = None
        self.global_zero = global_zero
        self.disabled_reason = None
        self.ledger = EnergyLedger(self.intensity, self.price)
        self.chains, self.sampler = [], None
        self.in_fit = True
        try:
            wall = self.wall_clock()
            for rate in (self.intensity, self.price):
                if rate is not None:
                    rate.anchor(wall)
            self.chains = list(chains() if callable(chains) else chains)
            self.sampler = EnergySampler(
                self.chains,
                self.ledger,
                self.sampling_period,
                clock=self.clock,
                wall_clock=self.wall_clock,
                warn=self.warn,
            )
            self.sampler.start()
            self.metering = True
        except Exception as error:
            self.disable(error)

    def stop(self) -> None:
        """Stop the thread, take a last reading, close the meters. Safe to call more than once."""
        sampler = self.sampler
        if sampler is not None and self.in_fit and self.metering:
            try:
                self._settle_meters(sampler)
            except Exception as error:
                self.warn_once("stop", f"EnergyLogger: stopping the meters failed ({error}).")
        self.metering = self.in_fit = False
        if sampler is not None:
            try:
                sampler.stop()
            except Exception as error:
                self.warn_once("stop", f"EnergyLogger: stopping the meters failed ({error}).")

    def disable(self, error: BaseException) -> None:
        """An unexpected error in our own machinery: stop metering, keep what was counted."""
        self.metering = False
        self.disabled_reason = f"{type(error).__name__}: {error}"
        self.warn_once(
            "disabled", f"EnergyLogger: energy metering stopped ({self.disabled_reason}); training goes on."
        )
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            try:
                sampler.stop(final_sample=False)
            except Exception:
                pass

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warn(message)

    # ------------------------------------------------------------------ labels and counts
    def mark(self, **changes: Any) -> None:
        """The label (``phase``, ``cycle``, ``epoch``, ``stage``) changes now. Only inside a fit: a later
        validation run must not add to a finished run's figures."""
        if self.ledger is not None and self.in_fit:
            now = self.clock()
            if self._last_batch_start is not None:  # inside a batch's end hooks (a phase change): its own
                self._loop_s += max(now - self._last_batch_start, 0.0)  # time ends here, in its label
                self._last_batch_start = None
            self.fold_counts()  # what was tallied so far belongs to the label that ends here
            self.ledger.mark(now, self.wall_clock(), **changes)

    def begin_training(
        self, step_counter: Callable[[], int], progress: tuple[int, int] = (0, 0), loader: Any = None
    ) -> None:
        """The training loop starts; ``step_counter()`` is the optimizer steps taken so far (a reader that
        holds no Trainer: a fit that raises leaves it in the account, which outlives the fit), ``progress``
        the run's ``(optimizer steps, batches)`` so far (a new run's forecast counts from there:
        :meth:`forecast_length`); ``loader`` the training DataLoader (or the several Lightning combines),
        whose batch size tells a time-major batch's samples
        (:class:`~lightning_pulse.energy.counting.BatchCounter`)."""
        self._counter = BatchCounter(loader, self._layouts_told_before)
        self.step_counter = step_counter
        self._counted_step = self._logged_step = step_counter()
        self.fit_start_progress = progress

    def join_run(
        self, step: int, resumed: bool, info: Callable[[str], None], warn: Callable[[str], None]
    ) -> None:
        """This fit's training starts at optimizer ``step`` (after :meth:`begin_training`); ``resumed``: the
        fit restored a checkpoint. A new run's figures count from there: past 0, ``info`` says why (an
        EnergyLogger added on a resume of a checkpoint saved without it; else a later fit of a Trainer that
        trained before, with no checkpoint: a new run, which counts that fit only). A rate that differs from
        the run's before adds a part to :attr:`rate_parts` from ``step`` on, said with ``info`` or ``warn``
        (:func:`~lightning_pulse.energy.rate_parts.extend_parts`); another currency is refused."""
        refuse_changed_currency(self.rate_parts["price"], self.price)  # a restore after set-up: first here
        if self.from_step is None:
            self.from_step = int(step)
            figures = "its figures (energy, CO2, cost, steps, samples) cover"
            if step > 0 and resumed:
                info(
                    f"EnergyLogger: added to this run at step {step}, with no state of its own from "
                    f"before: {figures} the run from step {step} on only, not the whole run; the report says "
                    "so (`figures_from_step`)."
                )
            elif step > 0:
                info(
                    f"EnergyLogger: this fit starts at step {step} with no checkpoint (a later `fit` of a "
                    f"Trainer that trained before): a new run, so {figures} this fit only, from step {step} "
                    "on, not the steps before; the report says so (`figures_from_step`). To count them, "
                    "resume from a checkpoint saved with the EnergyLogger."
                )
        total = (self.carried or {}).get("buckets", {}).get("total", {})
        for name, rate in (("intensity", self.intensity), ("price", self.price)):
            if not self.rate_parts[name]:  # a new run, or a version-1 checkpoint's with a rate: this one
                self.rate_parts[name].append(rate_part(rate, self.from_step))
                continue
            uncounted_kwh = float(total.get(UNCOUNTED_FIELD[name], 0.0)) / J_PER_KWH
            said = extend_parts(self.rate_parts[name], name, rate, step, uncounted_kwh)
            if said is not None:
                (warn if said[0] == "warn" else info)(said[1])

    def refuse_changed_currency(self) -> None:
        """Before :meth:`start` of a fit resumed from a checkpoint: refuse a price in another currency than
        the run's cost before it (:func:`~lightning_pulse.energy.rate_parts.refuse_changed_currency`)."""
        if self._restored:
            refuse_changed_currency(self.rate_parts["price"], self.price)

    def mark_training(self, phase: str, cycle: int | None, epoch: int) -> None:
        """The training loop starts in ``phase`` of pulse ``cycle`` (``None``: no pulse cycle) and ``epoch``
        (told here too: a fit resumed mid-epoch gets no ``on_train_epoch_start`` for the epoch it resumes in);
        a later phase change into a later cycle completes this one (:meth:`change_phase`)."""
        self._cycle = cycle
        self.mark(stage="train", phase=phase, cycle=cycle, epoch=epoch)
        self._open_epoch = epoch

    def start_epoch(self, epoch: int, collective: Collective | None = None) -> dict[str, float]:
        """``epoch`` starts: its label from now on; the wait for its first batch (the loader's iterator,
        workers starting) counts as a data-loader stall from here, the previous epoch's tail does not. Returns
        the figures of the epoch this closes (:meth:`closed_epoch_metrics`), to log (every rank calls it)."""
        closing, self._open_epoch = self._open_epoch, epoch
        self.mark(epoch=epoch)
        self.restart_gap()
        if closing is None or closing == epoch:  # a fit resumed at an epoch's start: none closes here
            return {}
        return self.closed_epoch_metrics(closing, collective)

    def close_last_epoch(self, collective: Collective | None = None) -> dict[str, float]:
        """After :meth:`end_training`: the figures of the fit's last epoch, which its end closed (every
        rank calls it)."""
        closing, self._open_epoch = self._open_epoch, None
        # a resumed fit that trained no batch (suspended again before its first) closes nothing: the fit
        # before logged that epoch's figures so far, and the fit that trains on in it logs them whole
        if closing is None or not self.batches_this_fit:
            return {}
        return self.closed_epoch_metrics(closing, collective)

    def closed_epoch_metrics(self, epoch: int, collective: Collective | None = None) -> dict[str, float]:
        """``energy/epoch_*`` of ``epoch`` once its label has ended (the next epoch's start, or the end of
        training): the reading taken here closes its last interval, so they are the report's, final. At
        the epoch-end hook they were not: the epoch goes on after it (the epoch-end hooks of the callbacks
        after EnergyLogger, a checkpoint save; the last epoch until training ends), and the next reading
        credited that tail, at its own power, to the epoch already logged (up to 35% on sub-second epochs
        with codecarbon). Never raises: a bug here warns once and training goes on."""
        key = f"epoch/{epoch}"
        try:
            bucket = self.snapshot(collective, keys=lambda name: name == key)["buckets"].get(key)
            if bucket is None:
                return {}
            row = bucket_figures(bucket, self.intensity is not None, self.price is not None)
        except Exception as error:
            self.warn_once("closed epoch", f"EnergyLogger: the closed epoch's figures failed ({error!r}).")
            return {}
        names = ("energy_kwh", "avg_power_w", "co2_kg", "cost", "stall_share")
        return _present({f"energy/epoch_{name.replace('energy_', '')}": row[name] for name in names})

    def change_phase(self, phase: str, cycle: int, after_phase: bool) -> int | None:
        """The pulse cycle's phase changes to ``phase`` of ``cycle``: the energy from now on belongs to it.
        Returns the cycle this change completed, whose figures are then due: the one the training was in,
        when the change comes ``after_phase`` (a phase before it) and enters a later cycle; else ``None``.
        A change with no phase before it into the phase and cycle already marked (a StabilityGuard rollback
        tells every listener its phase again) changes nothing: no label, no gap restarted, no cycle."""
        label = None if self.ledger is None else self.ledger.label
        if not after_phase and cycle == self._cycle and (label is None or label.phase == phase):
            return None
        self.mark(phase=phase, cycle=cycle)
        self.restart_gap()  # after the probe (if any): the fetch of the next batch is still a data wait
        finished, self._cycle = self._cycle, cycle
        if after_phase and finished is not None and cycle > finished:
            return finished
        return None

    def forecast_length(self, run_length: tuple[float, float], world_size: int = 1) -> tuple[float, float]:
        """The ``(steps, batches)`` of ``run_length`` (the whole run's; batches on one of ``world_size``
        ranks) that a forecast scales the figures to: all of them for a resumed run, whose figures hold its
        part before the resume; a new run (no checkpoint restored into the account) counts this fit only, so
        its forecast is of this fit's steps, not those an earlier fit of the same Trainer took (before
        :meth:`begin_training`'s ``progress``). The batches are every rank's, as the ledger counts them."""
        steps, batches = run_length
        if self.carried is None:
            steps_before, batches_before = self.fit_start_progress
            steps, batches = steps - steps_before, batches - batches_before
        return steps, batches * world_size

    def skip_gap(self) -> None:
        """The time from now holds something else (a validation run): no data wait, until
        :meth:`restart_gap` (or the next batch's end) opens the gap again."""
        self._last_batch_end = None

    def end_validation(self, in_train_loop: bool) -> None:
        """A fit's validation run (not its sanity check) ended: back to training (``other`` outside its
        loop); the fetch of the next training batch, which Lightning runs after it, counts as a wait."""
        self.mark(stage="train" if in_train_loop else "other")
        self.restart_gap()

    def restart_gap(self) -> None:
        """What ran since the last batch's end (a validation run, a phase change's probe, a pause, an epoch's
        start hooks) is no data wait, but the wait for the next batch from now on is: Lightning fetches it
        after them. Dropping the gap instead lost that fetch (with phases of 1-2 steps, most of the waits)."""
        self._last_batch_end = self.clock()

    @contextmanager
    def not_training(self) -> Iterator[None]:
        """A pause is no training (GreenWindow's ``when_dirty="pause"``): it is booked to stage ``other``, in
        no phase, cycle or epoch (the label a pause before its training loop starts has), then the label it
        had comes back. Else a pause inside an epoch was charged to the training stage, its phase and epoch,
        and the first epoch's forecast scaled the idle hours up to the whole run."""
        label = None if self.ledger is None else self.ledger.label
        if label is None:
            yield
            return
        self.mark(stage="other", phase=None, cycle=None, epoch=None)  # as `end_training`
        try:
            yield
        finally:
            self.mark(stage=label.stage, phase=label.phase, cycle=label.cycle, epoch=label.epoch)
            self.restart_gap()  # the time since the last batch's end holds the pause, not a data-loader wait

    def batch_started(self, batch: Any, batch_idx: int = 0) -> None:
        """A training batch starts: the data-loader wait before it; its samples and tokens are counted by
        :meth:`count_batch`. ``batch_idx``: its index in the epoch (which batches tell a layout for good:
        :class:`~lightning_pulse.energy.counting.BatchCounter`).

        Runs on every batch: plain-number tallies only, folded into the ledger at the next label change or
        read-out. A token count on the device stays pending (reading it would synchronise a GPU).
        """
        now, gap = self.clock(), self._last_batch_end
        if gap is not None and now > gap:  # the loop's time: each wait (a stall)...
            self._stall_s += now - gap
            self._loop_s += now - gap
        self._last_batch_start = now
        self._batches += 1
        self.batches_started_this_fit += 1
        self._uncounted, self._uncounted_index = batch, batch_idx

    def drop_batch_in_flight(self) -> None:
        """The batch that started and reached no backward (an exception in its forward) trained nothing: it is
        not counted at the read-out that follows (nor among the batches whose tokens are known)."""
        if self._uncounted is not None:  # nothing folded it yet: fold_counts counts the batch first
            self._batches -= 1
        self._uncounted = None

    def interrupted(self) -> str | None:
        """The fit raised: drop the batch in flight (:meth:`drop_batch_in_flight`) and stop metering. Where
        the fit stopped when none of its training batches trained (:meth:`nothing_trained`: no run to report
        on), else ``None``."""
        self.drop_batch_in_flight()
        self.stop()
        return self.nothing_trained()

    def count_batch(self) -> None:
        """Count the samples and tokens of the batch that started, once: at its backward, so a batch another
        callback cut in place at its start counts as it trained, whatever the callbacks' order (else at its end)."""
        batch, self._uncounted = self._uncounted, None
        if batch is None:
            return
        self.batches_counted_this_fit += 1
        try:
            if self.sample_counter is not None:
                samples = int(self.sample_counter(batch))
                tokens = self.token_counter(batch) if self.token_counter else self._counter.tokens(batch)
            else:  # the layout is decided at a batch type's first batch, then only applied
                samples, tokens = self._counter.count(batch, self._doubted, self._uncounted_index)
                if self.token_counter is not None:
                    tokens = self.token_counter(batch)
        except Exception as error:  # a counter that cannot read a batch must not stop training
            self.warn_once(
                "counter", f"EnergyLogger: could not count the batch ({type(error).__name__}: {error})."
            )
            self._flight = (self.batches_started_this_fit, self.batches_this_fit, 0, None)
            return
        # what a checkpoint saved before the batch's step ran through leaves out (_batch_in_flight_left_out)
        self._flight = (self.batches_started_this_fit, self.batches_this_fit, samples, tokens)
        if type(samples) is int:
            self._samples += samples
        else:  # a graph count as a tensor: read at the next read-out, not every step (a GPU synchronisation)
            pending = self._pending_samples_now
            self._pending_samples_now = samples if pending is None else pending + samples
        if tokens is None:
            return
        if type(tokens) is int:
            self._tokens += tokens
        elif isinstance(tokens, torch.Tensor):
            pending = self._pending_now
            self._pending_now = tokens.detach() if pending is None else pending + tokens.detach()
        else:
            self._tokens += int(tokens)
        self._token_batches += 1

    def nothing_trained(self) -> str | None:
        """Where a fit that raised stopped, when none of its training batches trained (reached its backward
        or its end): no run to report on; ``None`` once one did (then even a batch whose end hooks failed,
        after its optimizer step, is reported). Read after :meth:`drop_batch_in_flight`."""
        if self.batches_this_fit or self.batches_counted_this_fit:
            return None
        if self.batches_started_this_fit:  # it raised before its backward
            return "in its first training batch, before its backward (nothing trained)"
        return "before its first training batch"  # a refusal at fit start, or a crash before the first batch

    def _doubted(self, key: str, why: str) -> None:
        self.warn_once(key, f"EnergyLogger: {why}")

    def batch_ended(self) -> None:
        self.count_batch()  # a batch with no backward (its step returned None) counts as loaded
        self._last_batch_end = now = self.clock()
        if self._last_batch_start is not None:  # ... plus each batch's own time (unless a mark cut it)
            self._loop_s += now - self._last_batch_start
            self._last_batch_start = None
        self.batches_this_fit += 1

    def end_training(self, collective: Collective | None = None) -> None:
        """The training loop ended (every rank calls it): settle a meter still starting, before the report.
        Under DDP, where any rank has one, every rank waits for the others inside the start-up bucket: a rank
        whose meters are running would otherwise wait for a starting one in the report's first collective, in
        its own time. Ranks only skewed in time wait in ``"other"``, as in the report's collectives.

        :meth:`energy_so_far_kwh` gives the run's figure at this point from then on (see there)."""
        self.mark(stage="other", phase=None, cycle=None, epoch=None)
        try:
            self._settle_together(collective, after="other")  # the report follows
        finally:
            self.step_counter = None
            try:
                self._ended_kwh = self.kwh_now()
            except Exception as error:
                self.disable(error)
                self._ended_kwh = self.metered_kwh()

    def _settle_together(self, collective: Collective | None, after: str) -> bool:
        """Wait for a meter still starting, on any rank, every rank inside the start-up bucket, then label
        the time ``after`` (a stage); whether any rank had one. Every rank calls it at the same point: under
        DDP it asks every rank, unconditionally (the same collectives everywhere)."""
        sampler = self.sampler
        starting = sampler is not None and any(chain.starting for chain in sampler.chains)
        if not self._single(collective):
            assert collective is not None
            starting = bool(collective.all_gather(np.array([float(starting)])).any())
        if not starting:
            return False
        self.mark(stage=STARTUP_STAGE)
        try:
            if sampler is not None:  # a meter that started in the background must count
                try:
                    self._settle_meters(sampler)
                except Exception as error:
                    self.disable(error)
            if not self._single(collective):
                assert collective is not None
                collective.all_gather(np.zeros(1))  # every rank, once the slowest settled
        finally:
            self.mark(stage=after)
        return True

    @staticmethod
    def _single(collective: Collective | None) -> bool:
        return collective is None or collective.world_size == 1

    def _settle_meters(self, sampler: EnergySampler) -> None:
        """Wait for a meter still starting in the background (codecarbon's hardware detection, about 1.6 s in
        a process's first fit), then take the reading that holds its backlog. Called at the first epoch end
        that finds it starting, and at the end of training. The wait is the instrumentation's
        start-up, not the run's cost: it is booked to the ``meter_startup`` bucket, outside the run's total,
        stages, phases, cycles and epochs (so two identical runs compare at 1x whichever paid it), and the
        report shows it on its own line. The backlog is spread by time over the run and the wait. A start
        still running after :data:`~lightning_pulse.energy.sampler.STARTING_WAIT_S` is given up: the reading
        falls back to the next meter (``meters.cpu_watts`` or codecarbon's generic CPU) from the start on."""
        if not any(chain.starting for chain in sampler.chains):
            return
        ledger = self.ledger
        stage = ledger.label.stage if ledger is not None else "other"
        self.mark(stage=STARTUP_STAGE)
        try:
            sampler.settle()
            sampler.sample()
        finally:
            self.mark(stage=stage)

    def fold_counts(self) -> None:
        """Move the per-batch tallies into the ledger under the current label. Optimizer steps are the
        growth of the step counter since the last fold (never negative: a step taken back is not counted)."""
        self.count_batch()  # a read-out between a batch's start and its backward: it started, so it counts
        ledger = self.ledger
        if ledger is None:
            return
        steps = 0
        if self.step_counter is not None and self._counted_step is not None:
            step = self.step_counter()
            if step > self._counted_step:
                steps, self._counted_step = step - self._counted_step, step
        if not (self._batches or steps):
            return
        keys = ledger.current_keys()
        ledger.add_counts(
            keys,
            batches=self._batches,
            samples=self._samples,
            tokens=self._tokens,
            token_batches=self._token_batches,
            stall_s=self._stall_s,
            loop_s=self._loop_s,
            steps=steps,
        )
        for now, pending in (
            (self._pending_now, self._pending),
            (self._pending_samples_now, self._pending_samples),
        ):
            if now is not None:
                earlier = pending.get(keys)
                pending[keys] = now if earlier is None else earlier + now
        self._batches = self._samples = self._tokens = self._token_batches = 0
        self._stall_s = self._loop_s = 0.0
        self._pending_now = self._pending_samples_now = None

    # ------------------------------------------------------------------ read-outs
    def energy_so_far_kwh(self) -> float:
        """Energy metered by this process so far, in kWh (plus, on global rank 0 of a resumed run, the run
        before the resume), without the meter start-up (:meth:`_settle_meters`), as the report's total.
        Between readings it grows with the latest average power, so consecutive calls see a smooth, never
        decreasing value. Never raises.

        Once the training loop has ended, the run's figure at its end, exact: not the fit's shut-down after
        it, nor an extrapolation a little above it. The report, whose reading comes a moment later, may hold
        a little more."""
        if self._ended_kwh is not None:
            return self._ended_kwh
        try:
            sampler = self.sampler
            if sampler is not None and not sampler.running:  # no thread: read here, at most once a period
                last = sampler.last_sample_time
                if last is None or self.clock() - last >= self.sampling_period:
                    sampler.sample()
            if self.ledger is None:
                joules = 0.0
            elif self.metering:
                joules = self.ledger.estimate_joules(self.clock())
            else:  # metering has ended: the final figure, no extrapolation
                joules = self.ledger.run_reading[0]
        except Exception as error:
            self.disable(error)
            joules = self.ledger.run_reading[0] if self.ledger is not None else 0.0
        value = max(joules / J_PER_KWH + self.carried_kwh(), self._last_so_far_kwh)
        self._last_so_far_kwh = value
        return value

    def has_reading(self) -> bool:
        """Whether a meter has counted yet: before that (codecarbon still starting in the background),
        :meth:`energy_so_far_kwh` holds no measured growth, so a difference of two of its values is
        unknown."""
        return self.ledger is not None and self.ledger.counted

    def metered_kwh(self) -> float:
        """The run's energy at the latest reading (no extrapolation, no meter start-up), carried run included
        on global rank 0."""
        joules = self.ledger.run_reading[0] if self.ledger is not None else 0.0
        return joules / J_PER_KWH + self.carried_kwh()

    def kwh_now(self) -> float:
        """:meth:`metered_kwh` after a fresh reading of the meters (while metering): the energy up to this
        moment, as the meters counted it, not an extrapolation."""
        if self.sampler is not None and self.metering:
            self.sampler.sample()
        return self.metered_kwh()

    def carried_kwh(self) -> float:
        if not self.carried or not self.global_zero:
            return 0.0
        total = self.carried.get("buckets", {}).get("total", {})
        return sum(float(total.get(f"{c}_j", 0.0)) for c in COMPONENTS) / J_PER_KWH

    @property
    def last_reading_time(self) -> float | None:
        return None if self.ledger is None else self.ledger.last_reading_time

    def step_metrics(self) -> dict[str, float] | None:
        """``energy/kwh_so_far`` and, from the second call on, ``energy/power_w`` since the previous call: the
        run's figures at the latest reading, without the meter start-up's energy and seconds (the report's
        total leaves them out too, so the last ``kwh_so_far`` is never above it). No ``power_w`` for an
        interval with a reading that counted part of the energy only (a component's meters lost): a partial
        figure has no average power, as in the report."""
        ledger = self.ledger
        if ledger is None or not ledger.counted:
            # no meter has counted anything yet (codecarbon still starting: its zero point only): no figure,
            # rather than a 0 that reads as measured
            return None
        joules, seconds, partial = ledger.run_reading_gaps
        metrics = {"energy/kwh_so_far": joules / J_PER_KWH + self.carried_kwh()}
        previous = self._last_step_log
        if previous is not None and seconds > previous[1] and partial == previous[2]:
            metrics["energy/power_w"] = (joules - previous[0]) / (seconds - previous[1])
        self._last_step_log = (joules, seconds, partial)
        return metrics

    def log_steps_every(self, own: int | None, trainers: int) -> None:
        """:meth:`due_step_metrics` gives the step figures at each optimizer step that is a multiple of the
        interval, ``own`` (``accounting.log_every_n_steps``) or else the Trainer's ``log_every_n_steps``
        (``trainers``), after the step the training loop began at (:meth:`begin_training`); at none for the
        Trainer's ``0``, Lightning's "no step-level logging" (:func:`~.step_rows.step_rows_every`)."""
        self._log_every = step_rows_every(own, trainers)

    def due_step_metrics(self, global_step: int) -> dict[str, float] | None:
        """:meth:`step_metrics` at the first batch end of optimizer step ``global_step`` when it is a multiple
        of the interval (:meth:`log_steps_every`); ``None`` at any other batch end (a step already seen, as
        under gradient accumulation, or one between two logged steps)."""
        if global_step <= self._logged_step:
            return None
        self._logged_step = global_step
        if not is_step_row(global_step, self._log_every):  # 0: Lightning's "no step-level logging"
            return None
        return self.step_metrics()

    def progress_text(self) -> str:
        """The progress bar's figure; it changes only with a reading, so it is formatted once per reading.
        ASCII (``n/a`` before the first reading): Lightning's TQDM bar writes to ``sys.stdout``, which raises
        on a character its encoding (Latin-1, ASCII) lacks."""
        at = self.last_reading_time
        if at is None or at != self._progress_at:
            metered = self.ledger is not None and self.ledger.counted
            self._progress_at, self._progress_text = at, f"{self.metered_kwh():.3g}" if metered else "n/a"
        return self._progress_text

    def snapshot(
        self,
        collective: Collective | None = None,
        timeline: bool = True,
        keys: Callable[[str], bool] | None = None,
    ) -> dict[str, Any]:
        """The whole run so far, all ranks: carried run + this fit (collective when ``collective`` has more
        than one process). ``timeline=False`` gives the figures only; ``keys`` keeps only the buckets whose
        key passes it (figures only)."""
        if self.sampler is not None:
            try:
                self.sampler.sample()
            except Exception as error:
                self.disable(error)
        if keys is not None:
            timeline = False
        if collective is None or collective.world_size <= 1:
            current = self._local_snapshot(timeline=timeline, keys=keys)
        else:
            current = self._world_snapshot(collective, timeline, keys)
        carried = self.carried
        if not timeline:
            earlier = None
            if carried:
                wanted = {k: row for k, row in carried["buckets"].items() if keys is None or keys(k)}
                earlier = {"buckets": wanted}
            return merge_snapshots(earlier, current)
        events = sorted((event for chain in self.chains for event in chain.events), key=lambda e: e.elapsed_s)
        current["events"] = [event.to_dict() for event in events]
        return merge_snapshots(carried, current)

    def epoch_metrics(
        self,
        epoch: int,
        total_steps: float,
        collective: Collective | None = None,
        total_batches: float | None = None,
    ) -> tuple[dict[str, float], dict[str, Any] | None]:
        """The figures logged at an epoch end, and the run's forecast when this epoch made the first one
        (``total_batches``: the run's batches, all ranks together; see :func:`predict_run`)."""
        epoch_key = f"epoch/{epoch}"
        self._settle_for_total(collective)
        snapshot = self.snapshot(
            collective, keys=lambda key: key == "total" or key == epoch_key or key.startswith("phase/")
        )
        buckets = snapshot["buckets"]
        buckets.setdefault("total", {})
        groups = grouped_figures(buckets, self.intensity is not None, self.price is not None)
        row = groups["epochs"].get(str(epoch))  # its figures are logged when it closes: closed_epoch_metrics
        metrics: dict[str, float | None] = {}
        total = groups["total"]
        # the same on every rank (combined over ranks), as the condition of the wait must be
        self._total_seen = self._total_seen or total["energy_kwh"] is not None
        self.warn_if_unmetered(total)
        metrics.update(
            {
                "energy/total_kwh": total["energy_kwh"],
                "energy/total_co2_kg": total["co2_kg"],
                "energy/total_cost": total["cost"],
                "energy/j_per_sample": total["energy_per_sample_j"],
                "energy/j_per_token": total["energy_per_token_j"],
            }
        )
        for phase, figures in groups["phases"].items():
            metrics[f"energy/{phase}_kwh"] = figures["energy_kwh"]
            metrics[f"energy/{phase}_stall_share"] = figures["stall_share"]
        forecast = None
        if self.prediction is None and row is not None:
            forecast = self.prediction = predict_run(
                buckets[epoch_key],
                total_steps,
                self.intensity is not None,
                self.price is not None,
                epoch,
                steps_done=buckets["total"].get("steps"),
                total_batches=total_batches,
            )
            if forecast is not None:
                if self.from_step:  # joined the run there: the forecast is of the rest of it
                    forecast["from_step"] = self.from_step
                metrics["energy/predicted_kwh"] = forecast["energy_kwh"]
                metrics["energy/predicted_duration_s"] = forecast["duration_s"]
                metrics["energy/predicted_co2_kg"] = forecast["co2_kg"]
        return _present(metrics), forecast

    def running_total_kwh(self, collective: Collective | None = None) -> float | None:
        """``energy/total_kwh`` between epoch ends, for a monitor that reads it there (a fit-time validation,
        a ``ModelCheckpoint(every_n_train_steps=...)`` save): the run's energy so far, all ranks combined, the
        figure an epoch end would give at this moment, after the same wait for a meter still starting
        (``None``: nothing metered). Every rank calls it at the same point (under DDP it gathers)."""
        self._settle_for_total(collective)
        buckets = self.snapshot(collective, keys=lambda key: key == "total")["buckets"]
        total = grouped_figures(
            {"total": buckets.get("total", {})}, self.intensity is not None, self.price is not None
        )["total"]
        self._total_seen = (
            self._total_seen or total["energy_kwh"] is not None
        )  # combined: the same everywhere
        return total["energy_kwh"]

    def _settle_for_total(self, collective: Collective | None) -> None:
        """Before a read-out of the monitored total (an epoch end, :meth:`running_total_kwh`): wait for a
        meter still starting, once a fit, so that the total exists."""
        single = self._single(collective)
        if not self._settled_once and (self.metering if single else not self._total_seen):
            # a meter still starting in the background (a first epoch shorter than codecarbon's start) has no
            # reading yet: wait for it here, off the run's figures, so the epoch logs an estimate rather than
            # no figure (a monitored `energy/total_kwh` must exist) or a 0 nobody measured. Once a fit: a
            # start that hangs costs its timeout once, not at every epoch end. Under DDP every rank waits,
            # together (one `all_gather` asks whether any rank's meter is starting, at each epoch end until
            # the run has a figure): a rank that waited alone would make the others wait for it in the next
            # collective, inside their training time, and a rank that did not wait would log no figure. The
            # condition is the same on every rank (`metering` may not be: a rank can be disabled alone)
            # A start that does not finish within the wait is given up there: its chain falls back (one
            # warning) to an estimate over the whole span, never a 0 that no meter counted
            if self._settle_together(collective, after=self.ledger.label.stage if self.ledger else "other"):
                self._settled_once = True

    def cycle_metrics(self, cycle: int, collective: Collective | None = None) -> dict[str, float] | None:
        """The figures of a completed pulse cycle (``None`` if it has no bucket)."""
        row = self._cycle_row(cycle, collective)
        return None if row is None else _cycle_present(cycle, row)

    def close_cycle(self) -> int | None:
        """After :meth:`end_training`: the pulse cycle training ended in, whose figures are then due as a
        completed cycle's (:meth:`due_cycle_rows`); ``None`` without a pulse cycle, or for a fit that trained
        no batch. A fit resumed in that cycle logs it whole once complete (a later row at a later step: the
        last row of a cycle is its figure, as for an epoch)."""
        cycle, self._cycle = self._cycle, None
        return cycle if self.batches_this_fit else None

    def due_cycle_rows(
        self, completed: int | None, step: int, collective: Collective | None = None, settled: bool = False
    ) -> list[tuple[dict[str, float], int]]:
        """The cycle figures due to the loggers, each with its step: those of cycle ``completed``
        at ``step`` (``None``: none completed), after those of the cycles that completed before the meters'
        first reading (codecarbon starting in the background, about 1.6 s in a process's first fit) and waited
        for it. Logged at once, they would have been a lone ``energy/cycle``, though that reading gives them
        energy. ``settled``: the meters have settled (an epoch end, the end of training), so a cycle still
        without energy never gets any (nothing metered): no row. Nor does a cycle with no training step
        (entered at the fit's last step, its bucket holds the validation after it). Every rank calls it: the
        collectives, and what waits, follow figures combined over the ranks, the same on every rank."""
        if completed is not None:
            self._pending_cycles.append((completed, step))
        rows: list[tuple[dict[str, float], int]] = []
        while self._pending_cycles:
            cycle, at = self._pending_cycles[0]
            row = self._cycle_row(cycle, collective)
            if row is not None and row["energy_kwh"] is None and not settled:
                break  # no reading yet: none after it has one either (the first gives all before it energy)
            self._pending_cycles.pop(0)
            if row is not None and row["energy_kwh"] is not None and row["steps"] > 0:
                rows.append((_cycle_present(cycle, row), at))
        return rows

    def warn_if_unmetered(self, total: dict[str, Any]) -> None:
        """One warning when the run's energy is *none* (no meter counted anything) once no meter is still
        starting: its energy figures are then null in the report and not logged, never a 0 that reads as
        a measurement."""
        if self.disabled_reason is not None or total.get("energy_method") != NONE:
            return  # a disabled account has said so already
        if any(chain.starting for chain in self.chains):
            return
        self.warn_once(
            "unmetered",
            "EnergyLogger: no meter counted any energy (see the lines above, or no component is metered: "
            f"gpu/cpu/ram meters {[chain.meter_name for chain in self.chains] or 'none'}); energy, CO2 and "
            "cost are null in the report and no energy/*_kwh, *_co2_kg or *_cost metric is logged.",
        )

    def report(
        self, status: str, currency: str, collective: Collective | None = None, num_nodes: int = 1
    ) -> dict[str, Any]:
        """The JSON-ready report of the whole run so far."""
        report = self._assemble(status, currency, collective, num_nodes)
        self.warn_if_unmetered(report["total"])
        return report

    def _assemble(
        self, status: str, currency: str, collective: Collective | None, num_nodes: int
    ) -> dict[str, Any]:
        return assemble_report(
            self.snapshot(collective),
            status=status,
            world_size=1 if collective is None else collective.world_size,
            num_nodes=num_nodes,
            sampling_period_s=self.sampling_period,
            resumed_runs=self.resumed_runs,
            from_step=self.from_step,
            rate_parts=self.rate_parts,
            meters=self.meter_descriptions(1 if collective is None else collective.world_size),
            intensity=self.intensity,
            price=self.price,
            currency=currency,
            prediction=self.prediction,
            counting=self.counting_notes(),
            disabled=self.disabled_reason,
        )

    def counting_notes(self) -> dict[str, str]:
        """:data:`COUNTING_NOTES`, the samples' as this fit's batches were counted (a doubt said)."""
        if self.sample_counter is not None:
            return {**COUNTING_NOTES, "samples": "the `sample_counter` given, for each training batch."}
        described = self._counter.described()
        if described is None:
            return COUNTING_NOTES
        return {**COUNTING_NOTES, "samples": f"{described} (every micro-batch), summed over ranks."}

    def meter_descriptions(self, world_size: int = 1) -> dict[str, Any]:
        chains = {chain.component: chain for chain in self.chains}
        described = {}
        for component in COMPONENTS:
            chain = chains.get(component)
            described[component] = (
                chain.describe() if chain is not None else {"meter": "none", "method": "none"}
            )
            # a GPU chain is required where `meters.gpu_devices` names the node's devices: metered once a node
            per_rank = component == "gpu" and (chain is None or not chain.required)
            counted_on = "every rank, summed" if per_rank else "local rank 0 of each node"
            process_mode = described[component].get("tracking_mode") == "process"
            if process_mode and world_size > 1:  # refused where it misses a rank
                counted_on += ", its process and child processes (any other rank of the node among them)"
            described[component]["counted_on"] = counted_on
        return described

    # ------------------------------------------------------------------ checkpoints
    def state_dict(
        self, collective: Collective | None = None, batch_in_flight: bool = False
    ) -> dict[str, Any]:
        """The whole run so far, for a checkpoint. ``batch_in_flight``: it is saved inside a training step
        that a resume from it trains again (``compat.in_unfinished_step``): the batch in flight is left out
        (:meth:`_batch_in_flight_left_out`), so the resume counts it once."""
        with self._batch_in_flight_left_out(batch_in_flight):
            snapshot = self.snapshot(collective) if self.ledger is not None else self.carried
        total = (snapshot or {}).get("buckets", {}).get("total")
        self._saved_total = None if total is None else dict(total)
        return {
            "version": 2,
            "snapshot": snapshot,
            "resumed_runs": self.resumed_runs,
            "prediction": self.prediction,
            "intensity": None if self.intensity is None else self.intensity.state_dict(),
            "price": None if self.price is None else self.price.state_dict(),
            "from_step": self.from_step,
            "rates": {name: [dict(part) for part in parts] for name, parts in self.rate_parts.items()},
            # before this fit's training, the counter is empty: the run's layouts are still those restored
            "sample_layouts": self._counter.state_dict() or list(self._layouts_told_before),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # loaded before a fit, it makes that fit a resume (kept by `start`); loaded during one (strategies
        # that restore after set-up), it applies to the fit in progress
        self._restored = not self.in_fit
        self.carried = state_dict.get("snapshot")
        self.resumed_runs = int(state_dict.get("resumed_runs", 0)) + 1
        self.prediction = state_dict.get("prediction")
        for rate, key in ((self.intensity, "intensity"), (self.price, "price")):
            if rate is not None and state_dict.get(key):
                rate.load_state_dict(state_dict[key])
        self.from_step = int(state_dict.get("from_step") or 0)  # version 1: from the run's start
        self._layouts_told_before = list(state_dict.get("sample_layouts") or [])  # none before this version
        rates = state_dict.get("rates")
        if isinstance(rates, dict):
            self.rate_parts = {name: [dict(part) for part in rates.get(name, [])] for name in RATES}
            self._uncounted_before = ()
        else:  # version 1 kept no parts: a rate its run had none of counted none of its energy
            self._uncounted_before = tuple(
                name for name in RATES if name in state_dict and not state_dict[name]
            )
            self.rate_parts = {
                name: [rate_part(None, 0)] if name in self._uncounted_before else [] for name in RATES
            }
            _mark_uncounted(self.carried, self._uncounted_before)

    # ------------------------------------------------------------------ a suspend's checkpoint
    def saved_for_suspend(self, checkpoint: str | os.PathLike) -> None:
        """A checkpoint was just saved to ``checkpoint`` with :meth:`state_dict`'s latest figures, and the fit
        stops after it (GreenWindow's suspend): :meth:`carry_past_checkpoint` writes, at the fit's end, the
        whole run's figures next to it, for the fit that resumes from it (:meth:`extend_carried`)."""
        self._suspend_saved = (str(checkpoint), self._saved_total)

    @property
    def suspended(self) -> bool:
        """This fit saved a suspend checkpoint and stops (:meth:`saved_for_suspend`), until its figures are
        carried (:meth:`carry_past_checkpoint`)."""
        return self._suspend_saved is not None

    def carry_past_checkpoint(
        self, collective: Collective | None = None, writes: bool = True, warn: Callable[[str], None] = print
    ) -> None:
        r"""At the end of a fit that was suspended (:meth:`saved_for_suspend`; every rank calls it, a
        collective under DDP), after its report: write the whole run's figures next to the checkpoint
        (``writes``: rank 0), so that the resumed run also counts what this fit used after the checkpoint
        (Lightning's validation after the stop, the shut-down), once; ``warn``\ s when it cannot."""
        if self._suspend_saved is None:
            return
        (checkpoint, base), self._suspend_saved = self._suspend_saved, None
        snapshot = self.state_dict(collective)["snapshot"]  # taken after the report's: never below it
        if not writes or base is None or snapshot is None:
            return
        try:
            write_carry(checkpoint, base, snapshot)
        except (OSError, TypeError, ValueError) as error:  # a suspended run's figures must not fail its end
            warn(
                f"EnergyLogger: could not write {carry_path(checkpoint)} ({error}); a fit resumed from "
                f"{checkpoint} will not count the energy this fit used after saving it."
            )

    def extend_carried(
        self, checkpoint: str | os.PathLike | None, info: Callable[[str], None] = print
    ) -> None:
        """Before :meth:`start` of a fit resumed from ``checkpoint``: where a suspended fit left its whole
        figures next to it (:meth:`carry_past_checkpoint`), continuing the figures the checkpoint holds, the
        run carried is those (the energy after the checkpoint included, once), and ``info`` says so."""
        if not self._restored or not self.carried or checkpoint is None:
            return
        snapshot = read_carry(checkpoint, self.carried.get("buckets", {}).get("total"))
        if snapshot is None:
            return
        before = sum(float(self.carried["buckets"]["total"].get(f"{c}_j", 0.0)) for c in COMPONENTS)
        after = sum(float(snapshot["buckets"].get("total", {}).get(f"{c}_j", 0.0)) for c in COMPONENTS)
        self.carried = snapshot
        _mark_uncounted(self.carried, self._uncounted_before)
        info(
            f"EnergyLogger: the suspended fit used {(after - before) / J_PER_KWH:.3g} kWh after saving its "
            f"checkpoint (Lightning's validation after the stop, its shut-down): counted from "
            f"{carry_path(checkpoint).name}."
        )

    # ------------------------------------------------------------------ internals
    @contextmanager
    def _batch_in_flight_left_out(self, in_flight: bool) -> Iterator[None]:
        """Within it, where ``in_flight`` (a checkpoint saved inside a step its resume trains again) and this
        fit's batch in flight started here: the tallies without that batch, its samples, its tokens and its
        count as a batch (counted or not yet: a save before its backward); put back after, so this fit counts
        it as before. Its time and energy were spent, and stay. A read-out inside folds the tallies, so the
        batch leaves the ledger (under the labels of the moment) and comes back at the next fold."""
        flight, batch = self._flight, self._uncounted
        if not in_flight or self.ledger is None:
            yield
            return
        if batch is not None:  # started, not counted yet: the read-out must not count it
            samples, tokens = 0, None
        elif flight is not None and flight[:2] == (self.batches_started_this_fit, self.batches_this_fit):
            samples, tokens = flight[2:]  # counted, not ended
        else:  # no batch of this fit in flight (it started before this callback's batch start, or was dropped)
            yield
            return
        self._uncounted = None
        self._add_batch(-1, samples, tokens)
        try:
            yield
        finally:
            self._add_batch(1, samples, tokens)
            self._uncounted = batch

    def _add_batch(self, sign: int, samples: Any, tokens: Any) -> None:
        """Add (``sign`` 1) or take out (-1) one batch of ``samples`` and ``tokens``, as :meth:`count_batch`
        counts them, to the tallies."""
        self._batches += sign
        if type(samples) is int:
            self._samples += sign * samples
        else:
            pending = self._pending_samples_now
            self._pending_samples_now = sign * samples if pending is None else pending + sign * samples
        if tokens is None:
            return
        if isinstance(tokens, torch.Tensor):
            pending = self._pending_now
            self._pending_now = (
                sign * tokens.detach() if pending is None else pending + sign * tokens.detach()
            )
        else:
            self._tokens += sign * int(tokens)
        self._token_batches += sign

    def _reset(self) -> None:
        self.metering = self.in_fit = False
        self.batches_this_fit = 0  # training batches this fit that ended
        self.batches_started_this_fit = self.batches_counted_this_fit = 0  # see nothing_trained
        self.step_counter: Callable[[], int] | None = None
        self._counted_step: int | None = None
        self._last_batch_start: float | None = None  # the batch in flight's start, until its end (or a mark)
        self._last_batch_end: float | None = None  # where the data-loader wait before the next batch starts
        self._batches = self._samples = self._tokens = self._token_batches = 0
        self._uncounted: Any = None  # the batch that started, until its samples are counted
        self._uncounted_index = 0  # its index in the epoch
        # the batch counted last: (batches started, batches ended) when it was counted, its samples and tokens
        self._flight: tuple[int, int, Any, Any] | None = None
        self._stall_s = self._loop_s = 0.0
        self._pending_now: torch.Tensor | None = None
        self._pending: dict[tuple[str, ...], torch.Tensor] = {}
        self._pending_samples_now: torch.Tensor | None = None  # device sample counts (graphs), as tokens
        self._pending_samples: dict[tuple[str, ...], torch.Tensor] = {}
        self._last_step_log: tuple[float, float, int] | None = None  # (run J, run s, partial readings)
        self._last_so_far_kwh = 0.0
        self._ended_kwh: float | None = None  # the run's figure when its training loop ended
        self._open_epoch: int | None = None  # the epoch whose label is in force, until it closes
        self._pending_cycles: list[tuple[int, int]] = []  # (cycle, its last step), see due_cycle_rows
        self._progress_at: float | None = None
        self._progress_text = ""

    def _cycle_row(self, cycle: int, collective: Collective | None) -> dict[str, Any] | None:
        """The report's row of pulse ``cycle`` so far, all ranks (``None`` if it has no bucket)."""
        key = f"cycle/{cycle}"
        bucket = self.snapshot(collective, keys=lambda name: name == key)["buckets"].get(key)
        if bucket is None:
            return None
        return grouped_figures({key: bucket}, self.intensity is not None, self.price is not None)["cycles"][
            str(cycle)
        ]

    def _local_snapshot(
        self,
        edges: np.ndarray | None = None,
        timeline: bool = True,
        keys: Callable[[str], bool] | None = None,
    ) -> dict[str, Any]:
        ledger = self.ledger
        if ledger is None:
            return {"buckets": {}, "timeline": {}, "phase_segments": []} if timeline else {"buckets": {}}
        self.fold_counts()
        if self._pending:  # device token counts, read once per read-out rather than once per batch
            pending, self._pending = self._pending, {}
            for label_keys, tokens in pending.items():
                ledger.add_tokens(label_keys, int(tokens.item()))
        if self._pending_samples:
            pending, self._pending_samples = self._pending_samples, {}
            for label_keys, samples in pending.items():
                ledger.add_counts(label_keys, batches=0, samples=int(samples.item()))
        return ledger.snapshot(self.clock(), edges=edges, timeline=timeline, keys=keys)

    def _world_snapshot(
        self, collective: Collective, timeline: bool, wanted: Callable[[str], bool] | None
    ) -> dict[str, Any]:
        """Every rank's ledger combined: GPU energy and counts summed, time the max, stall averaged."""
        world = collective.world_size
        layout = None
        if self.global_zero:
            keys = sorted(self._local_snapshot(timeline=False, keys=wanted)["buckets"])
            ledger = self.ledger
            edges = timeline_edges(ledger.timeline_wall if ledger is not None and timeline else [])
            layout = (keys, edges.tolist())
        keys, edge_list = collective.broadcast(layout)
        edges = np.asarray(edge_list, dtype=np.float64)
        bins = max(len(edges) - 1, 0)
        local = self._local_snapshot(edges if timeline else None, timeline=timeline, keys=wanted)
        buckets = flatten_buckets(local["buckets"], keys).ravel()
        series = local.get("timeline", {})
        binned = np.array([series.get(f"{c}_j") or [0.0] * bins for c in COMPONENTS], dtype=np.float64)
        gathered = np.asarray(collective.all_gather(np.concatenate([buckets, binned.ravel()]))).reshape(
            world, -1
        )
        size = len(keys) * len(BUCKET_FIELDS)
        combined = {"buckets": combine_ranks(gathered[:, :size].reshape(world, len(keys), -1), keys)}
        if timeline:
            summed = gathered[:, size:].sum(axis=0).reshape(len(COMPONENTS), bins)
            combined["timeline"] = {
                "start_wall": edges[:-1].tolist(),
                "end_wall": edges[1:].tolist(),
                **{f"{c}_j": summed[i].tolist() for i, c in enumerate(COMPONENTS)},
            }
            combined["phase_segments"] = local["phase_segments"]
        return combined


def _mark_uncounted(snapshot: dict[str, Any] | None, rates: Sequence[str]) -> None:
    """Every joule of a version-1 checkpoint's ``snapshot`` uncounted by each of ``rates`` (its run had none;
    version 1 did not keep the joules no rate counted)."""
    for bucket in (snapshot or {}).get("buckets", {}).values():
        joules = sum(float(bucket.get(f"{c}_j", 0.0)) for c in COMPONENTS)
        for name in rates:
            bucket[UNCOUNTED_FIELD[name]] = joules


def _present(metrics: dict[str, float | None]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items() if value is not None}


def _cycle_present(cycle: int, row: Mapping[str, Any]) -> dict[str, float]:
    """``energy/cycle_*`` of a pulse cycle's report ``row``, and ``energy/cycle``, its number."""
    metrics = {
        f"energy/cycle_{name.replace('energy_', '')}": row[name] for name in ("energy_kwh", "co2_kg", "cost")
    }
    metrics["energy/cycle_avg_power_w"] = row["avg_power_w"]
    metrics["energy/cycle"] = float(cycle)
    return _present(metrics)
