"""Structured pruning of pre-norm residual language models (held-out sweep): the residual width, which an
embedding table sets, is kept unless the embedding is chosen; and the event's record says what a cut really
removed: every chosen layer whose output channels went counts as cut, and the share of the whole model's
parameters removed so far is stated."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import pruning
from tests.conftest import trainer_kwargs


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = (
            nn.LayerNorm(width),
            nn.Linear(width, 4 * width),
            nn.Linear(4 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class _ResidualLM(nn.Module):
    """Embedding -> two pre-norm residual MLP blocks -> LayerNorm -> an untied head; ``stem``: a Linear on
    float features in the embedding's place (a residual stream that a chosen layer sets)."""

    def __init__(self, vocab: int = 64, width: int = 32, stem: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(vocab, width) if stem else nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([_Block(width), _Block(width)])
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def _params(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def test_an_unchosen_embedding_keeps_the_residual_width_and_the_feed_forward_width_is_cut():
    # held-out sweep: the default layer types cut the residual width through the embedding (64x32 -> 64x16,
    # every LayerNorm, the head's inputs): 69% of the parameters, reported as 3 layers cut
    model = _ResidualLM()
    outcome = pruning.Pruner(mode="structured").prune(model, 0.5, (), torch.randint(0, 64, (2, 8)))
    assert tuple(model.inp.weight.shape) == (64, 32) and tuple(model.ln.weight.shape) == (32,)
    assert model.head.in_features == 32
    for block in model.blocks:
        assert block.fc1.out_features == 64 and tuple(block.fc2.weight.shape) == (32, 64)
    assert outcome.layer_sparsity == {"blocks.0.fc1": 0.5, "blocks.1.fc1": 0.5}
    assert outcome.narrowed == ["blocks.0.fc2", "blocks.1.fc2"]  # their input columns only


def test_a_chosen_embedding_is_cut_as_asked_and_every_layer_whose_outputs_went_is_reported_cut():
    # the embedding chosen (layer_types=None): the residual width is cut, and the blocks' output layers, cut
    # within another layer's group, were said "narrowed only by another layer's cut"
    model = _ResidualLM()
    before = _params(model)
    outcome = pruning.Pruner(mode="structured", layer_types=None).prune(
        model, 0.5, (), torch.randint(0, 64, (2, 8))
    )
    assert tuple(model.inp.weight.shape) == (64, 16) and model.blocks[0].fc2.out_features == 16
    assert outcome.layer_sparsity == {
        name: 0.5 for name in ("inp", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2")
    }
    assert outcome.uncut == outcome.narrowed == ["head"]
    assert outcome.removed_share == pytest.approx(1 - _params(model) / before)
    line = pruning.event_summary(pruning.event_record(1, 0.5, outcome, model))
    assert (
        f"over 5 layers holding 88% of the model's weights ({outcome.removed_share:.0%} of the model's "
        in line
    )
    assert "69% of the model's parameters removed so far" in line


def test_the_writers_of_a_residual_stream_a_linear_sets_are_reported_cut_at_each_event_from_their_originals():
    # default layer types: `inp` or a block's fc2 leads the residual group, the others are cut within it
    model = _ResidualLM(stem=True)
    before, example = _params(model), torch.randn(2, 8, 64)
    pruner = pruning.Pruner(mode="structured")
    first = pruner.prune(model, 0.25, (), example)
    assert set(first.layer_sparsity) == {
        "inp",
        "blocks.0.fc1",
        "blocks.0.fc2",
        "blocks.1.fc1",
        "blocks.1.fc2",
    }
    assert set(first.layer_sparsity.values()) == {0.25} and first.uncut == ["head"]
    state = pruner.state_dict()
    resumed = pruning.Pruner(mode="structured")
    resumed.load_state_dict(state)
    second = resumed.prune(model, 0.5, (), example)
    assert model.inp.out_features == 16 and model.blocks[1].fc2.out_features == 16
    assert set(second.layer_sparsity.values()) == {0.5} and second.sparsity == 0.5
    assert second.removed_share == pytest.approx(1 - _params(model) / before)
    # a checkpoint from before the model's size was kept: the share is unknown, and not said
    old = {key: value for key, value in state.items() if key not in ("layer_channels", "original_params")}
    unknown = pruning.Pruner(mode="structured")
    unknown.load_state_dict(old)
    outcome = unknown.prune(model, 0.5, (), example)
    assert outcome.removed_share is None
    assert "removed so far" not in pruning.event_summary(pruning.event_record(2, 0.5, outcome, model))


def test_a_resume_from_a_checkpoint_without_the_widths_reports_no_layer_below_its_true_cut():
    # a review: from a checkpoint saved before the widths were kept, a layer cut within another's group had
    # its width at the resume taken for its original, so a later event reported 0.333 for a layer cut by half
    # and 0.476 overall for 0.5; such layers are named narrowed now, as before, and no figure is wrong
    model, example = _ResidualLM(stem=True), torch.randn(2, 8, 64)
    first = pruning.Pruner(mode="structured")
    first.prune(model, 0.25, (), example)
    old = {k: v for k, v in first.state_dict().items() if k not in ("layer_channels", "original_params")}
    resumed = pruning.Pruner(mode="structured")
    resumed.load_state_dict(old)
    outcome = resumed.prune(model, 0.5, (), example)
    assert model.inp.out_features == 16 and model.blocks[1].fc2.out_features == 16  # every writer at 0.5
    assert outcome.layer_sparsity and set(outcome.layer_sparsity.values()) == {0.5}
    assert outcome.sparsity == 0.5


def test_an_unstructured_event_states_the_share_of_the_model_it_masked():
    model = _ResidualLM()
    outcome = pruning.Pruner().prune(model, 0.5)
    masked = sum(int((layer.weight_mask == 0).sum()) for layer in pruning.Pruner().layers(model).values())
    assert (
        outcome.removed_share == pytest.approx(masked / _params(model)) and 0.3 < outcome.removed_share < 0.5
    )
    assert pruning.event_metrics(pruning.event_record(1, 0.5, outcome, model))[
        "prune/params_removed_share"
    ] == pytest.approx(outcome.removed_share)


class _NeoXLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPTNeoXConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            rotary_pct=0.25,
            max_position_embeddings=32,
        )
        self.model = transformers.GPTNeoXForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        logits = self(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_gpt_neox_at_default_settings_keeps_its_residual_width_and_cuts_its_mlp_widths(caplog):
    # held-out sweep: the event said "sparsity 0.500 over 3 layers holding 29% of the model's weights" while
    # the embedding, every LayerNorm and the head's inputs were halved too: 59% of the parameters gone
    module = _NeoXLM()
    neox, before = module.model.gpt_neox, _params(module)
    ids = torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(0))
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=1, end=3, every=1, probe_batches=0)
    with caplog.at_level("INFO"):
        pl.Trainer(max_steps=5, callbacks=[prune], **trainer_kwargs()).fit(
            module, DataLoader(TensorDataset(ids), batch_size=16)
        )
    assert tuple(neox.embed_in.weight.shape) == (64, 32) and tuple(neox.final_layer_norm.weight.shape) == (
        32,
    )
    assert tuple(module.model.lm_head.weight.shape) == (64, 32)
    for layer in neox.layers:
        assert layer.mlp.dense_h_to_4h.out_features == 32 and tuple(layer.mlp.dense_4h_to_h.weight.shape) == (
            32,
            32,
        )
        assert layer.attention.dense.out_features == 32
    event = prune.events[-1]
    assert event["params_removed_share"] == pytest.approx(1 - _params(module) / before)
    assert f"({event['params_removed_share']:.0%} of the model's parameters removed so far)" in caplog.text


class _SharedDepth(pl.LightningModule):
    """One residual MLP block applied three times (weights shared across depth, as ALBERT shares its
    layer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        self.block = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(3):
            h = h + self.block(h)
        return self.out(h)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_block_applied_at_several_depths_is_refused_naming_the_repeated_calls_and_a_way_out_that_applies():
    # held-out sweep: the refusal said only "no channel group of the selected layers can be cut safely" and
    # offered a `forward`, an `example_input_array` or a narrower `layer_types`, none of which applies
    from lightning_pulse.errors import PulseRefusal

    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    prune = ScheduledPrune(
        final_sparsity=0.5,
        mode="structured",
        start=2,
        end=4,
        every=1,
        probe_batches=0,
        exclude_pattern="^inp$",
    )
    with pytest.raises(PulseRefusal, match="called more than once per forward") as refused:
        pl.Trainer(max_steps=6, callbacks=[prune], **trainer_kwargs()).fit(_SharedDepth(), data)
    message = str(refused.value)
    assert "(block.1 x3, block.3 x3)" in message and "give each call its own module" in message
    assert "give the module a `forward`" not in message and prune.events == []
