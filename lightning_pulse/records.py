"""The event lists a callback keeps for its report and its checkpoint, bounded.

A run of a million steps must carry no more state than a run of a thousand: a phase change, a freeze or a
flagged step is kept while it is among the latest :data:`RECENT_RECORDS` of its list. What a run needs in total
is counted apart (steps per phase, freezes, spikes by kind, rollbacks), so dropping old entries loses no total.
"""

from __future__ import annotations

from typing import Any

#: how many entries of each event list are kept (the latest)
RECENT_RECORDS = 1000


def append_recent(records: list[Any], record: Any, limit: int = RECENT_RECORDS) -> None:
    """Append ``record`` to ``records``, dropping the oldest entries beyond ``limit``."""
    records.append(record)
    if len(records) > limit:
        del records[: len(records) - limit]
