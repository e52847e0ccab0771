"""Which optimizer steps get a callback's step-level rows, read as Lightning reads ``log_every_n_steps``.

Plain Python: the phase clock and the energy account decide their rows with it too. Lightning's
``Trainer(log_every_n_steps=0)`` turns step-level logging off (``should_update_logs`` is never true):
a callback gives no row for a step of the interval then, and keeps its event rows (a phase boundary, a
check, a flagged step, an epoch's or a cycle's end).
"""

from __future__ import annotations


def step_rows_every(own: int | None, trainers: int) -> int:
    """The interval of a callback's step-level rows: its ``own`` setting, else the Trainer's
    ``log_every_n_steps`` (``trainers``); ``0``: none."""
    return own or max(int(trainers), 0)


def is_step_row(step: int, every: int) -> bool:
    """Whether ``step`` is one of the interval ``every`` (:func:`step_rows_every`; ``0``: no step is)."""
    return every > 0 and step % every == 0
