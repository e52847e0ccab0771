"""Which way a final logged metric is better, so that a comparison of two runs says when a saving came with a
worse result.

A metric's direction comes from the Trainer's own word first: a ``ModelCheckpoint`` or ``EarlyStopping`` that
monitors it, with its ``mode`` (``"min"`` or ``"max"``), recorded in the run's report as ``metric_modes``.
Else from its name: a loss, an error or a perplexity is better lower, an accuracy, an F1 or an AUROC higher
(:data:`LOWER_BETTER`, :data:`HIGHER_BETTER`). A metric of neither kind has no direction: its difference is
shown, not judged. Neither are this library's own metrics (``pulse/``, ``hard_sample_replay/``, ...: how a
run was trained, not its result) nor training metrics named so (``train_loss``: measured on the batches the
run trained, which a run that selects hard samples picks to be the hardest), unless a monitor names them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

#: name parts of metrics that are better lower
LOWER_BETTER = frozenset(
    ("loss", "nll", "mse", "mae", "rmse", "error", "err", "perplexity", "ppl", "wer", "cer", "bpc", "bpd")
)
#: name parts of metrics that are better higher (a trailing number dropped: ``acc1``, ``top5``)
HIGHER_BETTER = frozenset(
    ("acc", "accuracy", "top", "f1", "auc", "auroc", "auprc", "precision", "recall", "iou", "miou", "dice")
    + ("bleu", "rouge", "psnr", "ssim", "r2")
)
#: this library's own metric namespaces: how a run was trained, not its result
OWN_NAMESPACES = (
    "pulse/",
    "hard_sample_replay/",
    "gradient_cache/",
    "prune/",
    "stability/",
    "green/",
    "energy/",
    "mhc/",
)


def monitored_modes(trainer: Any) -> dict[str, str]:
    """``{metric: "min" | "max"}`` of the metrics a ``ModelCheckpoint`` or ``EarlyStopping`` of ``trainer``
    monitors (a metric two of them monitor in opposite modes is left out)."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    modes: dict[str, str] = {}
    clashing = set()
    for callback in getattr(trainer, "callbacks", None) or []:
        if not isinstance(callback, (ModelCheckpoint, EarlyStopping)):
            continue
        monitor, mode = getattr(callback, "monitor", None), getattr(callback, "mode", None)
        if isinstance(monitor, str) and mode in ("min", "max"):
            if modes.get(monitor, mode) != mode:
                clashing.add(monitor)
            modes[monitor] = mode
    return {name: mode for name, mode in sorted(modes.items()) if name not in clashing}


def metric_direction(name: str, *modes: Mapping[str, Any] | None) -> str | None:
    """``"min"`` (better lower), ``"max"`` (better higher) or ``None`` (not judged) for the metric ``name``:
    the ``mode`` the runs' monitors gave it (``modes``: each run's ``metric_modes``; runs that disagree give
    ``None``), else from its name (see the module's docstring)."""
    given = {mode.get(name) for mode in modes if isinstance(mode, Mapping)} - {None}
    if given:
        return next(iter(given)) if len(given) == 1 and given <= {"min", "max"} else None
    if name.startswith(OWN_NAMESPACES):
        return None
    parts = [re.sub(r"\d+$", "", part) for part in re.split(r"[^a-z0-9]+", _snake(name)) if part]
    if "train" in parts:
        return None
    lower, higher = any(p in LOWER_BETTER for p in parts), any(p in HIGHER_BETTER for p in parts)
    if lower == higher:  # neither, or a name of both kinds ("acc_loss")
        return None
    return "min" if lower else "max"


def verdict(a: Any, b: Any, direction: str | None) -> str | None:
    """``"worse"``, ``"better"`` or ``"equal"``: run B's value ``b`` against the baseline's ``a`` in the metric's
    ``direction``; ``None`` without a direction or a number on both sides."""
    difference = signed_difference(a, b)
    if direction is None or difference is None:
        return None
    if difference == 0:
        return "equal"
    return "worse" if (difference < 0) == (direction == "max") else "better"


def signed_difference(a: Any, b: Any) -> float | None:
    """``b - a`` where both are finite numbers, else ``None``."""
    numbers = [value for value in (a, b) if isinstance(value, (int, float)) and not isinstance(value, bool)]
    if len(numbers) != 2 or not all(math.isfinite(value) for value in numbers):
        return None
    return float(b) - float(a)


def worse_line(rows: list[Mapping[str, Any]]) -> str | None:
    """``"Quality: B is worse than the baseline in val_acc (0.4476 against 0.4924, -0.0448) ..."`` for the
    metric rows (:func:`~lightning_pulse.energy.compare.compare_runs`) whose verdict is ``"worse"``; ``None``
    when none is."""
    worse = [row for row in rows if row.get("verdict") == "worse"]
    if not worse:
        return None
    parts = [
        f"{row['metric']} ({row['b']:.4g} against {row['a']:.4g}, {row['difference']:+.4g})" for row in worse
    ]
    return (
        f"Quality: B is worse than the baseline in {', '.join(parts)}: its savings come with that cost, not at "
        "an equal result."
    )


def _snake(name: str) -> str:
    """``valAcc`` -> ``val_acc``, lower case."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
