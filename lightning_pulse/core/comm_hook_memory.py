"""The memories a stateful DDP communication hook carries from one step to the next (PowerSGD's).

torch's PowerSGD hooks keep, in their ``PowerSGDState``, the compression error of each bucket (error
feedback, ``error_dict``) and the low-rank factors of the last step (warm start, ``p_memory_dict`` and
``q_memory_dict``), keyed by the DDP bucket index and sized to the bucket. Both go wrong when the step they
came from is undone or the buckets change:

* a skipped or rolled-back step's compression error is added to every later gradient (one NaN batch left NaN
  in ``error_dict``: every later step non-finite, the fit stopped blaming the data);
* a DDP wrapper rebuilt after a structured cut has smaller buckets under the same indices (a size mismatch
  crashed the backward after the first cut).

:func:`forget_compression_memory` drops them, as a new state holds none; the user's settings (rank, start
step, error feedback, warm start, random generator) stay. Other states (a process group, post-local SGD's
state) carry no such memory and are left as they are.
"""

from __future__ import annotations

from typing import Any

_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")  # PowerSGDState's, keyed by bucket index


def forget_compression_memory(state: Any, new_buckets: bool = False) -> bool:
    """Clear a PowerSGD-like hook ``state``'s per-bucket memories. Returns whether ``state`` has any.

    ``new_buckets``: the DDP wrapper was rebuilt; its step counter goes back to at most two steps before
    ``start_powerSGD_iter``, so that the hook all-reduces uncompressed for two steps, the least torch asks of a
    new wrapper (DDP rebuilds its buckets after its first backward: a memory taken before that may not fit
    them). Not back to 0: torch's default start is step 1,000, and every cut would turn compression off that
    long (for the whole pruning window).
    """
    memories = [memory for name in _MEMORIES if isinstance(memory := getattr(state, name, None), dict)]
    for memory in memories:
        memory.clear()
    start = getattr(state, "start_powerSGD_iter", None)
    if memories and new_buckets and isinstance(getattr(state, "iter", None), int) and isinstance(start, int):
        state.iter = min(state.iter, max(start - 2, 0))
    return bool(memories)
