"""GradientCache on units that get a gradient at every step and never move, from a QAT sweep: on a model with
learnable fake quantizers (``_LearnableFakeQuantize``) the input QuantStub's quantizer was split into two
one-element units, ``zero_point`` first, whose gradient is exactly 0 on an input the observer's range covers
(and whose ``scale`` the observer writes back at every forward). Never moving, it was never scored (a score
is the movement over its peak, 0 / 0), and as the first unit it blocked every freeze for the whole run,
under an end line advising "a longer run, or a higher threshold", which could not help."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GradientCache
from lightning_pulse.core.freeze_units import ForwardOrderTrace, discover_units
from lightning_pulse.core.layer_freezing import FreezeSettings, LayerFreezer, freezer_from_state
from tests.conftest import trainer_kwargs


class _Chain(nn.Module):
    """``still`` (added to the input), then three layers: the first unit in forward order is ``still``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.still = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(self.still(x))


def _freezer(**settings) -> tuple[_Chain, LayerFreezer]:
    model = _Chain()
    trace = ForwardOrderTrace(discover_units(model))
    trace.begin()
    model(torch.randn(2, 4)).sum().backward()
    units = trace.finish()
    model.zero_grad(set_to_none=True)
    assert [unit.name for unit in units] == ["still", "body.0", "body.2", "body.4"]
    options = dict(threshold=0.5, check_every=4, freeze_for=40, max_frozen_share=1.0) | settings
    return model, LayerFreezer(units, FreezeSettings(**options))


def _drive(freezer: LayerFreezer, steps: int, first: str) -> list[int]:
    """Steps in which the later units move fast over the first window and a tenth of that afterwards (stable
    from the second check), and the first unit as ``first`` says: ``"zero"`` gets a gradient of exactly 0 and
    does not move, ``"overwritten"`` gets a non-zero one and does not move (its forward writes it back),
    ``"sometimes"`` gets none at odd steps and does not move, ``"moving"`` moves like the others."""
    prefixes = []
    for _ in range(steps):
        speed = 1e-2 if freezer.steps < freezer.settings.check_every else 1e-3
        for index, unit in enumerate(freezer.units):
            for param in unit.params:
                if not param.requires_grad:
                    param.grad = None
                    continue
                param.grad = torch.full_like(param, speed)
                if index == 0 and first != "moving":
                    if first == "zero":
                        param.grad = torch.zeros_like(param)
                    elif first == "sometimes" and freezer.steps % 2:
                        param.grad = None
                    continue
                with torch.no_grad():
                    param.sub_(param.grad * torch.sign(param))  # the norm shrinks: not still growing
        prefixes.append(freezer.step(True).frozen_prefix)
    return prefixes


@pytest.mark.parametrize("first", ["zero", "overwritten"])
def test_a_unit_getting_a_gradient_at_every_step_that_never_moves_is_stable_and_blocks_no_prefix(first):
    model, freezer = _freezer()
    prefixes = _drive(freezer, 8, first)
    # scored 0 at the first check (before: never scored, and no prefix could start at it)
    assert freezer.scores[0] == 0.0 and freezer.stable[0] and freezer.peak_rate[0] == 0.0
    assert prefixes[3] == 1 and prefixes[-1] == 3  # the head always trains
    assert not model.still.weight.requires_grad and not model.body[2].weight.requires_grad
    assert freezer.idle_note() is None


def test_a_unit_going_without_a_gradient_at_some_steps_is_still_not_scored_and_the_end_line_says_why():
    _, freezer = _freezer()
    assert set(_drive(freezer, 12, "sometimes")) == {0}
    assert freezer.scores[0] is None and freezer.scores[1] is not None and freezer.stable[1]
    note = freezer.idle_note()
    assert "first unit, still, not scored" in note
    assert "neither a longer run nor a higher threshold changes that" in note
    assert (
        "a longer run, or a higher threshold, lets it freeze" not in note and "requires_grad_(False)" in note
    )


def test_a_moving_first_unit_is_scored_from_its_movement_as_before():
    _, freezer = _freezer(threshold=0.05)
    assert set(_drive(freezer, 12, "moving")) == {0}
    assert 0.05 < freezer.scores[0] < 0.2 and not freezer.stable[0]  # a tenth of its peak pace, about
    assert "The weights were still moving: a longer run, or a higher threshold" in freezer.idle_note()


def test_a_resume_inside_a_window_keeps_whether_a_still_unit_went_without_a_gradient():
    _, freezer = _freezer()
    _drive(freezer, 1, "sometimes")  # a gradient at step 0, none at step 1 ...
    _drive(freezer, 1, "sometimes")
    state = freezer.state_dict()
    assert state["gradient_missed"][0] and not any(state["gradient_missed"][1:])
    model = _Chain()
    resumed = freezer_from_state(state, model, freezer.settings)
    resumed.apply_requires_grad()
    _drive(freezer, 2, "zero")  # ... and exactly 0 at steps 2 and 3: the window still missed one
    _drive(resumed, 2, "zero")
    assert freezer.scores[0] is None and resumed.scores[0] is None
    assert [freezer.stable, freezer.frozen] == [resumed.stable, resumed.frozen]
    # a state saved before the flag was: the window in progress gives the still unit no score
    del state["gradient_missed"]
    old = freezer_from_state(state, _Chain(), freezer.settings)
    assert old.gradient_missed == [True] * 4


# ------------------------------------------------------------------------------------- a learnable-quantizer QAT net
def _lsq_net(split: bool = True) -> nn.Module:
    from torch.ao.quantization import (
        DeQuantStub,
        MovingAverageMinMaxObserver,
        QConfig,
        QuantStub,
        prepare_qat,
    )
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

    torch.manual_seed(0)
    net = nn.Sequential(
        QuantStub(),
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
        DeQuantStub(),
    ).train()
    observer = MovingAverageMinMaxObserver
    activation = _LearnableFakeQuantize.with_args(observer=observer, quant_min=0, quant_max=255)
    weight = _LearnableFakeQuantize.with_args(
        observer=observer,
        quant_min=-128,
        quant_max=127,
        dtype=torch.qint8,
        qscheme=torch.per_tensor_symmetric,
    )
    net.qconfig = QConfig(activation=activation, weight=weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat(net)


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _lsq_net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_a_learnable_fake_quantizer_is_one_unit_and_a_quant_stubs_comes_first_whole():
    names = [unit.name for unit in discover_units(_lsq_net())]
    # before: "0.activation_post_process.scale", "0.activation_post_process.zero_point" as units of their own
    assert names == ["0.activation_post_process", "1", "3", "5"], names


def _fit(**options) -> tuple[GradientCache, str]:
    torch.manual_seed(0)
    x = torch.rand(192, 8)
    x[:, 0], x[:, 1] = 0.0, 1.0  # the input's range, [0, 1], in every batch: the observer's scale holds
    y = (x @ torch.randn(8, 4)).argmax(1)
    cache = GradientCache(threshold=0.95, check_every=2, freeze_for=6, phases=("burst", "replay"), **options)
    pl.seed_everything(0)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=24, callbacks=[cache]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Classifier(), DataLoader(TensorDataset(x, y), batch_size=16))
    return cache, " ".join(str(w.message) for w in caught)


@pytest.mark.parametrize(
    "units",
    [
        None,
        ["net.0.activation_post_process.zero_point", "net.0.activation_post_process.scale", "net.1", "net.3"],
    ],
    ids=["automatic", "zero-point-alone"],
)
def test_a_qat_net_with_learnable_fake_quantizers_freezes_past_its_input_quantizer(units):
    cache, said = _fit(units=units)
    first = cache._lifecycle.units[0]
    assert first.name == ("net.0.activation_post_process" if units is None else units[0])
    freezer = cache._lifecycle.freezer
    assert freezer.peak_rate[0] == 0.0  # it never moved ...
    assert max(event["to"] for event in cache.events) >= 2  # ... and blocked nothing: 0 frozen before
    assert "froze nothing" not in said
