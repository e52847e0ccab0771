"""What a stateful DDP communication hook remembers of earlier steps, dropped (core/comm_hook_memory.py)."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from lightning_pulse.core.comm_hook_memory import forget_compression_memory


def _powersgd_state_after_steps() -> powerSGD_hook.PowerSGDState:
    state = powerSGD_hook.PowerSGDState(
        None, matrix_approximation_rank=2, start_powerSGD_iter=3, warm_start=True
    )
    state.iter = 7
    state.error_dict[0] = torch.full((10,), float("nan"))
    state.p_memory_dict[0], state.q_memory_dict[0] = torch.ones(4, 2), torch.ones(3, 2)
    return state


def test_powersgds_memories_are_dropped_and_its_settings_kept():
    state = _powersgd_state_after_steps()
    draws = state.rng.get_state()[1].copy()
    assert forget_compression_memory(state)
    assert state.error_dict == state.p_memory_dict == state.q_memory_dict == {}
    assert state.iter == 7  # a skip: the same buckets, compression goes on
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.warm_start) == (2, 3, True)
    assert (state.rng.get_state()[1] == draws).all()  # the ranks' shared generator is not touched


def test_a_new_wrapper_gives_powersgd_two_uncompressed_steps_not_its_whole_start_again():
    state = _powersgd_state_after_steps()  # start_powerSGD_iter=3, at step 7
    assert forget_compression_memory(state, new_buckets=True)
    assert state.iter == 1 and state.error_dict == {}  # all-reduced uncompressed for two steps
    # a review: back to 0 turned compression off for 1,000 steps (torch's default start) at every cut
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=1000)
    state.iter, state.error_dict[0] = 1500, torch.zeros(3)
    assert forget_compression_memory(state, new_buckets=True) and state.iter == 998
    state.iter = 5  # not started compressing yet: left where it is
    state.error_dict[0] = torch.zeros(3)
    assert forget_compression_memory(state, new_buckets=True) and state.iter == 5


def test_a_state_without_such_memories_is_left_as_it_is():
    assert not forget_compression_memory(None)
    assert not forget_compression_memory(object())
