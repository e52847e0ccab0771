"""Which way a final logged metric is better, so that a comparison of two runs says when a saving came with a
worse result.

A metric's direction comes from the Trainer's own word first: a ``ModelCheckpoint`` or ``EarlyStopping`` that
monitors it, with its ``mode`` (``"min"`` or ``"max"``), recorded in the run's report as ``metric_modes``; a mode
that contradicts the metric's name (``monitor="val_acc"`` with Lightning's default ``mode="min"``) is taken for a
slip, and the metric is not judged. Else from its name, and only for a metric measured on held-out data: one
with a ``val``, ``valid``, ``validation``, ``eval``, ``dev`` or ``test`` part (:data:`HELD_OUT`). There a loss,
an error or a perplexity is better lower, an accuracy, an F1 or an AUROC higher (:data:`LOWER_BETTER`,
:data:`HIGHER_BETTER`). Any other metric is shown, not judged: a training metric whatever its spelling
(``loss``, ``train_loss``, ``training_loss``, ``trn_loss``: measured on the batches the run trained, which a
run that selects hard samples picks to be the hardest), a name of both kinds or with a word that turns its
direction (``val_loss_gap``, ``val_acc_std``), and this library's own metrics (``pulse/``,
``hard_sample_replay/``, ...: how a run was trained, not its result). Nor is a metric named as better lower
(``val_loss``) of a run whose optimizer ascends the value its module returns (torch's ``maximize=True``,
recorded as ``loss_maximized``): a module that logs its objective as ``val_loss`` logs a reward there
(:func:`ascended_loss_note`); a monitor's ``mode`` still judges it. A value that is not finite (a run that
diverged: ``nan``) is worse than a finite one in a metric with a direction. Two values within
:data:`RELATIVE_TOLERANCE` of each other are equal (float noise).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_pulse.core.loss_direction import loss_directions

#: name parts of metrics that are better lower
LOWER_BETTER = frozenset(
    ("loss", "nll", "mse", "mae", "rmse", "error", "err", "perplexity", "ppl", "wer", "cer", "bpc", "bpd")
)
#: name parts of metrics that are better higher (a trailing number dropped: ``acc1``, ``top5``)
HIGHER_BETTER = frozenset(
    ("acc", "accuracy", "top", "f1", "auc", "auroc", "auprc", "precision", "recall", "iou", "miou", "dice")
    + ("bleu", "rouge", "psnr", "ssim", "r2")
)
#: name parts of a metric measured on held-out data: only such a metric is judged by its name
HELD_OUT = frozenset(("val", "valid", "validation", "eval", "dev", "test"))
#: name parts that turn or hide a metric's direction (``val_acc_drop``, ``val_loss_std``): not judged by name
MODIFIERS = frozenset(("gap", "drop", "std", "var", "diff", "delta", "scale", "weight"))
#: name parts of training metrics (never judged by name)
TRAINING = frozenset(("train", "training", "trn", "tr", "fit"))
#: two values closer than this, relative to the larger (at least 1), are equal: float noise
RELATIVE_TOLERANCE = 1e-6
#: how a report writes a final metric that is not finite (``nonfinite_metrics``)
NONFINITE = ("nan", "inf", "-inf")
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


def loss_maximized(trainer: Any) -> bool:
    """Whether an optimizer of ``trainer`` ascends the value the module returns in a parameter group (torch's
    ``maximize=True``): its logged objective may be a reward, whatever it is named
    (:func:`ascended_loss_note`)."""
    ascending, _ = loss_directions(list(getattr(trainer, "optimizers", None) or []))
    return bool(ascending)


def ascended_loss_note(name: str, ascended: Sequence[str], *modes: Mapping[str, Any] | None) -> str | None:
    """Why the metric ``name``, which its name says is better lower (``val_loss``), is not judged where runs
    ``ascended`` (``["B"]``: their reports' ``loss_maximized``) ascend the value their module returns: a
    module logging its objective as ``val_loss`` logs a reward there (a run that never learned read as
    better than its baseline). ``None`` where no run ascended, a monitor gives the metric a ``mode`` (the
    user's word), or the name gives no lower-is-better direction."""
    given = {mode.get(name) for mode in modes if isinstance(mode, Mapping)} - {None}
    if not ascended or given or metric_direction(name) != "min":
        return None
    runs = f"run {ascended[0]}'s optimizer ascends" if len(ascended) == 1 else "both runs' optimizers ascend"
    return (
        f"{runs} the value the module returns (`maximize=True`), so {name} may hold that reward, better "
        "higher, rather than a loss; a monitor's `mode` judges it"
    )


def metric_direction(name: str, *modes: Mapping[str, Any] | None, ascended: Sequence[str] = ()) -> str | None:
    """``"min"`` (better lower), ``"max"`` (better higher) or ``None`` (not judged) for the metric ``name``:
    the ``mode`` the runs' monitors gave it (``modes``: each run's ``metric_modes``; runs that disagree, or a
    mode against the name's direction, give ``None``), else from its name (see the module's docstring).
    ``ascended``: the runs (``"A"``, ``"B"``) whose optimizer ascends the value their module returns
    (:func:`ascended_loss_note`)."""
    given = {mode.get(name) for mode in modes if isinstance(mode, Mapping)} - {None}
    if given:
        if len(given) != 1 or not given <= {"min", "max"} or mode_conflict(name, *modes, ascended=ascended):
            return None
        return next(iter(given))
    if ascended_loss_note(name, ascended, *modes) is not None:
        return None
    if name.startswith(OWN_NAMESPACES):
        return None
    parts = _parts(name)
    if not HELD_OUT & set(parts) or TRAINING & set(parts):
        return None
    return _name_direction(parts)


def mode_conflict(name: str, *modes: Mapping[str, Any] | None, ascended: Sequence[str] = ()) -> str | None:
    """``"the monitor says min, the name says max"`` when the runs' monitors agree on a mode for ``name`` that
    its name contradicts (``ModelCheckpoint(monitor="val_acc")`` keeps Lightning's default ``mode="min"``),
    else ``None``. Not ``"max"`` for a name better lower where runs ``ascended`` their objective
    (:func:`ascended_loss_note`): a reward logged as ``val_loss`` is better higher."""
    given = {mode.get(name) for mode in modes if isinstance(mode, Mapping)} - {None}
    by_name = _name_direction(_parts(name))
    if len(given) != 1 or by_name is None or given == {by_name}:
        return None
    if ascended and by_name == "min" and given == {"max"}:
        return None
    return f"the monitor says {next(iter(given))}, the name says {by_name}"


def _parts(name: str) -> list[str]:
    return [part for part in re.split(r"[^a-z0-9]+", _snake(name)) if part]


def _name_direction(parts: list[str]) -> str | None:
    """The direction the name parts give, a part read as it is and without a trailing number (``f1``,
    ``top5``, ``acc1``); ``None`` for neither kind, both kinds (``acc_loss``) or a modifier (``loss_gap``)."""
    forms = {form for part in parts for form in (part, re.sub(r"\d+$", "", part))}
    if forms & MODIFIERS:
        return None
    lower, higher = bool(forms & LOWER_BETTER), bool(forms & HIGHER_BETTER)
    if lower == higher:
        return None
    return "min" if lower else "max"


def is_nonfinite(value: Any) -> bool:
    """Whether ``value`` is a metric value that is not finite: a float NaN or infinity, or a report's
    ``"nan"`` / ``"inf"`` / ``"-inf"``."""
    if isinstance(value, str):
        return value in NONFINITE
    return isinstance(value, float) and not math.isfinite(value)


def verdict(a: Any, b: Any, direction: str | None) -> str | None:
    """``"worse"``, ``"better"`` or ``"equal"``: run B's value ``b`` against the baseline's ``a`` in the metric's
    ``direction``; a value that is not finite (:func:`is_nonfinite`: a diverged run) is worse than a finite one;
    values within :data:`RELATIVE_TOLERANCE` are equal; ``None`` without a direction or a value on both sides."""
    if direction is None:
        return None
    difference = signed_difference(a, b)
    if difference is None:
        if is_nonfinite(b) and signed_difference(a, a) is not None:
            return "worse"
        if is_nonfinite(a) and signed_difference(b, b) is not None:
            return "better"
        return None
    if abs(difference) <= RELATIVE_TOLERANCE * max(abs(float(a)), abs(float(b)), 1.0):
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
    parts = [f"{row['metric']} ({pair_text(row)})" for row in worse]
    return (
        f"Quality: B is worse than the baseline in {', '.join(parts)}: its savings come with that cost, not at "
        "an equal result."
    )


def pair_text(row: Mapping[str, Any], with_difference: bool = True) -> str:
    """``"0.4476 against 0.4924, -0.0448"``: a metric row's B against A (with the difference), at the precision
    that tells the two apart (at least 4 significant digits); ``"nan against 1.999: not finite"`` where a
    value is not finite."""
    a, b, difference = row.get("a"), row.get("b"), row.get("difference")
    if difference is None:
        nonfinite = with_difference and (is_nonfinite(a) or is_nonfinite(b))
        return f"{_value_text(b, 4)} against {_value_text(a, 4)}" + (": not finite" if nonfinite else "")
    digits = next((n for n in range(4, 17) if f"{float(a):.{n}g}" != f"{float(b):.{n}g}"), 4)
    text = f"{float(b):.{digits}g} against {float(a):.{digits}g}"
    return text + (f", {difference:+.4g}" if with_difference else "")


def _value_text(value: Any, digits: int) -> str:
    if value is None:
        return "none"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{float(value):.{digits}g}"
    return str(value)


def _snake(name: str) -> str:
    """``valAcc`` -> ``val_acc``, lower case."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
