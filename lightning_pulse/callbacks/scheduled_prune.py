"""ScheduledPrune: gradual pruning on the cubic schedule, in maintain windows, with real compute savings.

Thin Lightning glue over :mod:`lightning_pulse.core.pruning` (what to prune, and how) and
:mod:`lightning_pulse.core.distillation` (optional recovery after each pruning event).
"""

from __future__ import annotations

import io
import math
import re
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.callbacks.pulse_cycle import (
    first_validation_batches,
    phase_of,
    pulse_cycle_of,
    run_validation_probe,
)
from lightning_pulse.core import pruning
from lightning_pulse.core.distillation import LogitDistiller
from lightning_pulse.phase import Phase, PhaseChange
from lightning_pulse.protocols import ParametersReplacedListener, listeners

MODES = ("unstructured", "structured")
CADENCES = ("auto", "maintain", "steps")


def default_input_from_batch(batch: Any) -> Any:
    """The model input of a batch: the batch itself if it is a tensor, its first item if it is a tuple or
    list, or its ``"x"`` / ``"input"`` / ``"inputs"`` / ``"input_ids"`` entry if it is a mapping."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    if isinstance(batch, Mapping):
        for key in ("x", "input", "inputs", "input_ids"):
            if key in batch:
                return batch[key]
    raise ValueError(
        "ScheduledPrune(mode='structured') traces the model on one training input but cannot find it in a "
        f"batch of type {type(batch).__name__}; pass `input_from_batch=` (batch -> model input) or set the "
        "module's `example_input_array`."
    )


def _small_example(example: Any) -> Any:
    # Two samples are enough to trace the graph, and keep the copy stored in checkpoints tiny.
    if isinstance(example, torch.Tensor):
        return (example[:2] if example.dim() and example.shape[0] > 2 else example).detach().cpu().clone()
    if isinstance(example, (list, tuple)):
        return type(example)(_small_example(item) for item in example)
    return example


class _StateDictFitter:
    """``load_state_dict`` pre-hook that makes the module fit a pruned state dict before it loads: it adds
    masks for ``*.weight_mask`` entries and replays structured pruning recorded in the checkpoint.

    Holds its callback weakly and is neither deep-copied nor pickled with the module (a copy of the module
    would otherwise drag the callback and the Trainer along).
    """

    def __init__(self, callback: ScheduledPrune) -> None:
        self._callback = weakref.ref(callback)

    def __call__(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        callback = self._callback()
        if callback is not None:
            callback._fit_module_to_state_dict(module, state_dict, prefix)

    def __deepcopy__(self, memo: dict[int, Any]) -> _StateDictFitter:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_hook, ())


def _inert_hook(*args: Any) -> Callable[..., None]:
    return _do_nothing


def _do_nothing(*args: Any) -> None:
    return None


def _no_trainer() -> None:
    return None


class ScheduledPrune(Callback):
    r"""Gradual magnitude pruning (Zhu & Gupta 2017) that runs in the maintain phases of a pulse cycle.

    Sparsity follows the cubic schedule ``s_t = s_f + (s_i - s_f)(1 - (t - t_start)/(t_end - t_start))^3``.
    With a :class:`~lightning_pulse.PulseCycle` attached, a pruning event happens when a maintain phase
    starts (right after its evaluation probe); without one, every ``every`` optimizer steps. Each event sets
    the sparsity to the schedule's value: targets are absolute (50% then 70% gives 70%, never the 85% that
    compounding would give), and a weight or channel pruned once stays pruned.

    Modes:

    * ``"unstructured"``: individual weights are masked with ``torch.nn.utils.prune``. This shrinks the
      number of non-zero weights but NOT the compute: dense kernels multiply the zeros all the same, so a
      masked model is no faster to train or to run.
    * ``"structured"``: whole output channels (convolutions) or neurons (linear layers) are removed with
      torch-pruning's dependency graph, which also cuts every coupled layer. The model really gets smaller
      and faster. After each event the optimizer's parameters and state (e.g. Adam's moments) are cut to the
      kept channels in place, so the optimizer and any LR scheduler stay the same objects; under DDP the
      module is wrapped in a fresh ``DistributedDataParallel``. Layers whose outputs are the model's outputs
      are never cut. Callbacks that keep per-parameter tensors can define
      ``on_pulse_parameters_replaced(trainer, pl_module, remap)`` to follow
      (:class:`~lightning_pulse.core.pruning.ParameterRemap`).

    Each event records and logs (under ``prune/``): target and reached sparsity, per-layer sparsity, the
    parameter count, the median training-batch time before and after the event, and the probe metrics
    (e.g. ``val_acc``) before and after pruning. Events are in :attr:`events` and in checkpoints.

    Optional distillation (``distill=True``): the model as it was just before an event is kept as a frozen
    teacher and, for the following light phase, a KL term on the logits (temperature ``T``, scaled by
    ``T^2``) is added to the user's loss through a forward hook, without touching the module's code. The
    module's ``forward`` must return the logits. Cost: one teacher forward per training step of the window
    and one model copy in memory.

    Rollbacks: a :class:`~lightning_pulse.StabilityGuard` rollback restores this callback with the model
    (``restore_on_rollback``). Its schedule goes back to the snapshot (sparsity reached, events, next event
    step), so an event the rollback undid is redone at the next maintain entry (or, on the step cadence, at
    the next step) at the schedule's value for that step; distillation follows the restored state. A
    snapshot taken before masks were added or channels were cut no longer fits the model and is never
    restored, so the masks or channels and this callback's record of them always agree.

    Resuming: checkpoints carry masks (as ``weight_orig``/``weight_mask``) and, in structured mode, the
    recorded channel removals and a two-sample example input; when Lightning restores a checkpoint into a
    freshly built module, the removals are replayed before the weights load. To load such a checkpoint
    outside a Trainer use :meth:`load_pruned`.

    Distributed: single-device and DDP strategies. Under ``strategy="ddp"`` both modes are supported
    (structured events re-wrap the module). Under ``ddp_spawn``/``ddp_fork`` Lightning copies rank 0's
    final weights back into the main process's unpruned module, which cannot take pruned shapes (or masks),
    so structured mode, and unstructured mode with ``make_permanent=False``, raise at setup.

    Args:
        final_sparsity: target share of weights (unstructured) or of channels of the chosen layers
            (structured) removed at the end of the schedule, in ``[0, 1)``.
        initial_sparsity: sparsity at the start of the schedule, in ``[0, final_sparsity]``.
        mode: ``"unstructured"`` or ``"structured"``.
        start: when the schedule starts: an ``int`` optimizer step, or a ``float`` share of the run's optimizer
            steps in ``[0, 1]``.
        end: when the schedule reaches ``final_sparsity``, same forms; not before ``start``.
        every: optimizer steps between events on the step cadence.
        cadence: ``"maintain"`` (events at maintain-phase starts; needs a PulseCycle with a maintain phase),
            ``"steps"`` (every ``every`` steps), or ``"auto"`` (maintain when possible, else steps).
        layer_types: layer classes (or ``torch.nn`` names, or dotted paths) to prune; ``None`` for any layer
            with a ``weight``. In structured mode these are the layers whose output channels are removed.
        layer_pattern: only layers whose qualified name matches this regex (``re.search``).
        exclude_pattern: never layers whose name matches this regex.
        ranking: ``"layer"`` (every layer reaches the target) or ``"global"`` (all chosen layers together).
        importance: ``"magnitude"`` (``|w|``; group L2 norm in structured mode) or ``"taylor"``
            (``|w * dL/dw|`` averaged over the optimizer steps since the previous event).
        min_channels: structured mode: channels every layer keeps at least.
        lottery_ticket_reset: unstructured mode: after each event, reset the surviving weights to their values
            at the start of training (Frankle & Carbin 2019). Off by default.
        distill: distil the pre-event model into the pruned one during the light phase after each event.
        distill_weight: multiplier of the distillation term.
        distill_temperature: softening temperature ``T``.
        distill_steps: optimizer steps of distillation after an event; ``None`` means until the maintain
            phase ends (with PulseCycle) or until the next event (step cadence).
        make_permanent: at fit end, fold unstructured masks into the weights.
        export_path: at fit end, rank 0 saves the pruned module (masks folded, no hooks) with
            ``torch.save(module)``; load it with ``torch.load(path, weights_only=False)``.
        probe_batches: validation batches evaluated right after each event (and before it when no PulseCycle
            probe just ran); ``0`` turns the probes off.
        timing_steps: training batches whose median time is reported before and after each event.
        input_from_batch: structured mode: ``batch -> model input`` used to trace the model; by default the
            module's ``example_input_array``, else :func:`default_input_from_batch`.
        time_source: seconds counter for step times (``time.perf_counter``); tests inject a fake one.

    Raises:
        ValueError: at construction, naming the field, for a value out of range or of the wrong type, an
            unknown ``mode``/``cadence``/``ranking``/``importance``, an invalid regex or layer type,
            ``lottery_ticket_reset`` in structured mode. At fit start: no layer matches, ``start`` after
            ``end``, ``cadence="maintain"`` without a maintain phase, an unsupported strategy.
        ModuleNotFoundError: at construction, structured mode without torch-pruning installed.

    Example::

        from lightning import Trainer
        from lightning_pulse import PulseCycle, ScheduledPrune

        trainer = Trainer(max_epochs=30, callbacks=[
            PulseCycle(burst=20, replay=10, maintain=5),
            ScheduledPrune(final_sparsity=0.5, mode="structured"),
        ])

    The same in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_pulse.PulseCycle
              init_args: {burst: 20, replay: 10, maintain: 5}
            - class_path: lightning_pulse.ScheduledPrune
              init_args: {final_sparsity: 0.5, mode: structured}
    """

    # a StabilityGuard rollback may call `load_state_dict` during training (see `_load_mid_run`)
    restore_on_rollback = True

    def __init__(
        self,
        final_sparsity: float = 0.5,
        initial_sparsity: float = 0.0,
        mode: str = "unstructured",
        start: int | float = 0.1,
        end: int | float = 0.7,
        every: int = 100,
        cadence: str = "auto",
        layer_types: Sequence[str | type] | None = pruning.DEFAULT_LAYER_TYPES,
        layer_pattern: str | None = None,
        exclude_pattern: str | None = None,
        ranking: str = "layer",
        importance: str = "magnitude",
        min_channels: int = 1,
        lottery_ticket_reset: bool = False,
        distill: bool = False,
        distill_weight: float = 1.0,
        distill_temperature: float = 2.0,
        distill_steps: int | None = None,
        make_permanent: bool = True,
        export_path: str | None = None,
        probe_batches: int = 4,
        timing_steps: int = 10,
        input_from_batch: Callable[[Any], Any] | None = None,
        time_source: Callable[[], float] | None = None,
    ) -> None:
        super().__init__()
        _check_share(final_sparsity, "final_sparsity", upper_open=True)
        _check_share(initial_sparsity, "initial_sparsity", upper_open=True)
        if initial_sparsity > final_sparsity:
            raise ValueError(
                f"`initial_sparsity`={initial_sparsity} must not exceed `final_sparsity`={final_sparsity}; "
                "sparsity only grows."
            )
        _check_choice(mode, "mode", MODES)
        _check_choice(cadence, "cadence", CADENCES)
        _check_choice(ranking, "ranking", pruning.RANKINGS)
        _check_choice(importance, "importance", pruning.IMPORTANCES)
        _check_when(start, "start")
        _check_when(end, "end")
        if type(start) is type(end) and end < start:
            raise ValueError(f"`end`={end!r} comes before `start`={start!r}.")
        _check_int(every, "every", minimum=1)
        _check_int(min_channels, "min_channels", minimum=1)
        _check_int(probe_batches, "probe_batches", minimum=0)
        _check_int(timing_steps, "timing_steps", minimum=1)
        if distill_steps is not None:
            _check_int(distill_steps, "distill_steps", minimum=1)
        for name, value in (("distill_weight", distill_weight), ("distill_temperature", distill_temperature)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"`{name}`={value!r} must be a positive finite number.")
        for name, pattern in (("layer_pattern", layer_pattern), ("exclude_pattern", exclude_pattern)):
            if pattern is not None:
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as error:
                    raise ValueError(
                        f"`{name}`={pattern!r} is not a valid regular expression: {error}."
                    ) from None
        if lottery_ticket_reset and mode == "structured":
            raise ValueError(
                "`lottery_ticket_reset`=True needs `mode`='unstructured': removed channels have no initial "
                "values to go back to."
            )
        if export_path is not None and not isinstance(export_path, (str, Path)):
            raise ValueError(f"`export_path`={export_path!r} must be a path string or None.")
        if mode == "structured":
            pruning.import_torch_pruning()
        self.final_sparsity = float(final_sparsity)
        self.initial_sparsity = float(initial_sparsity)
        self.mode = mode
        self.start = start
        self.end = end
        self.every = every
        self.cadence = cadence
        self.layer_types = pruning.resolve_layer_types(layer_types)
        self.layer_pattern = layer_pattern
        self.exclude_pattern = exclude_pattern
        self.ranking = ranking
        self.importance = importance
        self.min_channels = min_channels
        self.lottery_ticket_reset = lottery_ticket_reset
        self.distill = distill
        self.distill_weight = float(distill_weight)
        self.distill_temperature = float(distill_temperature)
        self.distill_steps = distill_steps
        self.make_permanent = make_permanent
        self.export_path = None if export_path is None else str(export_path)
        self.probe_batches = probe_batches
        self.timing_steps = timing_steps
        self.input_from_batch = input_from_batch
        self.time_source = time_source or time.perf_counter

        # schedule state (checkpointed)
        self.sparsity = 0.0  # target reached by the last event
        self.finished = False
        self.events: list[dict[str, Any]] = []
        self.history: list[list[Any]] = []  # structured: torch-pruning history, all events in order
        self.original_channels: dict[str, int] = {}
        self._next_event_step: int | None = None
        self._example_inputs: Any = None
        self._scores: pruning.TaylorScores | None = pruning.TaylorScores() if importance == "taylor" else None
        self._initial_weights: dict[str, torch.Tensor] | None = None
        self._pending_teacher: dict[str, Any] | None = None

        # run state
        self._start_step = 0
        self._end_step = 0
        self._uses_maintain = False
        self._last_global_step = 0
        self._scored_step = -1
        self._step_times: deque[float] = deque(maxlen=timing_steps)
        self._after: dict[str, Any] | None = None
        self._batch_started: float | None = None
        self._event_in_batch = False
        self._last_batch: Any = None
        self._probe_data: list[Any] | None = None
        self._probe_unavailable = False
        self._fitter_handle: Any = None
        self._trainer_ref: Callable[[], pl.Trainer | None] = _no_trainer
        self._distiller: LogitDistiller | None = None
        self._distill_steps_left: int | None = None
        self._distill_event = -1
        self._warned_taylor_fallback = False
        self._training = False  # between on_train_start and the end of fit: a state load is a rollback

    # ------------------------------------------------------------------ public API
    @staticmethod
    def load_pruned(module: torch.nn.Module, checkpoint: str | Path | Mapping[str, Any]) -> torch.nn.Module:
        """Load a checkpoint written during a ScheduledPrune run into a freshly built ``module``.

        Replays the recorded channel removals (structured) and adds masks (unstructured) so the pruned
        state dict fits, then loads it. Returns ``module``.
        """
        if not isinstance(checkpoint, Mapping):
            checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=False)
        state = next(
            (
                value
                for key, value in checkpoint.get("callbacks", {}).items()
                if str(key).startswith("ScheduledPrune")
            ),
            None,
        )
        state_dict = checkpoint["state_dict"]
        if state and state.get("history"):
            pruning.replay_structure(module, state["example_inputs"], state["history"])
        for key in state_dict:
            if key.endswith(".weight_mask"):
                pruning.add_mask(module.get_submodule(key[: -len(".weight_mask")]))
        module.load_state_dict(state_dict)
        return module

    def benchmark_metrics(self) -> dict[str, Any]:
        """Figures for ``benchmarks/harness.py``: the events and the final sparsity and size."""
        last = self.events[-1] if self.events else {}
        return {
            "prune_events": len(self.events),
            "prune_sparsity": self.sparsity,
            "prune_params": last.get("params"),
            "prune_params_nonzero": last.get("params_nonzero"),
            "prune_event_log": [dict(event) for event in self.events],
        }

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer_ref = weakref.ref(trainer)
        if stage == "fit":
            self._check_strategy(trainer)
        if self._fitter_handle is None:
            self._fitter_handle = pl_module.register_load_state_dict_pre_hook(_StateDictFitter(self))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._training = False
        self._end_distillation(trainer)
        if self._fitter_handle is not None:
            self._fitter_handle.remove()
            self._fitter_handle = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = float(trainer.estimated_stepping_batches)
        self._start_step = self._resolve_step(self.start, total, "start")
        self._end_step = self._resolve_step(self.end, total, "end")
        if self._end_step < self._start_step:
            raise ValueError(
                f"ScheduledPrune: `end` (step {self._end_step}) comes before `start` (step {self._start_step})."
            )
        layers = self._layers(pl_module)
        if not layers:
            raise ValueError(
                f"ScheduledPrune: no layer of {pl_module.__class__.__name__} matches `layer_types`="
                f"{[t.__name__ for t in self.layer_types]}, `layer_pattern`={self.layer_pattern!r}, "
                f"`exclude_pattern`={self.exclude_pattern!r}."
            )
        cycle = pulse_cycle_of(trainer)
        has_maintain = cycle is not None and not cycle.clock.durations.get(Phase.MAINTAIN, _ZERO).is_zero
        if self.cadence == "maintain" and not has_maintain:
            raise ValueError(
                "ScheduledPrune: `cadence`='maintain' needs a PulseCycle with a non-zero maintain phase."
            )
        if self.cadence == "auto" and cycle is not None and not has_maintain:
            rank_zero_warn(
                "ScheduledPrune: the PulseCycle has no maintain phase; pruning on the step cadence."
            )
        self._uses_maintain = has_maintain and self.cadence != "steps"
        self._last_global_step = trainer.global_step
        if self._next_event_step is None:
            self._next_event_step = self._start_step
        if self.lottery_ticket_reset and self._initial_weights is None:
            self._initial_weights = {name: pruning.effective_weight(m).clone() for name, m in layers.items()}
        if self._pending_teacher is not None:
            saved, self._pending_teacher = self._pending_teacher, None
            self._resume_distillation(trainer, pl_module, saved)
        self._training = True
        where = "maintain-phase starts" if self._uses_maintain else f"every {self.every} steps"
        rank_zero_info(
            f"ScheduledPrune: {self.mode} pruning of {len(layers)} layers to {self.final_sparsity:.0%} "
            f"between steps {self._start_step} and {self._end_step}, at {where}."
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._last_batch = batch
        self._event_in_batch = False
        self._batch_started = self.time_source()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._scores is None or self.finished or self._scored_step == trainer.global_step:
            return
        self._scored_step = trainer.global_step
        self._scores.update(pl_module.named_parameters())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_started is not None and not self._event_in_batch:
            self._record_batch_time(trainer, self.time_source() - self._batch_started)
        steps = trainer.global_step - self._last_global_step
        if steps <= 0:  # inside an accumulation window
            return
        self._last_global_step = trainer.global_step
        if self._distiller is not None and self._distill_steps_left is not None:
            self._distill_steps_left -= steps
            if self._distill_steps_left <= 0:
                self._end_distillation(trainer)
        if (
            not self._uses_maintain
            and not self.finished
            and self._next_event_step is not None
            and trainer.global_step >= self._next_event_step
        ):
            self._prune_event(trainer, pl_module, trainer.global_step, maintain_entry=False)

    def on_pulse_phase_change(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, change: PhaseChange
    ) -> None:
        """Called by PulseCycle on every rank: prune when a maintain phase starts."""
        if (
            self._distiller is not None
            and self.distill_steps is None
            and change.previous is Phase.MAINTAIN
            and change.current is not Phase.MAINTAIN
        ):
            self._end_distillation(trainer)
        if (
            self._uses_maintain
            and change.current is Phase.MAINTAIN
            and change.reason != "resume"
            and not self.finished
            and change.step >= self._start_step
        ):
            self._prune_event(trainer, pl_module, change.step, maintain_entry=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training = False
        self._end_distillation(trainer)
        if self._after is not None:
            self._close_after_window(trainer)
        if not self.finished and self.events:
            # on the maintain cadence the schedule's end can pass between two maintain entries
            when = "before" if trainer.global_step < self._end_step else "with no event at or after"
            rank_zero_warn(
                f"ScheduledPrune: the run ended at step {trainer.global_step} {when} the schedule's end (step "
                f"{self._end_step}); sparsity reached {self.sparsity:.3f} of {self.final_sparsity}."
            )
        if self.mode == "unstructured" and self.make_permanent:
            pruning.make_masks_permanent(pl_module)
        if self.export_path is not None and trainer.is_global_zero:
            exported = pruning.copy_without_hooks(pl_module)
            pruning.make_masks_permanent(exported)
            Path(self.export_path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(exported, self.export_path)
            rank_zero_info(f"ScheduledPrune: pruned model saved to {self.export_path}.")

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "sparsity": self.sparsity,
            "finished": self.finished,
            "next_event_step": self._next_event_step,
            "events": [dict(event) for event in self.events],
            "history": [list(entry) for entry in self.history],
            "original_channels": dict(self.original_channels),
            "example_inputs": self._example_inputs,
        }
        if self._scores is not None:
            state["taylor"] = self._scores.state_dict()
        if self._initial_weights is not None:
            state["initial_weights"] = {name: w.detach().cpu() for name, w in self._initial_weights.items()}
        if self._distiller is not None:
            buffer = io.BytesIO()
            torch.save(self._distiller.teacher, buffer)
            state["teacher"] = {
                "module": buffer.getvalue(),
                "steps_left": self._distill_steps_left,
                "event": self._distill_event,
                "calls": self._distiller.calls,
                "loss_total": float(self._distiller._loss_total),
            }
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sparsity = float(state_dict["sparsity"])
        self.finished = bool(state_dict["finished"])
        self._next_event_step = state_dict["next_event_step"]
        self.events = [dict(event) for event in state_dict["events"]]
        self.history = [list(entry) for entry in state_dict["history"]]
        self.original_channels = dict(state_dict["original_channels"])
        self._example_inputs = state_dict["example_inputs"]
        if "taylor" in state_dict:
            self._scores = self._scores or pruning.TaylorScores()
            self._scores.load_state_dict(state_dict["taylor"])
        if "initial_weights" in state_dict:
            self._initial_weights = dict(state_dict["initial_weights"])
        self._pending_teacher = state_dict.get("teacher")
        if self._training:
            self._load_mid_run()

    def _load_mid_run(self) -> None:
        """Bring the run state in line with a state loaded during training (a StabilityGuard rollback).

        Before training starts (a checkpoint restore) there is nothing to do: ``on_train_start`` builds the
        run state from the loaded one. During training the model has just returned to the snapshot too:
        the timing window of an event the rollback undid is dropped (its event is gone), this batch's time
        (which holds the rollback) is not recorded, and distillation restarts from the restored state: the
        teacher of an undone event is dropped, a teacher saved in the snapshot comes back.
        """
        if self._after is not None and self._after["event"] >= len(self.events):
            self._after = None
        self._event_in_batch = True
        if self._distiller is not None:
            self._distiller.detach()
            self._distiller = None
            self._distill_steps_left = None
            self._distill_event = -1
        saved, self._pending_teacher = self._pending_teacher, None
        trainer = self._trainer_ref()
        if saved is not None and trainer is not None and trainer.lightning_module is not None:
            self._resume_distillation(trainer, trainer.lightning_module, saved)

    # ------------------------------------------------------------------ the event
    def _prune_event(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, maintain_entry: bool
    ) -> None:
        target = pruning.cubic_sparsity(
            step, self.initial_sparsity, self.final_sparsity, self._start_step, self._end_step
        )
        reached_end = step >= self._end_step
        self._next_event_step = None if reached_end else min(step + self.every, self._end_step)
        if target <= self.sparsity + 1e-9:
            self.finished = reached_end
            return
        self._end_distillation(trainer)
        self._close_after_window(trainer)
        step_time_before = statistics.median(self._step_times) if self._step_times else None
        probe_before = self._probe_before(trainer, pl_module, maintain_entry)
        teacher = pruning.copy_without_hooks(pl_module) if self.distill else None
        started = self.time_source()
        layers = self._layers(pl_module)
        if self.mode == "unstructured":
            self._prune_unstructured(layers, target)
            counts = pruning.layer_sparsity(layers)
            reached = pruning.global_sparsity(layers)
        else:
            self._prune_structured(trainer, pl_module, layers, target)
            counts_now = pruning.channel_counts(pl_module, list(self.original_channels))
            reached, counts = pruning.channel_sparsity(counts_now, self.original_channels)
        seconds = self.time_source() - started
        self.sparsity = target
        self.finished = reached_end
        if self._scores is not None:
            self._scores.reset()
        parameters = pruning.count_parameters(pl_module)
        probe_after = self._probe(trainer, pl_module)
        event = {
            "step": int(step),
            "phase": phase_of(trainer).value if pulse_cycle_of(trainer) is not None else None,
            "target_sparsity": target,
            "sparsity": reached,
            "layer_sparsity": counts,
            "params": parameters["params"],
            "params_nonzero": parameters["params_nonzero"],
            "seconds": seconds,
            "step_time_before": step_time_before,
            "step_time_after": None,
            "probe_before": probe_before,
            "probe_after": probe_after,
        }
        self.events.append(event)
        self._event_in_batch = True
        self._step_times.clear()
        self._after = {"event": len(self.events) - 1, "times": [], "skip": 1}
        metrics = {
            "prune/target_sparsity": target,
            "prune/sparsity": reached,
            "prune/params": float(parameters["params"]),
            "prune/params_nonzero": float(parameters["params_nonzero"]),
            "prune/event_seconds": seconds,
        }
        metrics.update({f"prune/layer/{name}": value for name, value in counts.items()})
        if step_time_before is not None:
            metrics["prune/step_time_before"] = step_time_before
        metrics.update({f"prune/{name}_before": value for name, value in (probe_before or {}).items()})
        metrics.update({f"prune/{name}_after": value for name, value in (probe_after or {}).items()})
        _log(trainer, metrics)
        rank_zero_info(
            f"ScheduledPrune: step {step}: sparsity {reached:.3f} (target {target:.3f}), "
            f"{parameters['params_nonzero']} non-zero parameters"
            + (f", {_probe_text(probe_before)} -> {_probe_text(probe_after)}" if probe_after else "")
        )
        if teacher is not None:
            self._start_distillation(trainer, pl_module, teacher, len(self.events) - 1, self.distill_steps)

    def _prune_unstructured(self, layers: dict[str, torch.nn.Module], target: float) -> None:
        scores = {}
        for name, module in layers.items():
            score = None
            if self._scores is not None:
                key = f"{name}.weight_orig" if pruning.current_mask(module) is not None else f"{name}.weight"
                score = self._scores.mean(key)
            if score is None or score.shape != module.weight.shape:
                if self._scores is not None:
                    self._warn_taylor_fallback()
                score = pruning.effective_weight(module).abs()
            scores[name] = score
        previous = {name: pruning.current_mask(module) for name, module in layers.items()}
        masks = pruning.unstructured_masks(scores, target, self.ranking, previous)
        pruning.apply_masks(layers, masks)
        if self._initial_weights is not None:
            with torch.no_grad():
                for name, module in layers.items():
                    module.weight_orig.copy_(self._initial_weights[name].to(module.weight_orig))
                    module.weight = module.weight_orig * module.weight_mask

    def _prune_structured(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        layers: dict[str, torch.nn.Module],
        target: float,
    ) -> None:
        if self._example_inputs is None:
            self._example_inputs = self._example_from(pl_module, self._last_batch)
        importance = self.importance
        if importance == "taylor" and (self._scores is None or not self._scores.steps):
            self._warn_taylor_fallback()
            importance = "magnitude"
        result = pruning.prune_channels(
            pl_module,
            self._example_inputs,
            layers,
            target,
            self.original_channels,
            ranking=self.ranking,
            importance=importance,
            scores=self._scores,
            min_channels=self.min_channels,
        )
        self.history.extend(result.history)
        if not len(result.remap):
            return
        for optimizer in trainer.optimizers:
            for problem in pruning.remap_optimizer_state(optimizer, result.remap):
                rank_zero_warn(f"ScheduledPrune: {problem}")
        if self._scores is not None:
            pruning.remap_taylor_scores(self._scores, pl_module, result.remap)
        for callback in listeners(trainer, ParametersReplacedListener, exclude=self):
            callback.on_pulse_parameters_replaced(trainer, pl_module, result.remap)
        compat.rewrap_ddp(trainer)

    # ------------------------------------------------------------------ helpers
    def _layers(self, pl_module: pl.LightningModule) -> dict[str, torch.nn.Module]:
        return pruning.select_layers(pl_module, self.layer_types, self.layer_pattern, self.exclude_pattern)

    def _example_from(self, pl_module: pl.LightningModule, batch: Any) -> Any:
        example = getattr(pl_module, "example_input_array", None)
        if example is None:
            if batch is None:
                raise ValueError("ScheduledPrune: no training batch seen yet to trace the model with.")
            example = (self.input_from_batch or default_input_from_batch)(batch)
        return _small_example(example)

    @staticmethod
    def _resolve_step(when: int | float, total: float, field: str) -> int:
        if isinstance(when, int):
            return when
        if not math.isfinite(total):
            raise ValueError(
                f"ScheduledPrune: `{field}`={when} is a share of the run, so the run needs a finite max_steps or "
                "max_epochs; give an int step instead."
            )
        return int(round(when * total))

    def _check_strategy(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) or not isinstance(
            strategy, (SingleDeviceStrategy, DDPStrategy)
        ):
            raise ValueError(
                f"ScheduledPrune supports single-device and DDP strategies, not {type(strategy).__name__}."
            )
        if isinstance(strategy, DDPStrategy) and compat.spawns_worker_processes(trainer):
            if self.mode == "structured":
                raise ValueError(
                    "ScheduledPrune(mode='structured') cannot run under a spawning DDP strategy (ddp_spawn, "
                    "ddp_fork, ddp_notebook): Lightning copies rank 0's final weights back into the main "
                    "process's unpruned module, which cannot take the pruned shapes. Use strategy='ddp'."
                )
            if not self.make_permanent:
                raise ValueError(
                    "ScheduledPrune(make_permanent=False) cannot run under a spawning DDP strategy: Lightning "
                    "copies rank 0's final weights back into the main process's module without masks and would "
                    "silently drop the masked layers. Use make_permanent=True or strategy='ddp'."
                )

    def _fit_module_to_state_dict(
        self, module: torch.nn.Module, state_dict: Mapping[str, Any], prefix: str
    ) -> None:
        keys = [key[len(prefix) :] for key in state_dict if key.startswith(prefix)]
        for key in keys:
            if key.endswith(".weight_mask"):
                try:
                    layer = module.get_submodule(key[: -len(".weight_mask")])
                except AttributeError:
                    continue
                if "weight" in layer._parameters:
                    pruning.add_mask(layer)
        own = module.state_dict()
        mismatched = [
            key
            for key in keys
            if key in own
            and isinstance(state_dict[prefix + key], torch.Tensor)
            and own[key].shape != state_dict[prefix + key].shape
        ]
        if not mismatched:
            return
        trainer = self._trainer_ref()
        checkpoint = compat.loaded_checkpoint(trainer) if trainer is not None else None
        state = (checkpoint or {}).get("callbacks", {}).get(self.state_key) if checkpoint else None
        if not state or not state.get("history"):
            raise RuntimeError(
                f"ScheduledPrune: the state dict has pruned shapes ({mismatched[0]}) but no recorded channel "
                "removals to rebuild them (the checkpoint lacks ScheduledPrune's state, e.g. it was saved with "
                "weights_only=True). Load it with ScheduledPrune.load_pruned(module, checkpoint)."
            )
        pruning.replay_structure(module, state["example_inputs"], state["history"])

    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float] | None:
        if self.probe_batches == 0 or self._probe_unavailable:
            return None
        if self._probe_data is None:
            self._probe_data = first_validation_batches(trainer, pl_module, self.probe_batches)
        batches = self._probe_data
        if not batches or not callable(getattr(pl_module, "validation_step", None)):
            rank_zero_warn(
                "ScheduledPrune: no validation data or `validation_step`; accuracy at events is off."
            )
            self._probe_unavailable = True
            return None
        return run_validation_probe(trainer, pl_module, batches)

    def _probe_before(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, maintain_entry: bool
    ) -> dict[str, float] | None:
        cycle = pulse_cycle_of(trainer)
        # PulseCycle has just evaluated the model at this maintain entry: reuse it rather than evaluate twice
        if maintain_entry and cycle is not None and cycle.maintain_eval == "probe" and cycle.last_probe:
            return dict(cycle.last_probe)
        return self._probe(trainer, pl_module)

    def _record_batch_time(self, trainer: pl.Trainer, seconds: float) -> None:
        if self._after is None:
            self._step_times.append(seconds)
            return
        if self._after["skip"] > 0:  # the first batch after an event pays one-off costs (allocation, caches)
            self._after["skip"] -= 1
            return
        self._after["times"].append(seconds)
        self._step_times.append(seconds)
        if len(self._after["times"]) >= self.timing_steps:
            self._close_after_window(trainer)

    def _close_after_window(self, trainer: pl.Trainer) -> None:
        if self._after is None:
            return
        times, index = self._after["times"], self._after["event"]
        self._after = None
        if not times or index >= len(self.events):
            return
        event = self.events[index]
        event["step_time_after"] = statistics.median(times)
        metrics = {"prune/step_time_after": event["step_time_after"]}
        if event["step_time_before"]:
            event["step_speedup"] = event["step_time_before"] / event["step_time_after"]
            metrics["prune/step_speedup"] = event["step_speedup"]
        _log(trainer, metrics)

    def _start_distillation(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        teacher: torch.nn.Module,
        event_index: int,
        steps_left: int | None,
    ) -> None:
        weight = self.distill_weight / max(1, trainer.accumulate_grad_batches)
        self._distiller = LogitDistiller(
            pl_module, teacher, weight=weight, temperature=self.distill_temperature
        )
        self._distiller.attach()
        self._distill_steps_left = steps_left
        self._distill_event = event_index

    def _resume_distillation(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, saved: dict[str, Any]
    ) -> None:
        teacher = torch.load(io.BytesIO(saved["module"]), map_location=pl_module.device, weights_only=False)
        self._start_distillation(trainer, pl_module, teacher, saved["event"], saved["steps_left"])
        assert self._distiller is not None
        self._distiller.calls = int(saved["calls"])
        self._distiller._loss_total = torch.tensor(float(saved["loss_total"]), dtype=torch.float64)

    def _end_distillation(self, trainer: pl.Trainer | None) -> None:
        distiller = self._distiller
        if distiller is None:
            return
        distiller.detach()
        self._distiller = None
        if 0 <= self._distill_event < len(self.events):
            event = self.events[self._distill_event]
            event["distill_calls"] = event.get("distill_calls", 0) + distiller.calls
            event["distill_loss"] = distiller.mean_loss
        if distiller.calls == 0:
            rank_zero_warn(
                "ScheduledPrune: distillation had no effect: the module's forward never returned a logits tensor "
                "of the teacher's shape during training."
            )
        elif trainer is not None:
            _log(trainer, {"prune/distill_loss": distiller.mean_loss})

    def _warn_taylor_fallback(self) -> None:
        if not self._warned_taylor_fallback:
            self._warned_taylor_fallback = True
            rank_zero_warn(
                "ScheduledPrune: `importance`='taylor' has no gradient scores yet at this event; "
                "ranking by magnitude instead."
            )


class _Zero:
    is_zero = True


_ZERO = _Zero()


def _probe_text(probe: Mapping[str, float] | None) -> str:
    if not probe:
        return "n/a"
    return ", ".join(f"{name}={value:.4f}" for name, value in sorted(probe.items()))


def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    # straight to the loggers, as PulseCycle does: `pl_module.log` is not allowed from every hook we run in
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _check_share(value: Any, field: str, upper_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value >= 1 if upper_open else value > 1):
        allowed = "[0, 1)" if upper_open else "[0, 1]"
        raise ValueError(f"`{field}`={value!r} must be a number in {allowed}.")


def _check_choice(value: Any, field: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"`{field}`={value!r} is not one of {list(allowed)}.")


def _check_int(value: Any, field: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{field}`={value!r} must be an int >= {minimum}.")


def _check_when(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"`{field}`={value!r} must be an int optimizer step or a float share of the run in [0, 1]."
        )
    if isinstance(value, int) and value < 0:
        raise ValueError(f"`{field}`={value!r} must be a non-negative optimizer step.")
    if isinstance(value, float) and not 0 <= value <= 1:
        raise ValueError(f"`{field}`={value!r} is a share of the run and must be in [0, 1].")
