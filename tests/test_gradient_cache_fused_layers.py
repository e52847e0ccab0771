"""GradientCache on layers whose own forward reads their children's parameters, from a sweep: torch's fused
Conv-BN QAT modules (``fuse_modules_qat`` + ``prepare_qat``: ``ConvBnReLU1d`` folds ``bn.weight`` into its
weight) were split into ``bn``/``weight``/``bias`` units, the first ``bn`` was pinned as "read again outside
its own forward", and nothing froze in the run, under a warning about "a tied input and output layer" to
untie with ``tie_word_embeddings=False``."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GradientCache
from tests.conftest import trainer_kwargs


def _cnn(fused: bool) -> nn.Module:
    from torch.ao.quantization import (
        DeQuantStub,
        QuantStub,
        fuse_modules_qat,
        get_default_qat_qconfig,
        prepare_qat,
    )

    net = nn.Sequential(
        QuantStub(),
        nn.Conv1d(1, 8, 3, padding=1),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Conv1d(8, 8, 3, padding=1),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(128, 4),
        DeQuantStub(),
    ).train()
    if fused:
        net = fuse_modules_qat(net, [["1", "2", "3"], ["4", "5", "6"]])
    net.qconfig = get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_qat(net)


class _ConvBn(nn.Module):
    """A user's fused Conv-BN: its forward folds its child's `bn.weight` into its own weight."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels_out, channels_in, 3) * 0.3)
        self.bias = nn.Parameter(torch.zeros(channels_out))
        self.bn = nn.BatchNorm1d(channels_out)

    def forward(self, x):
        scale = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
        folded = F.conv1d(x, self.weight * scale.reshape(-1, 1, 1), padding=1) / scale.reshape(1, -1, 1)
        return self.bn(folded + self.bias.reshape(1, -1, 1))


class _CNN(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x.unsqueeze(1))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit(module: pl.LightningModule, **options) -> tuple[GradientCache, list[str]]:
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = (x @ torch.randn(16, 4)).argmax(1)
    cache = GradientCache(
        threshold=1.0, check_every=4, freeze_for=8, phases=("burst", "replay", "maintain"), **options
    )
    trainer = pl.Trainer(**trainer_kwargs(max_steps=24, callbacks=[cache]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    return cache, [str(w.message) for w in caught if "GradientCache" in str(w.message)]


def _most_frozen(cache: GradientCache) -> int:
    return max((event["to"] for event in cache.events), default=0)


def test_a_fused_conv_bn_qat_cnn_freezes_its_layers_whole_as_the_unfused_one_does():
    # before: units net.1.bn, net.1.weight, net.1.bias, ...: the first pinned, 0 units frozen in the run
    # (the unfused CNN froze up to 6), and a warning to untie "a tied input and output layer"
    unfused, _ = _fit(_CNN(_cnn(fused=False)))
    cache, said = _fit(_CNN(_cnn(fused=True)))
    names = [unit.name for unit in cache._lifecycle.units]
    assert names[:2] == ["net.1", "net.4"], names
    assert _most_frozen(unfused) >= 2 and _most_frozen(cache) == 2  # both conv blocks: all but the head
    assert not [text for text in said if "tie_word_embeddings" in text or "tied input" in text], said


def test_a_users_layer_reading_its_childs_weight_is_named_with_the_way_out_that_freezes_it():
    net = nn.Sequential(_ConvBn(1, 8), nn.ReLU(), _ConvBn(8, 8), nn.ReLU(), nn.Flatten(), nn.Linear(128, 4))
    cache, said = _fit(_CNN(net))
    assert _most_frozen(cache) == 0
    first = [text for text in said if "the first unit in forward order" in text]
    assert first and "the forward of the module holding it, net.0" in first[0], said
    assert "name net.0 as one entry in `units`" in first[0] and "tie_word_embeddings" not in first[0]
    torch.manual_seed(0)
    net = nn.Sequential(_ConvBn(1, 8), nn.ReLU(), _ConvBn(8, 8), nn.ReLU(), nn.Flatten(), nn.Linear(128, 4))
    cache, _ = _fit(_CNN(net), units=["net.0", "net.2", "net.5"])
    assert _most_frozen(cache) == 2
