"""ScheduledPrune next to Lightning's own ModelPruning callback (a held-out sweep): structured mode is refused
at fit start, and in unstructured mode the fit ends cleanly and folds only ScheduledPrune's own masks."""

from __future__ import annotations

import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import pruning
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

FOLDED_ELSEWHERE = "had already been folded into their weights by another callback"
#: ModelPruning's amount of 0.3 compounds over its three epoch ends
HEAD_ZEROS = 1 - 0.7**3


class _ConvNet(pl.LightningModule):
    """A conv layer (ScheduledPrune's) whose channels feed a Linear head (ModelPruning's)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _NoStepBefore(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        raise AssertionError("a training step ran")


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 4, 4, generator=generator)
    y = torch.randint(0, 4, (64,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _fit(model: _ConvNet, prune: ScheduledPrune, model_pruning: ModelPruning, *extra: Callback) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=3, callbacks=[prune, model_pruning, *extra]))
    trainer.fit(model, _data())


def _prune(**overrides) -> ScheduledPrune:
    settings = {"final_sparsity": 0.5, "start": 2, "end": 8, "every": 1, "probe_batches": 0}
    return ScheduledPrune(layer_types=["Conv2d"], **{**settings, **overrides})


def _model_pruning(model: _ConvNet, **overrides) -> ModelPruning:
    return ModelPruning(
        "l1_unstructured",
        amount=0.3,
        parameters_to_prune=[(model.net[3], "weight")],
        use_lottery_ticket_hypothesis=False,
        verbose=0,
        **overrides,
    )


def _zeros(layer: nn.Module) -> float:
    return float((pruning.effective_weight(layer) == 0).float().mean())


@pytest.mark.parametrize("permanent", [True, False])
def test_structured_mode_is_refused_at_fit_start_next_to_model_pruning(permanent):
    # it crashed mid-run instead: a cut narrowed the input of the head ModelPruning had masked (TypeError)
    model = _ConvNet()
    prune = _prune(mode="structured")
    with pytest.raises(PulseRefusal) as refused:
        _fit(model, prune, _model_pruning(model, make_pruning_permanent=permanent), _NoStepBefore())
    message = str(refused.value)
    assert message.startswith("ScheduledPrune: mode='structured' cannot run next to ModelPruning")
    assert "Use mode='unstructured'" in message and "remove one of the two pruners" in message


def test_fit_ends_cleanly_when_model_pruning_folded_our_masks_first(caplog):
    # ModelPruning.on_train_end folds every prune hook in the model before ScheduledPrune.on_fit_end, whose
    # refresh of the hooks it had found crashed the finished fit: 'Conv2d' object
    # has no attribute 'weight_mask'
    model = _ConvNet()
    prune = _prune()
    with caplog.at_level(logging.INFO):
        _fit(model, prune, _model_pruning(model))  # the way out the refusal names works
    conv, head = model.net[0], model.net[3]
    assert pruning.current_mask(conv) is None and pruning.current_mask(head) is None
    assert prune.finished and prune.events[-1]["target_sparsity"] == pytest.approx(0.5)
    # the fit-end line's sparsity is still the weights' own: the zeros were folded, not lost
    assert _zeros(conv) == pytest.approx(prune.events[-1]["sparsity"]) == pytest.approx(0.5, abs=0.02)
    assert _zeros(head) == pytest.approx(HEAD_ZEROS, abs=0.02)
    assert caplog.text.count(FOLDED_ELSEWHERE) == 1 and "`net.0`" in caplog.text


def test_without_make_permanent_a_mask_folded_elsewhere_is_warned_of_once():
    model = _ConvNet()
    prune = _prune(options={"make_permanent": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(model, prune, _model_pruning(model))
    said = [str(w.message) for w in caught if FOLDED_ELSEWHERE in str(w.message)]
    assert len(said) == 1 and "ModelPruning(make_pruning_permanent=False)" in said[0]
    assert _zeros(model.net[0]) == pytest.approx(0.5, abs=0.02)


def test_fit_end_folds_only_its_own_masks_and_keeps_model_prunings():
    # make_masks_permanent(model) folded every mask in the model: ModelPruning, told to keep its
    # reparametrisation (make_pruning_permanent=False), lost it
    model = _ConvNet()
    prune = _prune()
    _fit(model, prune, _model_pruning(model, make_pruning_permanent=False))
    conv, head = model.net[0], model.net[3]
    assert pruning.current_mask(conv) is None and [n for n, _ in conv.named_parameters()] == [
        "weight",
        "bias",
    ]
    assert _zeros(conv) == pytest.approx(0.5, abs=0.02)
    assert [n for n, _ in head.named_buffers()] == ["weight_mask"]
    assert "weight_orig" in dict(head.named_parameters())
    assert pruning.mask_hook(head) is not None and _zeros(head) == pytest.approx(HEAD_ZEROS, abs=0.02)


def test_fit_end_keeps_model_prunings_bias_masks_on_the_layers_both_prune():
    # sweep: with ModelPruning's default parameters_to_prune (every layer's weight and bias), the fit-end fold
    # removed every prune hook of ScheduledPrune's layers, ModelPruning's bias masks too. The weight has one
    # mask, with both pruners' zeros: folded; the bias, ScheduledPrune's never, keeps its mask
    model = _ConvNet()
    prune = ScheduledPrune(**{"final_sparsity": 0.5, "start": 2, "end": 8, "every": 1, "probe_batches": 0})
    model_pruning = ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=False, verbose=0)
    _fit(model, prune, model_pruning)
    conv, head = model.net[0], model.net[3]
    for layer in (conv, head):
        assert pruning.current_mask(layer) is None and [n for n, _ in layer.named_buffers()] == ["bias_mask"]
        assert [n for n, _ in layer.named_parameters()] == ["weight", "bias_orig"]
        assert float((layer.bias == 0).float().mean()) > 0  # the bias mask still zeroes
    assert _zeros(conv) >= 0.5 and _zeros(head) >= 0.5
