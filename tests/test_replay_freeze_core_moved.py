"""Trainer-free tests of the pieces HardSampleReplay and GradientCache handed to their cores (lean-core pass).

Replay: ``loader_refusal``, ``reloaded_data_note`` without a previous loader, ``epoch_half_life_note``,
``BatchPlan.origins``, ``step_plan.loader_epoch_steps`` and the
``StepSavingStream`` state held while no pass runs. Freezing: ``FreezerLifecycle.follow_phase``, ``state_dict``,
``resume``, ``roll_back``, ``replan``, ``check_fit_start`` and ``start``'s pinned note, and ``refuse_setup``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_pulse.core.freeze_units import ForwardOrderTrace, discover_units
from lightning_pulse.core.layer_freezing import FreezerLifecycle, FreezeSettings, LayerFreezer, refuse_setup
from lightning_pulse.core.replay import (
    SEVERAL_LOADERS,
    BatchPlan,
    epoch_half_life_note,
    loader_refusal,
    parse_half_life,
    reloaded_data_note,
)
from lightning_pulse.core.step_plan import StepSavingStream, loader_epoch_steps
from lightning_pulse.errors import PulseRefusal
from tests.test_gradient_cache_core import TiedEmbeddingLM


# ------------------------------------------------------------------------------------------------- replay
class _Stream(IterableDataset):
    def __iter__(self):
        yield from range(4)


def _loader(samples: int = 12, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(samples, dtype=torch.float32)), batch_size=batch_size)


def test_a_loader_without_indices_is_refused_before_a_second_one_and_a_single_trackable_one_passes():
    untrackable = DataLoader(_Stream(), batch_size=2)
    refusal = loader_refusal(untrackable, second=True)  # the indices are named first
    assert refusal is not None and refusal.startswith("needs the dataset index of every sample, but the ")
    assert "IterableDataset" in refusal and "CombinedLoader" not in refusal
    second = loader_refusal(_loader(), second=True)
    assert second is not None and second.startswith(f"needs one training DataLoader, but {SEVERAL_LOADERS}.")
    assert loader_refusal(_loader(), second=False) is None


def test_the_fits_first_loader_has_no_reload_note_and_keeps_its_table():
    dataset = TensorDataset(torch.arange(6.0))
    assert reloaded_data_note(None, dataset) == (None, False)
    assert reloaded_data_note(dataset, dataset) == (None, False)
    note, fresh = reloaded_data_note(dataset, TensorDataset(torch.arange(7.0)))
    assert fresh and note is not None and "another length" in note


def test_the_epoch_half_life_note_names_the_epoch_the_optimizers_and_the_way_out():
    assert epoch_half_life_note(None, 10, 2) is None
    assert epoch_half_life_note(parse_half_life("400steps"), 10, 2) is None
    note = epoch_half_life_note(parse_half_life(2.0), 10, 3)
    assert note == (
        "`score_half_life`=2 epochs is read as 10 optimizer steps an epoch, one a batch, but this module steps "
        "its 3 optimizers itself (manual optimization) and trainer.global_step counts every step: scores age "
        "faster by the steps a batch makes. Give the half-life in steps (`score_half_life='400steps'`)."
    )


def test_a_batch_plan_names_the_origin_of_each_sample_in_order():
    plan = BatchPlan(torch.arange(4), np.array([0, 1, 2, 1]), None, None, 4.0, True, True)
    assert plan.origins == ["untouched", "selected", "unseen", "selected"]


def test_loader_epoch_steps_counts_a_short_last_window_and_nothing_for_a_loader_without_length():
    assert loader_epoch_steps(_loader(samples=40, batch_size=4), 3) == 4  # 10 batches, 3 a step
    assert loader_epoch_steps(iter([[0.0], [1.0]]), 1) is None  # an iterable of batches, no length

    class NoLength(torch.utils.data.Sampler):  # a DataLoader has __len__, which raises over this sampler
        def __iter__(self):
            return iter(range(8))

    assert loader_epoch_steps(DataLoader(range(8), batch_size=4, sampler=NoLength()), 1) is None


def test_a_restored_stream_is_saved_as_it_came_until_a_pass_runs_and_the_fits_end_is_held_once():
    stream = StepSavingStream()
    assert stream.checkpoint(None) is None  # no fit plans it, nothing restored
    assert stream.checkpoint(5)["step"] == 5 and stream.checkpoint(5)["total_steps"] == -1
    saved = {"epoch": 2, "samples": 8, "batches": 2, "step": 30, "total_steps": 90, "plain_steps": 120}
    stream.restore(saved)
    assert stream.checkpoint(40) is saved and stream.checkpoint(None) is saved
    assert stream._resume == {**saved}  # loaded for the next plan too
    stream.held = None  # a pass ran: the stream moves on
    stream.hold(55)
    stream.hold(70)  # held once: the fit's end
    assert stream.checkpoint(None)["step"] == 55 and stream.checkpoint(80)["step"] == 55
    stream.restore(None)
    assert stream.held is None and stream.checkpoint(12)["step"] == 12


# ------------------------------------------------------------------------------------------------ freezing
def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _ordered(model: nn.Module) -> LayerFreezer:
    """A freezer of ``model``'s units, put into forward order by one backward."""
    trace = ForwardOrderTrace(discover_units(model))
    trace.begin()
    model(torch.randn(2, 6)).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return LayerFreezer(trace.finish(), SETTINGS)


SETTINGS = FreezeSettings(threshold=1.0, check_every=2, freeze_for=50, max_frozen_share=1.0)


def _drive(freezer: LayerFreezer, steps: int) -> None:
    """Steps in which every trainable parameter moves a little less after the first window: stable."""
    for _ in range(steps):
        for param in (p for unit in freezer.units for p in unit.params):
            if param.requires_grad:
                param.grad = torch.full_like(param, 1e-3 if freezer.steps < 2 else 1e-4)
                with torch.no_grad():
                    param.add_(param.grad)
            else:
                param.grad = None
        freezer.step(True)


def _lifecycle_with_a_stable_prefix() -> tuple[FreezerLifecycle, nn.Module]:
    model = _mlp()
    lifecycle = FreezerLifecycle(SETTINGS)
    lifecycle.freezer = _ordered(model)
    _drive(lifecycle.freezer, 4)
    return lifecycle, model


class _Replay:
    """Stands for a LoaderActivationCache: records what it is planned on."""

    def __init__(self, lifecycle: FreezerLifecycle | None = None) -> None:
        self.plans: list[tuple[list[str], bool, bool]] = []
        self.lifecycle = lifecycle

    def plan(self, frozen_units, again: bool = False) -> None:
        moved = self.lifecycle is not None and self.lifecycle.optimizer_check.moved
        self.plans.append((list(frozen_units), again, moved))


def test_follow_phase_gives_the_prefix_before_a_change_and_freezes_nothing_once_the_optimizer_moved_units():
    assert FreezerLifecycle(SETTINGS).follow_phase(True) is None  # no freezer yet
    lifecycle, _ = _lifecycle_with_a_stable_prefix()
    assert lifecycle.frozen_prefix == 2
    assert lifecycle.follow_phase(True, resume=True) is None  # a resume keeps the restored prefix
    assert lifecycle.follow_phase(False) == 2 and lifecycle.frozen_prefix == 0  # a burst releases it
    assert lifecycle.follow_phase(False) is None  # nothing left to release
    lifecycle.optimizer_check.moved = True
    assert lifecycle.follow_phase(True) is None and lifecycle.frozen_prefix == 0  # read as a burst
    lifecycle.optimizer_check.moved = False
    assert lifecycle.follow_phase(True) == 0 and lifecycle.frozen_prefix == 2  # a light phase refreezes


def test_the_checkpoint_holds_the_freezer_the_given_ledger_and_a_copy_of_the_events():
    waiting = FreezerLifecycle(SETTINGS)
    events = [{"step": 3, "from": 0, "to": 2, "reason": "check"}]
    state = waiting.state_dict({"skipped": 1.5}, events)
    assert list(state) == ["cache", "ledger", "events", "optimizer_check", "units_argument"]
    assert state["units_argument"] is None  # the automatic split: a resume compares its own with it
    assert state["cache"] is None and state["ledger"] == {"skipped": 1.5}
    assert state["events"] == events and state["events"] is not events
    assert state["optimizer_check"] == waiting.optimizer_check.state_dict()
    lifecycle, _ = _lifecycle_with_a_stable_prefix()
    assert lifecycle.state_dict({}, [])["cache"]["frozen"] == [True, True, False]


def test_a_resumed_fit_plans_the_cache_on_the_restored_prefix_before_the_optimizer_check_releases_it():
    saved, model = _lifecycle_with_a_stable_prefix()
    state = saved.state_dict({}, [])
    state["optimizer_check"] = {"checked": True, "moved": True, "optimizer": "DecayAll"}
    saved.end()
    resumed = FreezerLifecycle(SETTINGS)
    replay = _Replay(resumed)
    assert resumed.resume(state, model, replay) is None  # no pinned unit to name
    assert replay.plans == [(["0", "2"], False, False)]  # planned first, on the restored frozen units
    assert resumed.frozen_prefix == 0 and not resumed.may_freeze  # then the check released everything
    fresh, fresh_replay = FreezerLifecycle(SETTINGS), _Replay()
    assert fresh.resume(None, _mlp(), fresh_replay) is None
    assert (
        fresh.freezer is None and [u.name for u in fresh.units] == ["0", "2", "4"] and not fresh_replay.plans
    )


def test_start_names_a_restored_freezers_pinned_units_only():
    model = TiedEmbeddingLM()
    trace = ForwardOrderTrace(discover_units(model))
    trace.begin()
    model(torch.randint(0, 10, (2, 3))).pow(2).mean().backward()
    state = LayerFreezer(trace.finish(), SETTINGS).state_dict()
    note = FreezerLifecycle(SETTINGS).start(state, model)
    assert note is not None and note.endswith("the frozen prefix stops before them: embed (also head.weight)")
    assert FreezerLifecycle(SETTINGS).start(None, model) is None  # named when the units are ordered


def test_a_rollback_restores_the_frozen_set_and_the_optimizer_check_then_replans_the_cache_from_scratch():
    lifecycle, model = _lifecycle_with_a_stable_prefix()
    state = lifecycle.state_dict({}, [])
    lifecycle.follow_phase(False)  # a burst released the prefix after the state was saved
    replay = _Replay(lifecycle)
    state["optimizer_check"] = {"checked": True, "moved": False, "optimizer": ""}
    assert lifecycle.roll_back(state, model, step=17, replay=replay) == 0
    assert (
        lifecycle.frozen_prefix == 2 and not model[0].weight.requires_grad and lifecycle.rolled_back_at == 17
    )
    assert replay.plans == [(["0", "2"], True, False)]
    moved = {**state, "optimizer_check": {"checked": True, "moved": True, "optimizer": "DecayAll"}}
    assert lifecycle.roll_back(moved, model, step=20, replay=replay) == 2
    assert lifecycle.frozen_prefix == 0 and replay.plans[-1] == ([], True, True)  # released, then replanned


def test_replan_plans_the_units_frozen_now_and_nothing_without_a_cache():
    lifecycle, _ = _lifecycle_with_a_stable_prefix()
    replay = _Replay()
    lifecycle.replan(replay)
    lifecycle.replan(replay, again=True)
    lifecycle.replan(None)
    assert replay.plans == [(["0", "2"], False, False), (["0", "2"], True, False)]
    FreezerLifecycle(SETTINGS).replan(replay)  # no freezer: nothing frozen
    assert replay.plans[-1] == ([], False, False)


def test_fit_start_checks_the_wrapped_model_then_the_optimizers():
    class FakeShardedStrategy:
        def __init__(self, model: nn.Module) -> None:
            self.model = model

    model = _mlp()
    lifecycle = FreezerLifecycle(SETTINGS)
    lifecycle.check_fit_start(FakeShardedStrategy(model), model, 1, [torch.optim.SGD(model.parameters())])
    assert lifecycle.frozen_before_wrap == set()  # one process: nothing to remember
    with pytest.raises(PulseRefusal, match="FakeShardedStrategy shards or flattens parameters"):
        lifecycle.check_fit_start(
            FakeShardedStrategy(model), model, 2, [torch.optim.LBFGS(model.parameters())]
        )
    with pytest.raises(PulseRefusal, match="LBFGS"):
        lifecycle.check_fit_start(
            FakeShardedStrategy(model), model, 1, [torch.optim.LBFGS(model.parameters())]
        )


def test_setup_refuses_manual_optimization_then_compile_then_a_sharded_strategy_then_a_reloaded_cache():
    from lightning.pytorch.strategies import FSDPStrategy

    sharded = SimpleNamespace(
        strategy=FSDPStrategy.__new__(FSDPStrategy), reload_dataloaders_every_n_epochs=1
    )
    plain = SimpleNamespace(strategy=object(), reload_dataloaders_every_n_epochs=1)
    manual, automatic = (
        SimpleNamespace(automatic_optimization=False),
        SimpleNamespace(automatic_optimization=True),
    )
    with pytest.raises(PulseRefusal, match="it needs automatic optimization"):
        refuse_setup(sharded, manual, "encoder", 8.0)
    with pytest.raises(PulseRefusal, match="GradientCache: encoder runs under torch.compile"):
        refuse_setup(sharded, automatic, "encoder", 8.0)
    with pytest.raises(
        PulseRefusal, match="GradientCache does not support FSDPStrategy: a rank holds flattened"
    ):
        refuse_setup(sharded, automatic, None, 8.0)
    with pytest.raises(PulseRefusal, match="`reload_dataloaders_every_n_epochs`=1 builds a new one"):
        refuse_setup(plain, automatic, None, 8.0)
    refuse_setup(plain, automatic, None, 0.0)  # no cache: reloading is fine
