"""ScheduledPrune(mode="structured") next to a head that ``training_step`` calls and ``forward`` does not.

A held-out sweep: an auxiliary head fed the backbone's output in ``training_step`` crashed mid-run at its
first call after the first cut with a bare torch shape error (``mat1 and mat2 shapes cannot be multiplied``,
at step 12; at step 32 when its loss joined at epoch 2): the cuts follow the trace of ``forward``, which never
calls it, so nothing narrows its inputs.
"""

from __future__ import annotations

import ast
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_pulse import ScheduledPrune
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


class AuxiliaryHead(pl.LightningModule):
    """A backbone and its head in ``forward``; ``aux_head`` adds its loss in ``training_step`` from optimizer
    step ``aux_from`` on, read from the backbone's output (``features``, or ``detached``) or the logits."""

    def __init__(self, aux_from: int = 0, reads: str = "features") -> None:
        super().__init__()
        self.aux_from, self.reads = aux_from, reads
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)
        self.aux_head = nn.Linear(3 if reads == "logits" else 16, 3)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        features = self.backbone(x)
        logits = self.head(features)
        loss = nn.functional.cross_entropy(logits, y)
        if self.global_step >= self.aux_from:
            read = {"features": features, "detached": features.detach(), "logits": logits}[self.reads]
            loss = loss + 0.3 * nn.functional.cross_entropy(self.aux_head(read), y)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, :3].argmax(1))), batch_size=16)


def _fit(model: pl.LightningModule, **prune_kwargs) -> ScheduledPrune:
    prune = ScheduledPrune(
        mode="structured", final_sparsity=0.5, start=2, end=6, every=1, probe_batches=0, **prune_kwargs
    )
    pl.Trainer(max_steps=10, callbacks=[prune], **trainer_kwargs()).fit(model, _data())
    return prune


def test_a_training_step_head_on_cut_features_is_refused_before_any_cut_and_the_way_out_trains():
    torch.manual_seed(0)
    model = AuxiliaryHead(aux_from=0)
    with pytest.raises(PulseRefusal) as refused:
        _fit(model)
    message = str(refused.value)
    assert message.startswith("ScheduledPrune: structured pruning cannot run on this model: `aux_head`")
    assert "outside `forward`" in message and "reads the output of `backbone.2`" in message
    assert "before any cut" in message and "mode='unstructured'" in message
    # refused at the first step, the model as it came: uncut, and without the callback's hooks
    assert model.global_step == 0 and tuple(model.backbone[2].weight.shape) == (16, 16)
    assert not model.aux_head._forward_pre_hooks
    # the exclusion offered trains: backbone.0's channels are cut, the width aux_head reads is kept
    pattern = ast.literal_eval(re.search(r"`exclude_pattern`=('[^']+')", message).group(1))
    torch.manual_seed(0)
    model = AuxiliaryHead(aux_from=0)
    prune = _fit(model, exclude_pattern=pattern)
    assert len(prune.events) == 4 and model.backbone[0].out_features == 8
    assert model.backbone[2].out_features == 16 and model.aux_head.in_features == 16


@pytest.mark.parametrize(
    ("reads", "why"),
    [
        ("features", "reads the output of `backbone.2`"),
        ("detached", "is called on inputs 8 wide where it takes 16"),
    ],
)
def test_a_head_switched_on_after_the_cuts_is_foretold_after_the_first_step_and_stops_the_run_naming_itself(
    reads, why
):
    # its loss joins at step 7, after the cut to 0.5 at step 6: nothing of it runs in the first step
    torch.manual_seed(0)
    model = AuxiliaryHead(aux_from=7, reads=reads)
    with pytest.warns(
        UserWarning, match="`aux_head` holds trainable parameters that `forward` does not call"
    ):
        with pytest.raises(PulseRefusal, match="ScheduledPrune: structured pruning cannot run") as refused:
            _fit(model)
    message = str(refused.value)
    assert why in message and "The model is already cut" in message and model.global_step == 7
    assert not model.aux_head._forward_pre_hooks


def test_a_head_called_only_in_training_step_on_the_logits_trains_with_the_cuts_and_no_warning():
    # the logits are never cut: a reader of theirs outside `forward` is no reason to stop, nor to warn
    torch.manual_seed(0)
    model = AuxiliaryHead(aux_from=0, reads="logits")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prune = _fit(model)
    assert not [w for w in caught if "does not call" in str(w.message)]
    assert len(prune.events) == 4 and model.backbone[2].out_features == 8
    assert not model.aux_head._forward_pre_hooks
