"""HyperConnectionMonitor: logs the stability diagnostics of HC / mHC layers every N optimizer steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_pulse import _lightning_compat as compat
from lightning_pulse.errors import FitRestores, names_itself
from lightning_pulse.loggers import log_to_loggers, refuse_logger_only_monitors
from lightning_pulse.nn.diagnostics import HyperConnectionRecorder


class HyperConnectionMonitor(compat.PulseStateKey, Callback):
    r"""Logs the composite gain and off-diagonal mass of a model's hyper-connection layers.

    Every ``every_n_steps`` optimizer steps it watches one training forward pass: forward hooks on every
    :class:`~lightning_pulse.nn.HyperConnection` / :class:`~lightning_pulse.nn.ManifoldHyperConnection` found in
    ``pl_module.modules()`` recompute each layer's ``H_res`` (no gradient, no change to the module or its
    outputs), and it logs to every logger of the Trainer, where Lightning logs the measured batch's loss:

    * ``{prefix}/forward_gain`` and ``{prefix}/backward_gain``: the largest absolute row and column sum of the
      product ``H_res^{(L)} ... H_res^{(1)}`` in call order, maximised over tokens (the mHC paper's "Amax gain
      magnitude"); 1 for mHC (doubly stochastic) and for plain residuals, unbounded for HC;
    * ``{prefix}/off_diagonal_mass``: mean over the layers that ran of the share of ``|H_res|`` off the
      diagonal (0: the streams never mix); with ``per_layer=True`` also
      ``{prefix}/layer_NN/off_diagonal_mass``, ``NN`` the layer's position among the hooked layers
      (``modules()`` order). No logged name is a path prefix of another: a store that keeps a metric in a
      file at its name (MLflow's file store) cannot hold ``a`` beside ``a/b``;
    * ``{prefix}/stream_rms``: the largest RMS of any layer's output streams, an activation-scale signal.

    A step whose streams hold a NaN (at any position, on any rank) logs NaN gains and stream RMS, never a
    finite figure from the other positions.

    A layer called on zero positions (an MoE expert without tokens) adds nothing.

    Under DDP every rank measures its own batch; gains and the stream RMS are reduced with max, each layer's
    mass is averaged over the ranks that ran it, so every rank logs and keeps the same figures. Ranks may run
    different layers, or none (LayerDrop, early exit, routing): each sends the same fixed-size tensors. The
    reduced tensors stay referenced until the backend's threads have let go of them, and ``teardown`` waits
    for that, so no rank aborts at exit. The
    hooks are registered once per fit and idle (one flag check per layer call) on unmeasured steps, so
    measurements also work when the layers run inside a ``torch.compile``'d module; registering them there
    clears dynamo's compiled code (``torch.compiler.reset()``, said in the log), which may hold a graph traced
    without them (an earlier fit in the process). A layer called twice in
    one measured step starts a new forward pass; passes are scored separately and the largest gain is logged.
    With gradient accumulation the first micro-batch of the step is measured. Layers are found at every
    measurement, so the module may be built lazily.

    Args:
        every_n_steps: measure when ``trainer.global_step`` is a multiple of this (step 0 included).
        per_layer: also log each layer's off-diagonal mass.
        prefix: the metric name prefix.

    Raises:
        ValueError: if ``every_n_steps`` is not a positive int or ``prefix`` is empty.

    Example::

        from lightning import Trainer
        from lightning_pulse import HyperConnectionMonitor

        trainer = Trainer(max_steps=1000, callbacks=[HyperConnectionMonitor(every_n_steps=50)])

    The same in LightningCLI YAML::

        trainer:
          callbacks:
            - class_path: lightning_pulse.HyperConnectionMonitor
              init_args: {every_n_steps: 50}
    """

    @names_itself
    def __init__(self, every_n_steps: int = 50, per_layer: bool = False, prefix: str = "mhc") -> None:
        super().__init__()
        self._fit_restores = FitRestores()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"`every_n_steps`={every_n_steps!r} must be a positive int.")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"`prefix`={prefix!r} must be a non-empty string.")
        if not isinstance(per_layer, bool):  # bool('no') is True, and bool(None) hid a null in YAML
            raise ValueError(f"`per_layer`={per_layer!r} must be a bool.")
        self.every_n_steps = every_n_steps
        self.per_layer = per_layer
        self.prefix = prefix
        self.history: list[dict[str, Any]] = []
        self._recorder: HyperConnectionRecorder | None = None
        self._measuring = False  # the current batch is measured
        self._warned_empty = False
        self._last_measured_step = -1
        self._logged_at = 0  # the measured batch's step on the loggers' axis (compat.logging_step)
        self._held = compat.CollectiveHold()  # reduced tensors a collective's thread may still hold

    # ------------------------------------------------------------------ public figures
    @property
    def last(self) -> dict[str, Any] | None:
        """The latest measurement: ``{"step", "forward_gain", "backward_gain", "off_diagonal_mass", ...}``."""
        return self.history[-1] if self.history else None

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._fit_restores.setup(trainer, self)  # in every stage, before Lightning restores: see FitRestores
        # a new fit counts from step 0 again: a step measured in an earlier fit would skip step 0 of this one,
        # and a fit shorter than every_n_steps logged nothing. Here, not in on_fit_start: a checkpoint's
        # state is loaded after setup, before on_fit_start, and must win on a resume
        if stage == "fit":
            self._last_measured_step = -1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        refuse_logger_only_monitors(trainer, "HyperConnectionMonitor", f"{self.prefix}/")
        # said before the first step; the module is built by now (configure_model ran at the strategy's setup)
        self._warned_empty = False
        self._recorder = self._hooked(pl_module)
        if self._recorder is None:
            rank_zero_warn(
                "HyperConnectionMonitor found no HyperConnection/ManifoldHyperConnection layer with n_streams > 1 "
                "in the module; nothing will be logged. Remove the monitor, or build the model with "
                "lightning_pulse.nn's hyper-connection layers."
            )

    def _hooked(self, pl_module: pl.LightningModule) -> HyperConnectionRecorder | None:
        """A recorder whose hooks stay on the module's current layers, idle, until the end of the fit.

        Registered once, not per measurement: under ``torch.compile`` a hook registered anew would run in a
        graph traced with its predecessor (dynamo guards on the number of hooks), and record nothing. For the
        same reason, new hooks on layers that run compiled clear dynamo's compiled code: dynamo does not guard
        on hooks added after it traced a graph, and reused the graph of an earlier fit or forward without them
        (a second model of the same classes too), so nothing was recorded."""
        recorder = HyperConnectionRecorder(pl_module)
        if self._recorder is not None and [id(m) for m in self._recorder.layers] == [
            id(m) for m in recorder.layers
        ]:
            return self._recorder
        self._release()
        if not recorder.layers:
            return None
        recorder.attach()
        recorder.stop()
        if (part := compat.compiled_part_holding(pl_module, recorder.layers)) is not None:
            torch.compiler.reset()  # the part, and the rest of the process's compiled code, compile again
            rank_zero_info(
                f"HyperConnectionMonitor: cleared torch.compile's compiled code (torch.compiler.reset()), so that "
                f"{part} is traced again with the monitor's hooks; a graph traced before they existed would "
                "run without them (dynamo does not guard on hooks added later)."
            )
        return recorder

    def _release(self) -> None:
        if self._recorder is not None:
            self._recorder.detach()
            self._recorder = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self._last_measured_step:
            return
        self._recorder = self._hooked(pl_module)  # layers may have been built or replaced since fit start
        if self._recorder is None:  # said at fit start
            return
        self._recorder.start()
        self._last_measured_step = step
        self._logged_at = compat.logging_step(trainer)  # where Lightning logs this batch's own loss
        self._measuring = True

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # the forward passes are over: activation checkpointing's recomputation in backward is not a new pass
        if self._recorder is not None:
            self._recorder.stop()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None or not self._measuring:
            return
        self._measuring = False
        recorder.stop()
        # every rank sends tensors of the same sizes at every measured step, whatever it ran: ranks may run
        # different layers (LayerDrop, early exit, routing) or none. Masses are (sum, count) per hooked layer
        # in module order, so a layer adds only where it ran; -inf maxima say "nothing recorded here"
        stats = recorder.diagnostics()
        maxima = torch.full((3,), -torch.inf, dtype=torch.float64, device=pl_module.device)
        masses = torch.zeros(2, len(recorder.layers), dtype=torch.float64, device=pl_module.device)
        if stats is not None:
            maxima = maxima.new_tensor([stats["forward_gain"], stats["backward_gain"], stats["stream_rms"]])
            masses[0, stats["layer_index"]] = masses.new_tensor(stats["off_diagonal_mass"])
            masses[1, stats["layer_index"]] = 1.0
        if trainer.world_size > 1:
            maxima = self._reduce(trainer, maxima, "max")
            masses = self._reduce(trainer, masses, "sum")
        ran = masses[1] > 0
        if not ran.any():  # no rank called the hooked layers in this forward pass
            if not self._warned_empty:
                self._warned_empty = True
                rank_zero_warn(
                    f"HyperConnectionMonitor recorded nothing at step {self._last_measured_step}: none of "
                    f"the {len(recorder.layers)} hyper-connection layers it hooks ran in the training "
                    "forward pass (or they ran in code that bypasses module forward hooks, such as a "
                    "torch.compile'd function that is not a module of the LightningModule, traced before "
                    "the hooks existed). Nothing is logged for such steps. Call the layers as modules in "
                    "training_step, compile the modules rather than a function (or call "
                    "torch.compiler.reset() before the fit), or remove the monitor."
                )
            return
        per_layer = dict(zip(ran.nonzero().flatten().tolist(), (masses[0][ran] / masses[1][ran]).tolist()))
        forward_gain, backward_gain, stream_rms = maxima.tolist()
        entry = {
            "step": self._last_measured_step,
            "forward_gain": forward_gain,
            "backward_gain": backward_gain,
            "off_diagonal_mass": sum(per_layer.values()) / len(per_layer),
            "stream_rms": stream_rms,
            "layers": len(per_layer),
        }
        self.history.append(entry)
        metrics = {
            f"{self.prefix}/forward_gain": forward_gain,
            f"{self.prefix}/backward_gain": backward_gain,
            f"{self.prefix}/off_diagonal_mass": entry["off_diagonal_mass"],
            f"{self.prefix}/stream_rms": stream_rms,
        }
        if self.per_layer:
            metrics.update(
                {f"{self.prefix}/layer_{i:02d}/off_diagonal_mass": mass for i, mass in per_layer.items()}
            )
        log_to_loggers(trainer, metrics, step=self._logged_at)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measuring = False
        self._release()  # the hooks leave with the fit

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._measuring = False
        self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._measuring = False
        # also when the training loop never ran (limit_train_batches=0, a finished run resumed)
        self._release()
        # the rank may exit right after this: no collective's thread may be left holding a reduced tensor
        self._held.wait()

    def _reduce(self, trainer: pl.Trainer, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """``tensor`` reduced over ranks (``"max"`` / ``"sum"``); the tensors stay referenced until released.

        A max is NaN wherever any rank's value is: the backends' max may keep the other rank's number instead
        (gloo does, depending on rank order), so a NaN flag per value travels in the same collective."""
        if reduce_op == "max":
            tensor = torch.cat((tensor, tensor.isnan().double()))
        reduced = compat.reduce_held(trainer.strategy, tensor, reduce_op, self._held)
        if reduce_op == "max":
            maxima, any_nan = reduced.chunk(2)
            reduced = maxima.masked_fill(any_nan > 0, torch.nan)
        return reduced

    # ------------------------------------------------------------------ checkpointing
    @property
    @override
    def state_key(self) -> str:
        # keyed by prefix, as ModelCheckpoint keys by its settings: two monitors with different prefixes
        # coexist
        return f"{super().state_key}{ {'prefix': self.prefix}!r}"

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # checkpoints written before the state key held the prefix keep the state under the class name
        states = checkpoint.get("callbacks") or {}
        legacy = states.get(super().state_key)
        if self.state_key not in states and isinstance(legacy, dict):
            self.load_state_dict(legacy)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [dict(entry) for entry in self.history],
            "last_measured_step": self._last_measured_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._fit_restores.restored():  # loaded by validate, test or predict: no resume
            return
        self.history = [dict(entry) for entry in state_dict.get("history", [])]
        self._last_measured_step = int(state_dict.get("last_measured_step", -1))
