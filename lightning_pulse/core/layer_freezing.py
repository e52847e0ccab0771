"""Stability-based freezing of a model's leading units, so that backward stops early. Plain torch.

:class:`LayerFreezer` is the state machine. Every ``check_every`` optimizer steps it scores each training unit
(see :mod:`lightning_pulse.core.freeze_units`) by its plasticity, its relative parameter movement over the
window against the largest it ever had, and freezes the longest stable *prefix* (``requires_grad`` off), for at
most ``freeze_for`` steps before the prefix trains one window again to re-check. A unit whose norm is still
growing (by more than :data:`MAX_STABLE_GROWTH` over a window) is not stable whatever its score: it is still
learning its scale from a small or zero init (LoRA's adapters, a zero-initialised residual branch, a layer scale),
and its first windows, moving far relative to its tiny norm, set a peak that later windows only look small
against.

Why a prefix: autograd only skips work when nothing upstream needs a gradient. Freezing the first ``k`` units
means the activation entering unit ``k`` does not require grad, so backward stops there and neither the weight
gradients nor the input gradients of the prefix are computed. Freezing a unit in the middle would only save
its weight gradients.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_pulse.core.activation_cache import FEATURE_ENCODER_HINT, LoaderActivationCache, reads_gradient
from lightning_pulse.core.backward_flops import BackwardFlopLedger
from lightning_pulse.core.custom_functions import DDP_INNER_BACKWARD, FunctionScan
from lightning_pulse.core.forward_calls import ForwardCalls, sequence_number
from lightning_pulse.core.freeze_metrics import freeze_event
from lightning_pulse.core.freeze_units import (
    ForwardOrderTrace,
    FreezeUnit,
    agree_inputs,
    cut_like,
    discover_units,
    farthest_reads,
    finer_units_way_out,
    head_positions,
    heads_note,
    mark_inputs,
    mark_shared,
    order_note,
    parameters_outside,
    pinned_note,
    replace_unit_parameters,
    reread_note,
    units_changed_since,
    untrained_entries,
)
from lightning_pulse.core.func_transforms import transform_active, unwrapped
from lightning_pulse.core.snapshots import hook_around_steps, is_zero_redundancy, runs_step_hooks
from lightning_pulse.core.stand_in_gradients import StandInGradients
from lightning_pulse.errors import PulseRefusal, refuse_sharded_strategy
from lightning_pulse.phase import KNOWN_LENGTH
from lightning_pulse.records import append_recent

STATE_VERSION = 2
# the `units` argument of the run that saved a state (a key of its own: older states are read without it)
UNITS_ARGUMENT = "units_argument"


# ---------------------------------------------------------------------------------------------------- settings
def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _check_run_point(name: str, point: int | float | None) -> None:
    if point is None:
        return
    if not _is_number(point):
        raise ValueError(f"`{name}`={point!r} must be an int step, a float share in [0, 1], or None.")
    if isinstance(point, int) and point < 0:
        raise ValueError(f"`{name}`={point!r} must be a non-negative int step.")
    if isinstance(point, float) and not 0.0 <= point <= 1.0:
        raise ValueError(f"`{name}`={point!r} must be a float share in [0, 1] of the run.")


@dataclass(frozen=True)
class FreezeWindow:
    """When freezing is allowed: in which pulse phases, and between which optimizer steps.

    Attributes:
        phases: names of the phases in which units may be frozen.
        start_at: no freezing before this point: an ``int`` step or a ``float`` share of the run in [0, 1].
        release_at: no freezing from this point on (same forms); ``None``: never.
    """

    phases: tuple[str, ...] = ("replay", "maintain")
    start_at: int | float | None = None
    release_at: int | float | None = None

    def __post_init__(self) -> None:
        from lightning_pulse.phase import PHASE_NAMES

        phases = self.phases  # its type before any truth test: an array's is ambiguous
        names = tuple(phases) if isinstance(phases, Iterable) and not isinstance(phases, str) else ()
        if not names or not all(isinstance(name, str) and name in PHASE_NAMES for name in names):
            raise ValueError(
                f"`phases`={phases!r} must be a non-empty list of phase names from {list(PHASE_NAMES)}."
            )
        object.__setattr__(self, "phases", names)
        _check_run_point("start_at", self.start_at)
        _check_run_point("release_at", self.release_at)
        if self.release_at is not None:
            start = self.start_at if self.start_at is not None else type(self.release_at)(0)
            # a step against a share compares only once the run's length is known: steps() does it then
            if type(start) is type(self.release_at) and self.release_at <= start:
                raise ValueError(_empty_window_text(self.start_at, self.release_at))

    def steps(self, total_steps: float) -> tuple[int | None, int | None]:
        """``(start, release)`` as optimizer steps of a run of ``total_steps``.

        Raises:
            ValueError: for a ``float`` share when ``total_steps`` is not finite.
        """
        resolved = []
        for name, point in (("start_at", self.start_at), ("release_at", self.release_at)):
            if isinstance(point, float):
                if not math.isfinite(total_steps):
                    raise ValueError(
                        f"`{name}`={point!r} is a share of the run, which needs {KNOWN_LENGTH}; give an int step "
                        "instead."
                    )
                point = int(round(point * total_steps))
            resolved.append(point)
        start, release = resolved
        if release is not None and release <= (start or 0):
            raise ValueError(
                _empty_window_text(
                    self.start_at, self.release_at, f" (steps {start or 0} and {release} of this run)"
                )
            )
        return start, release


def _empty_window_text(start_at: int | float | None, release_at: int | float, steps: str = "") -> str:
    return (
        f"`release_at`={release_at!r} is not after `start_at`={start_at!r}{steps}, so nothing would ever be "
        "frozen. Give a `release_at` after `start_at`, or None to never release."
    )


def in_span(span: tuple[int | None, int | None], step: int) -> bool:
    """Whether optimizer step ``step`` lies in ``span``, a ``(start, release)`` from :meth:`FreezeWindow.steps`."""
    start, release = span
    return (start is None or step >= start) and (release is None or step < release)


#: the most a unit's parameter norm may grow over a window for the unit to count as stable. A held-out LoRA
#: model's adapters, still growing 3-16% a window, scored 0.03-0.14 and were frozen (val loss 1.8x plain);
#: the units frozen on the MNIST-1D CNN benchmark shrank or held their norm (0.96-1.00 of the window's start).
MAX_STABLE_GROWTH = 0.01


@dataclass(frozen=True)
class FreezeSettings:
    """Validated settings of a :class:`LayerFreezer`.

    Attributes:
        threshold: a unit is stable when its plasticity score (movement over the last window divided by the
            largest window movement it ever had) is ``<= threshold`` and its norm grew by at most
            :data:`MAX_STABLE_GROWTH` over the window; ``>= 0``. Scores never exceed 1, so ``threshold >= 1``
            freezes whatever has been checked once (growing or not).
        check_every: optimizer steps per window; units are scored at the end of every window.
        freeze_for: longest freeze, in optimizer steps, before the prefix trains one window to re-check; a
            multiple of ``check_every``.
        max_frozen_share: largest share of the trainable parameters frozen at once, in (0, 1].
    """

    threshold: float = 0.2
    check_every: int = 20
    freeze_for: int = 200
    max_frozen_share: float = 0.9

    def __post_init__(self) -> None:
        if not _is_number(self.threshold) or not 0.0 <= self.threshold < math.inf:
            raise ValueError(f"`threshold`={self.threshold!r} must be a finite number >= 0.")
        for name in ("check_every", "freeze_for"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}`={value!r} must be a positive int of optimizer steps.")
        if self.freeze_for % self.check_every:
            raise ValueError(
                f"`freeze_for`={self.freeze_for} must be a multiple of `check_every`={self.check_every}, "
                "because freezes start and end at checks."
            )
        share = self.max_frozen_share
        if not _is_number(share) or not 0.0 < share <= 1.0:
            raise ValueError(f"`max_frozen_share`={share!r} must be a number in (0, 1].")


def relative_parameter_change(params: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor]) -> float:
    """``||theta - theta_snapshot|| / ||theta_snapshot||``: how far a unit moved over a window (plasticity)."""
    return relative_parameter_changes([(params, snapshot)])[0]


def relative_parameter_changes(
    pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
) -> list[float]:
    """:func:`relative_parameter_change` of several units at once, with a single host sync."""
    return [rate for rate, _ in window_movements(pairs)]


def _real_float(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 (float64 stays), a complex one as its real and imaginary parts (a cast to a real
    dtype would drop the imaginary part: a parameter moving only there looked still). Half-precision values
    widen exactly, so their difference is taken without rounding."""
    tensor = torch.view_as_real(tensor.detach()) if tensor.is_complex() else tensor.detach()
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


#: values per fused call of :func:`window_movements` (16 MB of float32): bounds its temporaries on a large model
WINDOW_CHUNK_VALUES = 1 << 22


def _chunks(tensors: Sequence[torch.Tensor], limit: int) -> list[slice]:
    """Consecutive slices of ``tensors`` holding at most ``limit`` values each (a larger tensor alone)."""
    slices, start, values = [], 0, 0
    for end, tensor in enumerate(tensors):
        if end > start and values + tensor.numel() > limit:
            slices.append(slice(start, end))
            start, values = end, 0
        values += tensor.numel()
    if start < len(tensors):
        slices.append(slice(start, len(tensors)))
    return slices


def window_movements(
    pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
) -> list[tuple[float, float]]:
    """For each unit ``(params, snapshot)``: its relative change (:func:`relative_parameter_change`) and the
    relative growth of its norm, ``||theta|| / ||theta_snapshot|| - 1`` (``inf`` from a zero snapshot), with a
    single host sync."""
    if not pairs:
        return []
    params = [p for unit, _ in pairs for p in unit]
    snapshot = [s for _, unit in pairs for s in unit]
    moved: list[torch.Tensor] = []
    reference: list[torch.Tensor] = []
    current: list[torch.Tensor] = []
    for chunk in _chunks(params, WINDOW_CHUNK_VALUES):
        # three fused norm kernels per chunk, not three ops per tensor; a chunk's float32 copies and
        # differences are the only temporaries (all at once took 6x a bf16 model's size on a window check)
        now = [_real_float(p) for p in params[chunk]]
        then = [_real_float(s) for s in snapshot[chunk]]
        moved += torch._foreach_norm(torch._foreach_sub(now, then), 2.0)
        reference += torch._foreach_norm(then, 2.0)
        current += torch._foreach_norm(now, 2.0)
    norms = [*moved, *reference, *current]
    if len({n.device for n in norms}) > 1:  # a model split over devices: its norms meet on the first one
        norms = [n.to(norms[0].device) for n in norms]
    read = torch.stack(norms).tolist() if norms else []
    count = len(params)
    movements, start = [], 0
    for unit, _ in pairs:
        end = start + len(unit)
        # a unit's norm from its tensors' norms, squared and summed in float64
        moved, reference, current = (
            math.sqrt(sum(value * value for value in read[base + start : base + end]))
            for base in (0, count, 2 * count)
        )
        start = end
        if reference > 0:
            movements.append((moved / reference, current / reference - 1.0))
        else:
            movements.append((math.inf, math.inf) if moved > 0 else (0.0, 0.0))
    return movements


#: why GradientCache refuses FSDP, DeepSpeed and ModelParallelStrategy (``errors.refuse_sharded_strategy``)
SHARDED_REASON = "a rank holds flattened shards, so per-module `requires_grad` is not per layer"


# ---------------------------------------------------------------------------------------------------- the freezer
@dataclass
class StepReport:
    """What one call of :meth:`LayerFreezer.step` did."""

    window_closed: bool = False
    changed: bool = False
    frozen_prefix: int = 0
    frozen_share: float = 0.0
    refreshed: list[str] = field(default_factory=list)
    outgrown: bool = False  # parameters outside the units train: nothing frozen until the units are retraced
    taken_back: bool = False  # someone else turned a frozen unit back on: the prefix was released first
    misplaced: bool = False  # a unit the ordering backward missed got a gradient: the order is traced again
    held: list[int] = field(
        default_factory=list
    )  # the units frozen during this backward (their grad is None)

    @property
    def reason(self) -> str:
        """Why the prefix changed at this step: ``"retrace"``, ``"check"`` (a window closed) or ``"release"``."""
        return "retrace" if self.outgrown or self.misplaced else "check" if self.window_closed else "release"


class LayerFreezer:
    """Windows, plasticity scores and the frozen prefix of a list of :class:`FreezeUnit` in forward order.

    Call :meth:`step` once per optimizer step, after the gradients are final and before the optimizer uses them.
    It

    1. counts the step into the window of every trainable unit;
    2. every ``check_every`` steps closes the window: each unit that trained the whole window is scored by its
       movement since the window's start (``||theta - theta_start|| / ||theta_start||``) divided by the largest
       such movement it ever had, and is stable when the score is ``<= threshold``; then the longest prefix of
       stable, fresh units within ``max_frozen_share`` in which no unit reads from a later one
       (:func:`~lightning_pulse.core.freeze_units.farthest_reads`) is frozen (``requires_grad`` off). A unit
       is fresh while its last score is younger than ``freeze_for`` steps; a frozen prefix whose oldest score
       expires is released for one window to be scored again (a refresh; a *hit* if it is still stable);
    3. sets ``grad=None`` on the units that were frozen during this backward, so torch optimizers skip them
       (no momentum, no weight decay, no step count).

    The units cover the parameters that trained when they were discovered. Once a parameter ``outside`` them
    requires grad (the user unfroze a backbone), a frozen prefix could have trainable layers before it: backward
    would still run through it, and it would stand still while its inputs change. So where a freeze is decided
    (a window's end, a light phase, a restored state; :meth:`check_outside` at other points) the freezer
    checks ``outside``; if one trains, it releases everything and freezes nothing more (:attr:`outgrown`) until
    its units are discovered again (:meth:`FreezerLifecycle.retrace`). One trains when it requires grad and
    got a gradient or one of ``optimizers`` holds it (:meth:`_outside_trains`). At the same points the
    ``model``'s parameters are compared with the units' and ``outside`` (a set of ids): a parameter created
    since (a layer the user replaced) joins ``outside``, and a trained unit's parameter the model no longer
    holds (:attr:`replaced`) counts as outgrown too, or the freezer would go on freezing (and reporting as
    skipped) parameter objects the model no longer uses.

    Args:
        units: the bound units in forward order (see :func:`discover_units` and :func:`order_units`).
        settings: validated :class:`FreezeSettings`.
        outside: the model's parameters in no unit (:func:`~lightning_pulse.core.freeze_units.parameters_outside`);
            none: the trainable set is not watched.
        optimizers: the fit's optimizers, read at each look (a param group added later counts); ``None``:
            unknown, so an ``outside`` parameter trains as soon as it requires grad.
        model: the module whose parameters the units and ``outside`` cover; ``None``: it is not compared.
    """

    def __init__(
        self,
        units: Sequence[FreezeUnit],
        settings: FreezeSettings | None = None,
        outside: Iterable[nn.Parameter] = (),
        rare: Iterable[str] = (),
        optimizers: Sequence[torch.optim.Optimizer] | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self.units = list(units)
        self.settings = settings or FreezeSettings()
        self.outside = list(outside)
        self.optimizers = optimizers
        self.outgrown = False  # a parameter outside the units requires grad: nothing freezes any more
        self.model = model
        # ids of the model's parameters at the last look (_parameters_changed); the units' and `outside`'s
        self._known = {id(param) for unit in self.units for param in unit.params} | set(map(id, self.outside))
        self.replaced: list[str] = []  # trained units' parameters the model no longer holds
        n = len(self.units)
        # units the ordering backward gave no gradient (ordered last): one that gets a gradient later (a block
        # LayerDrop skipped then) has an unknown place, so nothing freezes until the units are ordered again;
        # except ``rare`` ones, which :class:`ForwardOrderTrace` waited for in vain (trained less than once in
        # its MAX_BACKWARDS backwards): they stay last, or the run would spend its time ordering
        self.rare = sorted(set(rare))
        self._unplaced = [
            i for i, unit in enumerate(self.units) if not unit.used and unit.name not in self.rare
        ]
        self.misplaced: list[str] = []  # those of them found with a gradient (DDP: rank 0's, at a window end)
        self._unplaced_trained: list[str] = []
        used = [i for i, unit in enumerate(self.units) if unit.used]
        # the last unit that gets a gradient always trains, so the loss still requires grad
        self.freezable_limit = used[-1] if used else 0
        self._count()
        self.steps = 0
        self.step_in_window = 0
        self.frozen = [False] * n
        self.stable = [False] * n
        self.growing = [False] * n  # the norm grew by more than MAX_STABLE_GROWTH over the last window
        self.scores: list[float | None] = [None] * n
        self.validated_at: list[int | None] = [None] * n
        self.peak_rate = [0.0] * n
        self.checking = [False] * n  # released from a freeze; the next full window is a refresh
        self.window_count = [0] * n
        # a unit that never moved (peak_rate 0) went without a gradient at a step of its window: read only then
        self.gradient_missed = [False] * n
        # each unit's parameters at its window's start, on their device (1x the units' parameters, for the
        # whole fit): replaced by new tensors, never written in place, as state_dict hands these out uncopied
        self.snapshot: list[list[torch.Tensor]] = [self._clone_params(i) for i in range(n)]
        self.refreshes = 0
        self.refresh_hits = 0
        self.frozen_share_sum = 0.0
        self.freezes = 0
        # the parameters this freezer turned off: only these are turned back on, so a parameter the user (or
        # another callback, BackboneFinetuning say) froze meanwhile stays as they left it
        self._turned_off: dict[int, nn.Parameter] = {}
        # for state_before_step: the frozen share summed before the step counted last (None: none counted since
        # built or loaded), and (steps, state before it, events it recorded) where it changed more than counts
        self._share_sum_before: float | None = None
        self._before_step: tuple[int, dict[str, Any], int] | None = None
        # a restored state's movements of the window its first step closes: (that step's count, by unit)
        self._known_movements: tuple[int, dict[int, tuple[float, float]]] | None = None
        # a restored state saved inside a step whose window end found parameters outside the units training
        # (``"outgrown"``): until that step is counted, the prefix it saved holds, as in the run that saved it
        self._outgrown_at_close = False

    # ------------------------------------------------------------------ read-only views
    @property
    def frozen_prefix(self) -> int:
        """How many leading units are frozen now."""
        count = 0
        while count < len(self.units) and self.frozen[count]:
            count += 1
        return count

    @property
    def frozen_share(self) -> float:
        """Share of the trainable parameters that are frozen now."""
        frozen = sum(numel for numel, is_frozen in zip(self._unit_numel, self.frozen) if is_frozen)
        return frozen / self.trainable_numel if self.trainable_numel else 0.0

    @property
    def staleness(self) -> int:
        """Steps since the oldest score of a frozen unit was taken (0 if none is frozen)."""
        ages = [self.steps - (self.validated_at[i] or 0) for i in range(len(self.units)) if self.frozen[i]]
        return max(ages, default=0)

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of refreshes (a released unit's first full window) that found the unit still stable."""
        return self.refresh_hits / self.refreshes if self.refreshes else None

    @property
    def mean_frozen_share(self) -> float:
        """Parameter share frozen during backward, averaged over the steps seen."""
        return self.frozen_share_sum / self.steps if self.steps else 0.0

    @property
    def pinned_first(self) -> str | None:
        """Why nothing can ever be frozen, when the first unit in forward order is pinned (a tied embedding)."""
        first = self.units[0] if self.units and self.freezable_limit else None
        if first is None or not first.pinned:
            return None
        said = ", ".join(first.shared_with)
        if READ_BY_PARENT in said:
            parent = said.partition(READ_BY_PARENT)[2].strip().partition(" (")[0]
            return (
                f"the first unit in forward order, {first.name}, has {said.strip('<>')}: that forward reads "
                f"the unit's parameter with its own (a fused layer folding its child's weight into its "
                "own), and the automatic split divided it, so freezing the unit alone would stop a read the "
                f"rest of {parent} trains through, and nothing can be frozen; name {parent} as one entry "
                "in `units` to let it freeze as a whole"
            )
        if "<its weight read again outside its own forward" in said:
            return (
                f"the first unit in forward order, {first.name}, shares {said.strip('<>')}: another layer "
                "reads it too (a tie without a second name, as an output projection `F.linear(h, embed.weight)` "
                "reading the embedding's weight), so nothing can be frozen without stopping that read; give "
                "that layer its own weight (Hugging Face: `tie_word_embeddings=False`) to let it freeze"
            )
        return (
            f"the first unit in forward order, {first.name}, shares a parameter with "
            f"{', '.join(first.shared_with)} (a tied input and output layer), so nothing can be frozen without "
            "stopping the other side; untie them (Hugging Face: `tie_word_embeddings=False`) to let it freeze"
        )

    def idle_note(self, steps: int | None = None, rolled_back_at: int | None = None) -> str | None:
        """What the freezer measured, when it froze nothing in the run (``None`` if it froze something): so a
        run whose defaults never acted says why they waited.

        Args:
            steps: the run's optimizer steps (``None``: :attr:`steps`, which a rollback takes back).
            rolled_back_at: the optimizer steps taken when the fit last rolled back (the scores went back to a
                snapshot's); ``None``: no rollback.
        """
        if self.freezes or not self.freezable_limit or self.pinned_first is not None:
            return None  # it acted, or fit start said why it cannot (a single unit, or a tie)
        threshold, every = self.settings.threshold, self.settings.check_every
        most = self.settings.max_frozen_share
        nothing = f"froze nothing in {self.steps if steps is None else steps} steps"
        if rolled_back_at is not None:
            nothing += (
                f" (a rollback after {rolled_back_at} steps took its scores back to those of a snapshot)"
            )
        if self._unit_numel[0] > most * self.trainable_numel:  # no prefix fits (_propose): waiting was not it
            return (
                f"{nothing}: a frozen prefix starts at the first unit, "
                f"{self.units[0].name}, which holds {self._unit_numel[0] / self.trainable_numel:.0%} of the "
                f"trainable parameters, over max_frozen_share={most:g}, so no prefix fits however long the "
                "run; raise max_frozen_share, or pass `units` to split that unit or leave it out"
            )
        if not any(score is not None for score in self.scores):
            return (
                f"{nothing}: no unit trained a whole window of check_every={every} steps "
                f"{'yet' if rolled_back_at is None else 'since'}, so none was scored"
            )
        first = self.units[0]
        first_score = self.scores[0]
        scored = [(score, unit.name) for score, unit in zip(self.scores, self.units) if score is not None]
        lowest, lowest_name = min(scored)
        said = "not scored" if first_score is None else f"last scored {first_score:.3g}"
        stable_last = first_score is not None and first_score <= threshold
        growing = self.growing[0] and stable_last
        if growing:
            said += f", but its norm was still growing by over {MAX_STABLE_GROWTH:.0%} a window"
        together = farthest_reads(self.units)[0]
        if stable_last and not growing and together > 0:  # its group never was stable and fresh at once
            group = self.units[: together + 1]
            how = next((unit.differentiated for unit in group if unit.differentiated), "")
            cause = "a loop, or a custom autograd Function"
            if how:  # the derivative's backward applies their weights after the later units
                cause = f"the backward of a derivative taken through them, {how}"
            why = (
                f"It freezes only together with the units up to {self.units[together].name} ({cause}: see "
                "the message at the first step), "
            )
            never = self._never_frozen_with(together)
            why += (
                f"{never}, so no prefix can freeze in this fit"
                if never is not None
                else f"which were never all stable at one check within max_frozen_share={most:g}; a longer run, "
                "or a higher threshold, lets them freeze"
            )
        elif first_score is None and self.validated_at[0] is not None and not self.peak_rate[0]:
            # a window closed on it, but no pace to compare with: waiting or a higher threshold cannot help
            why = (
                "No window gave it a pace to compare with: it never moved by a measurable amount, and the "
                "windows in which it stood still did not give it a gradient at every step (a module used on "
                "some batches only), so neither a longer run nor a higher threshold changes that. Freeze it "
                "yourself if it is not meant to train (`requires_grad_(False)` before the fit leaves it out of "
                "the units)"
            )
        elif stable_last and not growing:  # stable at its last check, but no freeze followed it
            why = (
                "Its last check found it stable, but no freeze came after it: freezing waits for a light phase "
                "inside the freezing span, and the run ended (or stayed in a burst) first; a longer run lets it "
                "freeze"
            )
        else:
            way_out = (
                "a longer run lets it freeze"
                if growing
                else "a longer run, or a higher threshold, lets it freeze"
            )
            why = f"The weights were still moving: {way_out}"
        return (
            f"{nothing}: a frozen prefix starts at the first unit, {first.name}, "
            f"{said} (stable at <= threshold={threshold:g}); the lowest last score was {lowest:.3g} "
            f"({lowest_name}). {why}"
        )

    def _never_frozen_with(self, last: int) -> str | None:
        """Why the units up to ``last`` can never be frozen together, or ``None``: the last unit that gets a
        gradient or a head among them, or more parameters than ``max_frozen_share``."""
        if last >= self.freezable_limit:
            return f"and {self.units[last].name} always trains, as the last unit the loss reaches"
        if heads := sorted(i for i in head_positions(self.units) if i <= last):
            return f"and {self.units[heads[0]].name} is a head, which never freezes"
        share = sum(self._unit_numel[: last + 1]) / self.trainable_numel
        if share > self.settings.max_frozen_share:
            return f"which hold {share:.0%} of the trainable parameters, over max_frozen_share"
        return None

    @property
    def frozen_names(self) -> list[str]:
        return [unit.name for unit, frozen in zip(self.units, self.frozen) if frozen]

    def drop_frozen_gradients(self) -> None:
        """``grad=None`` on every frozen unit's parameters, so torch optimizers leave them alone."""
        for unit, is_frozen in zip(self.units, self.frozen):
            for param in unit.params if is_frozen else ():
                param.grad = None

    def turned_off(self) -> list[nn.Parameter]:
        """The parameters this freezer turned off (``requires_grad``) and has not turned back on."""
        return list(self._turned_off.values())

    # ------------------------------------------------------------------ the step
    def step(self, enabled: bool, agree: Callable[[list[bool]], list[bool]] | None = None) -> StepReport:
        """Account one optimizer step whose gradients are final; maybe score the units and move the prefix.

        Args:
            enabled: whether freezing is allowed from the next step on (``False`` in a burst phase or outside
                the freezing span): then the prefix is released.
            agree: maps this process's stable flags, followed by whether a parameter outside the units
                trains, to the flags every process uses (DDP: rank 0's, by broadcast). Called at every window
                end, on every process.
        """
        # someone else turned a frozen unit back on: their gradients count, so everything is released (a change
        # of its own, before whatever this step decides); the state before it kept for state_before_step
        before = self._fields() if self._taken_back() else None
        taken_back = before is not None and self.set_prefix(0)
        self._outgrown_at_close = False  # found again at this step's window end
        frozen_during_backward = [i for i, is_frozen in enumerate(self.frozen) if is_frozen]
        report = StepReport(
            frozen_share=self.frozen_share, taken_back=taken_back, held=frozen_during_backward
        )
        if self._unplaced and not self._unplaced_trained:  # a loop over the unused units' parameters only
            self._unplaced_trained = self._gradient_reached_unplaced()
        if agree is None:
            self.misplaced = self._unplaced_trained
        self._share_sum_before = self.frozen_share_sum
        self.frozen_share_sum += report.frozen_share
        self.steps += 1
        for i, unit in enumerate(self.units):
            if unit.used and not self.frozen[i]:
                self.window_count[i] += 1
                if not self.peak_rate[i] and all(param.grad is None for param in unit.params):
                    self.gradient_missed[i] = True  # idempotent: a step counted again on resume sets it alike
        self.step_in_window += 1
        if self.step_in_window >= self.settings.check_every:
            if before is None:  # the window's state goes: kept (its movements too) for state_before_step
                before = self._fields(counted=True)
            report.window_closed = True
            report.refreshed = self._close_window(before)
            # one broadcast per window carries the stable flags and whether the trainable set grew
            flags = [*self.stable, self.outgrown or self._outside_trains(), bool(self._unplaced_trained)]
            if agree is not None:
                flags = [bool(flag) for flag in agree(flags)]
                # rank 0's answer; the names are only for the message
                self.misplaced = (self._unplaced_trained or ["<on rank 0>"]) if flags[-1] else []
            self.stable, self.outgrown = flags[:-2], flags[-2]
            if self.outgrown:  # a resume from a state saved inside this step finds them here, not before it
                before["outgrown"] = True
            report.changed = self.set_prefix(self._propose(enabled))
            self.step_in_window = 0
        elif (not enabled or self.misplaced) and any(self.frozen):
            if before is None:
                before = self._fields(counted=True)
            report.changed = self.set_prefix(0)
        if before is not None:  # with the events GradientCache records for this step (record_step)
            self._before_step = (self.steps, before, int(report.taken_back) + int(report.changed))
        for i in frozen_during_backward:
            for param in self.units[i].params:
                # None, not zeros: torch optimizers skip a None grad, so no momentum and no weight decay
                param.grad = None
        report.frozen_prefix = self.frozen_prefix
        report.outgrown, report.misplaced = self.outgrown, bool(self.misplaced)
        return report

    def _gradient_reached_unplaced(self) -> list[str]:
        """The unused units (see :attr:`misplaced`) that got a gradient in this step's backward."""
        units = [self.units[i] for i in self._unplaced]
        return [unit.name for unit in units if any(param.grad is not None for param in unit.params)]

    def check_outside(self, agree: Callable[[list[bool]], list[bool]] | None = None) -> bool:
        """Whether a parameter outside the units requires grad now (under DDP rank 0's answer, from ``agree``);
        if so, release everything and freeze nothing more (:attr:`outgrown`). A loop over :attr:`outside`: call
        it where a freeze is decided, not at every step."""
        grew = self._outgrown_now()
        if agree is not None:
            grew = bool(agree([grew])[0])
        if grew:
            self.outgrown = True
            self.set_prefix(0)
        return grew

    def _outside_trains(self) -> bool:
        """Whether a parameter outside the units requires grad and got a gradient or an optimizer holds it.
        One that neither can move, nor slow a backward: a model re-creating an ``nn.Parameter`` in its forward
        (the widely copied VQ-VAE ``VectorQuantizerEMA``) leaves a new one outside at every step, which, taken
        for one that started training, released every unit at every window's end, so nothing ever froze."""
        if self._parameters_changed():
            return True
        wanting = [param for param in self.outside if param.requires_grad]
        if not wanting or self.optimizers is None or any(param.grad is not None for param in wanting):
            return bool(wanting)
        held = optimizer_parameter_ids(self.optimizers)
        return held is None or any(id(param) in held for param in wanting)

    def _parameters_changed(self) -> bool:
        """Whether a trained unit holds a parameter the model no longer does (:attr:`replaced`); parameters
        the model gained since the last look join :attr:`outside`. One set of ids built per look: it runs
        where :meth:`_outside_trains` does, not at every step."""
        if self.model is None or self.replaced:
            return bool(self.replaced)
        current = {id(param) for param in self.model.parameters()}
        if current == self._known:
            return False
        self._known = current
        self.outside = parameters_outside(self.model, self.units)
        self.replaced = [
            name
            for unit in self.units
            if unit.used
            for name, param in zip(unit.param_names, unit.params)
            if id(param) not in current
        ]
        return bool(self.replaced)

    def run_statistics(self) -> dict[str, float]:
        """The run's step count and statistics, which a freezer over rediscovered units continues."""
        names = ("steps", "refreshes", "refresh_hits", "frozen_share_sum", "freezes")
        return {name: getattr(self, name) for name in names}

    def continue_statistics(self, statistics: Mapping[str, float]) -> None:
        """Continue the step count and statistics of :meth:`run_statistics` (scores and windows start over)."""
        for name, value in statistics.items():
            setattr(self, name, type(getattr(self, name))(value))

    def release_all(self) -> bool:
        """Make every unit trainable (a burst phase started). Returns whether anything changed."""
        return self.set_prefix(0)

    def freeze_from_last_check(self) -> bool:
        """Freeze the prefix that the last check found stable and fresh (a light phase started); nothing once a
        parameter outside the units trains (:meth:`check_outside`)."""
        self.outgrown = self.outgrown or self._outside_trains()
        return self.set_prefix(self._propose(True))

    def follow_phase(self, enabled: bool, resume: bool = False) -> bool:
        """A pulse phase started: freeze the last stable prefix if freezing is ``enabled``, else release all.

        On ``resume`` the restored state already holds the frozen set of the moment it was saved; a rollback
        does not turn the clock back, so only a release applies (a prefix saved in a light phase must not stay
        frozen in a burst). Returns whether anything changed.
        """
        if resume:
            return not enabled and self.release_all()
        return self.freeze_from_last_check() if enabled else self.release_all()

    def _outgrown_now(self) -> bool:
        """Whether a parameter outside the units trains: known, or found by a scan, except in a state restored
        from a step whose window end found it (that window end, trained again, retraces as the run did)."""
        return self.outgrown or (not self._outgrown_at_close and self._outside_trains())

    def apply_requires_grad(self) -> None:
        """Turn off the parameters of the frozen units, and back on those of the others that this freezer
        turned off (after restoring a state). Nothing stays frozen once a parameter outside the units trains."""
        if self._outgrown_now():
            self.outgrown = True
            self.frozen = [False] * len(self.units)
        for unit, is_frozen in zip(self.units, self.frozen):
            for param in unit.params:
                self._turn_off(param) if is_frozen else self._turn_on(param)

    def restore_requires_grad(self) -> None:
        """Turn back on every parameter this freezer turned off (end of training); the others keep the
        ``requires_grad`` their owner gave them."""
        for param in list(self._turned_off.values()):
            self._turn_on(param)

    def _turn_off(self, param: nn.Parameter) -> None:
        if param.requires_grad:
            param.requires_grad_(False)
            self._turned_off[id(param)] = param

    def _turn_on(self, param: nn.Parameter) -> None:
        if self._turned_off.pop(id(param), None) is not None:
            param.requires_grad_(True)

    def release_taken_back(self) -> bool:
        """Release every unit if a parameter this freezer turned off requires grad again (someone else unfroze
        it: their gradients count). Returns whether anything changed."""
        return self._taken_back() and self.set_prefix(0)

    def _taken_back(self) -> bool:
        """Whether a parameter this freezer turned off requires grad again: someone else unfroze it."""
        return any(param.requires_grad for param in self._turned_off.values())

    @torch.no_grad()
    def replace_parameters(
        self, replacements: Iterable[tuple[nn.Parameter, nn.Parameter, torch.Tensor]]
    ) -> bool:
        """Follow parameters that were replaced by smaller ones (structured pruning cut channels).

        ``replacements`` yields ``(old, new, kept)`` with ``new.flatten() == old.flatten()[kept]`` (ScheduledPrune
        cuts in place: ``new is old``, already of the cut shape). Units point at ``new``, window snapshots are
        cut with ``kept`` (so the movement still compares the same elements) and the parameter counts are
        taken again. Returns whether any unit held a replaced parameter.
        """
        old_params = [list(unit.params) for unit in self.units]
        moved = replace_unit_parameters(self.units, replacements)
        for i, params in enumerate(old_params):
            for j, old in enumerate(params):
                if id(old) in moved:
                    new, kept = moved[id(old)]
                    snap = self.snapshot[i][j]
                    # a cut made in place (`new is old`) leaves a snapshot of the shape before it, which holds
                    # every kept index
                    fits = snap.shape != new.shape and (kept.numel() == 0 or snap.numel() > int(kept.max()))
                    self.snapshot[i][j] = cut_like(snap, new, kept) if fits else new.detach().clone()
        for old_id, (new, _) in moved.items():  # a frozen unit's new tensor is the one to turn back on
            if self._turned_off.pop(old_id, None) is not None:
                self._turned_off[id(new)] = new
        self._count()
        return bool(moved)

    # ------------------------------------------------------------------ internals
    def _count(self) -> None:
        self._unit_numel = [unit.numel for unit in self.units]
        self.trainable_numel = sum(self._unit_numel)

    def _clone_params(self, index: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.units[index].params]

    @torch.no_grad()  # here, not around every step: the context costs a few µs, most steps need no torch op
    def _close_window(self, keep: dict[str, Any] | None = None) -> list[str]:
        """Score the units that trained the whole window; ``keep`` gets their movements (``"movements"``)."""
        refreshed: list[str] = []
        full = [
            i
            for i, unit in enumerate(self.units)
            if not self.frozen[i] and unit.used and self.window_count[i] >= self.settings.check_every
        ]
        known, self._known_movements = self._known_movements, None
        if known is not None and known[0] == self.steps and all(i in known[1] for i in full):
            movements = [known[1][i] for i in full]  # measured before a checkpoint saved inside this step
        else:
            movements = window_movements([(self.units[i].params, self.snapshot[i]) for i in full])
        if keep is not None:
            keep["movements"] = dict(zip(full, movements))
        threshold = self.settings.threshold
        for i, (rate, growth) in zip(full, movements):
            if math.isfinite(rate):
                self.peak_rate[i] = max(self.peak_rate[i], rate)
            score = rate / self.peak_rate[i] if self.peak_rate[i] > 0 else None
            if score is None and rate == 0 and not self.gradient_missed[i]:
                # it got a gradient at every step and never moved (a gradient of exactly 0, as a learnable
                # zero point's on an input its observer's range covers, or steps that its forward overwrites,
                # as an observer writing the scale): freezing it changes nothing, so it is as stable as can be
                # (unscored, as the first unit it blocked every prefix for the whole run)
                score = 0.0
            self.growing[i] = growth > MAX_STABLE_GROWTH
            stable = score is not None and score <= threshold and (threshold >= 1 or not self.growing[i])
            if self.checking[i]:
                self.refreshes += 1
                self.refresh_hits += int(stable)
                refreshed.append(self.units[i].name)
                self.checking[i] = False
            self.scores[i] = score
            self.stable[i] = bool(stable)
            self.validated_at[i] = self.steps
        for i in range(len(self.units)):
            # a window cut short by a phase change says nothing reliable: it starts again
            self.window_count[i] = 0
            self.gradient_missed[i] = False
            if not self.frozen[i]:
                self.snapshot[i] = self._clone_params(i)
        return refreshed

    def _fresh(self, index: int) -> bool:
        validated = self.validated_at[index]
        return validated is not None and self.steps - validated < self.settings.freeze_for

    def _propose(self, enabled: bool) -> int:
        if not enabled or self.outgrown or self.misplaced:
            return 0
        budget = self.settings.max_frozen_share * self.trainable_numel
        frozen_numel = 0
        length = 0
        farthest = farthest_reads(self.units)
        heads = head_positions(self.units)
        for i in range(self.freezable_limit):
            unit = self.units[i]
            # a pinned unit shares a parameter with a later one, a head feeds the loss: the prefix ends
            if unit.pinned or i in heads or not unit.used or not self._fresh(i) or not self.stable[i]:
                break
            if frozen_numel + self._unit_numel[i] > budget:
                break
            frozen_numel += self._unit_numel[i]
            if farthest[i] == i:  # no unit up to here reads from a later one (a looped block is frozen whole)
                length = i + 1
        return length

    def set_prefix(self, length: int) -> bool:
        """Freeze exactly the first ``length`` units (``requires_grad`` off) and release the others."""
        changed = False
        for i, unit in enumerate(self.units):
            want = i < length
            if want and not self.frozen[i]:
                for param in unit.params:
                    self._turn_off(param)
                self.frozen[i] = True
                self.window_count[i] = 0
                self.gradient_missed[i] = False
                self.checking[i] = False
                self.freezes += 1
                changed = True
            elif not want and self.frozen[i]:
                for param in unit.params:
                    self._turn_on(param)
                self.frozen[i] = False
                self.window_count[i] = 0
                self.gradient_missed[i] = False
                self.checking[i] = True
                self.snapshot[i] = self._clone_params(i)
                changed = True
        return changed

    # ------------------------------------------------------------------ checkpointing
    def _fields(self, counted: bool = False) -> dict[str, Any]:
        """The saved fields :meth:`state_dict` gives besides the units and the snapshots, as they are now;
        ``counted``: but for the counts of the step counted last (the windows' steps, the frozen share), taken
        back: its frozen set has not changed since it counted them."""
        steps, in_window, window_count = self.steps, self.step_in_window, list(self.window_count)
        share_sum = self.frozen_share_sum
        if counted and self._share_sum_before is not None:
            steps, in_window, share_sum = steps - 1, in_window - 1, self._share_sum_before
            for i, unit in enumerate(self.units):
                if unit.used and not self.frozen[i]:
                    window_count[i] -= 1
        return {
            "steps": steps,
            "step_in_window": in_window,
            "frozen": list(self.frozen),
            "stable": list(self.stable),
            "scores": list(self.scores),
            "validated_at": list(self.validated_at),
            "peak_rate": list(self.peak_rate),
            "checking": list(self.checking),
            "window_count": window_count,
            "gradient_missed": list(self.gradient_missed),
            "stats": {
                "refreshes": self.refreshes,
                "refresh_hits": self.refresh_hits,
                "frozen_share_sum": share_sum,
                "freezes": self.freezes,
            },
        }

    def state_before_step(self) -> tuple[dict[str, Any], int] | None:
        """``(state, events)``: :meth:`state_dict` as the step counted last found it, for a checkpoint saved
        before that step's update, which a resume trains again (counted once then), and how many frozen-prefix
        events that step recorded; ``None`` where no step was counted since the freezer was built or loaded.
        Where the step changed no more than its counts, they are taken back; else the state it kept. The window
        snapshots stay: the step replaced only those it measures again (from the same weights, before the
        update) or takes again, and a window it closed keeps its movements (``"movements"``), which the
        resumed step's close reads instead of measuring from the snapshots it replaced."""
        if self._share_sum_before is None:
            return None
        kept = self._before_step
        if kept is not None and kept[0] == self.steps:
            return {**self.state_dict(), **kept[1]}, kept[2]
        return {**self.state_dict(), **self._fields(counted=True)}, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "units": [unit.name for unit in self.units],
            "unit_params": [list(unit.param_names) for unit in self.units],
            "used": [unit.used for unit in self.units],
            "inputs_from": [list(unit.inputs_from) for unit in self.units],
            **self._fields(),
            # the held tensors, not clones (as nn.Module.state_dict): a clone was a second 1x-parameters copy on
            # the accelerator at each checkpoint and guard snapshot. Nothing writes them in place (a window close
            # or a cut replaces them), so a state taken earlier keeps its values; its readers copy: torch.save,
            # StabilityGuard (to the CPU) and load_state_dict
            "snapshot": [list(item) for item in self.snapshot],
            "rare": list(self.rare),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Does not touch ``requires_grad``; call :meth:`apply_requires_grad`."""
        names = [unit.name for unit in self.units]
        if list(state["units"]) != names:
            raise ValueError(
                f"GradientCache checkpoint has units {list(state['units'])}, the model has {names}; "
                "the model changed since the checkpoint was written."
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"GradientCache checkpoint has state version {state.get('version')!r}, this version reads "
                f"{STATE_VERSION}; resume it with the lightning-pulse release that wrote it."
            )
        self.steps = int(state["steps"])
        self.step_in_window = int(state["step_in_window"])
        self.rare = sorted(set(self.rare) | set(state.get("rare", ())))
        self._unplaced = [i for i in self._unplaced if self.units[i].name not in self.rare]
        self.frozen = [bool(v) for v in state["frozen"]]
        self.stable = [bool(v) for v in state["stable"]]
        self.growing = [False] * len(self.units)  # only read by idle_note; the next window measures it again
        self.scores = [None if v is None else float(v) for v in state["scores"]]
        self.validated_at = [None if v is None else int(v) for v in state["validated_at"]]
        self.peak_rate = [float(v) for v in state["peak_rate"]]
        self.checking = [bool(v) for v in state["checking"]]
        self.window_count = [int(v) for v in state["window_count"]]
        # absent before it was saved: the window in progress then gives a unit that never moved no score
        self.gradient_missed = [bool(v) for v in state.get("gradient_missed", [True] * len(self.units))]
        # copies: the caller may load the same state again, and state_dict hands these out. One unit at a time,
        # each replacing the unit's old snapshot, so a rollback adds one unit's copy to the device, not 1x params
        for i, (unit, item) in enumerate(zip(self.units, state["snapshot"])):
            self.snapshot[i] = [t.detach().to(p.device, copy=True) for t, p in zip(item, unit.params)]
        for i, unit in enumerate(self.units):
            if any(t.shape != p.shape for t, p in zip(self.snapshot[i], unit.params)):
                # the parameters changed shape since the state was saved (channels cut by structured pruning
                # in a version that did not follow them): the unit's window starts over on the current tensors
                self.snapshot[i] = self._clone_params(i)
                self.window_count[i] = 0
                self.gradient_missed[i] = False
        stats = state["stats"]
        self.refreshes = int(stats["refreshes"])
        self.refresh_hits = int(stats["refresh_hits"])
        self.frozen_share_sum = float(stats["frozen_share_sum"])
        self.freezes = int(stats["freezes"])
        self._share_sum_before, self._before_step = None, None
        movements, self._known_movements = (
            state.get("movements"),
            None,
        )  # saved inside a step closing a window
        if movements is not None:
            known = {int(i): (float(rate), float(growth)) for i, (rate, growth) in movements.items()}
            self._known_movements = (self.steps + 1, known)
        self._outgrown_at_close = bool(state.get("outgrown", False))


def freezer_from_state(
    state: Mapping[str, Any],
    model: nn.Module,
    settings: FreezeSettings,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
) -> LayerFreezer:
    """A :class:`LayerFreezer` rebuilt from :meth:`LayerFreezer.state_dict` on ``model``'s parameters.

    Units are bound against every parameter, trainable or not: a restored unit may be frozen now.
    """
    everything = dict(model.named_parameters())
    inputs_from = state.get("inputs_from") or [[] for _ in state["units"]]  # absent in older checkpoints
    units = [
        FreezeUnit(name, list(params), used=bool(used), inputs_from=list(reads))
        for name, params, used, reads in zip(state["units"], state["unit_params"], state["used"], inputs_from)
    ]
    for unit in units:
        unit.bind(everything)
    outside = parameters_outside(model, units)
    freezer = LayerFreezer(mark_shared(units, model), settings, outside, optimizers=optimizers, model=model)
    freezer.load_state_dict(state)
    return freezer


def restore_freezer(
    current: LayerFreezer | None,
    state: Mapping[str, Any] | None,
    model: nn.Module,
    settings: FreezeSettings,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
) -> LayerFreezer | None:
    """The freezer described by ``state`` (``None``: one saved before the units were ordered), with
    ``requires_grad`` set from its frozen flags; ``current`` is reused when it has the same units.
    ``optimizers``: see :class:`LayerFreezer`."""
    if current is not None:
        current.restore_requires_grad()
    if state is None:
        return None
    if current is not None and [u.name for u in current.units] == list(state["units"]):
        current.load_state_dict(state)
        freezer = current
    else:
        freezer = freezer_from_state(state, model, settings, optimizers)
    freezer.apply_requires_grad()
    return freezer


def restore_during_fit(
    current: LayerFreezer | None,
    trace: ForwardOrderTrace | None,
    state: Mapping[str, Any] | None,
    model: nn.Module,
    settings: FreezeSettings,
    optimizers: Sequence[torch.optim.Optimizer] | None = None,
) -> tuple[LayerFreezer | None, ForwardOrderTrace | None]:
    """:func:`restore_freezer` in the middle of a fit (a rollback), with the pending unit trace to go with it.

    A state saved before the first backward (``None``) has no order yet: the current freezer's units are traced
    into forward order again. Returns ``(freezer, trace)``; at most one of them is not ``None``, unless
    ``current`` and ``state`` are both ``None`` and ``trace`` is kept.
    """
    units = current.units if current is not None else None
    freezer = restore_freezer(current, state, model, settings, optimizers)
    if freezer is not None:
        return freezer, None
    return None, ForwardOrderTrace(units) if units is not None else trace


def follow_replaced_parameters(
    replacements: Iterable[tuple[nn.Parameter, nn.Parameter, torch.Tensor]],
    freezer: LayerFreezer | None,
    trace: ForwardOrderTrace | None,
) -> None:
    """Point the freezer (units and window snapshots) and a pending trace's units at replaced parameters."""
    replacements = list(replacements)
    if freezer is not None:
        freezer.replace_parameters(replacements)
    if trace is not None:
        replace_unit_parameters(trace.units, replacements)


# transformers' gradient_checkpointing_enable() calls enable_input_require_grads() for text models (even for
# non-reentrant checkpointing, the only kind GradientCache accepts), whose hook makes the input embeddings'
# output require grad: backward then runs through every frozen unit after them
INPUT_REQUIRE_GRADS_CAUSE = (
    "transformers' `enable_input_require_grads()`, which `gradient_checkpointing_enable()` calls for text "
    "models, hooks the input embeddings to make their output require grad"
)
INPUT_REQUIRE_GRADS_WAY_OUT = (
    "Call `model.disable_input_require_grads()` after `model.gradient_checkpointing_enable(...)` and before "
    "fit: the non-reentrant checkpointing GradientCache accepts does not need it"
)


def input_embeddings_marked_by_transformers(model: nn.Module) -> tuple[set[int], bool]:
    """The ids of the Hugging Face models' input embeddings (``get_input_embeddings()``) and of the modules
    that transformers' ``enable_input_require_grads`` hooked (it keeps the hook handles as
    ``_require_grads_hooks``; before transformers 5, one as ``_require_grads_hook``), and whether a hooked
    module is frozen: then it, not its weights, makes the activations after it require grad."""
    handles, embeddings = [], set()
    for module in model.modules():
        kept = list(getattr(module, "_require_grads_hooks", None) or ())
        single = getattr(module, "_require_grads_hook", None)
        handles += kept + ([single] if single is not None and single not in kept else [])
        if callable(getattr(module, "enable_input_require_grads", None)):  # a transformers PreTrainedModel
            try:
                found = module.get_input_embeddings()
            except (AttributeError, NotImplementedError):
                continue
            if isinstance(found, nn.Module):
                embeddings.add(id(found))
    hook_ids = {getattr(handle, "id", None) for handle in handles}
    hooked = [module for module in model.modules() if handles and hook_ids & set(module._forward_hooks)]
    frozen_hooked = any(not any(p.requires_grad for p in module.parameters()) for module in hooked)
    return embeddings | {id(module) for module in hooked}, frozen_hooked


class BackwardReachCheck:
    """Whether backward still runs through the frozen prefix, looked at once per new longest prefix.

    Freezing units ``0..k-1`` stops backward at unit ``k`` only when no activation of the prefix requires
    grad. A module that sets ``requires_grad`` on its own output (Hugging Face's wav2vec2 feature encoder, for
    its gradient checkpointing; the input embeddings under transformers' ``enable_input_require_grads`` hook,
    which ``gradient_checkpointing_enable()`` adds for text models) or an input that requires grad makes
    autograd carry the gradient back through the frozen units anyway: their parameters stand still, but their
    input gradients are computed (a held-out wav2vec2 skipped 38.6% of its backward FLOPs instead of 63.8%).
    The first forward after the prefix grew past every length looked at runs with forward hooks on the frozen
    units' modules; :meth:`finish` removes them before the backward and names the first frozen unit whose
    output requires grad (a ``torch.jit.script``-ed unit takes no hooks and goes unchecked). Other steps cost
    nothing; once it said so, it never looks again in the fit."""

    def __init__(self) -> None:
        self.longest_checked = 0  # the longest frozen prefix already looked at
        self.noted = False
        self._hooks: list[Any] = []
        self._reached: list[tuple[int, bool]] = []  # (unit index, whether its input required grad already)
        self._armed_prefix = 0
        # transformers' enable_input_require_grads hooked frozen input embeddings; these units hold input
        # embeddings
        self._inputs_marked = False
        self._marking_units: set[int] = set()

    def arm(self, model: nn.Module | None, units: Sequence[FreezeUnit], prefix: int) -> None:
        """Before a forward with ``prefix`` units frozen: hook their modules if that prefix is new."""
        if self.noted or model is None or prefix <= self.longest_checked:
            return
        self.longest_checked = self._armed_prefix = prefix
        marked, self._inputs_marked = input_embeddings_marked_by_transformers(model)
        self._marking_units = set()
        for index, unit in enumerate(units[:prefix]):
            try:
                module = model.get_submodule(unit.name)
            except AttributeError:  # a unit named by a parameter, or the rest of the model: no output
                continue
            if any(id(inner) in marked for inner in module.modules()):
                self._marking_units.add(index)
            look = functools.partial(self._look, index)
            try:
                self._hooks.append(module.register_forward_hook(look, with_kwargs=True))
            except RuntimeError:  # a torch.jit.script'ed unit takes no hooks: it goes unchecked, not the fit
                continue

    def _look(self, index: int, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        values = tuple(output.values()) if isinstance(output, Mapping) else output
        values = values if isinstance(values, (tuple, list)) else (values,)
        if transform_active():  # what the transform differentiates is its own: judged by the fit's autograd
            values, args = tuple(map(unwrapped, values)), tuple(map(unwrapped, args))
            kwargs = {key: unwrapped(value) for key, value in kwargs.items()}
        if reads_gradient(values, {}):
            self._reached.append((index, reads_gradient(args, kwargs)))

    def finish(self, units: Sequence[FreezeUnit]) -> str | None:
        """Remove the hooks once the forward is over; a note if backward runs through a frozen unit."""
        self.close()
        reached, self._reached = self._reached, []
        if not reached:
            return None
        index, inherited = min(reached)
        self.noted = True
        name, frozen = units[index].name, [unit.name for unit in units[index : self._armed_prefix]]
        if index in self._marking_units or (inherited and self._inputs_marked):
            cause, way_out = INPUT_REQUIRE_GRADS_CAUSE, INPUT_REQUIRE_GRADS_WAY_OUT
        else:
            cause = f"a module that sets `requires_grad` on its own output: {FEATURE_ENCODER_HINT}"
            way_out = (
                "For a Hugging Face speech model call `model.freeze_feature_encoder()` before fit (the "
                "feature encoder then never trains); or leave it where that gradient is wanted (an "
                "input-gradient penalty)"
            )
        reason = (
            f"the input of frozen unit {name!r} already requires grad (the model's input, as for an "
            f"input-gradient penalty, or {cause})"
            if inherited
            else f"frozen unit {name!r} returns an output that requires grad although none of its inputs "
            f"does ({cause})"
        )
        return (
            f"backward still runs through the frozen units {', '.join(frozen)}: {reason}. Their parameters "
            "stand still, but their input gradients are still computed (the skipped share logged with "
            f"`measure_flops` counts only what was really skipped). {way_out}"
        )

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class FreezerLifecycle:
    """A fit's :class:`LayerFreezer`, from the fit's start to its end.

    A fit starts (:meth:`start`) from a checkpoint's freezer, or with the units discovered in the model waiting
    in a :class:`~lightning_pulse.core.freeze_units.ForwardOrderTrace`, since only a backward shows their forward
    order: after the first (:meth:`begin_backward`, :meth:`end_backward`) they get their freezer. The first
    backward also walks the graph once (:func:`check_first_graph`, :func:`mark_inputs`); in a resumed fit, it
    trains the restored prefix (:meth:`begin_forward`), so that the walk sees the whole model. A rollback
    (:meth:`restore`) and parameters that structured pruning replaced (:meth:`follow`) reach the freezer, or
    the units still waiting. When parameters outside the units start training (:attr:`LayerFreezer.outgrown`),
    :meth:`retrace` discovers the units again, and the next backward orders them like the first.

    Args:
        settings: the freezer's settings.
        unit_names: explicit units as module or parameter names; ``None``: the automatic split.

    Attributes:
        freezer: the fit's freezer; ``None`` while the units wait for a backward to order them.
        trace: the units waiting for that backward; ``None`` once there is a freezer.
        events: the latest 1,000 changes of the frozen prefix (:func:`freeze_event`, see :meth:`record`), for
            :class:`~lightning_pulse.GradientCache`'s report and checkpoint; a rollback keeps them.
        pending: a checkpoint's state restored before the fit trains (:meth:`hold`), until :meth:`resume`.

    Example::

        lifecycle = FreezerLifecycle(FreezeSettings(check_every=2))
        lifecycle.start(None, model)                 # a fresh run: the units wait for the first backward
        for x, y in batches:
            lifecycle.begin_forward()                # a resumed fit's first forward trains its frozen prefix
            loss = F.cross_entropy(model(x), y)
            lifecycle.begin_backward(loss)
            loss.backward()
            lifecycle.end_backward()                 # True once: the freezer was built
            lifecycle.freezer.step(enabled=True)
            optimizer.step(); optimizer.zero_grad()
        lifecycle.end()                              # every parameter trainable again
    """

    def __init__(self, settings: FreezeSettings, unit_names: Sequence[str] | None = None) -> None:
        self.settings = settings
        self.unit_names = unit_names
        self.freezer: LayerFreezer | None = None
        self.trace: ForwardOrderTrace | None = None
        self._rare: list[str] = []  # units a trace waited for in vain (see LayerFreezer), kept over retraces
        self._graph_checked = False
        self._calls = ForwardCalls()  # the modules' calls in the forward of the graph checked (begin_forward)
        self._open_first_forward = False  # a restored prefix trains in the first forward (begin_forward)
        self._opened: list[nn.Parameter] = []  # its parameters, turned on until that backward ends
        # their gradients, kept past a backward DDP did not synchronize (see :meth:`_close_opened`)
        self._opened_gradients: list[nn.Parameter] = []
        self._wrapped: nn.Module | None = None  # the strategy's model (from fit start): DDP's wrapper, or not
        # whether it has DDP's `require_backward_grad_sync` (DDP's __init__ sets it); only then read at each
        # backward: a miss on a module raises inside nn.Module.__getattr__ (about 7 µs a step)
        self._sync_flag = False
        self._marked = False  # this backward marked the units' inputs (under DDP, rank 0's are shared)
        self._model: nn.Module | None = None  # the fit's model: its parameters outside the units are watched
        self._statistics: dict[str, float] | None = None  # a retraced freezer's, for the next one to continue
        # a freezer retraced in the step under way: its state before that step (LayerFreezer.state_before_step)
        self._retraced_before: tuple[dict[str, Any], int] | None = None
        # under DDP, the parameters frozen when the strategy wrapped the model (read at fit start, right after
        # the wrap): its reducer left them out, so their gradients are never averaged once they train
        self.frozen_before_wrap: set[int] = set()
        self.optimizer_check = GradlessStepCheck()  # whether the optimizer leaves frozen parameters alone
        # zero gradients for frozen parameters while the module's own hooks may read every gradient (started
        # at fit start, where those hooks are known): given after each backward, None again at the step
        self.stand_in = StandInGradients()
        # the fit's optimizers (from fit start): a parameter outside the units none holds, with no gradient,
        # does not train (LayerFreezer._outside_trains); None before, as for a freezer used on its own
        self.optimizers: list[torch.optim.Optimizer] | None = None
        self.rolled_back_at: int | None = None  # optimizer steps taken at the fit's last rollback (restore)
        self._announced: tuple[str, str | None] | None = None  # the units :meth:`announce` last named
        self._step_counted = False  # the step under way was counted (at its first closure evaluation)
        self.repeats_closure = False  # the optimizer evaluates its closure more than once per step (SAM)
        self._released_now: list[nn.Parameter] = []  # released at the step's first closure evaluation
        self._ended = False  # the fit ended: every parameter trains again
        # the first backward's custom Functions (core.custom_functions), kept until the units are ordered
        self._scan: FunctionScan | None = None
        # unit parameters the first backward gave a gradient without reaching them as leaves (inside a custom
        # Function's backward): checked at the first backward after each freeze
        # (:meth:`_check_lost_gradients`)
        self._reached_inside: list[tuple[str, nn.Parameter]] = []
        self._freezes_seen = 0  # the freezer's freeze count at that check
        self.gradients_lost: list[str] = []  # names of parameters a freeze cut off: nothing freezes any more
        self._notes: list[str] = []  # warnings for :meth:`announce`
        self.backward_reach = BackwardReachCheck()  # whether backward still runs through the frozen prefix
        self.events: list[dict[str, Any]] = []  # the latest 1,000 changes of the frozen prefix
        self.pending: dict[str, Any] | None = None  # a checkpoint's state, until the fit's start applies it

    @property
    def units(self) -> list[FreezeUnit]:
        """The units: the freezer's, in forward order, or those waiting for a backward to order them."""
        if self.freezer is not None:
            return self.freezer.units
        return self.trace.units if self.trace is not None else []

    @property
    def ordering(self) -> bool:
        """Whether the backward under way records the order of units waiting for their freezer."""
        return self.trace is not None and self.trace.running

    @property
    def frozen_prefix(self) -> int:
        """How many leading units are frozen now (none without a freezer)."""
        return self.freezer.frozen_prefix if self.freezer is not None else 0

    @property
    def frozen_names(self) -> list[str]:
        """Names of the units frozen now: none without a freezer or once the fit ended (:meth:`end` turned
        every parameter back on; the freezer keeps its flags for :meth:`state_dict`)."""
        return self.freezer.frozen_names if self.freezer is not None and not self._ended else []

    def held_frozen_names(self, model: nn.Module) -> list[str]:
        """Qualified names in ``model`` of the parameters the freezer turned off and will turn back on (not
        those the user froze); none once the fit ended."""
        held = (
            {id(param) for param in self.freezer.turned_off()} if self.freezer and not self._ended else set()
        )
        return [name for name, param in model.named_parameters(remove_duplicate=False) if id(param) in held]

    @property
    def backward_prefix(self) -> int:
        """Leading units the next backward skips (none in a resumed fit's first: :meth:`begin_forward`)."""
        return 0 if self._opened else self.frozen_prefix

    def start(
        self, state: Mapping[str, Any] | None, model: nn.Module, units: Sequence[FreezeUnit] | None = None
    ) -> str | None:
        """Start a fit from a checkpoint's freezer ``state`` (``requires_grad`` set from it), or, for a fresh run
        or a state saved before the first backward (``None``), with ``units`` (default: those discovered in
        ``model``) waiting. Returns :func:`~lightning_pulse.core.freeze_units.pinned_note` for a restored
        freezer's units (units still to be ordered are named when they are: :meth:`announce`), else ``None``.

        Raises:
            ValueError: for a name in ``unit_names`` that ``model`` does not have (see :func:`discover_units`).
        """
        self._graph_checked, self._model, self._statistics, self._rare = False, model, None, []
        self._retraced_before = None
        self.rolled_back_at, self._announced, self._step_counted, self._ended = None, None, False, False
        self._scan, self._reached_inside, self.gradients_lost, self._notes = None, [], [], []
        self.backward_reach.close()
        self.backward_reach = BackwardReachCheck()
        self.freezer, self.trace = restore_freezer(None, state, model, self.settings, self.optimizers), None
        self._open_first_forward, self._opened, self._opened_gradients = self.freezer is not None, [], []
        if self.freezer is None:
            self.trace = ForwardOrderTrace(discover_units(model, self.unit_names) if units is None else units)
            return None
        return pinned_note(self.freezer.units)

    def check_fit_start(
        self, strategy: Any, model: nn.Module, world_size: int, optimizers: Iterable[torch.optim.Optimizer]
    ) -> None:
        """At fit start, once the ``strategy`` wrapped ``model`` (as ``strategy.model``) and the
        ``optimizers`` exist: :func:`check_wrapped_model`; under DDP, remember the parameters frozen now
        (:attr:`frozen_before_wrap`); :func:`refuse_optimizers_that_move_gradless_parameters`.

        Raises:
            PulseRefusal: from those two checks.
        """
        check_wrapped_model(strategy.model, world_size, type(strategy).__name__)
        self._wrapped = strategy.model
        self._sync_flag = hasattr(self._wrapped, "require_backward_grad_sync")
        if world_size > 1:  # DDP just wrapped the model: what is frozen now, its reducer left out
            self.frozen_before_wrap = frozen_parameter_ids(model)
        optimizers = self.optimizers = list(optimizers)
        refuse_optimizers_that_move_gradless_parameters(optimizers)
        self.optimizer_check.attach(optimizers)  # frozen parameters put back right after a wrapper's step

    def stand_in_for(self, readers: Sequence[str], info: Callable[[str], None] | None = None) -> None:
        """At fit start, after :meth:`check_fit_start`: where the module's own hooks (``readers``, as
        ``"Class.hook"``) may touch every parameter's gradient between a backward and the step, give the frozen
        parameters zero gradients after each backward and ``None`` again as the optimizer updates
        (:class:`~lightning_pulse.core.stand_in_gradients.StandInGradients`); ``info`` says so once. Nothing
        (and no cost) without ``readers``."""
        self.stand_in.start(readers, self.optimizers or (), info)

    def follow_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Look at the fit's optimizers now (in the list the freezer shares): a recipe unfreezing a backbone
        may have replaced them (``trainer.strategy.setup_optimizers``)."""
        if self.optimizers is not None:
            self.optimizers[:] = list(optimizers)
            self.stand_in.attach(self.optimizers)  # nothing while off

    @property
    def resumed_first_batch(self) -> bool:
        """Whether the next forward is a resumed fit's first (:meth:`begin_forward` opens its prefix)."""
        return self._open_first_forward

    def release_taken_back(self, step: int, replay: LoaderActivationCache | None = None) -> None:
        """At an epoch's first batch, before its forward: release every unit if the user's code turned one
        the freezer froze back on (:meth:`LayerFreezer.release_taken_back`), and :meth:`record` that at
        ``step``, so the forward and the FLOP ledger see the release."""
        before = self.frozen_prefix
        if self.freezer is not None and self.freezer.release_taken_back():
            self.record(step, before, "taken back", replay)

    def begin_forward(self) -> None:
        """Before a batch's forward. In a resumed fit's first, turn the restored prefix back on, so that the
        graph check of its backward (:meth:`begin_backward`) sees the whole model: a frozen prefix hides what
        follows it (a reentrant checkpoint whose input needs no gradient leaves no node at all).
        :meth:`end_backward` turns it off again and drops its gradients (under DDP, after the accumulation
        window's synchronizing backward), so it stands still as in the run that saved it. Call it after
        looking for units someone else turned back on (:meth:`LayerFreezer.release_taken_back`): turned on
        here, their change would no longer show. A frozen prefix longer than any before is watched in this
        forward (:class:`BackwardReachCheck`). Before the graph check's forward, the modules' calls are
        recorded (:class:`~lightning_pulse.core.forward_calls.ForwardCalls`), so that a weight read twice
        inside its own layer's forward (spectral norm) pins nothing."""
        if self._open_first_forward and self.freezer is not None:
            self._opened = self.freezer.turned_off()
            for param in self._opened:
                param.requires_grad_(True)
        self._open_first_forward = False  # also when a retrace at that batch left no freezer to open
        if not self._graph_checked and self._model is not None:  # tells a weight's reads in its own forward
            self._calls.arm(self._model, self.units)
        if self.freezer is not None and not self._opened:
            self.backward_reach.arm(self._model, self.freezer.units, self.freezer.frozen_prefix)
        check = self.optimizer_check
        # the step's frozen set is final before its forward; nothing to build once the check is over
        if self.freezer is not None and self.optimizers and check.may_arm:
            # what arm found all checked, if unchanged (a structured cut swaps parameters: follow forgets it)
            frozen_set = (id(self.freezer), tuple(self.freezer.frozen))
            check.arm(self.optimizers, self._frozen_parameters, self.repeats_closure, frozen_set)

    def _frozen_parameters(self) -> list[nn.Parameter]:
        """The parameters of the units frozen now (read when an optimizer step begins: the freezer then)."""
        freezer = self.freezer
        if freezer is None:
            return []
        return [
            param for unit, frozen in zip(freezer.units, freezer.frozen) if frozen for param in unit.params
        ]

    def begin_backward(self, loss: torch.Tensor) -> None:
        """Before a backward. At the fit's first, before anything is frozen, :func:`check_first_graph` and pin
        the units holding a parameter read twice: a restored freezer's, or those about to be ordered (the same
        objects). There and at every backward that orders units, :func:`mark_inputs`. While units wait, record
        the order this backward hands out gradients in. A note for :meth:`announce` when the forward showed that
        this backward runs through frozen units (:class:`BackwardReachCheck`)."""
        self._rediscover_refrozen()
        if self.freezer is not None and (note := self.backward_reach.finish(self.freezer.units)) is not None:
            self._notes.append(note)  # said by announce, after this backward
        first = not self._graph_checked
        if first:
            self._graph_checked = True
            own_read = self._calls.own_reads(self.units, self._model) if self._model is not None else None
            if self._model is not None:
                how = self._calls.differentiated_units(self.units, self._model)
                for unit in self.units:
                    unit.differentiated = how.get(unit.name, "")
            self._calls.close()
            reader = (
                self._calls.enclosing_reader(self.units, self._model) if self._model is not None else None
            )
            pin_read_twice(self.units, check_first_graph(loss), own_read, reader)
            if self._scan is not None:
                self._scan.finish()
            named = dict(self._model.named_parameters()) if self._model is not None else {}
            self._scan = FunctionScan(self.units, loss, named)
        if first or self.trace is not None:
            mark_inputs(self.units, loss)
            self._marked = True
        if self.trace is not None and not self.trace.running:
            self.trace.begin()

    def _rediscover_refrozen(self) -> None:
        """Discover the units waiting for their order again when the user's code froze one of their parameters
        since they were discovered (in its own or the module's ``on_train_start`` after GradientCache's, or in
        the first ``on_train_epoch_start``): that counts as a freeze before the fit, so those parameters
        belong to no unit and are watched like a frozen backbone. Before, recording the order hooked a
        parameter that no longer required grad, and the fit crashed at its first backward."""
        trace = self.trace
        if trace is None or trace.running or self._model is None:
            return
        if all(param.requires_grad for unit in trace.units for param in unit.params):
            return
        units = discover_units(self._model, self.unit_names)
        self.trace = ForwardOrderTrace(units, trace.previous, sorted(trace.wanted))
        self._graph_checked = False  # the pins and custom Functions are found on the new units

    def end_backward(self, broadcast: Callable[[list[Any]], list[Any]] | None = None) -> bool:
        """After a backward: turn the restored prefix :meth:`begin_forward` opened off again; put the waiting
        units in the order it recorded (under DDP rank 0's, which ``broadcast`` gives every process, as it
        gives rank 0's :func:`mark_inputs`) and build their freezer; group the units a custom Function needs
        frozen together (:meth:`_group_functions`) and check the first backward after a freeze
        (:meth:`_check_lost_gradients`). Returns whether the freezer was built now, or a warning waits for
        :meth:`announce`."""
        # DDP's wrapper in its `no_sync` (a micro-batch that accumulates) does not synchronize this backward
        self._close_opened(synced=not self._sync_flag or self._wrapped.require_backward_grad_sync)
        marked, self._marked = self._marked, False
        if marked and broadcast is not None:  # a loop counted from the data reads differently on each rank
            agree_inputs(self.units, broadcast)
        built = self.trace is not None and self.trace.running and self._order_waiting(broadcast)
        self._group_functions(broadcast)
        self._check_lost_gradients(broadcast)
        if self.stand_in.readers:  # the module's gradient hooks come next: zeros for the frozen parameters
            self.stand_in.give(self._frozen_parameters())
        return built or bool(self._notes)

    def _group_functions(self, broadcast: Callable[[list[Any]], list[Any]] | None) -> None:
        """Once the units are in forward order after the first backward: make the units a custom Function
        needs frozen together freeze only together (:meth:`FunctionScan.groups`), saying so; remember the
        parameters that got their gradient inside a Function's backward, for :meth:`_check_lost_gradients`."""
        scan = self._scan
        if scan is None:
            return
        scan.finish()
        if self.freezer is None:  # the units still wait for their order: grouped once they have it
            return
        self._scan, units = None, self.freezer.units
        for first, last, note in scan.groups(units):
            if units[last].name not in units[first].frozen_with:
                units[first].frozen_with.append(units[last].name)
                self._notes.append(note)
        named = {name: param for unit in units for name, param in zip(unit.param_names, unit.params)}
        reached = [
            name for name, param in named.items() if id(param) not in scan.leaves and param.grad is not None
        ]
        if broadcast is not None:  # every process freezes the same prefix, and checks at the same backwards
            groups, reached = broadcast([[(unit.name, list(unit.frozen_with)) for unit in units], reached])
            together = dict(groups)
            for unit in units:
                unit.frozen_with = list(together.get(unit.name, []))
        self._reached_inside = [(name, named[name]) for name in reached if name in named]
        self._freezes_seen = self.freezer.freezes

    def _check_lost_gradients(self, broadcast: Callable[[list[Any]], list[Any]] | None) -> None:
        """The safety net for what the first backward could not show: at the first backward after a freeze,
        every parameter still training that the first backward reached inside a custom Function must get a
        gradient again. If one got none, the freeze cut it off: freezing stops for the run (the next step
        releases every unit) and a warning names them. Costs nothing on other steps, nor for a model whose
        parameters are all leaves of the graph."""
        freezer = self.freezer
        if freezer is None or not self._reached_inside or freezer.freezes == self._freezes_seen:
            return
        self._freezes_seen = freezer.freezes
        if self.gradients_lost:
            return
        lost = [name for name, param in self._reached_inside if param.requires_grad and param.grad is None]
        if broadcast is not None:
            lost = list(broadcast([lost])[0])
        if lost:
            self.gradients_lost = lost
            shown = ", ".join(lost[:4]) + (f" and {len(lost) - 4} more" if len(lost) > 4 else "")
            self._notes.append(
                f"after freezing {', '.join(freezer.frozen_names)}, parameters it left training got no "
                f"gradient ({shown}): they get theirs inside a custom autograd Function's backward, which "
                "the frozen prefix stopped autograd from calling. It released every unit at this step and "
                "freezes nothing for the rest of the run; have that Function take those parameters as "
                "inputs, or remove GradientCache"
            )

    def _close_opened(self, synced: bool = True) -> None:
        """Turn the prefix :meth:`begin_forward` opened off again, once a backward or a step without one
        ran, and drop its gradients once a backward was synchronized (``synced``) or the step comes.

        A backward DDP does not synchronize (the first micro-batches of an accumulation window) still counts
        the opened prefix as used in the window, so the window's synchronizing backward averages its
        gradients, and fails on one that is gone ("Encountered gradient which is undefined"); they are kept
        until that backward is over (a held-out two-rank resume with ``accumulate_grad_batches=2`` crashed).
        The later micro-batches run with the prefix off, as in the run that saved it."""
        opened, self._opened = self._opened, []
        if not self._graph_checked:  # no backward ran on it (a skipped batch): open it again for the next one
            self._open_first_forward = bool(opened)
        if opened and self.freezer is not None:  # a resumed fit's first backward is over
            still_off = {id(param) for param in self.freezer.turned_off()}  # unless a burst released them
            for param in (param for param in opened if id(param) in still_off):
                param.requires_grad_(False)
                self._opened_gradients.append(param)
        if synced:
            for param in self._opened_gradients:
                param.grad = None  # the optimizer skips them: they stand still, as in the run that saved them
            self._opened_gradients = []

    def _order_waiting(self, broadcast: Callable[[list[str]], list[str]] | None) -> bool:
        units = self.trace.finish(broadcast)
        if units is None:  # a unit to place was missed again: the next backward is traced too
            return False
        outside = parameters_outside(self._model, units) if self._model is not None else []
        rare = [*self._rare, *self.trace.given_up]
        freezer = LayerFreezer(units, self.settings, outside, rare, self.optimizers, self._model)
        self.freezer, self.trace = freezer, None
        self.backward_reach.longest_checked = 0  # new units: their prefixes are looked at anew
        if self._statistics is not None:
            self.freezer.continue_statistics(self._statistics)
            self._statistics = None
        return True

    def announce(self, info: Callable[[str], None], warn: Callable[[str], None]) -> None:
        """:func:`announce_units` for the units :meth:`end_backward` just put in order, unless this fit named
        the same units already: a rollback to a state saved before the first backward orders them again."""
        units = self.freezer.units
        if self._announced != (said := (order_note(units), pinned_note(units))):
            self._announced = said
            announce_units(self.freezer, info, warn, self._model)
            if (
                self.unit_names
                and self._model is not None
                and (left := untrained_entries(self._model, self.unit_names))
            ):
                info(
                    f"GradientCache: `units` entries {left} hold no parameter that trains (frozen by the "
                    "user), so they are left out of the units, as frozen parameters are."
                )
        notes, self._notes = self._notes, []
        for note in notes:
            warn(f"GradientCache: {note}.")

    def idle_note(self, steps: int, events: Iterable[Mapping[str, Any]] = ()) -> str | None:
        """:meth:`LayerFreezer.idle_note` for a run of ``steps`` optimizer steps; ``None`` without a freezer, or
        when ``events`` (the changes of the frozen prefix, which a rollback keeps) show a freeze: one a rollback
        undid is a freeze too."""
        if self.freezer is None or any(event["to"] > event["from"] for event in events):
            return None
        return self.freezer.idle_note(steps, self.rolled_back_at)

    def retrace(
        self, model: nn.Module, agree: Callable[[list[bool]], list[bool]] | None = None, check: bool = False
    ) -> tuple[str, int, bool] | None:
        """Discover the units again once parameters outside them train (the user unfroze a backbone): the
        freezer releases everything, and the units, now with those parameters, wait for the next backward to
        put them into forward order (the graph is checked again there). The new freezer continues the run's
        statistics; scores and windows start over, since the units' inputs changed.

        Args:
            model: the fit's model.
            agree: under DDP, gives every process rank 0's answer to ``check``.
            check: look at the parameters outside the units now (:meth:`LayerFreezer.check_outside`); otherwise
                act only on what the freezer found where it last decided (:attr:`LayerFreezer.outgrown`).

        Returns:
            ``(what happened, as a line to log; the frozen prefix it released; whether the line is a warning)``,
            or ``None`` when the units still cover what trains.
        """
        freezer = self.freezer
        if freezer is None:
            return None
        released = freezer.frozen_prefix if check else 0  # the freezer released it itself where it decided
        if not (freezer.check_outside(agree) if check else freezer.outgrown or freezer.misplaced):
            return None
        previous = [unit.name for unit in freezer.units if unit.used]  # merged with the next backward's order
        self._retraced_before = freezer.state_before_step() if self._step_counted else None  # for state_dict
        if not freezer.outgrown:  # a unit the ordering backward missed got a gradient
            freezer.restore_requires_grad()
            self._statistics, self._graph_checked = freezer.run_statistics(), False
            self._rare = freezer.rare
            self.freezer, self.trace = None, ForwardOrderTrace(freezer.units, previous, freezer.misplaced)
            return misplaced_note(freezer.misplaced), released, False
        watched = {id(param) for param in freezer.outside}
        training = [(name, id(p)) for name, p in model.named_parameters() if p.requires_grad]
        grown = [name for name, key in training if key in watched]
        unsynced = [name for name, key in training if key in self.frozen_before_wrap]
        freezer.restore_requires_grad()  # the module as the user left it, to discover the units in
        self._statistics, self._model, self._graph_checked = freezer.run_statistics(), model, False
        self.freezer, self.trace = None, ForwardOrderTrace(discover_units(model, self.unit_names), previous)
        shown = ", ".join(grown[:3]) + (f" and {len(grown) - 3} more" if len(grown) > 3 else "")
        replaced = freezer.replaced
        gone = ", ".join(replaced[:3]) + (f" and {len(replaced) - 3} more" if len(replaced) > 3 else "")
        why = (
            f"the model no longer holds parameters of its units ({gone}; a layer replaced by a new one?), so "
            "freezing them would stop nothing and count backward FLOPs as skipped that still run"
            if replaced
            else f"parameters outside its units started training ({shown or 'on rank 0'}), so a frozen "
            "prefix could have trainable layers before it"
        )
        note = (
            f"{why}. It released every unit, discovered the units again "
            "with them, and orders them at the next backward; freezing resumes once they are scored, and the "
            "backward FLOPs are measured again"
        )
        if unsynced:  # DDP's own limit, with or without this callback: said where it shows
            note += (
                f". Under DDP, {unsynced[0]}{' and others' if len(unsynced) > 1 else ''} were frozen when DDP "
                "wrapped the model, so DDP never averages their gradients: each rank trains its own copy and the "
                "ranks drift apart (Lightning's BackboneFinetuning, which freezes in `setup`, has the same "
                "limit). Freeze them after DDP wraps the model instead, in a callback's `on_train_start`, so its "
                "reducer holds them"
            )
        return note, released, bool(unsynced)

    def step(
        self,
        enabled: bool,
        agree: Callable[[list[bool]], list[bool]] | None = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> StepReport:
        """:meth:`LayerFreezer.step` (needs a freezer; nothing freezes once the optimizer was found moving
        frozen parameters), then :meth:`GradlessStepCheck.before_step` on the units frozen during its
        backward."""
        self._close_opened()  # a step without a backward (training_step returned None)
        if optimizers:
            self.follow_optimizers(optimizers)
        freezer = self.freezer
        if freezer is None:
            return StepReport()
        frozen_before = list(freezer.frozen) if self.repeats_closure else None
        report = freezer.step(enabled and self.may_freeze, agree)
        if frozen_before is not None and report.changed:
            # the closure runs again in this step (SAM), so the frozen set holds until the step ends: units
            # frozen now keep no gradient of this evaluation (SAM would perturb them and, without a gradient
            # at the next, never restore them), units released now get none from the later ones (SAM would
            # restore them to the point it saved at the last step they trained)
            freezer.drop_frozen_gradients()
            self._released_now = [
                param
                for unit, was, now in zip(freezer.units, frozen_before, freezer.frozen)
                if was and not now
                for param in unit.params
            ]
        held = [param for i in report.held for param in freezer.units[i].params]
        self.optimizer_check.before_step(optimizers, held, self.repeats_closure)  # none held: copies dropped
        if self.stand_in.readers:  # the zeros it dropped, for the module's hooks (taken back at the update)
            self.stand_in.give(self._frozen_parameters())
        return report

    def record_step(
        self, step: int, before: int, report: StepReport, replay: LoaderActivationCache | None = None
    ) -> None:
        """:meth:`record` the changes of the frozen prefix that :meth:`step` reported in ``report``, at
        optimizer ``step``, from the ``before`` units frozen when it began: first a release because the user's
        code turned a frozen unit back on in the middle of an epoch, then the step's own change."""
        if report.taken_back:
            self.record(step, before, "taken back", replay, after=0)
            before = 0
        if report.changed:
            self.record(step, before, report.reason, replay)

    def record(
        self,
        step: int,
        before: int,
        reason: str,
        replay: LoaderActivationCache | None = None,
        after: int | None = None,
    ) -> None:
        """Append a change of the frozen prefix, at optimizer ``step`` from ``before`` units to ``after``
        (``None``: the frozen prefix now), and ``reason``, to :attr:`events`; then plan ``replay`` on the
        units frozen now (:meth:`replan`)."""
        after = self.frozen_prefix if after is None else after
        append_recent(self.events, freeze_event(step, before, after, reason))
        self.replan(replay)

    def repeated_evaluation(self) -> bool:
        """Whether this call (one per closure evaluation, before the optimizer uses its gradients) is a later
        evaluation of an optimizer step counted already: SAM evaluates its closure twice per step. Windows and
        freezes count optimizer steps, so it counts nothing; the frozen units' gradients are dropped again.
        The first call of a step returns ``False``; :meth:`optimizer_moved_frozen_units` ends the step. Units
        released at the first evaluation get no gradient from the later ones either: they train from the next
        step."""
        if not self._step_counted:
            self._step_counted = True
            return False
        self.repeats_closure = True
        if self.freezer is not None:
            self.freezer.drop_frozen_gradients()
        for param in self._released_now:  # released at this step's first evaluation: train from the next
            param.grad = None
        if self.stand_in.readers:  # zeros again for the module's hooks at this evaluation too
            self.stand_in.give([*self._frozen_parameters(), *self._released_now])
        return True

    def follow_phase(self, enabled: bool, resume: bool = False) -> int | None:
        """A pulse phase started: :meth:`LayerFreezer.follow_phase`, where nothing freezes once the optimizer
        was found moving frozen parameters (:attr:`may_freeze`). Returns the frozen prefix before when the
        frozen set changed; ``None`` when it did not, or without a freezer."""
        if self.freezer is None:
            return None
        before = self.freezer.frozen_prefix
        return before if self.freezer.follow_phase(enabled and self.may_freeze, resume=resume) else None

    @property
    def may_freeze(self) -> bool:
        """``False`` once the optimizer was found moving frozen parameters (:class:`GradlessStepCheck`), or a
        freeze cut parameters still training off their gradients (:attr:`gradients_lost`)."""
        return not self.optimizer_check.moved and not self.gradients_lost

    def optimizer_moved_frozen_units(
        self, agree: Callable[[list[bool]], list[bool]] | None = None
    ) -> int | None:
        """After the optimizer step (at each batch end, which ends the step :meth:`repeated_evaluation`
        counts): if it moved frozen parameters (:meth:`GradlessStepCheck.after_step`, found once), they are
        back where they were, every unit is released and nothing freezes again: returns the frozen prefix
        before that; ``None`` otherwise."""
        self._step_counted, self._released_now, self._retraced_before = False, [], None
        self.stand_in.take_back()  # a step that never came (an AMP skip): nothing released starts from zeros
        if not self.optimizer_check.after_step(agree):
            return None
        before = self.frozen_prefix
        if self.freezer is not None:
            self.freezer.release_all()
        return before

    def load_optimizer_check(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`GradlessStepCheck.state_dict` (resume, rollback): if the optimizer was found moving
        frozen parameters, every unit is released."""
        self.optimizer_check.load_state_dict(state)
        if self.optimizer_check.moved and self.freezer is not None:
            self.freezer.release_all()

    def restore(self, state: Mapping[str, Any] | None, model: nn.Module, step: int | None = None) -> None:
        """A rollback in the middle of the fit, after ``step`` optimizer steps: :func:`restore_during_fit`."""
        self._model, self._open_first_forward, self.rolled_back_at = model, False, step
        self.freezer, self.trace = restore_during_fit(
            self.freezer, self.trace, state, model, self.settings, self.optimizers
        )

    def resume(
        self,
        state: Mapping[str, Any] | None,
        model: nn.Module,
        replay: LoaderActivationCache | None = None,
        info: Callable[[str], None] | None = None,
        step: int = 0,
        ledger: BackwardFlopLedger | None = None,
    ) -> str | None:
        """Start a fit from a :meth:`state_dict` (``None``: a fresh run): :meth:`start` from its freezer,
        plan ``replay`` (the fit's activation cache) on the restored frozen units, then
        :meth:`load_optimizer_check`. Returns :meth:`start`'s note on the pinned units, and says it through
        ``info``: a restored freezer's (units still to be ordered are named when they are:
        :meth:`announce`). Drops the :attr:`pending` state (pass it as ``state``).

        When this fit's ``unit_names`` give other units than the state's (:func:`units_changed_since`), they
        are honoured: :meth:`_take_over_saved_run` at optimizer ``step``, with the fit's FLOP ``ledger``.
        """
        self.pending = None
        saved = None if state is None else state["cache"]
        units = None if state is None else self._changed_units(state, model)
        pinned = self.start(saved if units is None else None, model, units)
        if units is not None:
            self._take_over_saved_run(state, units, step, ledger, info)
        elif saved is None and state is not None and state.get("statistics"):
            self._statistics = dict(state["statistics"])  # saved after a retrace, before the units' order
        if state is not None:
            self.replan(replay)
            self.load_optimizer_check(state.get("optimizer_check"))
        if pinned is not None and info is not None:
            info(f"GradientCache: {pinned}.")
        return pinned

    def _changed_units(self, state: Mapping[str, Any], model: nn.Module) -> list[FreezeUnit] | None:
        """The units this fit's ``units`` argument gives where ``state`` (a :meth:`state_dict`) was saved with
        others (:func:`units_changed_since`); ``None`` when they are the same, or it holds no freezer."""
        saved = state["cache"]
        if saved is None:
            return None
        argument_saved = UNITS_ARGUMENT in state
        return units_changed_since(
            saved["units"], state.get(UNITS_ARGUMENT), self.unit_names, model, argument_saved
        )

    def _take_over_saved_run(
        self,
        state: Mapping[str, Any],
        units: Sequence[FreezeUnit],
        step: int,
        ledger: BackwardFlopLedger | None,
        info: Callable[[str], None] | None,
    ) -> None:
        """Continue a checkpoint's run on other ``units`` (this fit's ``units`` argument), as a retrace does:
        scores, windows and snapshots belong to the saved units and say nothing of regrouped ones (a unit's
        plasticity is its movement against its own largest), so the new units start unfrozen, wait for the
        first backward to order them and are scored from new windows; the step count and statistics go on.
        The saved frozen prefix's release goes to :attr:`events` (reason ``"units"``) at ``step``, the
        ``ledger``'s per-prefix measurements are taken again, and ``info`` says what changed."""
        saved = state["cache"]
        # continued by the freezer that _order_waiting builds on the new units
        self._statistics = {"steps": saved["steps"], **saved["stats"]}
        released = next((i for i, frozen in enumerate(saved["frozen"]) if not frozen), len(saved["frozen"]))
        if released:
            append_recent(self.events, freeze_event(step, released, 0, "units"))
        if ledger is not None:
            ledger.remeasure()
        if info is not None:
            info(units_changed_note(state, saved["units"], self.unit_names, units, released))

    def roll_back(
        self,
        state: Mapping[str, Any],
        model: nn.Module,
        step: int,
        replay: LoaderActivationCache | None = None,
    ) -> int:
        """A rollback, after ``step`` optimizer steps, to a :meth:`state_dict`: :meth:`restore` its freezer,
        :meth:`load_optimizer_check`, then plan ``replay`` again; a change of the frozen prefix goes to
        :attr:`events` (reason ``"restore"``), which the state does not replace. Returns the frozen prefix
        before."""
        before = self.frozen_prefix
        saved = state["cache"]
        units = self._changed_units(state, model)  # a snapshot from before this fit's `units` took over
        if units is None:
            self.restore(saved, model, step)
        else:
            # StabilityGuard listed first snapshots at fit start, before GradientCache resumes: restoring that
            # snapshot's units put the old ones back silently (and the next checkpoint saved them under the new
            # argument). This fit's units stay, unfrozen and traced again as at the resume (a state from
            # before the first backward), with the snapshot's statistics
            self.restore(None, model, step)
            self._statistics = {"steps": saved["steps"], **saved["stats"]}
        self.load_optimizer_check(state.get("optimizer_check"))
        # the records were made with parameters the rollback may have changed: record again
        self.replan(replay, again=True)
        if (after := self.frozen_prefix) != before:
            append_recent(self.events, freeze_event(step, before, after, "restore"))
        return before

    def replan(self, replay: LoaderActivationCache | None, again: bool = False) -> None:
        """Cache, in ``replay`` (the fit's activation cache; ``None``: off), the outputs of the units frozen
        now; ``again``: drop its records first (:meth:`LoaderActivationCache.plan`)."""
        if replay is not None:
            replay.plan(self.freezer.frozen_names if self.freezer is not None else [], again)

    def hold(self, state: Mapping[str, Any]) -> None:
        """A checkpoint restore before the fit trains: keep ``state`` (a :meth:`state_dict`) as
        :attr:`pending` for :meth:`resume` at the fit's start (DDP must see every parameter trainable when it
        wraps the model), and take its :attr:`events` at once."""
        self.pending, self.events = dict(state), list(state["events"])

    def state_dict(
        self, ledger: Mapping[str, Any], events: Iterable[Mapping[str, Any]], in_unfinished_step: bool = False
    ) -> dict[str, Any]:
        """:class:`~lightning_pulse.GradientCache`'s checkpoint: the freezer's state (``None`` while the units
        wait for their order), the given FLOP ``ledger`` state and frozen-prefix ``events``, the optimizer
        check's state and the ``units`` argument (:data:`UNITS_ARGUMENT`, which a resume compares with its
        own); the :attr:`pending` state as it came while a restored fit trained nothing (no :meth:`resume`
        came). ``in_unfinished_step``: saved inside a training step whose update has not run, which a resume
        trains again (``compat.in_unfinished_step``): where the freezer counted that step already, its state
        and events as before it (:meth:`LayerFreezer.state_before_step`), so the resume counts it once; also
        where that step's window end retraced the units and dropped it (:meth:`retrace`). Without a freezer
        (the units wait for their order after a retrace): the run's statistics (``"statistics"``), which the
        next freezer continues."""
        if self.pending is not None:
            return dict(self.pending)
        freezer, events = self.freezer, list(events)
        cache = freezer.state_dict() if freezer is not None else None
        if in_unfinished_step and self._step_counted:  # the freezer of that step, also one it retraced
            before = freezer.state_before_step() if freezer is not None else self._retraced_before
            if before is not None:
                cache, recorded = before
                del events[len(events) - recorded :]  # record_step's, for that step
        # units waiting for their order after a retrace: the run's statistics, which their freezer continues
        statistics = {"statistics": dict(self._statistics)} if cache is None and self._statistics else {}
        return {
            **statistics,
            "cache": cache,
            "ledger": ledger,
            "events": events,
            "optimizer_check": self.optimizer_check.state_dict(),
            UNITS_ARGUMENT: None if self.unit_names is None else list(self.unit_names),
        }

    def follow(
        self,
        replacements: Iterable[tuple[nn.Parameter, nn.Parameter, torch.Tensor]],
        replay: LoaderActivationCache | None = None,
    ) -> None:
        """Point the units and the window snapshots at parameters that replaced others (structured pruning):
        :func:`follow_replaced_parameters`. The new parameters are not checked yet: the optimizer check arms
        again. ``replay`` (the fit's activation cache) drops its records and plans again (:meth:`replan`)."""
        follow_replaced_parameters(replacements, self.freezer, self.trace)
        self.optimizer_check.forget_checked_set()
        self.replan(replay, again=True)

    def close(
        self, replay: LoaderActivationCache | None = None, ledger: BackwardFlopLedger | None = None
    ) -> None:
        """Remove the order recording's hooks (also when the backward never came); with them, end the batch
        under way of ``replay``'s cache and ``ledger``'s count (a rollback, the fit's end)."""
        if replay is not None:
            replay.cache.end_batch()
        if self.trace is not None:
            self.trace.close()
        if self._scan is not None:
            self._scan.finish()
        self._calls.close()
        self.backward_reach.close()
        if ledger is not None:
            ledger.close()

    def end(self) -> None:
        """Turn back on every parameter the freezer turned off, so the module leaves the fit as it came in."""
        self._ended, self._wrapped, self._opened_gradients, self._sync_flag = True, None, [], False
        self.optimizer_check.detach()
        self.stand_in.detach()
        self.optimizers = None  # their state is not kept past the fit; unknown again, as for a freezer alone
        if self.freezer is not None:
            self.freezer.optimizers = None
        if self.freezer is not None:
            self.freezer.restore_requires_grad()


def units_changed_note(
    state: Mapping[str, Any],
    saved_units: Sequence[str],
    argument: Sequence[str] | None,
    units: Sequence[FreezeUnit],
    released: int,
) -> str:
    """What :meth:`FreezerLifecycle.resume` says when this fit's ``units`` ``argument`` gives other ``units``
    than the ``saved_units`` of the checkpoint ``state``, whose frozen prefix of ``released`` units it let
    go."""
    saved_argument = (
        f"`units`={state[UNITS_ARGUMENT]!r}" if UNITS_ARGUMENT in state else "saved by an older release"
    )
    way_back = (
        f"resume with `units`={state[UNITS_ARGUMENT]!r}"
        if UNITS_ARGUMENT in state
        else f"resume with the `units` that gave {list(saved_units)}"
    )
    frozen = (
        f"the checkpoint's frozen prefix of {released} unit(s) is released"
        if released
        else "nothing was frozen then"
    )
    return (
        f"GradientCache: `units` changed since the checkpoint: its run's units were {list(saved_units)} "
        f"({saved_argument}), this fit's `units`={None if argument is None else list(argument)!r} gives "
        f"{[unit.name for unit in units]}, which it uses. They start unfrozen ({frozen}), are put in forward "
        "order at the first backward and scored from new windows, as in a fresh fit; the step count and the "
        f"freeze statistics go on. To continue the checkpoint's freezing instead, {way_back}."
    )


def misplaced_note(names: Sequence[str]) -> str:
    """What :meth:`FreezerLifecycle.retrace` says when units the ordering backward missed got a gradient."""
    return (
        f"{', '.join(names)} got no gradient in the backward that put the units into forward order (skipped "
        "there: LayerDrop, a branch used on some batches), so it was ordered last and its place was unknown "
        "once it trained: a frozen prefix could have held units after it. It released every unit and orders "
        "them again at the next backward (merged with the order known so far); freezing resumes once they "
        "are scored"
    )


def refuse_setup(trainer: Any, module: Any, compiled: str | None, cache_mb: float) -> None:
    """:class:`~lightning_pulse.GradientCache`'s refusals at setup, in this order: a ``module`` that runs its
    own optimizer (:func:`refuse_manual_optimization`), a part of it run under ``torch.compile``
    (``compiled``, its name: :func:`refuse_compiled_module`), a ``trainer`` strategy that shards parameters
    (:func:`~lightning_pulse.errors.refuse_sharded_strategy`) and an activation cache of ``cache_mb`` on
    DataLoaders reloaded every ``trainer.reload_dataloaders_every_n_epochs`` epochs
    (:meth:`LoaderActivationCache.refuse_reload`).

    Raises:
        PulseRefusal: for the first of these that applies.
    """
    refuse_manual_optimization(module)
    refuse_compiled_module(compiled)
    refuse_sharded_strategy(trainer, "GradientCache", SHARDED_REASON)
    LoaderActivationCache.refuse_reload(cache_mb, trainer.reload_dataloaders_every_n_epochs)


def refuse_manual_optimization(module: Any) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` for a module that runs its own optimizer."""
    if not module.automatic_optimization:
        raise PulseRefusal(
            "GradientCache: it needs automatic optimization, because it freezes and releases units between "
            "the optimizer steps Lightning runs; set `automatic_optimization = True` or remove GradientCache."
        )


def refuse_compiled_module(compiled: str | None) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` when part of the module (``compiled``, its name) runs
    under ``torch.compile``. The units' forward order is read from the order in which backward hands out
    gradients, and a compiled backward hands them out together in its own order: a held-out compiled CNN froze
    layers whose inputs still trained (no backward saved), and a compiled GPT-2 lost its tied-embedding pin.
    Each change of the frozen set would also recompile the graph."""
    if compiled is not None:
        raise PulseRefusal(
            f"GradientCache: {compiled} runs under torch.compile, whose backward returns the gradients together in "
            "its own order, from which the units' forward order cannot be read (and each change of the frozen "
            "set would recompile). Remove GradientCache, or train without torch.compile."
        )


def check_first_graph(loss: torch.Tensor) -> dict[int, dict[str, list[int | None]]]:
    """One walk of the first step's autograd graph: refuse what freezing cannot follow, and find the parameters
    the forward reads in ways of different kinds, with those kinds (by ``id`` of the parameter).

    Reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, and
    Hugging Face's ``gradient_checkpointing_enable()`` where it picks that) raises a
    :class:`~lightning_pulse.errors.PulseRefusal`: a reentrant checkpoint hands its parameters no gradient when
    none of its inputs needs one, which is what a frozen prefix ending before or inside it makes (a held-out
    model's checkpointed block stopped training for 40 steps, although GradientCache had not frozen it). The
    non-reentrant form has no such rule.

    A parameter read by ops of different kinds (a token embedding's lookup and, as ``F.linear(h, embed.weight)``,
    the output projection) is tied without a second name, which :func:`mark_shared` cannot see: freezing its
    unit would stop the output layer too. A module applied several times reads its weights by one kind of op:
    not reported (it is one unit, frozen or trained as a whole). Returned for each such parameter: each kind
    of op and the sequence numbers of its nodes reading it, for :func:`pin_read_twice` to leave out the reads
    inside the parameter's own unit's forward."""
    seen, stack = set(), [loss.grad_fn]
    # a parameter's id: kind of op reading it -> its nodes' sequence numbers
    readers: dict[int, dict[str, list[int | None]]] = {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise PulseRefusal(
                "GradientCache: the loss goes through reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True), which gives a checkpointed block's parameters no "
                "gradient once a frozen prefix stops its input from needing one: layers GradientCache does not "
                "freeze would stop training. Pass use_reentrant=False to checkpoint (Hugging Face: "
                'gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})), or '
                "remove GradientCache."
            )
        for next_node, _ in node.next_functions:
            variable = getattr(next_node, "variable", None)  # an AccumulateGrad: a parameter read by `node`
            if isinstance(variable, torch.Tensor):
                kind = (
                    type(node).__name__.rstrip("0123456789").removesuffix("Backward")
                )  # MeanBackward1: Mean
                number = sequence_number(node)  # None without the private method: judged as a tie
                readers.setdefault(id(variable), {}).setdefault(kind, []).append(number)
            stack.append(next_node)
    return {key: kinds for key, kinds in readers.items() if len(kinds) > 1}


def pin_read_twice(
    units: Sequence[FreezeUnit],
    read_twice: Mapping[int, Mapping[str, Sequence[int | None]]],
    own_read: Callable[[nn.Parameter, Mapping[str, Sequence[int | None]]], bool] | None = None,
    reader: Callable[[nn.Parameter, Mapping[str, Sequence[int | None]]], str | None] | None = None,
) -> None:
    """Pin the units holding a parameter :func:`check_first_graph` found read by ops of different kinds,
    unless ``own_read`` (:meth:`~lightning_pulse.core.forward_calls.ForwardCalls.own_reads`) finds every one
    of those reads inside calls of the parameter's own unit's forward, each call reading it by every kind:
    spectral norm's ``W / sigma`` with ``sigma = u . (W v)``, weight standardisation's
    ``(w - mean(w)) / std(w)``, which freezing the unit stops together. ``reader``
    (:meth:`~lightning_pulse.core.forward_calls.ForwardCalls.enclosing_reader`) names the module above the
    unit whose forward made every read, for the pin to say so (:data:`READ_BY_PARENT`) instead of a tie."""
    for unit in units:
        kinds: set[str] = set()
        parents: set[str] = set()
        for param in unit.params:
            # a node of a backward formula (ConvolutionBackwardBackward0: a `create_graph=True` derivative)
            # reads the weight of the op it differentiates: that op's read, not another layer's
            reads = {
                kind: nodes for kind, nodes in read_twice.get(id(param), {}).items() if not _derivative(kind)
            }
            if len(reads) > 1 and (own_read is None or not own_read(param, reads)):
                kinds.update(reads)
                parent = reader(param, reads) if reader is not None else None
                if parent is not None:
                    parents.add(parent)
        if kinds and not unit.pinned:
            ops = ", ".join(sorted(kinds))
            unit.shared_with = [
                f"<{READ_BY_PARENT} {', '.join(sorted(parents))} ({ops})>"
                if parents
                else f"<its weight read again outside its own forward ({ops})>"
            ]


#: how a pin names a unit's parameter read again by the forward of a module holding the unit
#: (:func:`pin_read_twice`): a layer whose forward reads its child's weight, split by the automatic split
READ_BY_PARENT = "its weight read again by the forward of the module holding it,"


def _derivative(kind: str) -> bool:
    """Whether ``kind`` (:func:`check_first_graph`'s name of a node's op) is a backward formula's: a node made
    by a backward that builds a graph (``ConvolutionBackwardBackward0`` is kind ``ConvolutionBackward``)."""
    return kind.endswith("Backward")


def refuse_optimizers_that_move_gradless_parameters(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Raise :class:`~lightning_pulse.errors.PulseRefusal` for an optimizer that updates a parameter without a
    gradient. Freezing relies on torch's first-order optimizers skipping a parameter whose ``grad`` is ``None``;
    L-BFGS instead steps every parameter along a direction built from its curvature history, so a frozen unit
    would go on moving (a held-out L-BFGS fit changed its frozen layer at every frozen step)."""
    for optimizer in optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise PulseRefusal(
                "GradientCache: torch.optim.LBFGS updates every parameter along its curvature history, also those "
                "without a gradient, so a frozen unit would still move; use a first-order optimizer (SGD, Adam, "
                "AdamW, ...) or remove GradientCache."
            )


def skips_gradless_parameters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's own (a class defined in ``torch.optim``, not a subclass
    elsewhere): they leave a parameter whose ``grad`` is ``None`` alone (LBFGS, which does not, is refused at
    fit start)."""
    return type(optimizer).__module__.startswith("torch.optim.") and not isinstance(
        optimizer, torch.optim.LBFGS
    )


def holds_frozen_parameters_every_step(
    optimizer: torch.optim.Optimizer, repeats_closure: bool = False
) -> bool:
    """Whether GradientCache puts the frozen parameters back after every step of ``optimizer``, not only checks
    the first: a wrapper holding another optimizer whose step it calls (Lookahead) writes parameters itself
    after the inner step, on some steps only (its slow-weight sync every k steps pulls a unit frozen mid-cycle
    towards the slow copy), so a first frozen step that is not one of them says nothing; and torch runs no step
    hooks for a class that skipped ``Optimizer.__init__`` (pytorch_optimizer's, lonePatient's and alphadl's
    Lookahead), so whether such a step ran cannot be seen. Not a ZeroRedundancyOptimizer around one of torch's
    optimizers (it broadcasts the unchanged values of the parameters its rank owns), nor a wrapper that
    evaluates its closure twice at every step (``repeats_closure``) around one of torch's (SAM perturbs and
    restores at every step, so its first frozen step shows what it does); a wrapper around SAM still is."""
    if not runs_step_hooks(optimizer):
        return True
    inner = _inner_optimizers(optimizer)
    if is_zero_redundancy(optimizer) or repeats_closure:
        return not all(skips_gradless_parameters(held) for held in inner)
    return bool(inner)


def _moved(param: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    return (torch.ne(param, copy) & ~(torch.isnan(param) & torch.isnan(copy))).any()


def optimizer_parameter_ids(optimizers: Iterable[torch.optim.Optimizer]) -> set[int] | None:
    """Ids of the parameters ``optimizers`` (and the optimizers they wrap) hold now; ``None`` when one of them
    shows no ``param_groups``, so what it holds cannot be told."""
    held: set[int] = set()
    for optimizer in optimizers:
        for part in (optimizer, *_inner_optimizers(optimizer)):
            groups = getattr(part, "param_groups", None)
            if groups is None:
                return None
            held.update(id(param) for group in groups for param in group["params"])
    return held


def _inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    # getattr, not vars(): a class with __slots__ has no __dict__
    values = getattr(optimizer, "__dict__", {}).values()
    return [value for value in values if isinstance(value, torch.optim.Optimizer)]


class GradlessStepCheck:
    """Checks, at the first optimizer step each parameter spends frozen, that the optimizer leaves it alone.

    Freezing sets a frozen parameter's ``grad`` to ``None`` and relies on the optimizer skipping it, as
    torch's optimizers, Lion and HF Adafactor do; one that updates every parameter (decoupled weight decay
    applied before its ``grad is None`` test) moved the units GradientCache reported frozen at every frozen
    step. Unless every optimizer is one of torch's (:func:`skips_gradless_parameters`: no copy, no cost),
    an exact copy, on the CPU (a frozen prefix of a large model need not fit twice on the accelerator), of the
    frozen parameters not checked before is kept for that one step, taken as the step begins
    (:meth:`arm`, :class:`StepStartCopy`), before it evaluates its closure: an optimizer may move them there
    (decoupled weight decay applied before the closure), and Lightning calls :meth:`before_step` from inside
    the closure, where such a move was already made and went unseen. :meth:`after_step` compares: if they
    moved, it puts them back and :attr:`moved` turns freezing off for the rest of the run. Each parameter is
    checked once, the first time it is frozen (a first prefix in a no-decay group says nothing of a later,
    larger one). A step the optimizer did not run (a skipped AMP step) checks
    nothing; the next frozen step checks again. Under DDP the frozen parameters and the optimizer are the same
    on every rank, so every rank finds the same; ``agree`` makes that certain.

    A wrapper optimizer (:func:`holds_frozen_parameters_every_step`: Lookahead) is held instead, and freezing
    goes on: a copy on the parameter's device, taken once when a parameter joins the frozen set (again if
    something wrote it in place since: a rollback) and dropped when it leaves, is written back, where the
    step moved it, right after every step: from a step post hook, or a wrapped instance ``step`` where torch
    runs no hooks (:meth:`attach`), so callbacks that read the weights at the batch end, in any order, see
    them frozen; :meth:`after_step` puts back what a step the hooks missed moved. No host transfer but one
    flag per parameter.

    Attributes:
        checked: a step with frozen units has been checked, or needed no check.
        moved: the optimizer moved frozen parameters: nothing is frozen from then on.
        put_back: frozen parameters a wrapper optimizer moved at a step and that were put back (not saved).
    """

    def __init__(self) -> None:
        self.checked = False
        self.moved = False
        self.optimizer_name = ""
        self._torch_only = False  # every optimizer is one of torch's: nothing to check, ever
        self._verified: set[int] = set()  # ids of the parameters a step left alone while frozen
        self._all_checked: Any = None  # the frozen set arm last found all verified
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._at_start: StepStartCopy | None = None  # the copy taken as the step under check begins
        self._holding = False  # this step's frozen parameters are put back after it
        self._put_back_after_step = False  # by the hooks, right after it: the batch end writes nothing
        # id -> (frozen parameter, its value when it froze, its version counter then): held optimizers only
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._attached: dict[int, list[Any]] = {}  # optimizer id -> the hooks that put back after its step
        self._depth: dict[int, int] = {}  # a subclass's super().step() runs the hooks within its own step
        self.put_back = 0

    def attach(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """At fit start: put back after each step of those that may be held (an optimizer whose step torch
        never hooks is wrapped now, so its first frozen step is covered too); until :meth:`detach`."""
        for optimizer in optimizers:
            if id(optimizer) in self._attached or skips_gradless_parameters(optimizer):
                continue
            if not holds_frozen_parameters_every_step(optimizer):
                continue
            self._attached[id(optimizer)] = hook_around_steps(optimizer, self)

    def detach(self) -> None:
        for hooks in self._attached.values():
            for hook in hooks:
                hook.remove()
        if self._at_start is not None:
            self._at_start.remove()
            self._at_start = None
        self._attached, self._depth, self._copies, self._holding = {}, {}, {}, False
        self._put_back_after_step = False

    @property
    def may_arm(self) -> bool:
        """Whether :meth:`arm` can still hook a step: no move found yet, an optimizer not torch's own, no copy
        armed already."""
        return not (self.moved or self._torch_only or self._at_start is not None)

    def forget_checked_set(self) -> None:
        """The frozen set :meth:`arm` found all checked no longer holds the same parameters (a cut replaced
        them, keeping the key): look at them again."""
        self._all_checked = None

    def arm(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        frozen: Callable[[], list[torch.Tensor]],
        repeats_closure: bool = False,
        frozen_set: Any = None,
    ) -> None:
        """Before a batch's forward: if parameters frozen now (``frozen()``) are not checked yet and an
        optimizer needs the check (not one of torch's, not held), copy those frozen when its next step begins
        (:class:`StepStartCopy`); :meth:`after_step` removes the hooks. Checked parameters cost no hook, and
        a ``frozen_set`` (a key of what is frozen) found all checked before costs no walk over them either
        (the checked set only grows)."""
        if not self.may_arm:
            return
        if frozen_set is not None and frozen_set == self._all_checked:
            return
        if all(id(param) in self._verified for param in frozen()):
            self._all_checked = frozen_set
            return
        unknown = [optimizer for optimizer in optimizers if not skips_gradless_parameters(optimizer)]
        if not unknown or any(holds_frozen_parameters_every_step(o, repeats_closure) for o in unknown):
            return  # before_step finds nothing to check, or holds them (copied when they join the frozen set)
        self._at_start = StepStartCopy(
            unknown, lambda: [param for param in frozen() if id(param) not in self._verified]
        )

    def before_step(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Iterable[torch.Tensor],
        repeats_closure: bool = False,
    ) -> None:
        """Before an optimizer step in which ``params`` (the frozen units') have no gradient (each step, with
        none where nothing is frozen). ``repeats_closure``: the optimizer evaluates its closure twice (SAM)."""
        params = list(params)
        if not params and not self._copies:  # nothing frozen, no copy held: nothing to drop or check
            return
        kept = {id(param) for param in params}  # a held copy of a released parameter is dropped
        self._copies = {key: entry for key, entry in self._copies.items() if key in kept}
        if self.moved or self._torch_only or not params:
            return
        unknown = [optimizer for optimizer in optimizers if not skips_gradless_parameters(optimizer)]
        if not unknown:
            self.checked = self._torch_only = True
            return
        self.optimizer_name = type(unknown[0]).__qualname__
        held = [o for o in unknown if holds_frozen_parameters_every_step(o, repeats_closure)]
        if held:
            self.attach(held)  # a hooked one from this step on (its post hook has not run yet)
            for param in params:
                entry = self._copies.get(id(param))
                if entry is None or entry[2] != param._version:  # new to the frozen set, or written since
                    self._copies[id(param)] = (param, param.detach().clone(), param._version)
            self._holding = True
            return
        unchecked = [param for param in params if id(param) not in self._verified]
        if not unchecked:
            return
        if self._at_start is None:  # not armed (a freezer used on its own): the step has not begun yet
            self._at_start = StepStartCopy(unknown, list)
        # the copies taken as the step began; taken now where it has not begun: a precision plugin evaluating
        # the closure before the step (AMP's GradScaler), or not armed
        taken = self._at_start.take()
        self._held = [taken.get(id(param)) or (param, _host_copy(param)) for param in unchecked]

    def _enter(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._depth[id(optimizer)] = self._depth.get(id(optimizer), 0) + 1

    def _leave(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self._depth[id(optimizer)] = max(0, self._depth.get(id(optimizer), 0) - 1)
        if depth == 0 and self._holding:
            self._put_back()
            self._put_back_after_step = True

    @torch.no_grad()
    def _put_back(self) -> None:  # a wrapper's own writes (Lookahead's sync) are undone; freezing goes on
        entries = list(self._copies.values())
        if not entries:
            return
        # one flag per parameter, read at once: the only transfer to the host
        device = entries[0][1].device
        # NaN where it was NaN is no move (a frozen NaN would be written back, and its version bumped, every step)
        flags = torch.stack([_moved(param, copy).to(device) for param, copy, _ in entries]).tolist()
        for (param, copy, _), moved in zip(entries, flags):
            if moved:  # one the step left alone keeps its version: the activation cache's records stay valid
                param.copy_(copy)
                self.put_back += 1
            self._copies[id(param)] = (param, copy, param._version)  # the optimizer's own write, same values

    def after_step(self, agree: Callable[[list[bool]], list[bool]] | None = None) -> bool:
        """After that step: whether it moved the frozen parameters (then put back). ``True`` once, if so."""
        if self._at_start is None and not self._holding and not self._held:
            return False  # most steps: nothing armed, held or copied, so no grad-mode context (~15 µs a step)
        return self._after_checked_step(agree)

    @torch.no_grad()
    def _after_checked_step(self, agree: Callable[[list[bool]], list[bool]] | None) -> bool:
        at_start, self._at_start = self._at_start, None
        if at_start is not None:  # hooks for the steps of this batch only
            at_start.remove()
        if self._holding:  # put back after the step already, unless the hooks missed it
            if not self._put_back_after_step:  # else a write since (a rollback) is not the step's: kept
                self._put_back()
            self._holding, self.checked, self._put_back_after_step = False, True, False
            return False
        if not self._held:
            return False
        held, self._held, stepped = self._held, [], at_start is not None and at_start.stepped
        moved = stepped and any(not torch.equal(param.detach().cpu(), copy) for param, copy in held)
        if agree is not None:
            stepped, moved = (bool(flag) for flag in agree([stepped, moved]))
        if moved:
            for param, copy in held:
                param.copy_(copy)
        elif stepped:
            self._verified.update(id(param) for param, _ in held)
        self.checked, self.moved = self.checked or stepped, moved
        return moved

    def warning(self) -> str:
        return (
            f"GradientCache: the optimizer {self.optimizer_name} moved the parameters of frozen units, which "
            "had no gradient (it updates every parameter, e.g. weight decay applied before its `grad is "
            "None` test), so freezing could not hold them still. They were put back for that step, and "
            "GradientCache froze nothing for the rest of the run (nor counts any saving). Skip parameters "
            "whose `grad` is None in its `step` (as torch.optim's optimizers do), or remove GradientCache."
        )

    def state_dict(self) -> dict[str, bool]:
        return {"checked": self.checked, "moved": self.moved, "optimizer": self.optimizer_name}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict`, keeping what this run found already (a rollback does not unlearn
        it)."""
        if state:
            self.checked = self.checked or bool(state["checked"])
            self.moved = self.moved or bool(state["moved"])
            self.optimizer_name = self.optimizer_name or str(state.get("optimizer", ""))

    def __getstate__(self) -> dict[str, Any]:  # pickled for spawning strategies and deep-copied: no tensors
        dropped = {"_held": [], "_at_start": None, "_verified": set(), "_holding": False, "_copies": {}}
        dropped["_all_checked"] = None  # what it found checked was the dropped _verified
        return {**self.__dict__, **dropped, "_attached": {}, "_depth": {}}


class StepStartCopy:
    """A host copy of ``frozen()``, taken when a step of one of ``optimizers`` begins (torch's step pre hook,
    through :func:`~lightning_pulse.core.snapshots.hook_around_steps`), so before the step evaluates its
    closure, or at :meth:`take` if that comes first; :attr:`stepped` once such a step ended. A subclass's
    ``super().step()`` runs the hooks again inside its step: only the outermost counts."""

    def __init__(
        self, optimizers: Iterable[torch.optim.Optimizer], frozen: Callable[[], list[torch.Tensor]]
    ) -> None:
        self.frozen, self.stepped = frozen, False
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._depth: dict[int, int] = {}
        self._handles = [hook for optimizer in optimizers for hook in hook_around_steps(optimizer, self)]

    def take(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The copies, by parameter id (taken now if the step has not begun)."""
        if self.copies is None:
            self.copies = {id(param): (param, _host_copy(param)) for param in self.frozen()}
        return self.copies

    def _enter(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._depth[id(optimizer)] = self._depth.get(id(optimizer), 0) + 1
        self.take()

    def _leave(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self._depth[id(optimizer)] = max(0, self._depth.get(id(optimizer), 0) - 1)
        self.stepped = self.stepped or depth == 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _host_copy(param: torch.Tensor) -> torch.Tensor:
    return param.detach().to("cpu", copy=True)


def announce_units(
    freezer: LayerFreezer,
    info: Callable[[str], None],
    warn: Callable[[str], None],
    model: nn.Module | None = None,
) -> None:
    """Say, once the units are in forward order, what they are (``info``), and why nothing can ever freeze if
    so: a single trainable unit (``info``; ``warn`` with the ``units`` that split it where ``model`` holds its
    parameters in one container, :func:`~lightning_pulse.core.freeze_units.finer_units_way_out`) or a tied
    first unit (``warn``); which other units are pinned (``info``,
    :func:`~lightning_pulse.core.freeze_units.pinned_note`) and which freeze only with later ones (``info``,
    :func:`~lightning_pulse.core.freeze_units.reread_note`)."""
    pinned = freezer.units
    if freezer.freezable_limit == 0:
        single = "GradientCache: the model has a single trainable unit, so nothing can be frozen"
        way_out = None if model is None else finer_units_way_out(model, freezer.units[0])
        if way_out is None:
            info(f"{single}.")
        else:  # a callback that can never act, where it could: a warning, as for other options that do nothing
            warn(f"{single}: {way_out}.")
    elif freezer.pinned_first is not None:
        warn(f"GradientCache: {freezer.pinned_first}{'' if model is None else forced_tie_note(model)}.")
        pinned = pinned[1:]  # the warning named the first unit's tie: one message for one fact
    info(f"GradientCache: {order_note(freezer.units)}")
    for note in (pinned_note(pinned), reread_note(freezer.units), heads_note(freezer.units)):
        if note is not None:
            info(f"GradientCache: {note}.")


def forced_tie_note(model: nn.Module) -> str:
    """Where ``model`` holds a Hugging Face model whose config class ties its embeddings whatever it is given
    (transformers 5's ``T5Config`` sets ``tie_word_embeddings=True`` itself), that the way out the warning
    names does nothing there; else ``""``. Read at fit start only: it builds one config of that class with
    its defaults."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "tie_word_embeddings", None) is not True:
            continue
        try:
            forced = type(config)(tie_word_embeddings=False).tie_word_embeddings is True
        except Exception:  # a config class that needs arguments: nothing to tell
            return ""
        if forced:
            return (
                f"; but {type(config).__name__} ties them whatever it is given (it sets "
                "`tie_word_embeddings=True` itself), so GradientCache cannot freeze this model: leave it out"
            )
        return ""
    return ""


def frozen_parameter_ids(model: nn.Module) -> set[int]:
    """The ids of ``model``'s parameters that do not require grad now (right after DDP wrapped it: those its
    reducer left out)."""
    return {id(param) for param in model.parameters() if not param.requires_grad}


def check_wrapped_model(model: nn.Module, world_size: int, strategy_name: str) -> None:
    """Raise a :class:`~lightning_pulse.errors.PulseRefusal` naming the fix if the (strategy-wrapped)
    ``model`` cannot follow ``requires_grad`` changes.

    DDP registers every trainable parameter with its reducer when it wraps the model and, by default, waits for
    a gradient from each of them in every backward. A frozen parameter never produces one, so DDP must look for
    unused parameters (``find_unused_parameters=True``) and must not assume a static graph. Strategies that
    shard or flatten parameters (FSDP, DeepSpeed) do not see per-module ``requires_grad`` changes at all.
    """
    if isinstance(model, DistributedDataParallel):
        if getattr(model, "static_graph", False):
            raise PulseRefusal(
                "GradientCache: it changes which parameters get gradients, which `static_graph=True` forbids; use "
                "`DDPStrategy(find_unused_parameters=True)` without `static_graph`. That advice does not "
                f"hold for every model. {DDP_INNER_BACKWARD}."
            )
        if not model.find_unused_parameters:
            raise PulseRefusal(
                "GradientCache: it freezes parameters after DDP wrapped the model, so DDP must skip parameters that get "
                "no gradient: use `strategy=DDPStrategy(find_unused_parameters=True)` or the strategy name "
                "'ddp_find_unused_parameters_true' ('ddp_spawn_find_unused_parameters_true' for spawn). That "
                f"advice does not hold for every model. {DDP_INNER_BACKWARD}."
            )
        return
    if world_size > 1:
        raise PulseRefusal(
            f"GradientCache: it supports single-process training and DDP; {strategy_name} shards or flattens "
            "parameters, so per-module `requires_grad` changes would not take effect. Use DDP."
        )
