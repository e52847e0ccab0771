"""ScheduledPrune and a parametrization the module registers on a chosen layer mid-run (``weight_norm``,
``spectral_norm``, ``orthogonal``). Registered before the fit, such a layer is left out and named at setup;
registered mid-run, structured events stopped cutting it (or the layer feeding it) with nothing said: the run
ended at 0.391 of ``final_sparsity=0.5``, every later event reported ``uncut_layers=[]`` and
``ScheduledPrune.sparsity`` read 0.5 (a sweep of the user's own surgery). Each event now makes the fit-start
check again: the layers it can no longer prune are named in ``uncut_layers`` and ``left_out_layers``, warned
of once with the reason and the way out, and the sparsity reported is the one reached."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PruneOptions, ScheduledPrune
from tests.conftest import trainer_kwargs

LEFT_OUT = "chosen at fit start could no longer be pruned"


class _Net(pl.LightningModule):
    """An MLP that parametrizes ``target`` (``head`` or ``backbone.2``) at the start of epoch ``at``."""

    def __init__(self, at: int, target: str, parametrize=parametrizations.weight_norm) -> None:
        super().__init__()
        self.at, self.target, self.parametrize = at, target, parametrize
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.example_input_array = torch.zeros(2, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return F.cross_entropy(self(inputs), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == self.at:
            self.parametrize(self.get_submodule(self.target))
            self.trainer.strategy.setup_optimizers(self.trainer)  # new parameters: a new optimizer


def _fit(model: pl.LightningModule, mode: str, tmp_path) -> tuple[ScheduledPrune, list[str]]:
    pl.seed_everything(0)
    inputs = torch.randn(128, 16, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(inputs, inputs[:, :4].argmax(1)), batch_size=16)
    prune = ScheduledPrune(
        final_sparsity=0.5, mode=mode, start=4, end=36, every=8, probe_batches=0,
        options=PruneOptions(cadence="steps"),
    )  # fmt: skip
    trainer = pl.Trainer(max_epochs=5, callbacks=[prune], **trainer_kwargs(default_root_dir=tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    return prune, [str(w.message) for w in caught if str(w.message).startswith("ScheduledPrune")]


@pytest.mark.parametrize(
    "target, parametrize, left_out, because_of",
    [
        ("head", parametrizations.weight_norm, ["backbone.2"], "it is cut with head"),
        (
            "backbone.2",
            parametrizations.spectral_norm,
            ["backbone.2", "backbone.0"],
            "it is cut with backbone.2",
        ),
        (
            "backbone.2",
            parametrizations.orthogonal,
            ["backbone.2", "backbone.0"],
            "it is cut with backbone.2",
        ),
    ],
)
def test_a_parametrization_registered_mid_run_is_named_at_each_event_and_the_sparsity_reached_is_said(
    target, parametrize, left_out, because_of, tmp_path
):
    prune, said = _fit(_Net(at=2, target=target, parametrize=parametrize), "structured", tmp_path)
    first, *later = prune.events  # the first at step 12, before the parametrization (epoch 2 starts at 16)
    assert first["uncut_layers"] == ["head"] and not first.get("left_out_layers")
    for event in later:  # each event names what it could not cut, cut before or chosen at fit start
        assert set(left_out) <= set(event["uncut_layers"])  # it was []: nothing said uncut
        assert sorted(event["left_out_layers"]) == sorted(left_out)
    reached = prune.events[-1]["sparsity"]
    assert reached < 0.45 and prune.sparsity == pytest.approx(reached)  # it read the target, 0.5
    warned = [text for text in said if LEFT_OUT in text]
    assert len(warned) == 1 and "at the event of step 20" in warned[0]  # once, at the first event after it
    assert because_of in warned[0] and f"remove_parametrizations(layer, 'weight')` for {target}" in warned[0]
    assert "Way out: make that change before the fit" in warned[0]
    ended = [text for text in said if "the fit ended short of `final_sparsity`=0.5" in text]
    assert len(ended) == 1 and f"at sparsity {reached:.3f}" in ended[0]


def test_unstructured_names_a_layer_parametrized_before_its_first_mask(tmp_path):
    # the layer was left out of the masks silently; the event's sparsity counts the layers it masks
    prune, said = _fit(_Net(at=1, target="backbone.2"), "unstructured", tmp_path)
    for event in prune.events:
        assert event["uncut_layers"] == ["backbone.2"]  # it was []: left out with nothing said
        assert event["left_out_layers"] == ["backbone.2"]
        assert "backbone.2" not in event["layer_sparsity"]
    assert prune.sparsity == pytest.approx(0.5)
    warned = [text for text in said if LEFT_OUT in text]
    assert len(warned) == 1 and "at the event of step 12" in warned[0]
    assert "backbone.2: its weight is computed by a parametrization" in warned[0]
    assert "counts the other layers only" in warned[0]
