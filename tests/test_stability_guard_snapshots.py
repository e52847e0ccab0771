"""CPU snapshots for StabilityGuard's rollbacks, and the clean-skip property of torch's optimizers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from torch.utils._pytree import tree_leaves

from lightning_pulse.core.snapshots import (
    RollbackState,
    SnapshotRing,
    copy_to_cpu,
    nonfinite_tensors,
    restore_snapshot,
    take_snapshot,
    tensor_bytes,
)


class CountingCallbackState:
    """Anything with state_dict/load_state_dict, like a pulse callback."""

    def __init__(self) -> None:
        self.seen = [1, 2]

    def state_dict(self):
        return {"seen": list(self.seen), "scores": torch.arange(3.0)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


def _train_steps(model, optimizer, scheduler, steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=50)
    return model, optimizer, scheduler


def test_restore_returns_model_optimizer_scheduler_and_callbacks_to_the_snapshot():
    model, optimizer, scheduler = _setup()
    _train_steps(model, optimizer, scheduler, 5)
    callback = CountingCallbackState()
    snapshot = take_snapshot(5, model, [optimizer], [scheduler], {"cb": callback}, extra={"note": 1})
    expected_model = copy.deepcopy(model.state_dict())
    expected_optimizer = copy.deepcopy(optimizer.state_dict())
    expected_lr = scheduler.get_last_lr()
    params_before = [id(p) for p in model.parameters()]

    _train_steps(model, optimizer, scheduler, 7, seed=1)
    callback.seen.append(3)
    restore_snapshot(snapshot, model, [optimizer], [scheduler], {"cb": callback})

    assert [id(p) for p in model.parameters()] == params_before  # copied in place
    for name, value in expected_model.items():
        assert torch.equal(model.state_dict()[name], value), name
    for key, state in expected_optimizer["state"].items():
        for name, value in state.items():
            assert torch.equal(optimizer.state_dict()["state"][key][name], value), (key, name)
    assert scheduler.get_last_lr() == expected_lr
    assert optimizer.param_groups[0]["lr"] == expected_lr[0]
    assert callback.seen == [1, 2]
    # the same training from there reproduces itself: nothing of the undone steps leaked
    twin_model, twin_optimizer, twin_scheduler = _setup()
    _train_steps(twin_model, twin_optimizer, twin_scheduler, 5)
    _train_steps(model, optimizer, scheduler, 3, seed=2)
    _train_steps(twin_model, twin_optimizer, twin_scheduler, 3, seed=2)
    for mine, twin in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(mine, twin)


def test_non_persistent_buffers_go_back_with_the_model():
    # held-out sweep: a running statistic registered with persistent=False is not in the state_dict, and a
    # rollback left it at its diverged value
    model = nn.Linear(3, 2)
    model.register_buffer("feature_mean", torch.zeros(3), persistent=False)
    model.register_buffer("seen", torch.zeros(()))
    snapshot = take_snapshot(5, model)
    assert set(snapshot.buffers) == {"feature_mean"} and "seen" in snapshot.model
    with torch.no_grad():
        model.feature_mean.add_(7.0)
        model.seen.add_(64)
        model.weight.mul_(2)
    saved = model.feature_mean
    restore_snapshot(snapshot, model)
    assert torch.equal(model.feature_mean, torch.zeros(3)) and model.feature_mean is saved  # in place
    assert model.seen.item() == 0
    assert snapshot.nbytes == sum(t.numel() * t.element_size() for t in model.state_dict().values()) + 3 * 4


def test_restore_without_rewinding_keeps_the_schedule_and_hyperparameters():
    model, optimizer, scheduler = _setup()
    _train_steps(model, optimizer, scheduler, 5)
    snapshot = take_snapshot(5, model, [optimizer], [scheduler])
    _train_steps(model, optimizer, scheduler, 10)
    lr_now, epoch_now = optimizer.param_groups[0]["lr"], scheduler.last_epoch
    restore_snapshot(snapshot, model, [optimizer], [scheduler], rewind_schedule=False)
    assert optimizer.param_groups[0]["lr"] == lr_now
    assert scheduler.last_epoch == epoch_now
    assert optimizer.state_dict()["state"][0]["step"].item() == 5


def test_a_snapshot_of_another_kind_of_lr_scheduler_does_not_fit_and_nothing_is_loaded():
    """StochasticWeightAveraging swaps the module's scheduler for SWALR mid-run: StepLR's saved state went
    into SWALR, and the optimizer's groups came back without SWALR's ``swa_lr`` (a ``KeyError`` at its next
    step). Such a snapshot no longer fits (with the schedule rewound), and is refused before anything
    loads; without rewinding, the current scheduler and hyperparameters stay, so it still fits."""
    from torch.optim.swa_utils import SWALR

    model, optimizer, _ = _setup()
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)
    snapshot = take_snapshot(0, model, [optimizer], [step_lr])
    swa_lr = SWALR(optimizer, swa_lr=0.01)
    assert snapshot.fits(model, [optimizer], [step_lr]) and not snapshot.fits(model, [optimizer], [swa_lr])
    with torch.no_grad():
        model[0].weight.add_(1.0)
    changed = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"1 scheduler\(s\) \['StepLR'\], but 1 and 1 \['SWALR'\]"):
        restore_snapshot(snapshot, model, [optimizer], [swa_lr])
    assert torch.equal(model[0].weight, changed)
    restore_snapshot(snapshot, model, [optimizer], [swa_lr], rewind_schedule=False)
    assert not torch.equal(model[0].weight, changed) and optimizer.param_groups[0]["swa_lr"] == 0.01


def test_a_rewound_restore_keeps_the_group_keys_a_scheduler_set_since_the_snapshot():
    """A snapshot taken before a scheduler was created (it fits: the same schedulers are given) has groups
    without the keys that scheduler set (``initial_lr``, SWALR's ``swa_lr``): they were lost on a restore
    that rewinds the optimizers' hyperparameters, and the scheduler's next step raised ``KeyError``."""
    from torch.optim.swa_utils import SWALR

    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshot = take_snapshot(0, model, [optimizer])
    scheduler = SWALR(optimizer, swa_lr=0.01)
    restore_snapshot(snapshot, model, [optimizer])
    assert optimizer.param_groups[0]["swa_lr"] == 0.01 and optimizer.param_groups[0]["initial_lr"] == 0.1
    optimizer.step()
    scheduler.step()  # reads both


def test_snapshot_is_an_independent_cpu_copy():
    model, optimizer, scheduler = _setup()
    _train_steps(model, optimizer, scheduler, 2)
    snapshot = take_snapshot(2, model, [optimizer], [scheduler])
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert not torch.equal(snapshot.model["0.weight"], model[0].weight)
    assert all(t.device.type == "cpu" for t in snapshot.model.values())
    assert snapshot.nbytes == tensor_bytes(snapshot.model) + tensor_bytes(snapshot.optimizers) + tensor_bytes(
        snapshot.schedulers
    )
    assert snapshot.nbytes > sum(p.numel() * 4 for p in model.parameters())
    # module versions (read by BatchNorm's load_state_dict) survive the copy
    assert copy_to_cpu(model.state_dict())._metadata == model.state_dict()._metadata


def test_restore_rejects_a_snapshot_of_another_optimizer_setup():
    model, optimizer, scheduler = _setup()
    snapshot = take_snapshot(0, model, [optimizer], [scheduler])
    with pytest.raises(ValueError, match="optimizer"):
        restore_snapshot(snapshot, model, [optimizer, optimizer], [scheduler])


def test_ring_keeps_the_newest_and_finds_the_newest_before_a_step():
    model, optimizer, _ = _setup()
    ring = SnapshotRing(capacity=3)
    for step in (0, 10, 20, 30):
        ring.add(take_snapshot(step, model, [optimizer]))
    assert ring.steps == [10, 20, 30]
    assert ring.newest_at_or_before(25).step == 20
    assert ring.newest_at_or_before(5) is None
    ring.add(take_snapshot(30, model, [optimizer]))  # same step replaces, never duplicates
    assert ring.steps == [10, 20, 30]
    ring.drop_after(15)
    assert ring.steps == [10] and ring.newest().step == 10
    with pytest.raises(ValueError, match="`capacity`"):
        SnapshotRing(0)


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.1, weight_decay=0.1),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.1, weight_decay=0.1),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.1, weight_decay=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5, weight_decay=0.1),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p, weight_decay=0.1),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.1),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.1, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_torch_optimizers_change_nothing_when_every_grad_is_none(name):
    """StabilityGuard's clean skip relies on this for every optimizer class in ``torch.optim``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = OPTIMIZERS[name](model.parameters())
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4)).pow(2).sum().backward()
        optimizer.step()
    state_before = copy.deepcopy(optimizer.state_dict())
    params_before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    for before, after in zip(params_before, model.parameters()):
        assert torch.equal(before, after)
    for key, state in state_before["state"].items():
        for field, value in state.items():
            now = optimizer.state_dict()["state"][key][field]
            assert torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value, (key, field)


def _assert_same_optimizer_state(state, expected):
    """Every state tensor of every parameter equal to the expected one, in the same dtype."""
    assert state.keys() == expected.keys()
    for key, fields in expected.items():
        for field, value in fields.items():
            now = state[key][field]
            if isinstance(value, torch.Tensor):
                assert now.dtype == value.dtype and torch.equal(now, value), (key, field, now, value)
            else:
                assert now == value, (key, field)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["NAdam", "ASGD"])
def test_restore_gives_back_optimizer_state_kept_in_another_dtype_than_its_parameters(name, dtype):
    # held-out sweep: Optimizer.load_state_dict casts every state tensor but `step` to its parameter's dtype,
    # so under bf16-true a rollback rounded NAdam's float32 `mu_product` (ASGD's `eta`, `mu`) to bfloat16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).to(dtype)
    optimizer = OPTIMIZERS[name](model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(3, 4, dtype=dtype)).pow(2).sum().backward()
        optimizer.step()
    expected = copy.deepcopy(optimizer.state_dict()["state"])
    assert any(v.dtype == torch.float32 for fields in expected.values() for v in fields.values())
    snapshot = take_snapshot(3, model, [optimizer])
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(3, 4, dtype=dtype)).pow(2).sum().backward()
        optimizer.step()
    restore_snapshot(snapshot, model, [optimizer])
    _assert_same_optimizer_state(optimizer.state_dict()["state"], expected)
    restore_snapshot(snapshot, model, [optimizer])  # the snapshot is unchanged: it restores again
    _assert_same_optimizer_state(optimizer.state_dict()["state"], expected)


def test_a_snapshot_no_longer_fits_a_model_whose_structure_changed():
    model, optimizer, _ = _setup()
    snapshot = take_snapshot(0, model, [optimizer])
    assert snapshot.fits(model)
    model.register_buffer("grown", torch.zeros(1))  # an entry added since (pruning masks still fit: below)
    assert not snapshot.fits(model)
    smaller = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))  # channels pruned away
    assert not snapshot.fits(smaller)


def test_a_recycled_snapshot_is_refilled_in_place_and_equals_a_fresh_one():
    model, optimizer, scheduler = _setup()
    ring = SnapshotRing(capacity=2)
    callback = CountingCallbackState()
    for step in (0, 1):
        _train_steps(model, optimizer, scheduler, 1, seed=step)
        ring.add(take_snapshot(step, model, [optimizer], [scheduler], {"cb": callback}))
    oldest_weight = ring.oldest().model["0.weight"]
    _train_steps(model, optimizer, scheduler, 1, seed=2)
    recycled = ring.recycle(2)  # the ring is full: adding step 2 would evict step 0
    assert recycled.step == 0 and ring.steps == [1]
    snapshot = take_snapshot(2, model, [optimizer], [scheduler], {"cb": callback}, reuse=recycled)
    ring.add(snapshot)
    fresh = take_snapshot(2, model, [optimizer], [scheduler], {"cb": callback})
    assert snapshot.model["0.weight"] is oldest_weight  # the evicted buffer, refilled
    for name, value in fresh.model.items():
        assert torch.equal(snapshot.model[name], value), name
    assert snapshot.optimizers[0]["state"].keys() == fresh.optimizers[0]["state"].keys()
    for index, state in fresh.optimizers[0]["state"].items():
        for field, value in state.items():
            assert torch.equal(snapshot.optimizers[0]["state"][index][field], value), (index, field)
    assert snapshot.schedulers == fresh.schedulers and snapshot.callbacks["cb"]["seen"] == [1, 2]
    # refilled from the live state, not aliased to it
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert torch.equal(snapshot.model["0.weight"], fresh.model["0.weight"])
    # a snapshot of the same step replaces the newest one, which is the one recycled
    assert ring.recycle(2) is snapshot and ring.steps == [1]


def test_the_last_good_snapshot_is_the_newest_before_the_trouble_that_still_fits():
    model, optimizer, _ = _setup()
    ring = SnapshotRing(capacity=3)
    for step in (0, 10, 20):
        ring.add(take_snapshot(step, model, [optimizer]))
    assert [(s.step if s else None, predates) for s, predates in [ring.last_good(model, 15)]] == [(10, True)]
    snapshot, predates = ring.last_good(model, -5)  # none predates: the oldest, flagged as such
    assert (snapshot.step, predates) == (0, False)
    smaller = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))  # channels pruned since
    ring.add(take_snapshot(30, smaller, []))
    assert ring.last_good(smaller, 100) == (ring.newest(), True) and ring.steps == [30]  # the others dropped
    assert ring.last_good(model, 100) == (None, False) and len(ring) == 0


def test_the_rollback_candidates_are_the_last_good_snapshot_then_the_oldest_once_each():
    model, optimizer, _ = _setup()
    ring = SnapshotRing(capacity=3)
    assert ring.rollback_candidates(model, 15) == []
    ring.add(take_snapshot(0, model, [optimizer]))
    assert [s.step for s in ring.rollback_candidates(model, 15)] == [0]  # the oldest is the last good one
    for step in (10, 20):
        ring.add(take_snapshot(step, model, [optimizer]))
    assert [s.step for s in ring.rollback_candidates(model, 15)] == [10, 0]
    smaller = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    assert ring.rollback_candidates(smaller, 15) == []  # none fits a pruned model


def test_rollback_state_prefers_the_callbacks_own_rollback_part():
    class Clocked(CountingCallbackState):
        def rollback_state_dict(self):
            return {"seen": list(self.seen)}

        def load_rollback_state_dict(self, state):
            self.seen = list(state["seen"]) + ["rolled back"]

    plain, clocked = RollbackState(CountingCallbackState()), RollbackState(Clocked())
    assert set(plain.state_dict()) == {"seen", "scores"} and set(clocked.state_dict()) == {"seen"}
    clocked.load_state_dict({"seen": [5]})
    assert clocked.callback.seen == [5, "rolled back"]


def test_carried_tensors_are_found_and_put_back_including_a_state_that_did_not_exist_yet():
    from lightning_pulse.core.carried_state import carried_tensors, restore_carried_tensors

    class Carrier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(2, 3)
            self.rnn.extra = torch.ones(2)  # a plain tensor attribute of a submodule
            self.state = None  # hidden state, before the first batch

    model = Carrier()
    saved = copy_to_cpu(carried_tensors(model))
    assert saved["state"] is None and torch.equal(saved["rnn.extra"], torch.ones(2))
    assert not any(
        name.endswith(("weight_ih_l0", "bias_hh_l0")) for name in saved
    )  # parameters are not carried
    model.state = (torch.full((1, 3), float("nan")),)
    model.rnn.extra = torch.zeros(2)
    model.rnn.mode_name = None  # None now, and was not carried: left alone
    restore_carried_tensors(model, saved)
    assert model.state is None and torch.equal(model.rnn.extra, torch.ones(2))


def test_a_nested_carried_state_is_put_back_as_fresh_copies_in_containers_of_its_own_types():
    """Sweep: only the outer container's items were copied, so an inner tuple came back holding the saved
    (snapshot's, CPU) tensors themselves."""
    from collections import OrderedDict, namedtuple

    from lightning_pulse.core.carried_state import restore_carried_tensors

    Hidden = namedtuple("Hidden", "h c")
    model = torch.nn.Linear(2, 2)
    saved = {
        "layers": [(torch.ones(1, 2, 3), torch.zeros(1, 2, 3)), (torch.ones(1, 2, 3), torch.zeros(1, 2, 3))],
        "named": Hidden(torch.ones(2), torch.zeros(2)),
        "by_key": OrderedDict(a=[torch.ones(2)], b=(torch.zeros(2),)),
    }
    restore_carried_tensors(model, saved)
    for name, value in saved.items():
        now = getattr(model, name)
        assert type(now) is type(value), name
        for kept, put_back in zip(tree_leaves(value), tree_leaves(now)):
            assert put_back is not kept and torch.equal(put_back, kept)
            assert put_back.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
    assert [type(layer) for layer in model.layers] == [tuple, tuple]
    assert list(model.by_key) == ["a", "b"] and type(model.by_key["a"]) is list


def test_a_snapshot_from_before_a_pruning_mask_fits_and_restores_under_the_current_mask():
    """Unstructured pruning moves a layer's ``weight`` to ``weight_orig`` next to a ``weight_mask``: snapshots
    taken before no longer had the model's entries, so a rollback after a pruning event found none to return
    to, and the guard trained on from the bad state. The saved weight goes back under the mask the layer has
    now (the parameter keeps its name). Sweep 20a gave it a mask of ones instead, which silently undid the
    pruning of Lightning's ``ModelPruning`` or the user's own ``prune`` call (nothing prunes again); only
    ScheduledPrune, which redoes its events, resets its own layers' masks, in its rollback load
    (``tests/test_scheduled_prune.py``)."""

    from lightning_pulse.core.snapshots import restore_snapshot, take_snapshot

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    before = take_snapshot(0, model)
    saved_weight = model[0].weight.detach().clone()
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    parameter, mask = model[0].weight_orig, model[0].weight_mask.clone()
    with torch.no_grad():
        model[0].weight_orig[0, 0] = float("nan")
    assert before.fits(model)
    restore_snapshot(before, model)
    assert model[0].weight_orig is parameter and torch.equal(model[0].weight_orig, saved_weight)
    assert torch.equal(model[0].weight_mask, mask) and not bool(mask.all())
    assert torch.equal(
        model[0](torch.eye(4)).detach(),
        nn.functional.linear(torch.eye(4), saved_weight * mask, model[0].bias),
    )
    model.add_module("extra", nn.Linear(2, 2))  # any other change of structure still does not fit
    assert not before.fits(model)


def test_nonfinite_tensors_names_nan_and_infinities_but_not_an_overflowing_sum_of_finite_values():
    big = torch.finfo(torch.float32).max
    named = {
        "nan": torch.tensor([1.0, float("nan")]),
        "plus_inf": torch.tensor([float("inf"), 0.0]),
        "minus_inf": torch.tensor([[0.0], [float("-inf")]]),
        "complex_nan": torch.tensor([complex(0.0, float("nan"))]),
        "half_nan": torch.tensor([float("nan")], dtype=torch.bfloat16),
        "float8_nan": torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn),  # no isfinite for float8
        "sum_overflows": torch.tensor([big, big]),  # finite, though its sum is not
        "half_sum_overflows": torch.full((4,), 60000.0, dtype=torch.float16),
        "integers": torch.tensor([1, 2]),
        "empty": torch.empty(0),
        "finite": torch.randn(3, 3),
    }
    assert nonfinite_tensors(named) == [
        "nan",
        "plus_inf",
        "minus_inf",
        "complex_nan",
        "half_nan",
        "float8_nan",
    ]
    assert nonfinite_tensors({}) == [] and nonfinite_tensors({"ints": torch.tensor([3])}) == []


def test_nonfinite_tensors_names_only_a_nan_in_the_tensors_that_may_hold_infinities():
    inf, nan = float("inf"), float("nan")
    nan_only = {
        "causal_mask": torch.tensor([0.0, -inf]),
        "observer_range": torch.tensor([inf, -inf]),  # a NaN sum of no NaN
        "running_var": torch.tensor([1.0, nan]),
        "half_nan": torch.tensor([nan], dtype=torch.bfloat16),
        "float8_nan": torch.tensor([1.0, nan]).to(torch.float8_e4m3fn),
    }
    named = {"weight": torch.tensor([-inf]), "bias": torch.zeros(2)}
    assert nonfinite_tensors(named, nan_only=nan_only) == ["weight", "running_var", "half_nan", "float8_nan"]
    assert nonfinite_tensors({}, nan_only={"mask": torch.tensor([-inf])}) == []
