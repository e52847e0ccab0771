"""Logit distillation (Hinton et al. 2015) added from outside the student's code.

The student's ``training_step`` computes its own loss from its own forward output; we cannot add a term to
that loss without editing it. We do not need to: adding ``weight * T**2 * KL(p_teacher || p_student)`` to
the loss only adds ``dKL/dlogits`` to the gradient that reaches the logits. :class:`LogitDistiller` wraps
the student's forward output in an identity whose backward adds exactly that gradient. The forward values,
the user's loss and everything logged stay as they were; the autograd graph is the one the student's own
forward built, so DDP, gradient accumulation and mixed precision see an ordinary backward.

Under a GradScaler (``16-mixed``) the loss is multiplied by the scale before its backward, and every gradient
divided by it before the step: the term is added scaled too (:attr:`LogitDistiller.loss_scale`), else it
reached the step divided by the scale (65536: none at all).

Where the optimizers ascend the loss the module returns (torch's ``maximize=True``), they negate every
gradient, the added one too: the term is then added negated, so that they descend the KL as they would for a
module descending its loss (:attr:`LogitDistiller.maximized`, read at train start by :class:`DistillWindow`).

Cost: one teacher forward (no grad) per training forward while attached; memory for one teacher copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pulse.core import prune_widths, pruning
from lightning_pulse.core.loss_direction import maximizes_loss
from lightning_pulse.errors import PulseRefusal, names_itself
from lightning_pulse.phase import Phase, PhaseChange


@dataclass
class DistillConfig:
    """Logit distillation from the model as it was before a pruning event into the pruned one.

    Attributes:
        weight: multiplier of the distillation term, > 0.
        temperature: softening temperature ``T``, > 0.
        steps: optimizer steps of distillation after an event; ``None`` means until the maintain phase ends
            (with a PulseCycle) or until the next event (step cadence).

    Raises:
        ValueError: naming the field, for a non-positive or non-finite ``weight``/``temperature`` or a
            ``steps`` that is not an int >= 1.
    """

    weight: float = 1.0
    temperature: float = 2.0
    steps: int | None = None

    @names_itself  # "DistillConfig: `weight`=...", as the other nested configs name themselves
    def __post_init__(self) -> None:
        for name in ("weight", "temperature"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"`{name}`={value!r} must be a positive finite number.")
        steps = self.steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"`steps`={steps!r} must be None or an int >= 1.")


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``T**2 * KL(softmax(t / T) || softmax(s / T))``, averaged over positions.

    Args:
        student_logits: ``(..., C)`` logits of the student.
        teacher_logits: ``(..., C)`` logits of the teacher.
        temperature: softening temperature ``T``; the ``T**2`` factor keeps gradient sizes comparable across
            temperatures (Hinton et al. 2015).

    Returns:
        A scalar: the KL summed over classes, averaged over every leading position (batch, sequence, ...).
    """
    classes = student_logits.shape[-1]
    log_p_student = F.log_softmax(student_logits.float().reshape(-1, classes) / temperature, dim=-1)
    log_p_teacher = F.log_softmax(teacher_logits.float().reshape(-1, classes) / temperature, dim=-1)
    return temperature**2 * F.kl_div(log_p_student, log_p_teacher, reduction="batchmean", log_target=True)


class _AddDistillationGradient(torch.autograd.Function):
    """Identity on the student's logits whose backward adds ``weight * d(distillation_loss)/dlogits``."""

    @staticmethod
    def forward(
        ctx: Any,
        student: torch.Tensor,
        teacher: torch.Tensor,
        weight: float,
        temperature: float,
        loss_scale: Callable[[], torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(student, teacher)
        ctx.weight = weight
        ctx.temperature = temperature
        ctx.loss_scale = loss_scale
        return student.view_as(student)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        student, teacher = ctx.saved_tensors
        temperature = ctx.temperature
        positions = student.numel() // student.shape[-1]
        p_student = torch.softmax(student.float() / temperature, dim=-1)
        p_teacher = torch.softmax(teacher.float() / temperature, dim=-1)
        # d/ds [T^2 * mean_n KL(p_t || softmax(s/T))] = T * (p_s - p_t) / N, its factors in one coefficient: one
        # vocabulary-sized multiply per backward
        coefficient: float | torch.Tensor = ctx.weight * temperature / positions
        # grad_output is the scaled loss's: read at backward, after the scaler's scale() made its tensor
        if ctx.loss_scale is not None and (scale := ctx.loss_scale()) is not None:
            coefficient = scale * coefficient
        extra = (p_student - p_teacher) * coefficient
        return grad_output + extra.to(grad_output.dtype), None, None, None, None


class LogitDistiller:
    """Distils ``teacher`` into ``student`` through a forward hook on the student.

    Every training-mode, grad-enabled call of ``student`` that returns a floating tensor of at least two
    dimensions (logits ``(B, C)`` or ``(B, T, C)``) runs ``teacher`` on the same arguments and adds the
    distillation gradient to that output. Other calls (evaluation, a Lightning strategy's redirected
    ``training_step`` returning a loss) pass through untouched.

    Args:
        student: the module being trained (its forward output must be the logits).
        teacher: a frozen module with the same output shape; it is put in eval mode.
        weight: multiplier of the distillation term (divide by the gradient-accumulation factor to match a
            loss that Lightning divides by it).
        temperature: softening temperature.

    Attributes:
        maximized: the optimizers ascend the loss the module returns (torch's ``maximize=True``): the term's
            gradient is added negated, since they negate it with the rest, so that they descend the KL.
        loss_scale: reads the factor the loss is multiplied by before its backward (a GradScaler's scale
            tensor, ``16-mixed``; ``None`` without one): the term's gradient is multiplied by it too, as the
            scaler divides every gradient by it before the step. Not pickled.
    """

    def __init__(
        self, student: nn.Module, teacher: nn.Module, weight: float = 1.0, temperature: float = 2.0
    ) -> None:
        self.student = student
        self.teacher = teacher.eval()
        for parameter in self.teacher.parameters():
            parameter.requires_grad_(False)
        self.weight = float(weight)
        self.temperature = float(temperature)
        self.calls = 0
        self.mismatched_calls = 0
        self._loss_total = torch.zeros((), dtype=torch.float64)
        self._handle: Any = None
        self.maximized = False
        self.loss_scale: Callable[[], torch.Tensor | None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "loss_scale": None}

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def attach(self) -> None:
        if self._handle is None:
            self._handle = self.student.register_forward_hook(self._hook, with_kwargs=True)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def mean_loss(self) -> float:
        """Mean distillation loss (before ``weight``) over the calls so far; NaN if none."""
        return float(self._loss_total) / self.calls if self.calls else float("nan")

    def state_dict(self) -> dict[str, Any]:
        """The teacher's tensors (its ``state_dict()``) and the running loss, enough to continue after a
        restore. No module object is pickled: a checkpoint holding one could not be saved for a module with an
        attribute pickle cannot take (a lambda), ran code when read, and needed the class where it was at
        save time (``__main__.Net``); the restore rebuilds the teacher from the student
        (:func:`teacher_from_state`)."""
        tensors = self.teacher.state_dict()
        return {"teacher_state": dict(tensors), "calls": self.calls, "loss_total": float(self._loss_total)}

    @classmethod
    def from_state_dict(
        cls,
        student: nn.Module,
        state: dict[str, Any],
        weight: float = 1.0,
        temperature: float = 2.0,
        teacher: nn.Module | None = None,
        template: nn.Module | None = None,
    ) -> LogitDistiller:
        """The distiller saved in ``state``, its teacher ``teacher`` (the live one, at a rollback) or rebuilt
        from ``student`` (or in ``template``) and the saved tensors (:func:`teacher_from_state`).

        Raises:
            PulseRefusal: the teacher cannot be rebuilt, or ``state`` holds a pickled one (an earlier
                version's checkpoint), which is not unpickled.
        """
        if teacher is None:
            if "teacher_state" not in state:
                raise PulseRefusal(
                    "ScheduledPrune: the checkpoint holds the distillation teacher (`distill`) as a pickled "
                    "module, as earlier versions saved it, and it is not unpickled: that runs whatever code "
                    "the file holds, past `weights_only=True`. Resume from a checkpoint saved outside a "
                    "distillation window, or with the version that wrote it."
                )
            tensors, step = state["teacher_state"], state.get("event_step")
            teacher = teacher_from_state(student, tensors, step, template)
        distiller = cls(student, teacher, weight=weight, temperature=temperature)
        distiller.calls = int(state["calls"])
        distiller._loss_total = torch.tensor(float(state["loss_total"]), dtype=torch.float64)
        return distiller

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if module is not self.student or not module.training or not torch.is_grad_enabled():
            return None
        if not (isinstance(output, torch.Tensor) and output.is_floating_point() and output.dim() >= 2):
            return None
        if not output.requires_grad:
            return None
        with torch.no_grad():
            teacher_output = self.teacher(*args, **kwargs)
        if not isinstance(teacher_output, torch.Tensor) or teacher_output.shape != output.shape:
            self.mismatched_calls += 1
            return None
        self.calls += 1
        # accumulated as a tensor: no device sync per step
        self._loss_total = (
            self._loss_total.to(output.device)
            + distillation_loss(output.detach(), teacher_output, self.temperature).double()
        )
        weight = -self.weight if self.maximized else self.weight  # see `maximized`
        teacher_output, scale = teacher_output.detach(), self.loss_scale
        return _AddDistillationGradient.apply(output, teacher_output, weight, self.temperature, scale)


def teacher_from_state(
    student: nn.Module,
    tensors: dict[str, Any],
    event_step: int | None = None,
    template: nn.Module | None = None,
) -> nn.Module:
    """The teacher whose ``state_dict()`` was ``tensors``, rebuilt in ``template`` (structured, at a resume:
    the model as built, with the cuts before the teacher's event redone) or in a hook-free copy of ``student``
    (:func:`~lightning_pulse.core.pruning.copy_without_hooks`): the teacher is the student as it was before an
    event. Unstructured: the copy's masks are made those the teacher had (an event masks more layers);
    structured without ``template`` (a rollback): its layers take the teacher's wider shapes
    (:func:`~lightning_pulse.core.prune_widths.fit_widths`; a cut module cannot be given its channels back by
    replaying removals). Every value then comes from ``tensors``.

    Raises:
        PulseRefusal: the copy cannot take ``tensors`` (a layer whose width its shapes do not tell, a grouped
            convolution; or other entries), naming the event's step and the way out.
    """
    teacher = template if template is not None else pruning.copy_without_hooks(student)
    masked = {key[: -len(".weight_mask")] for key in tensors if key.endswith(".weight_mask")}
    unmasked = set(pruning.masked_layer_names(teacher)) - masked
    try:
        if unmasked:  # masked by the event itself: the teacher computed with the plain weight
            pruning.make_masks_permanent(teacher, only=unmasked, tensors={"weight"})
        for name in masked:
            pruning.add_mask(teacher.get_submodule(name))
        prune_widths.fit_widths(teacher, tensors)
        if (
            template is not None
        ):  # copied as Lightning restores the model, before its dtype and device are set
            _to_saved_dtypes(teacher, tensors, next((p.device for p in student.parameters()), None))
        teacher.load_state_dict(tensors)
    except (RuntimeError, AttributeError, KeyError) as error:
        when = f"the event of step {event_step}" if event_step is not None else "the event"
        raise PulseRefusal(
            f"ScheduledPrune: the distillation teacher (`distill`: the model before {when}) saved in the "
            f"checkpoint cannot be rebuilt from the resumed model ({error}). Resume from a checkpoint saved "
            "outside a distillation window, or without `distill`."
        ) from error
    return teacher


def _to_saved_dtypes(teacher: nn.Module, tensors: dict[str, Any], device: torch.device | None) -> None:
    """Give each of ``teacher``'s parameters and buffers the dtype of its saved tensor (``bf16-true``,
    ``64-true``) and the student's ``device``: ``load_state_dict`` copies values, keeping its own."""
    for name, tensor in [*teacher.named_parameters(), *teacher.named_buffers()]:
        saved = tensors.get(name)
        dtype = saved.dtype if isinstance(saved, torch.Tensor) else tensor.dtype
        if tensor.dtype != dtype or (device is not None and tensor.device != device):
            tensor.data = tensor.data.to(device=device, dtype=dtype)


#: what parameter groups that mix both directions do to the distillation, and the ways out, for the refusal
#: (:func:`~lightning_pulse.core.loss_direction.maximizes_loss`)
_MIXED = (
    "the term it adds to the logits' gradient would pull the groups that descend the loss toward the model "
    "before the event and push the groups that ascend it away from it",
    "or leave `distill` out (pruning itself reads no loss)",
)


class DistillWindow:
    """The distillation window after a pruning event: at most one open at a time, closed after
    ``config.steps`` optimizer steps (see :meth:`step`) or by the caller.

    Args:
        config: weight, temperature and length of each window.
    """

    def __init__(self, config: DistillConfig) -> None:
        self.config = config
        self.distiller: LogitDistiller | None = None
        self.steps_left: int | None = None
        # the step of the event the open window follows (its record's ``step``), not its index: the record
        # list keeps the latest RECENT_RECORDS, so an index shifts once older records drop
        self.event_step: int | None = None
        # (event step, teacher) of the last window, closed, until the next opens: a StabilityGuard rollback
        # into it takes that teacher back (a structured rollback never crosses a cut, so no older one is
        # needed; rebuilding it from the cut student fails for widths its shapes do not tell, a depthwise
        # convolution's). Not pickled: a checkpoint holds the teacher's tensors only.
        self._last: tuple[int | None, nn.Module] | None = None
        self.maximized = False  # the optimizers ascend the loss (read_direction): each window's distiller's
        self.loss_scale: Callable[[], torch.Tensor | None] | None = None  # the run's GradScaler's: each one's

    def read_direction(self, optimizers: Any) -> None:
        """At train start, before a restored window reopens: whether ``optimizers`` ascend the loss the module
        returns (torch's ``maximize=True``; :attr:`LogitDistiller.maximized`).

        Raises:
            PulseRefusal: for parameter groups that mix ``maximize=True`` and ``False``.
        """
        self.maximized = maximizes_loss(optimizers, "ScheduledPrune's distillation (`distill`)", *_MIXED)

    def open(
        self,
        student: nn.Module,
        teacher: nn.Module | LogitDistiller,
        event_step: int | None,
        accumulation: int = 1,
        steps_left: int | None = None,
    ) -> None:
        """Start distilling ``teacher`` into ``student`` after the event at optimizer step ``event_step``
        (``None``: unknown); the term is divided by ``accumulation`` (the gradient-accumulation factor), as
        Lightning divides the loss."""
        self.close()
        self._last = None
        distiller = teacher if isinstance(teacher, LogitDistiller) else LogitDistiller(student, teacher)
        distiller.weight = self.config.weight / max(1, accumulation)
        distiller.temperature = self.config.temperature
        distiller.maximized, distiller.loss_scale = self.maximized, self.loss_scale
        distiller.attach()
        self.distiller, self.event_step = distiller, event_step
        self.steps_left = self.config.steps if steps_left is None else steps_left

    def accumulate(self, accumulation: int) -> None:
        """The open window's term is divided by ``accumulation`` from now on: the gradient-accumulation factor
        changed (a ``GradientAccumulationScheduler`` sets it at an epoch's start, after a resume reopened the
        window at the Trainer's factor)."""
        if self.distiller is not None:
            self.distiller.weight = self.config.weight / max(1, accumulation)

    def ends_with(self, change: PhaseChange) -> bool:
        """Whether the phase ``change`` ends the window: it leaves a maintain phase, and the window lasts until
        then (``config.steps`` is ``None``)."""
        leaves_maintain = change.previous is Phase.MAINTAIN and change.current is not Phase.MAINTAIN
        return leaves_maintain and self.config.steps is None

    def step(self, steps: int = 1) -> bool:
        """Count ``steps`` optimizer steps; whether the window's length is used up (the caller closes it)."""
        if self.distiller is None or self.steps_left is None:
            return False
        self.steps_left -= steps
        return self.steps_left <= 0

    def close(self, events: list[dict[str, Any]] | None = None) -> tuple[int, float] | None:
        """Stop distilling: ``(calls, mean loss)`` of the window, or ``None`` if none was open. With
        ``events`` (event records, oldest first), the record of the window's event (found by its ``step``)
        gets ``distill_calls`` and ``distill_loss``."""
        distiller, self.distiller = self.distiller, None
        if distiller is None:
            return None
        distiller.detach()
        step, self.event_step, self.steps_left = self.event_step, None, None
        self._last = (step, distiller.teacher)
        # searched from the newest: the window's event is the last record (none if it was dropped)
        found = (r for r in reversed(events or ()) if r.get("step") == step)
        record = next(found, None) if step is not None else None
        if record is not None:
            record["distill_calls"] = record.get("distill_calls", 0) + distiller.calls
            record["distill_loss"] = distiller.mean_loss
        return distiller.calls, distiller.mean_loss

    def state_dict(self) -> dict[str, Any] | None:
        if self.distiller is None:
            return None
        return {**self.distiller.state_dict(), "steps_left": self.steps_left, "event_step": self.event_step}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last": None, "loss_scale": None}

    def restore(
        self,
        student: nn.Module,
        state: dict[str, Any] | None,
        accumulation: int = 1,
        template: nn.Module | None = None,
    ) -> None:
        """Close the open window and reopen the one saved in ``state``, if any (a resume or a rollback). A
        rollback into the window still open keeps its teacher (a frozen copy: the saved tensors are its own);
        else the teacher is rebuilt (:func:`teacher_from_state`, in ``template`` where given)."""
        live, step = None, None if state is None else state.get("event_step")
        if step is not None and self.distiller is not None and step == self.event_step:
            live = self.distiller.teacher
        elif step is not None and self._last is not None and step == self._last[0]:
            live = self._last[1]  # a rollback into the last window, since closed
        self.close()
        if state is not None:
            self.load_state_dict(student, state, accumulation, live, template)

    def load_state_dict(
        self,
        student: nn.Module,
        state: dict[str, Any],
        accumulation: int = 1,
        teacher: nn.Module | None = None,
        template: nn.Module | None = None,
    ) -> None:
        """Reopen the window saved in ``state`` (its teacher, running loss, steps left and event's step); the
        teacher is ``teacher``, or rebuilt (:meth:`LogitDistiller.from_state_dict`)."""
        distiller = LogitDistiller.from_state_dict(student, state, teacher=teacher, template=template)
        step = state.get("event_step")
        self.open(student, distiller, None if step is None else int(step), accumulation, state["steps_left"])
