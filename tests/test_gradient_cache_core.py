"""The functional core of GradientCache: units, forward order, measures, the freeze state machine, FLOPs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_pulse.core.gradient_cache import (
    BackwardFlopLedger,
    CacheSettings,
    ModuleGradientCache,
    discover_units,
    gradient_cosine,
    order_units,
    record_gradient_order,
    relative_norm_change,
    relative_parameter_change,
)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))


def traced_units(model: nn.Module, inputs: torch.Tensor, **kwargs):
    """Units of ``model`` in forward order, traced from one real backward."""
    units = discover_units(model, **kwargs)
    named = dict(model.named_parameters())
    for unit in units:
        unit.bind(named)
    params = {name: p for unit in units for name, p in zip(unit.param_names, unit.params)}
    with record_gradient_order(params) as order:
        output = model(inputs)
        (output.float().pow(2).mean() if output.dtype != torch.long else output.sum()).backward()
    model.zero_grad(set_to_none=True)
    return order_units(units, order)


def backward_flops(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    loss = F.cross_entropy(model(inputs), targets)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


# ------------------------------------------------------------------------------------------ units and order
def test_transformer_splits_into_embedding_position_blocks_norm_and_head_in_forward_order():
    from examples.charlm import CharTransformerLM

    model = CharTransformerLM(d_model=32, n_layers=2, n_heads=4, seq_len=16)
    units = traced_units(model, torch.randint(0, 128, (2, 16)))
    names = [unit.name for unit in units]
    # the embedding and the positional parameter both sit at the input; their order between them is free
    assert set(names[:2]) == {"embed", "position"}
    assert names[2:] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    assert all(unit.used for unit in units)
    assert sum(unit.numel for unit in units) == sum(p.numel() for p in model.parameters())


def test_forward_order_comes_from_backward_not_from_registration():
    class Backwards(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 2)  # registered first, runs last
            self.body = nn.Linear(8, 8)
            self.stem = nn.Linear(4, 8)
            self.spare = nn.Linear(3, 3)  # never called

        def forward(self, x):
            return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))

    units = traced_units(Backwards(), torch.randn(5, 4))
    assert [unit.name for unit in units] == ["stem", "body", "head", "spare"]
    assert [unit.used for unit in units] == [True, True, True, False]
    cache = ModuleGradientCache(units)
    assert cache.freezable_limit == 2  # the head (last used unit) always trains; the unused one never freezes


def test_tied_weight_belongs_to_the_input_side_unit():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 6)
            self.body = nn.Linear(6, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(torch.tanh(self.body(self.embed(tokens))))

    units = traced_units(Tied(), torch.randint(0, 10, (3, 5)))
    assert [unit.name for unit in units] == ["embed", "body"]  # head owns nothing of its own
    assert units[0].param_names == ["embed.weight"]


def test_explicit_units_cover_the_rest_and_reject_unknown_or_overlapping_names():
    model = mlp()
    units = discover_units(model, module_names=["0", "2"])
    assert [unit.name for unit in units] == ["0", "2", "<rest>"]
    assert units[2].param_names == ["4.weight", "4.bias"]
    with pytest.raises(ValueError, match="'nope'"):
        discover_units(model, module_names=["nope"])
    with pytest.raises(ValueError, match="overlaps"):
        discover_units(model, module_names=["0", "0.weight"])


def test_parameters_the_user_froze_are_left_out():
    model = mlp()
    model[0].requires_grad_(False)
    units = discover_units(model)
    assert [unit.name for unit in units] == ["2", "4"]


# ------------------------------------------------------------------------------------------ measures
def test_measures_on_known_vectors():
    a = [torch.tensor([1.0, 0.0]), torch.tensor([2.0])]
    assert gradient_cosine(a, a) == pytest.approx(1.0)
    assert gradient_cosine(a, [-t for t in a]) == pytest.approx(-1.0)
    assert gradient_cosine(a, [torch.zeros(2), torch.zeros(1)]) == 0.0
    assert relative_norm_change([2 * t for t in a], a) == pytest.approx(1.0)
    assert relative_norm_change(a, [torch.zeros(2), torch.zeros(1)]) == math.inf
    snapshot = [torch.tensor([3.0, 4.0])]
    assert relative_parameter_change([torch.tensor([3.0, 4.5])], snapshot) == pytest.approx(0.1)


# ------------------------------------------------------------------------------------------ backward work
def test_frozen_prefix_really_skips_backward_flops():
    model, x, y = mlp(), torch.randn(32, 40), torch.randint(0, 10, (32,))
    batch = 32
    weight0, weight1, input1 = 2 * batch * 40 * 100, 2 * batch * 100 * 100, 2 * batch * 100 * 100
    weight2, input2 = 2 * batch * 100 * 10, 2 * batch * 100 * 10
    full = backward_flops(model, x, y)
    assert full == weight0 + weight1 + input1 + weight2 + input2
    units = traced_units(model, x)
    cache = ModuleGradientCache(units)
    cache._set_prefix(1)
    # layer 0 costs nothing and layer 1 no longer needs the gradient of its input
    assert backward_flops(model, x, y) == weight1 + weight2 + input2
    cache._set_prefix(2)
    assert backward_flops(model, x, y) == weight2
    # a frozen unit in the middle saves only its weight gradient: that is why only prefixes are frozen
    cache._set_prefix(0)
    model[2].requires_grad_(False)
    assert backward_flops(model, x, y) == full - weight1


def test_transformer_prefix_freeze_skips_backward_flops():
    from examples.charlm import CharTransformerLM

    model = CharTransformerLM(d_model=32, n_layers=2, n_heads=4, seq_len=16)
    tokens, targets = torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16))

    def lm_backward_flops() -> int:
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, 128), targets.reshape(-1))
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        model.zero_grad(set_to_none=True)
        return counter.get_total_flops()

    full = lm_backward_flops()
    cache = ModuleGradientCache(traced_units(model, tokens))
    costs = []
    for prefix in range(1, 6):
        cache._set_prefix(prefix)
        costs.append(lm_backward_flops())
    # embedding + position alone save nothing measurable (an index lookup); each block then saves more
    assert costs[0] == full and costs[1] == full
    assert full > costs[2] > costs[3] > costs[4]
    assert costs[4] < 0.5 * full  # first layer (attention + MLP) frozen: over half the backward is gone


# ------------------------------------------------------------------------------------------ the state machine
def drive(cache: ModuleGradientCache, grads, steps: int, enabled: bool = True):
    """Run ``steps`` optimizer steps whose gradients are ``grads(step, unit_index, param)`` for trainable units."""
    reports = []
    for _ in range(steps):
        for index, unit in enumerate(cache.units):
            for param in unit.params:
                param.grad = grads(cache.steps, index, param) if param.requires_grad else None
        reports.append(cache.after_backward(enabled))
    return reports


def constant(step, index, param):
    return torch.ones_like(param)


def test_stable_prefix_freezes_then_refreshes_after_freeze_for():
    model = mlp()
    settings = CacheSettings(
        measure="cosine", threshold=0.9, check_every=5, freeze_for=10, max_frozen_share=1.0
    )
    cache = ModuleGradientCache(traced_units(model, torch.randn(2, 40)), settings)
    reports = drive(cache, constant, 5)
    assert cache.frozen_prefix == 0  # first window: no cache to compare with yet
    reports = drive(cache, constant, 5)
    assert reports[-1].changed and cache.frozen_prefix == 2  # head always trains
    assert not model[0].weight.requires_grad and model[4].weight.requires_grad
    drive(cache, constant, 5)
    assert cache.frozen_prefix == 2 and cache.staleness == 5
    reports = drive(cache, constant, 5)
    # freeze_for reached: the prefix trains one window to refresh its cache
    assert cache.frozen_prefix == 0 and model[0].weight.requires_grad
    reports = drive(cache, constant, 5)
    assert reports[-1].refreshed == ["0", "2"]
    assert reports[-1].similarity_at_refresh == pytest.approx(1.0)
    assert cache.frozen_prefix == 2 and cache.cache_hit_rate == 1.0


def test_refresh_that_finds_a_changed_gradient_keeps_the_unit_training():
    model = mlp()
    settings = CacheSettings(
        measure="cosine", threshold=0.9, check_every=5, freeze_for=5, max_frozen_share=1.0
    )
    cache = ModuleGradientCache(traced_units(model, torch.randn(2, 40)), settings)
    drive(cache, constant, 10)
    assert cache.frozen_prefix == 2
    drive(cache, constant, 5)  # expires: released for a refresh window
    assert cache.frozen_prefix == 0

    def flipped(step, index, param):
        return -torch.ones_like(param) if index == 0 else torch.ones_like(param)

    reports = drive(cache, flipped, 5)
    assert reports[-1].similarity_at_refresh == pytest.approx(0.0)  # mean of -1 (unit 0) and +1 (unit 1)
    assert cache.frozen_prefix == 0 and cache.cache_hit_rate == 0.5
    assert model[0].weight.requires_grad


def test_frozen_parameters_get_no_gradient_and_adam_leaves_them_alone():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    settings = CacheSettings(
        measure="cosine", threshold=0.9, check_every=2, freeze_for=20, max_frozen_share=0.3
    )
    cache = ModuleGradientCache(traced_units(model, torch.randn(2, 40)), settings)
    for _ in range(4):
        drive(cache, constant, 1)
        optimizer.step()
    assert cache.frozen_prefix == 1  # max_frozen_share 0.3 stops the prefix after the first layer
    frozen_weight, adam_steps = (
        model[0].weight.detach().clone(),
        optimizer.state[model[0].weight]["step"].item(),
    )
    for _ in range(6):
        drive(cache, constant, 1)
        assert model[0].weight.grad is None
        optimizer.step()
    assert torch.equal(model[0].weight, frozen_weight)  # no momentum, no weight decay
    assert optimizer.state[model[0].weight]["step"].item() == adam_steps
    assert optimizer.state[model[2].weight]["step"].item() == adam_steps + 6


def test_cached_update_applies_the_decayed_cached_gradient():
    model = mlp()
    settings = CacheSettings(
        measure="cosine",
        threshold=0.9,
        check_every=2,
        freeze_for=20,
        max_frozen_share=0.3,
        frozen_update="cached",
        cached_decay=0.5,
    )
    cache = ModuleGradientCache(traced_units(model, torch.randn(2, 40)), settings)
    drive(cache, lambda s, i, p: torch.full_like(p, 3.0), 4)
    assert cache.frozen_prefix == 1
    drive(cache, lambda s, i, p: torch.full_like(p, 3.0), 2)
    # two frozen steps since the cache was checked: 3 * 0.5 ** 2
    assert torch.allclose(model[0].weight.grad, torch.full_like(model[0].weight, 0.75))


def test_stale_replay_freezes_everything_but_the_head_without_a_stability_test():
    model = mlp()
    settings = CacheSettings(
        measure="cosine", check_every=2, freeze_for=4, max_frozen_share=1.0, mode="stale_replay"
    )
    cache = ModuleGradientCache(traced_units(model, torch.randn(2, 40)), settings)

    def noisy(step, index, param):
        return torch.randn_like(param)

    drive(cache, noisy, 2)
    assert cache.frozen_prefix == 2  # one window of cache is enough, however dissimilar
    assert cache.frozen_update == "cached"
    drive(cache, noisy, 1)
    assert model[0].weight.grad is not None


def test_disabled_phase_releases_the_prefix_at_once():
    model = mlp()
    settings = CacheSettings(
        measure="cosine", threshold=0.9, check_every=5, freeze_for=50, max_frozen_share=1.0
    )
    cache = ModuleGradientCache(traced_units(model, torch.randn(2, 40)), settings)
    drive(cache, constant, 10)
    assert cache.frozen_prefix == 2
    drive(cache, constant, 1, enabled=False)
    assert cache.frozen_prefix == 0 and all(p.requires_grad for p in model.parameters())
    assert cache.freeze_from_last_check() and cache.frozen_prefix == 2  # caches are still fresh


def test_state_dict_round_trip_continues_identically():
    def fresh():
        model = mlp()
        settings = CacheSettings(measure="plasticity", threshold=2.0, check_every=3, freeze_for=6)
        return model, ModuleGradientCache(traced_units(model, torch.randn(2, 40)), settings)

    def grads(step, index, param):
        return torch.full_like(param, float(step % 4) + index)

    model_a, cache_a = fresh()
    drive(cache_a, grads, 7)
    state = cache_a.state_dict()
    model_b, cache_b = fresh()
    cache_b.load_state_dict(state)
    cache_b.apply_requires_grad()
    assert cache_b.frozen == cache_a.frozen
    assert [p.requires_grad for p in model_b.parameters()] == [p.requires_grad for p in model_a.parameters()]
    reports_a = drive(cache_a, grads, 11)
    reports_b = drive(cache_b, grads, 11)
    assert [(r.frozen_prefix, r.window_closed) for r in reports_a] == [
        (r.frozen_prefix, r.window_closed) for r in reports_b
    ]
    assert cache_a.state_dict()["stats"] == cache_b.state_dict()["stats"]


def test_state_dict_of_another_model_is_refused():
    model = mlp()
    cache = ModuleGradientCache(traced_units(model, torch.randn(2, 40)))
    other = ModuleGradientCache(discover_units(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))))
    with pytest.raises(ValueError, match="model changed"):
        other.load_state_dict(cache.state_dict())


def test_flop_ledger_counts_skipped_backward_work():
    model, x, y = mlp(), torch.randn(8, 40), torch.randint(0, 10, (8,))
    cache = ModuleGradientCache(traced_units(model, x))
    ledger = BackwardFlopLedger()
    for prefix in (0, 1, 1):
        cache._set_prefix(prefix)
        loss = F.cross_entropy(model(x), y)
        if ledger.needs(prefix):
            with ledger.measuring(prefix):
                loss.backward()
        else:
            loss.backward()
        ledger.account(prefix)
    full, cheaper = ledger.flops_by_prefix[0], ledger.flops_by_prefix[1]
    assert ledger.skipped == 2 * (full - cheaper) and ledger.reference == 3 * full
    assert ledger.skipped_share == pytest.approx(2 * (full - cheaper) / (3 * full))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"measure": "entropy"}, "measure"),
        ({"mode": "svrg"}, "mode"),
        ({"frozen_update": "momentum"}, "frozen_update"),
        ({"mode": "stale_replay", "frozen_update": "none"}, "frozen_update"),
        ({"check_every": 0}, "check_every"),
        ({"freeze_for": 30, "check_every": 20}, "freeze_for"),
        ({"measure": "cosine", "threshold": 1.5}, "threshold"),
        ({"measure": "plasticity", "threshold": -0.1}, "threshold"),
        ({"max_frozen_share": 0.0}, "max_frozen_share"),
        ({"cached_decay": 1.5}, "cached_decay"),
    ],
)
def test_bad_settings_fail_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        CacheSettings(**kwargs)
