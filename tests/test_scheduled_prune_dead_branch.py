"""Structured ScheduledPrune on a model with a dead branch: a layer that runs in the forward but whose output
never reaches the model's output (a WaveNet's last residual conv, computed and discarded). torch-pruning
builds its graph from the output's autograd graph, which never reaches that layer: its input channels did not
follow the cut of the layer feeding it, the trial cut failed ("expected input[2, 13, 12] to have 16
channels"), and the fit was refused with no ``exclude_pattern`` offered. Where the ordinary trace's trial cut
fails, the check now traces the dead branches too (only then: a DETR forward discarding its loss traced so ran
past the search's time limit)."""

from __future__ import annotations

import ast
import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.callbacks.scheduled_prune import PruneOptions
from lightning_pulse.core import pruning
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

STEPS = 8


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dil = nn.Conv1d(channels, 2 * channels, 3, padding=1)
        self.res = nn.Conv1d(channels, channels, 1)
        self.skip = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        value, gate = self.dil(x).chunk(2, 1)
        z = torch.tanh(value) * torch.sigmoid(gate)
        return x + self.res(z), self.skip(z)


class _WaveNet(pl.LightningModule):
    """Two gated blocks; only the skips reach the head. ``use_last_residual=False``: the last block's residual
    output is computed and discarded, as WaveNet code does."""

    def __init__(self, use_last_residual: bool = False) -> None:
        super().__init__()
        self.use_last_residual = use_last_residual
        self.inp = nn.Conv1d(3, 16, 1)
        self.blocks = nn.ModuleList([_Block(16), _Block(16)])
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, s = self.inp(x), 0
        for block in self.blocks:
            h, k = block(h)
            s = s + k
        return self.out(F.relu(s + h if self.use_last_residual else s).mean(-1))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(80, 3, 12, generator=generator)  # 5 batches an epoch: step 5 ends one, between the events
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (80,), generator=generator)), batch_size=16)


def _prune(exclude_pattern: str | None = None) -> ScheduledPrune:
    options = PruneOptions(cadence="steps")
    return ScheduledPrune(
        final_sparsity=0.5,
        mode="structured",
        start=2,
        end=6,
        every=2,
        probe_batches=0,
        exclude_pattern=exclude_pattern,
        options=options,
    )


def test_only_a_trace_asked_to_reaches_a_dead_branch_and_a_model_without_one_traces_as_it_was():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12)
    model = _WaveNet()
    assert pruning.dead_branch_layers(model, x) == ["blocks.1.res"]
    ordinary = pruning.build_dependency_graph(model, x)
    # the ordinary trace never sees the discarded residual's conv: a cut of `blocks.1.dil` leaves its input
    assert model.blocks[1].res not in ordinary.module2node and ordinary.dead_branches == []
    graph = pruning.build_dependency_graph(model, x, dead_branches=True)
    # traced when asked: the conv is in the graph, fed by the gated output it reads
    assert model.blocks[1].res in graph.module2node and graph.dead_branches == ["blocks.1.res"]
    used = _WaveNet(use_last_residual=True)
    assert pruning.dead_branch_layers(used, x) == []
    assert pruning.build_dependency_graph(used, x, dead_branches=True).dead_branches == []


def test_a_wavenet_discarding_its_last_residual_prunes_resumes_and_loads(tmp_path):
    torch.manual_seed(0)
    module, prune = _WaveNet(), _prune()
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=STEPS, callbacks=[prune, saving], enable_checkpointing=True)
    )
    trainer.fit(module, _data())
    assert trainer.global_step == STEPS and prune.pruner.trace_dead_branches
    assert [e["step"] for e in prune.events if e["sparsity"] > 0] == [4, 6]
    # the gated layers lost half their value/gate pairs; the dead `res` lost the same inputs
    for block in module.blocks:
        assert (
            block.dil.weight.shape[0] == 16 and block.res.weight.shape[1] == block.skip.weight.shape[1] == 8
        )
    # the discarded residual output keeps its width (a dead output's channels are never cut), so does `inp`
    assert module.blocks[1].res.weight.shape[0] == 16 and module.inp.weight.shape[0] == 16

    # resumed between the two events into a fresh module: the second event cuts as the uninterrupted run did
    middle = tmp_path / "epoch=0-step=5.ckpt"
    resumed, resume = _WaveNet(), _prune()
    pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[resume])).fit(resumed, _data(), ckpt_path=middle)
    assert (
        resume.events[-1]["step"] == 6 and resume.events[-1]["sparsity"] > resume.events[-2]["sparsity"] > 0
    )
    uninterrupted, again = module.state_dict(), resumed.state_dict()
    assert uninterrupted.keys() == again.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(value, again[key]), key

    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)
    fresh = ScheduledPrune.load_pruned(_WaveNet(), path).eval()
    x = torch.randn(4, 3, 12)
    with torch.no_grad():
        assert torch.equal(fresh(x), module.eval()(x))


class _WaveNetReadingSixteenSkipChannels(_WaveNet):
    """The head reads the skip sum as 16 channels by a fixed reshape: no cut of the skips runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, s = self.inp(x), 0
        for block in self.blocks:
            h, k = block(h)
            s = s + k
        return self.out(F.relu(s).reshape(s.shape[0], 16, -1).mean(-1))


def test_a_failing_cut_on_a_dead_branch_model_names_it_and_offers_a_pattern_checked_so_that_trains():
    torch.manual_seed(0)
    with pytest.raises(PulseRefusal) as refusal:
        pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[_prune()])).fit(
            _WaveNetReadingSixteenSkipChannels(), _data()
        )
    message = str(refusal.value)
    assert "shape '[2, 16, -1]' is invalid" in message
    assert f"{pruning.DEAD_BRANCHES_CHECKED}: blocks.1.res" in message
    offered = re.search(r"with `exclude_pattern`=('[^']+') the trial cut passes", message)
    assert offered is not None
    # the pattern offered was checked with the dead branch traced: the fit with it cuts and trains
    module, prune = _WaveNetReadingSixteenSkipChannels(), _prune(ast.literal_eval(offered.group(1)))
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[prune]))
    trainer.fit(module, _data())
    assert trainer.global_step == STEPS and prune.events[-1]["sparsity"] > 0
    assert module.blocks[1].res.weight.shape[1] == module.blocks[1].dil.weight.shape[0] // 2 < 16
