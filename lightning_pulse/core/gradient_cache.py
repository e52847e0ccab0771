"""A per-module gradient cache that decides which leading modules may stop computing gradients.

Plain torch, no Lightning. The pieces:

* :func:`discover_units` splits a model into *units* (embedding, blocks, head, ...) named by their parameters.
* :func:`order_units` sorts units into forward order from the order in which one real backward pass
  finished their gradients (the unit finished last is the one nearest the input).
* Measures that compare a fresh window-mean gradient with the cached one: :func:`gradient_cosine`,
  :func:`relative_norm_change`, and :func:`relative_parameter_change` (the parameter-space plasticity).
* :class:`ModuleGradientCache`: the state machine. Every optimizer step it adds the fresh gradients of the
  trainable units to a window; every ``check_every`` steps it scores each unit against its cache and
  freezes the longest stable *prefix* of units (``requires_grad`` off), for at most ``freeze_for`` steps
  before the prefix is released to refresh its cache.
* :class:`BackwardFlopLedger`: backward FLOPs per frozen-prefix length, measured with
  ``torch.utils.flop_counter``, turned into FLOPs skipped per step.

Why a prefix: autograd only skips work when nothing upstream needs a gradient. Freezing the first ``k`` units
means the activation entering unit ``k`` does not require grad, so backward stops there and neither the
weight gradients nor the input gradients of the prefix are computed (and unit ``k`` skips its input
gradient too). Freezing a unit in the middle would only save its weight gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MEASURES = ("cosine", "norm_change", "plasticity")
DEFAULT_THRESHOLDS = {"cosine": 0.5, "norm_change": 0.2, "plasticity": 0.2}
FROZEN_UPDATES = ("none", "cached")
MODES = ("freeze", "stale_replay")
SCHEDULES = ("adaptive", "freezeout")
SCALINGS = {"linear": 1, "squared": 2, "cubic": 3}
STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class CacheSettings:
    """Validated settings of a :class:`ModuleGradientCache` (see :class:`GradientCache` for their meaning)."""

    measure: str = "plasticity"
    threshold: float | None = None
    check_every: int = 20
    freeze_for: int = 200
    max_frozen_share: float = 0.9
    frozen_update: str | None = None
    cached_decay: float = 0.9
    mode: str = "freeze"

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ValueError(f"`measure`={self.measure!r} is not one of {list(MEASURES)}.")
        if self.mode not in MODES:
            raise ValueError(f"`mode`={self.mode!r} is not one of {list(MODES)}.")
        if self.frozen_update is not None and self.frozen_update not in FROZEN_UPDATES:
            raise ValueError(
                f"`frozen_update`={self.frozen_update!r} is not one of {list(FROZEN_UPDATES)} or None."
            )
        if self.mode == "stale_replay" and self.frozen_update == "none":
            raise ValueError(
                "`frozen_update`='none' contradicts `mode`='stale_replay', whose point is to apply the cached "
                "gradients; leave `frozen_update` as None or set it to 'cached'."
            )
        for name in ("check_every", "freeze_for"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}`={value!r} must be a positive int of optimizer steps.")
        if self.freeze_for % self.check_every:
            raise ValueError(
                f"`freeze_for`={self.freeze_for} must be a multiple of `check_every`={self.check_every}, "
                "because freezes start and end at cache checks."
            )
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
                raise ValueError(f"`threshold`={self.threshold!r} must be a number or None.")
            if self.measure == "cosine" and not -1.0 <= self.threshold <= 1.0:
                raise ValueError(f"`threshold`={self.threshold!r} must be in [-1, 1] for `measure`='cosine'.")
            if self.measure != "cosine" and not 0.0 <= self.threshold:
                raise ValueError(
                    f"`threshold`={self.threshold!r} must be >= 0 for `measure`={self.measure!r}."
                )
        share = self.max_frozen_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
            raise ValueError(f"`max_frozen_share`={share!r} must be a number in (0, 1].")
        decay = self.cached_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"`cached_decay`={decay!r} must be a number in [0, 1].")

    @property
    def effective_threshold(self) -> float:
        return float(DEFAULT_THRESHOLDS[self.measure] if self.threshold is None else self.threshold)

    @property
    def effective_frozen_update(self) -> str:
        if self.frozen_update is not None:
            return self.frozen_update
        return "cached" if self.mode == "stale_replay" else "none"


# ---------------------------------------------------------------------------------------------------- units
@dataclass
class FreezeUnit:
    """A group of parameters that is frozen or trained as one.

    Attributes:
        name: the module (or parameter) name the unit stands for, e.g. ``"blocks.0"`` or ``"position"``.
        param_names: qualified names (as in ``model.named_parameters()``) of the trainable parameters it owns.
        params: the parameters themselves, bound with :meth:`bind`.
        used: whether the parameters received a gradient in the traced backward; unused units never freeze.
    """

    name: str
    param_names: list[str]
    params: list[nn.Parameter] = field(default_factory=list)
    used: bool = True

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def bind(self, named: Mapping[str, nn.Parameter]) -> None:
        missing = [name for name in self.param_names if name not in named]
        if missing:
            raise ValueError(f"Unit {self.name!r}: the model has no parameter {missing[0]!r}.")
        self.params = [named[name] for name in self.param_names]


def _trainable_named_parameters(root: nn.Module) -> dict[str, nn.Parameter]:
    # named_parameters() yields a shared (tied) parameter once, under its first name, which gives it one owner
    return {name: p for name, p in root.named_parameters() if p.requires_grad}


def _under(prefix: str, names: Sequence[str]) -> list[str]:
    return [name for name in names if name == prefix or name.startswith(prefix + ".")]


def discover_units(
    root: nn.Module, min_units: int = 8, module_names: Sequence[str] | None = None
) -> list[FreezeUnit]:
    """Split ``root``'s trainable parameters into freeze units (in registration order; see :func:`order_units`).

    Automatic split: start from the whole model and keep expanding the largest unit that has sub-modules with
    parameters into those sub-modules (its own direct parameters become one unit each) until there are at
    least ``min_units`` units or nothing can be expanded. A transformer ends up as embedding, positional
    parameter, blocks, final norm and head; a small CNN as its layers.

    Args:
        root: the model.
        min_units: stop expanding once there are this many units.
        module_names: explicit units instead: qualified module or parameter names. Trainable parameters not
            covered by any of them form one extra unit ``"<rest>"``.

    Raises:
        ValueError: for a name that is neither a module nor a parameter of ``root``, or names that overlap.
    """
    named = _trainable_named_parameters(root)
    all_names = list(named)
    if module_names is not None:
        modules = dict(root.named_modules())
        units: list[FreezeUnit] = []
        claimed: set[str] = set()
        for name in module_names:
            if name not in modules and name not in dict(root.named_parameters()):
                raise ValueError(f"`units` entry {name!r} is neither a module nor a parameter of the model.")
            owned = _under(name, all_names)
            overlap = claimed.intersection(owned)
            if overlap:
                raise ValueError(f"`units` entry {name!r} overlaps another entry on {sorted(overlap)[0]!r}.")
            claimed.update(owned)
            if owned:
                units.append(FreezeUnit(name, owned))
        rest = [name for name in all_names if name not in claimed]
        if rest:
            units.append(FreezeUnit("<rest>", rest))
        return units

    def expand(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module | None]]:
        parts: list[tuple[str, nn.Module | None]] = []
        for pname, param in module.named_parameters(recurse=False):
            qualified = f"{prefix}.{pname}" if prefix else pname
            if qualified in named and named[qualified] is param:
                parts.append((qualified, None))
        for cname, child in module.named_children():
            qualified = f"{prefix}.{cname}" if prefix else cname
            if _under(qualified, all_names):
                parts.append((qualified, child))
        return parts

    def expandable(module: nn.Module | None) -> bool:
        return module is not None and any(True for _ in module.children())

    def size(name: str) -> int:
        return (
            sum(named[n].numel() for n in _under(name, all_names))
            if name
            else sum(p.numel() for p in named.values())
        )

    pieces: list[tuple[str, nn.Module | None]] = expand("", root)
    while True:
        # a single wrapper (LightningModule -> net) is see-through: always expand it
        candidates = [
            (size(name), index) for index, (name, module) in enumerate(pieces) if expandable(module)
        ]
        if not candidates or (len(pieces) >= min_units and len(pieces) > 1):
            break
        _, index = max(candidates, key=lambda item: (item[0], -item[1]))
        name, module = pieces[index]
        replacement = expand(name, module)  # type: ignore[arg-type]
        if not replacement:
            break
        pieces[index : index + 1] = replacement
    return [FreezeUnit(name, _under(name, all_names)) for name, _ in pieces if _under(name, all_names)]


@contextmanager
def record_gradient_order(params: Mapping[str, nn.Parameter]) -> Iterator[list[str]]:
    """Record the names of ``params`` in the order backward finishes accumulating their gradients.

    Used around the first real backward: the parameter finished last is the one nearest the input.
    """
    order: list[str] = []
    handles = []
    for name, param in params.items():

        def hook(_: torch.Tensor, name: str = name) -> None:
            order.append(name)

        handles.append(param.register_post_accumulate_grad_hook(hook))
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()


def order_units(units: Sequence[FreezeUnit], gradient_order: Sequence[str]) -> list[FreezeUnit]:
    """Sort units into forward order from a backward's gradient-completion order.

    A unit's position is the *last* time one of its parameters got its gradient, read backwards: a tied
    embedding/head weight completes last, so its unit counts as the first one. Units none of whose parameters
    got a gradient are marked ``used=False`` and go last.
    """
    last_seen = {name: index for index, name in enumerate(gradient_order)}
    keyed = []
    for position, unit in enumerate(units):
        seen = [last_seen[name] for name in unit.param_names if name in last_seen]
        unit.used = bool(seen)
        keyed.append((0 if seen else 1, -max(seen) if seen else position, position, unit))
    return [unit for *_, unit in sorted(keyed, key=lambda item: item[:3])]


# ---------------------------------------------------------------------------------------------------- measures
def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return float(sum(torch.sum(x.double() * y.double()) for x, y in zip(a, b)))


def _norm(a: Sequence[torch.Tensor]) -> float:
    return math.sqrt(max(_dot(a, a), 0.0))


def gradient_cosine(current: Sequence[torch.Tensor], cached: Sequence[torch.Tensor]) -> float:
    """Cosine similarity of two gradients given as matching lists of tensors; 0 if either is zero."""
    denominator = _norm(current) * _norm(cached)
    return _dot(current, cached) / denominator if denominator > 0 else 0.0


def relative_norm_change(current: Sequence[torch.Tensor], cached: Sequence[torch.Tensor]) -> float:
    """``| ||g|| - ||g_cached|| | / ||g_cached||`` (AutoFreeze's gradient-norm change rate); inf if cached is 0."""
    reference = _norm(cached)
    return abs(_norm(current) - reference) / reference if reference > 0 else math.inf


def relative_parameter_change(params: Sequence[torch.Tensor], snapshot: Sequence[torch.Tensor]) -> float:
    """``||theta - theta_snapshot|| / ||theta_snapshot||``: how far a unit moved over a window (plasticity)."""
    moved = math.sqrt(
        sum(float(torch.sum((p.detach().double() - s.double()) ** 2)) for p, s in zip(params, snapshot))
    )
    reference = _norm(snapshot)
    return moved / reference if reference > 0 else (math.inf if moved > 0 else 0.0)


# ---------------------------------------------------------------------------------------------------- FreezeOut
def freezeout_points(count: int, t0: float, scaling: str) -> list[float]:
    """FreezeOut's freeze points (Brock et al. 2017) of ``count`` units in forward order, as shares in (0, 1].

    ``t_i = (t0 + (1 - t0) * i / count) ** p`` with ``p`` = 1, 2, 3 for ``scaling`` linear, squared, cubic:
    the first unit stops at ``t0 ** p`` of the annealing span, later ones evenly (in ``t ** (1/p)``) after it;
    the unit after the last one (the first that always trains) would get 1, the end of the run.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"`scaling`={scaling!r} is not one of {list(SCALINGS)}.")
    power = SCALINGS[scaling]
    return [(t0 + (1.0 - t0) * i / count) ** power for i in range(count)]


def freezeout_factor(step: float, start: float, stop: float) -> float:
    """The learning-rate factor of a unit annealed from ``start`` to ``stop`` (optimizer steps).

    ``0.5 * (1 + cos(pi * (step - start) / (stop - start)))``: 1 until ``start``, a half cosine down to 0 at
    ``stop``, 0 after (the unit is frozen from ``stop`` on).
    """
    if step <= start:
        return 1.0
    if step >= stop:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - start) / (stop - start)))


# ---------------------------------------------------------------------------------------------------- the cache
@dataclass
class StepReport:
    """What one call of :meth:`ModuleGradientCache.after_backward` did."""

    window_closed: bool = False
    changed: bool = False
    frozen_prefix: int = 0
    frozen_share: float = 0.0
    refreshed: list[str] = field(default_factory=list)
    similarity_at_refresh: float | None = None


class ModuleGradientCache:
    """Gradient windows, caches and the frozen prefix of a list of :class:`FreezeUnit` in forward order.

    Call :meth:`after_backward` once per optimizer step, after the (accumulated, all-reduced) gradients are
    final and before the optimizer uses them. It

    1. adds the gradients of trainable units to the current window;
    2. every ``check_every`` steps, closes the window: each unit that trained the whole window gets a score
       against its cache (previous window's mean gradient, or the cache taken when it froze), the window mean
       becomes the new cache, and the longest prefix of stable, fresh units is frozen (``requires_grad``
       off). A unit is fresh while its cache is younger than ``freeze_for`` steps; a frozen prefix whose
       oldest cache expires is released for one window to refresh it;
    3. sets the gradients of the units that were frozen during this backward: ``None`` (so torch optimizers
       skip them: no momentum, no weight decay), or with ``frozen_update='cached'`` the cached mean gradient
       times ``cached_decay ** staleness``.

    Scores: ``cosine`` is the cosine similarity of window means (stable when >= threshold: the cache
    predicts the gradient); ``norm_change`` is AutoFreeze's relative gradient-norm change (stable when <=
    threshold); ``plasticity`` is the unit's relative parameter movement over the window divided by the
    largest movement it ever had (stable when <= threshold: the unit has slowed down).

    Args:
        units: the units in forward order (see :func:`discover_units` and :func:`order_units`).
        settings: validated :class:`CacheSettings`.
    """

    def __init__(self, units: Sequence[FreezeUnit], settings: CacheSettings | None = None) -> None:
        self.units = list(units)
        self.settings = settings or CacheSettings()
        self.threshold = self.settings.effective_threshold
        self.frozen_update = self.settings.effective_frozen_update
        n = len(self.units)
        used = [i for i, unit in enumerate(self.units) if unit.used]
        # the last unit that gets a gradient always trains, so the loss still requires grad
        self.freezable_limit = used[-1] if used else 0
        self._unit_numel = [unit.numel for unit in self.units]  # units never change size within a run
        self.trainable_numel = sum(self._unit_numel)
        self.steps = 0
        self.step_in_window = 0
        self.frozen = [False] * n
        self.stable = [False] * n
        self.scores: list[float | None] = [None] * n
        self.validated_at: list[int | None] = [None] * n
        self.peak_rate = [0.0] * n
        self.checking = [False] * n  # released from a freeze; the next full window checks the cache
        self.window_count = [0] * n
        self.window_sum: list[list[torch.Tensor] | None] = [None] * n
        self.cached_mean: list[list[torch.Tensor] | None] = [None] * n
        self.snapshot: list[list[torch.Tensor] | None] = [None] * n
        if self.settings.measure == "plasticity":
            self.snapshot = [self._clone_params(i) for i in range(n)]
        # statistics
        self.cache_checks = 0
        self.cache_hits = 0
        self.similarity_sum = 0.0
        self.last_similarity_at_refresh: float | None = None
        self.frozen_share_sum = 0.0
        self.freezes = 0

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
    def schedulable_prefix(self) -> int:
        """The longest prefix that may ever be frozen: used units before the last one, within
        ``max_frozen_share`` of the trainable parameters."""
        budget = self.settings.max_frozen_share * self.trainable_numel
        frozen_numel = 0
        for i in range(self.freezable_limit):
            if not self.units[i].used or frozen_numel + self._unit_numel[i] > budget:
                return i
            frozen_numel += self._unit_numel[i]
        return self.freezable_limit

    @property
    def staleness(self) -> int:
        """Steps since the oldest cache of a frozen unit was last checked against fresh gradients (0 if none)."""
        ages = [self.steps - (self.validated_at[i] or 0) for i in range(len(self.units)) if self.frozen[i]]
        return max(ages, default=0)

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of cache checks (a frozen unit's first full window after release) that found it still stable."""
        return self.cache_hits / self.cache_checks if self.cache_checks else None

    @property
    def mean_similarity_at_refresh(self) -> float | None:
        return self.similarity_sum / self.cache_checks if self.cache_checks else None

    @property
    def mean_frozen_share(self) -> float:
        """Parameter share frozen during backward, averaged over the steps seen."""
        return self.frozen_share_sum / self.steps if self.steps else 0.0

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def after_backward(
        self,
        enabled: bool,
        agree: Callable[[list[bool]], list[bool]] | None = None,
        target: int | None = None,
    ) -> StepReport:
        """Account one optimizer step whose gradients are final; maybe check caches and move the prefix.

        Args:
            enabled: whether freezing is allowed from the next step on (``False`` in a burst phase or after the
                release point): then the prefix is released.
            agree: maps this process's stable flags to the flags every process uses (DDP: rank 0's, by
                broadcast). Called at every window end, on every process.
            target: a prefix length fixed by a schedule (FreezeOut) instead of the stability test: applied at
                once, at every step, capped at :attr:`schedulable_prefix`. The windows and scores are still
                kept, for the metrics.
        """
        frozen_during_backward = [i for i, is_frozen in enumerate(self.frozen) if is_frozen]
        report = StepReport(frozen_share=self.frozen_share)
        self.frozen_share_sum += report.frozen_share
        self.steps += 1
        self._accumulate()
        self.step_in_window += 1
        if self.step_in_window >= self.settings.check_every:
            report.window_closed = True
            report.refreshed, similarities = self._close_window()
            if similarities:
                report.similarity_at_refresh = sum(similarities) / len(similarities)
            if agree is not None:
                self.stable = [bool(flag) for flag in agree(list(self.stable))]
            if target is None:
                report.changed = self._set_prefix(self._propose(enabled))
            self.step_in_window = 0
        if target is not None:
            report.changed = self._set_prefix(min(target, self.schedulable_prefix) if enabled else 0)
        elif not report.window_closed and not enabled and any(self.frozen):
            report.changed = self._set_prefix(0)
        self._fill_frozen_gradients(frozen_during_backward)
        report.frozen_prefix = self.frozen_prefix
        return report

    def release_all(self) -> bool:
        """Make every unit trainable (a burst phase started). Returns whether anything changed."""
        return self._set_prefix(0)

    def freeze_from_last_check(self) -> bool:
        """Freeze the prefix that the last check found stable and fresh (a light phase started)."""
        return self._set_prefix(self._propose(True))

    def apply_requires_grad(self) -> None:
        """Set ``requires_grad`` of every unit from the frozen flags (after restoring a checkpoint)."""
        for unit, is_frozen in zip(self.units, self.frozen):
            for param in unit.params:
                param.requires_grad_(not is_frozen)

    def restore_requires_grad(self) -> None:
        """Make every unit's parameters require grad again, as the user built them (end of training)."""
        for unit in self.units:
            for param in unit.params:
                param.requires_grad_(True)

    # ------------------------------------------------------------------ internals
    def _clone_params(self, index: int) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.units[index].params]

    def _accumulate(self) -> None:
        totals: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for i, unit in enumerate(self.units):
            if self.frozen[i] or not unit.used:
                continue
            sums = self.window_sum[i]
            if sums is None:
                sums = self.window_sum[i] = [torch.zeros_like(p, dtype=torch.float32) for p in unit.params]
            for total, param in zip(sums, unit.params):
                grad = param.grad
                if grad is not None:  # a parameter unused in this step's forward adds nothing
                    totals.append(total)
                    grads.append(grad.detach().float())
            self.window_count[i] += 1
        if totals:
            # one multi-tensor add instead of one small kernel launch per parameter (the same sums)
            torch._foreach_add_(totals, grads)

    def _close_window(self) -> tuple[list[str], list[float]]:
        refreshed: list[str] = []
        similarities: list[float] = []
        measure = self.settings.measure
        for i, unit in enumerate(self.units):
            full = not self.frozen[i] and unit.used and self.window_count[i] >= self.settings.check_every
            if full:
                mean = [total.div_(self.window_count[i]) for total in self.window_sum[i]]  # type: ignore[union-attr]
                cached = self.cached_mean[i]
                similarity = gradient_cosine(mean, cached) if cached is not None else None
                score: float | None
                if measure == "cosine":
                    score = similarity
                    stable = score is not None and score >= self.threshold
                elif measure == "norm_change":
                    score = relative_norm_change(mean, cached) if cached is not None else None
                    stable = score is not None and score <= self.threshold
                else:
                    snapshot = self.snapshot[i]
                    rate = relative_parameter_change(unit.params, snapshot) if snapshot is not None else None
                    if rate is not None and math.isfinite(rate):
                        self.peak_rate[i] = max(self.peak_rate[i], rate)
                    score = rate / self.peak_rate[i] if rate is not None and self.peak_rate[i] > 0 else None
                    stable = score is not None and score <= self.threshold
                if self.checking[i] and similarity is not None:
                    self.cache_checks += 1
                    self.cache_hits += int(stable)
                    self.similarity_sum += similarity
                    similarities.append(similarity)
                    refreshed.append(unit.name)
                    self.checking[i] = False
                self.cached_mean[i] = mean
                self.window_sum[i] = None
                self.scores[i] = score
                self.stable[i] = bool(stable)
                self.validated_at[i] = self.steps
            elif not self.frozen[i] and self.window_sum[i] is not None:
                # a window cut short by a phase change says nothing reliable: drop it
                for total in self.window_sum[i]:  # type: ignore[union-attr]
                    total.zero_()
            self.window_count[i] = 0
            if measure == "plasticity" and not self.frozen[i]:
                self.snapshot[i] = self._clone_params(i)
        if similarities:
            self.last_similarity_at_refresh = sum(similarities) / len(similarities)
        return refreshed, similarities

    def _fresh(self, index: int) -> bool:
        validated = self.validated_at[index]
        return validated is not None and self.steps - validated < self.settings.freeze_for

    def _propose(self, enabled: bool) -> int:
        if not enabled:
            return 0
        budget = self.settings.max_frozen_share * self.trainable_numel
        frozen_numel = 0
        length = 0
        for i in range(self.freezable_limit):
            unit = self.units[i]
            if not unit.used or not self._fresh(i) or self.cached_mean[i] is None:
                break
            if self.settings.mode == "freeze" and not self.stable[i]:
                break
            if frozen_numel + unit.numel > budget:
                break
            frozen_numel += unit.numel
            length = i + 1
        return length

    def _set_prefix(self, length: int) -> bool:
        changed = False
        for i, unit in enumerate(self.units):
            want = i < length
            if want and not self.frozen[i]:
                for param in unit.params:
                    param.requires_grad_(False)
                self.frozen[i] = True
                self.window_sum[i] = None
                self.window_count[i] = 0
                self.checking[i] = False
                self.freezes += 1
                changed = True
            elif not want and self.frozen[i]:
                for param in unit.params:
                    param.requires_grad_(True)
                self.frozen[i] = False
                self.window_count[i] = 0
                self.checking[i] = True
                if self.settings.measure == "plasticity":
                    self.snapshot[i] = self._clone_params(i)
                changed = True
        return changed

    def _fill_frozen_gradients(self, indices: Sequence[int]) -> None:
        for i in indices:
            cached = self.cached_mean[i]
            use_cache = self.frozen_update == "cached" and cached is not None
            factor = (
                self.settings.cached_decay ** (self.steps - (self.validated_at[i] or 0)) if use_cache else 0.0
            )
            for j, param in enumerate(self.units[i].params):
                if use_cache:
                    param.grad = cached[j].mul(factor).to(param.dtype)  # type: ignore[index]
                else:
                    # None, not zeros: torch optimizers skip a None grad, so no momentum and no weight decay
                    param.grad = None

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        def tensors(values: list[list[torch.Tensor] | None]) -> list[list[torch.Tensor] | None]:
            return [None if item is None else [t.detach().clone() for t in item] for item in values]

        return {
            "version": STATE_VERSION,
            "units": [unit.name for unit in self.units],
            "unit_params": [list(unit.param_names) for unit in self.units],
            "used": [unit.used for unit in self.units],
            "steps": self.steps,
            "step_in_window": self.step_in_window,
            "frozen": list(self.frozen),
            "stable": list(self.stable),
            "scores": list(self.scores),
            "validated_at": list(self.validated_at),
            "peak_rate": list(self.peak_rate),
            "checking": list(self.checking),
            "window_count": list(self.window_count),
            "window_sum": tensors(self.window_sum),
            "cached_mean": tensors(self.cached_mean),
            "snapshot": tensors(self.snapshot),
            "stats": {
                "cache_checks": self.cache_checks,
                "cache_hits": self.cache_hits,
                "similarity_sum": self.similarity_sum,
                "last_similarity_at_refresh": self.last_similarity_at_refresh,
                "frozen_share_sum": self.frozen_share_sum,
                "freezes": self.freezes,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Does not touch ``requires_grad``; call :meth:`apply_requires_grad`."""
        names = [unit.name for unit in self.units]
        if list(state["units"]) != names:
            raise ValueError(
                f"GradientCache checkpoint has units {list(state['units'])}, the model has {names}; "
                "the model changed since the checkpoint was written."
            )

        def tensors(values: list[list[torch.Tensor] | None]) -> list[list[torch.Tensor] | None]:
            restored: list[list[torch.Tensor] | None] = []
            for unit, item in zip(self.units, values):
                if item is None:
                    restored.append(None)
                else:
                    # copies: the windows are summed into in place, and the caller may load the same state again
                    restored.append([t.detach().to(p.device, copy=True) for t, p in zip(item, unit.params)])
            return restored

        self.steps = int(state["steps"])
        self.step_in_window = int(state["step_in_window"])
        self.frozen = [bool(v) for v in state["frozen"]]
        self.stable = [bool(v) for v in state["stable"]]
        self.scores = [None if v is None else float(v) for v in state["scores"]]
        self.validated_at = [None if v is None else int(v) for v in state["validated_at"]]
        self.peak_rate = [float(v) for v in state["peak_rate"]]
        self.checking = [bool(v) for v in state["checking"]]
        self.window_count = [int(v) for v in state["window_count"]]
        self.window_sum = tensors(state["window_sum"])
        self.cached_mean = tensors(state["cached_mean"])
        self.snapshot = tensors(state["snapshot"])
        stats = state["stats"]
        self.cache_checks = int(stats["cache_checks"])
        self.cache_hits = int(stats["cache_hits"])
        self.similarity_sum = float(stats["similarity_sum"])
        last = stats["last_similarity_at_refresh"]
        self.last_similarity_at_refresh = None if last is None else float(last)
        self.frozen_share_sum = float(stats["frozen_share_sum"])
        self.freezes = int(stats["freezes"])


# ---------------------------------------------------------------------------------------------------- FLOPs
class BackwardFlopLedger:
    """Backward FLOPs per frozen-prefix length, and the FLOPs that freezing skipped.

    Each distinct prefix length is measured once, on a real backward, with
    ``torch.utils.flop_counter.FlopCounterMode`` (see :meth:`measuring`); length 0 (nothing frozen) is the
    reference. Every later backward adds ``flops[0] - flops[length]`` to the skipped total. Backwards of a
    different batch size than the measured one are counted at the measured size.
    """

    def __init__(self) -> None:
        self.flops_by_prefix: dict[int, float] = {}
        self.skipped = 0.0
        self.reference = 0.0
        self.backwards = 0

    def needs(self, prefix: int) -> bool:
        return prefix not in self.flops_by_prefix

    @contextmanager
    def measuring(self, prefix: int) -> Iterator[None]:
        """Count the FLOPs of the backward run inside the block as the cost of ``prefix`` frozen units."""
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:
            yield
        self.flops_by_prefix[prefix] = float(counter.get_total_flops())

    def account(self, prefix: int) -> float | None:
        """Record one backward with ``prefix`` frozen units; return the FLOPs it skipped, if known."""
        reference = self.flops_by_prefix.get(0)
        cost = self.flops_by_prefix.get(prefix)
        if reference is None or cost is None:
            return None
        self.backwards += 1
        self.reference += reference
        skipped = max(reference - cost, 0.0)
        self.skipped += skipped
        return skipped

    @property
    def skipped_share(self) -> float | None:
        return self.skipped / self.reference if self.reference else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "flops_by_prefix": {str(k): v for k, v in self.flops_by_prefix.items()},
            "skipped": self.skipped,
            "reference": self.reference,
            "backwards": self.backwards,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.flops_by_prefix = {int(k): float(v) for k, v in state["flops_by_prefix"].items()}
        self.skipped = float(state["skipped"])
        self.reference = float(state["reference"])
        self.backwards = int(state["backwards"])


# ---------------------------------------------------------------------------------------------------- activations
def uncacheable_reason(module: nn.Module) -> str | None:
    """Why the outputs of ``module`` cannot be replayed per sample, or ``None`` if they can.

    Replaying needs the output to be a function of the sample alone: no dropout and no batch-statistics
    normalisation in training mode inside it, and a plain class ``forward`` that can be swapped for the
    replay while the module is frozen.
    """
    if "forward" in vars(module):
        return "it already has an instance-level `forward`"
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0 and sub.training:
            return f"{name or 'it'} is dropout in training mode"
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            return f"{name or 'it'} uses batch statistics in training mode"
    return None


@dataclass
class _ActivationEntry:
    name: str
    module: nn.Module
    storage: torch.Tensor | None = None  # (capacity, *output shape without batch)
    calls: int = 0


class PrefixActivationCache:
    """Outputs of frozen modules per training sample, replayed so the frozen prefix's forward is skipped.

    While a prefix is frozen its parameters do not change, so a module's output for a given sample does not
    change either. The first visit of a sample records the outputs of the frozen modules; once every sample
    of a batch is recorded, the modules' ``forward`` is swapped for a lookup for that batch, and restored
    right after. The first all-recorded batch of every plan is computed for real once more and compared with
    the records: a mismatch (data augmentation, noise added in ``training_step``) switches the cache off.

    Args:
        capacity: how many distinct samples this process sees per epoch (rows of each store).
        dataset_size: size of the dataset the sample indices refer to.
        budget_bytes: the most memory all stores together may take; modules whose store would not fit are
            not cached (nor any after them).
    """

    def __init__(self, capacity: int, dataset_size: int, budget_bytes: int) -> None:
        self.capacity = int(capacity)
        self.budget_bytes = int(budget_bytes)
        self.slot_of = torch.full((int(dataset_size),), -1, dtype=torch.long)
        self.filled = torch.zeros(self.capacity, dtype=torch.bool)
        self.next_slot = 0
        self.entries: list[_ActivationEntry] = []
        self.verified = False
        self.disabled_reason: str | None = None
        self.hits = 0
        self.batches = 0
        self._handles: list[Any] = []
        self._stubbed: list[nn.Module] = []
        self._slots: torch.Tensor | None = None
        self._mode = "off"

    @property
    def bytes_used(self) -> int:
        return sum(
            e.storage.numel() * e.storage.element_size() for e in self.entries if e.storage is not None
        )

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.batches if self.batches else None

    def plan(self, modules: Sequence[tuple[str, nn.Module]]) -> None:
        """Cache the outputs of ``modules`` (the frozen module units, in forward order).

        Records of modules that left the list are dropped, together with every later one: a released unit
        trains, so everything downstream of it changes.
        """
        keep = 0
        while keep < min(len(self.entries), len(modules)) and self.entries[keep].name == modules[keep][0]:
            keep += 1
        changed = keep != len(self.entries) or keep != len(modules)
        self.entries = self.entries[:keep]
        if keep == 0:
            self.filled.zero_()
        for name, module in modules[keep:]:
            if uncacheable_reason(module) is not None:
                break
            self.entries.append(_ActivationEntry(name, module))
        if changed:
            self.verified = False
            if keep == 0:
                self.slot_of.fill_(-1)
                self.next_slot = 0
            else:
                # new modules start empty, so every sample has to be visited again
                self.filled.zero_()

    def begin_batch(self, indices: torch.Tensor) -> str:
        """Prepare the forward of the batch with dataset ``indices`` (B,): ``"hit"``, ``"record"`` or ``"off"``."""
        self.end_batch()
        if self.disabled_reason is not None or not self.entries:
            return "off"
        self.batches += 1
        slots = self._slots_for(indices)
        if slots is None:
            self._mode = "off"
            return "off"
        self._slots = slots
        complete = bool(self.filled[slots].all()) and all(e.storage is not None for e in self.entries)
        if complete and self.verified:
            for entry in self.entries:
                self._install_replay(entry, slots)
            self.hits += 1
            self._mode = "hit"
        else:
            self._mode = "verify" if complete else "record"
            for entry in self.entries:
                entry.calls = 0
                self._handles.append(entry.module.register_forward_hook(self._recorder(entry)))
        return self._mode

    def end_batch(self) -> None:
        """Undo what :meth:`begin_batch` installed; after a recording forward, mark its samples as recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._stubbed:
            del module.forward  # back to the class's forward
        self._stubbed = []
        if self._mode in ("record", "verify") and self._slots is not None and self.disabled_reason is None:
            broken = [e for e in self.entries if e.calls != 1 or e.storage is None]
            if broken:
                # a module called twice (or not at all) per forward cannot be replayed by one lookup
                index = self.entries.index(broken[0])
                self.entries = self.entries[:index]
            if self.entries:
                self.filled[self._slots] = True
                if self._mode == "verify":
                    self.verified = True
        self._mode = "off"
        self._slots = None

    def _slots_for(self, indices: torch.Tensor) -> torch.Tensor | None:
        indices = indices.to(torch.long).cpu()
        slots = self.slot_of[indices]
        new = indices[slots < 0].unique()
        if self.next_slot + len(new) > self.capacity:
            return None
        self.slot_of[new] = torch.arange(self.next_slot, self.next_slot + len(new))
        self.next_slot += len(new)
        return self.slot_of[indices]

    def _recorder(self, entry: _ActivationEntry) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            entry.calls += 1
            slots = self._slots
            if not isinstance(output, torch.Tensor) or slots is None or output.shape[0] != len(slots):
                entry.calls += 1  # mark as not replayable
                return
            if entry.storage is None:
                per_sample = output[0].numel() * output.element_size()
                if self.bytes_used + per_sample * self.capacity > self.budget_bytes:
                    entry.calls += 1  # over budget: this module (and the ones after it) stay uncached
                    return
                entry.storage = torch.zeros(
                    (self.capacity, *output.shape[1:]), dtype=output.dtype, device=output.device
                )
            stored = entry.storage.index_select(0, slots.to(entry.storage.device))
            if self._mode == "verify" and not torch.allclose(stored, output.detach(), rtol=1e-3, atol=1e-5):
                self.disabled_reason = (
                    f"the output of {entry.name} differs between two visits of the same frozen sample (random data "
                    "augmentation or noise in the forward?)"
                )
                return
            entry.storage.index_copy_(0, slots.to(entry.storage.device), output.detach())

        return record

    def _install_replay(self, entry: _ActivationEntry, slots: torch.Tensor) -> None:
        storage = entry.storage
        assert storage is not None
        rows = slots.to(storage.device)

        def replay(*args: Any, **kwargs: Any) -> torch.Tensor:
            return storage.index_select(0, rows)

        entry.module.forward = replay  # type: ignore[method-assign]
        self._stubbed.append(entry.module)
