"""ScheduledPrune on module structures from a sweep: a layer held under a second name (a handle such as
``self.first = self.backbone[0]``) is one layer, pruned once; a model whose every layer computes its weight (a
parametrization) is refused naming the call that removes it, not other ``layer_types``."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def _vectors() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :4].argmax(dim=1)), batch_size=16)


def _prune(**overrides) -> ScheduledPrune:
    options = {"final_sparsity": 0.5, "start": 2, "end": 6, "every": 2, "probe_batches": 0}
    return ScheduledPrune(**{**options, **overrides})


def _fit(module: pl.LightningModule, prune: ScheduledPrune, steps: int = 8) -> list[str]:
    """Fit ``module`` with ``prune``; the ScheduledPrune warnings given."""
    trainer = pl.Trainer(callbacks=[prune], max_steps=steps, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _vectors())
    return [str(w.message) for w in caught if "ScheduledPrune" in str(w.message)]


def _zeros(weight: torch.Tensor) -> float:
    return float((weight == 0).float().mean())


class _Classifier(pl.LightningModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Handles(_Classifier):
    """A backbone with handles on its first layer and on itself: the same modules under a second name."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.first = self.backbone[0]
        self.features = self.backbone
        self.example_input_array = torch.randn(2, 16)

    def forward(self, x):
        return self.head(self.backbone(x))


def test_a_layer_under_a_second_name_is_pruned_once_and_reported_as_its_weights_are():
    # sweep: only `head` was pruned (2% of the parameters) and the fit-start warning said `backbone.0.weight`
    # was "shared with first.weight, which is not pruned", though `first` is that very layer
    module = _Handles()
    prune = _prune()
    said = _fit(module, prune)
    assert not [text for text in said if "shared with" in text], said
    last = prune.events[-1]
    assert set(last["layer_sparsity"]) == {"backbone.0", "backbone.2", "head"}
    for name in ("backbone.0", "backbone.2", "head"):
        weight = module.get_submodule(name).weight
        assert _zeros(weight) == pytest.approx(0.5, abs=0.01)
        assert last["layer_sparsity"][name] == pytest.approx(_zeros(weight), abs=1e-6)
    assert module.first is module.backbone[0] and module.features is module.backbone


def test_a_layer_under_a_second_name_is_cut_in_structured_mode():
    # sweep: a bare `KeyError: 'first'` at fit start (`'features.0'` with the whole-backbone handle only)
    module = _Handles()
    prune = _prune(mode="structured")
    _fit(module, prune)
    assert prune.events and module.backbone[0].out_features == 32 and module.backbone[2].out_features == 32
    assert module.first is module.backbone[0] and module.head.in_features == 32
    assert module(torch.randn(3, 16)).shape == (3, 4)


class _HandleAndTie(_Handles):
    """The handles, and `mirror`, another layer holding `backbone.0`'s weight: a tie between two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.mirror = nn.Linear(16, 64)
        self.mirror.weight = self.backbone[0].weight

    def forward(self, x):
        return self.head(self.backbone(x) + self.mirror(x))


def test_a_weight_tied_to_another_module_left_out_names_that_module_not_the_handle(caplog):
    module = _HandleAndTie()
    with caplog.at_level(logging.INFO):
        _fit(module, _prune(exclude_pattern="^mirror$"))
    assert _zeros(module.backbone[0].weight) == 0.0 and module.mirror.weight is module.backbone[0].weight
    assert _zeros(module.backbone[2].weight) == pytest.approx(0.5, abs=0.01)
    assert "backbone.0 (weight shared with mirror.weight, which is not pruned)" in caplog.text
    assert "first.weight" not in caplog.text


class _AllParametrized(_Classifier):
    """An MLP whose every `Linear` computes its weight: weight_norm, spectral_norm, orthogonal, a user's."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.head = (
            nn.Linear(16, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 4),
        )
        parametrizations.weight_norm(self.l0)
        parametrizations.spectral_norm(self.l1)
        parametrizations.orthogonal(self.l2)
        parametrize.register_parametrization(self.head, "weight", nn.Identity())
        self.example_input_array = torch.randn(2, 16)

    def forward(self, x):
        return self.head(torch.relu(self.l2(torch.relu(self.l1(torch.relu(self.l0(x)))))))


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_a_model_whose_every_layer_computes_its_weight_is_told_the_call_that_removes_it(mode):
    # sweep: the refusal called the layers weightless ("ParametrizedLinear has no `weight` parameter") and
    # offered "Choose other `layer_types`", which no type can satisfy
    module = _AllParametrized()
    with pytest.raises(PulseRefusal, match="^ScheduledPrune: no layer of _AllParametrized") as refused:
        _fit(module, _prune(mode=mode))
    said = str(refused.value)
    assert "Choose other `layer_types`" not in said and "has no `weight` parameter" not in said
    removal = "`torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')`"
    assert (
        f"Way out: remove what computes their weight before the fit ({removal} for `l0`, `l1`, `l2` and 1 "
        "more) to prune them or remove ScheduledPrune."
    ) in said
    for layer in (module.l0, module.l1, module.l2, module.head):  # the way out named works
        parametrize.remove_parametrizations(layer, "weight")
    prune = _prune(mode=mode)
    _fit(module, prune)
    assert prune.events and prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.02)


class _ParametrizedAndNorm(_AllParametrized):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.l2(torch.relu(self.l1(torch.relu(self.l0(x))))))))


def test_other_layer_types_are_offered_where_they_would_select_a_layer():
    with pytest.raises(PulseRefusal) as refused:
        _fit(_ParametrizedAndNorm(), _prune())
    assert str(refused.value).endswith("to prune them, choose other `layer_types` or remove ScheduledPrune.")
