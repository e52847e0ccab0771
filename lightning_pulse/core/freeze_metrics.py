"""What :class:`~lightning_pulse.GradientCache` reports: the logged metrics of a step and the freeze events.

Plain Python over the core objects (:class:`~lightning_pulse.core.layer_freezing.LayerFreezer`,
:class:`~lightning_pulse.core.backward_flops.BackwardFlopLedger`,
:class:`~lightning_pulse.core.activation_cache.PrefixActivationCache`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_pulse.core.activation_cache import PrefixActivationCache
    from lightning_pulse.core.backward_flops import BackwardFlopLedger
    from lightning_pulse.core.layer_freezing import LayerFreezer, StepReport

METRIC_PREFIX = "gradient_cache/"


def freeze_event(step: int, before: int, after: int, reason: str) -> dict[str, Any]:
    """One change of the frozen prefix: at optimizer ``step``, from ``before`` to ``after`` units, and why."""
    return {"step": int(step), "from": before, "to": after, "reason": reason}


def freeze_metrics(
    report: StepReport,
    freezer: LayerFreezer,
    ledger: BackwardFlopLedger,
    activations: PrefixActivationCache | None,
    measure_flops: bool,
) -> dict[str, float]:
    """The metrics of one optimizer step under :data:`METRIC_PREFIX`; those without a value are left out.

    ``report`` is the step's :class:`~lightning_pulse.core.layer_freezing.StepReport`: its frozen share is the
    one backward ran with, its frozen prefix the one the next step starts with.
    """
    metrics = {
        "frozen_share": report.frozen_share,
        "frozen_units": float(report.frozen_prefix),
        "staleness": float(freezer.staleness),
        "backward_flops_skipped": ledger.step_skipped if measure_flops else None,
        "backward_flops_skipped_share": ledger.skipped_share,
        "cache_hit_rate": freezer.cache_hit_rate,
        "activation_hit_rate": activations.hit_rate if activations is not None else None,
    }
    return {METRIC_PREFIX + k: v for k, v in metrics.items() if v is not None}
