"""The energy a suspended fit uses after its suspend checkpoint, carried to the fit that resumes from it.

GreenWindow's suspend saves its checkpoint and then stops the fit; Lightning then validates once more (a stop
request triggers a validation pass) and shuts down. That energy is in the suspended fit's report but cannot be
in the checkpoint, which was written before it. So at the suspended fit's end the whole run's figures are
written next to the checkpoint (:func:`carry_path`), with the checkpoint's own total they continue; a fit
resumed from that checkpoint takes them in place of the checkpoint's (:func:`read_carry`): all the suspended
fit's energy, once. A checkpoint copied elsewhere without this file resumes with the checkpoint's figures.

Plain Python, no Lightning.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

VERSION = 1


def carry_path(checkpoint: str | os.PathLike) -> Path:
    """``last-green-window.ckpt`` -> ``last-green-window.energy.json``, next to it."""
    return Path(checkpoint).with_suffix(".energy.json")


def write_carry(checkpoint: str | os.PathLike, base: Mapping[str, Any], snapshot: Mapping[str, Any]) -> Path:
    """Write, atomically, the whole run's ``snapshot`` at the suspended fit's end next to ``checkpoint``,
    whose ``total`` bucket was ``base``. Raises ``OSError`` (or ``TypeError``) when it cannot."""
    path = carry_path(checkpoint)
    record = {
        "version": VERSION,
        "about": (
            "EnergyLogger: the whole run at the end of the fit suspended to "
            f"{Path(checkpoint).name}; a fit resumed from that checkpoint counts this instead of the "
            "checkpoint's figures, which end at the suspend (before Lightning's validation after the stop)."
        ),
        "checkpoint_total": dict(base),
        "snapshot": snapshot,
    }
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(record))
    os.replace(temporary, path)
    return path


def read_carry(checkpoint: str | os.PathLike, base: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The whole-run snapshot written by :func:`write_carry` next to ``checkpoint``, when it continues the
    figures the checkpoint holds (every field of the ``total`` bucket it recorded has its value in ``base``,
    exactly: a checkpoint of an older version gains fields when it loads); else ``None`` (no such file, an
    unreadable one, or one written for another save of that path)."""
    if base is None:
        return None
    try:
        record = json.loads(carry_path(checkpoint).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("version") != VERSION:
        return None
    total = record.get("checkpoint_total")
    if not isinstance(total, dict) or not isinstance(record.get("snapshot"), dict):
        return None
    if any(base.get(name) != value for name, value in total.items()) or not total:
        return None
    return record["snapshot"]
