"""ScheduledPrune(mode="structured") on the models of a held-out sweep: a gated MLP whose Linear output is
split with ``chunk(2, dim=-1)``, a Hugging Face causal LM that returns its key/value cache, and the usual
Hugging Face wrapper ``forward(self, **inputs)`` fed dict batches."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_pulse.core import prune_targets, pruning
from lightning_pulse.core.pruning import UNTRACEABLE_OUTPUT
from lightning_pulse.errors import PulseRefusal
from tests.clients import HFSequenceClassifier, TextWindowsDataModule
from tests.conftest import trainer_kwargs
from tests.test_real_models_scheduled_prune import STEPS, _count_training_steps, _fit, _prune


# ----------------------------------------------------------------------------------------------
# forward(**inputs)
class _AnyKeywords(nn.Module):
    def forward(self, **inputs):
        return inputs


class _AnyArguments(nn.Module):
    def forward(self, *args, **kwargs):
        return args


def test_a_forward_taking_only_keywords_gets_every_entry_of_a_dict_batch_by_name():
    ids, mask, labels = torch.ones(4, 3), torch.zeros(4, 3), torch.zeros(4)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    # held-out sweep: `input_ids` went in by position (a TypeError), other batches were refused outright
    assert prune_targets.example_from_batch(_AnyKeywords(), batch) == batch
    pixels = {"pixel_values": ids, "labels": labels}
    assert prune_targets.example_from_batch(_AnyKeywords(), pixels) == pixels
    # `forward(*args, **kwargs)` keeps taking the batch's input by position
    assert prune_targets.example_from_batch(_AnyArguments(), batch) == (ids,)


class _WrappedSequenceClassifier(HFSequenceClassifier):
    """The usual wrapper of a Hugging Face model: every batch entry goes through by name."""

    def forward(self, **inputs):
        return self.model(**inputs)


def test_the_usual_hf_wrapper_forward_of_keywords_is_traced_from_the_dict_batch_and_cut():
    module, data = _WrappedSequenceClassifier(), TextWindowsDataModule("classify")
    prune = _prune(mode="structured", exclude_pattern=r"attention|pooler|classifier|output")
    assert _fit(module, data, prune).global_step == STEPS
    for layer in module.model.bert.encoder.layer:
        assert layer.intermediate.dense.out_features == 32 and layer.output.dense.in_features == 32
    assert set(prune.pruner.example_inputs) == {"input_ids", "attention_mask", "labels"}


# ---------------------------------------------------------------------------------------------- an output
# cache
class _TinyQwen2(pl.LightningModule):
    """Hugging Face Qwen2 (tied embeddings) from a config; its forward returns the model's whole output."""

    def __init__(self, use_cache: bool) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            use_cache=use_cache,
        )
        self.model = Qwen2ForCausalLM(config)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _token_dicts():
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=8)


def test_an_output_holding_a_key_value_cache_is_refused_naming_it_and_use_cache_and_the_way_out_trains():
    # held-out sweep: the refusal quoted "'tuple' object has no attribute 'grad_fn'" and blamed model.lm_head,
    # a layer the callback had left out, with an `exclude_pattern` that could not help
    module = _TinyQwen2(use_cache=True)
    calls = _count_training_steps(module)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[_prune(mode="structured")]))
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(module, _token_dicts())
    message = str(refusal.value)
    assert message.startswith(
        f"ScheduledPrune: structured pruning cannot run on this model: {UNTRACEABLE_OUTPUT}"
    )
    assert "DynamicCache at `output.cache`" in message and "`model.config.use_cache = False`" in message
    assert "lm_head" not in message and "exclude_pattern" not in message and "grad_fn" not in message
    assert calls == [] and trainer.global_step == 0
    # the way out it names
    prune = _prune(mode="structured", exclude_pattern="self_attn")
    assert _fit(_TinyQwen2(use_cache=False), _token_dicts(), prune).global_step == STEPS
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------- gated layers
class _GatedLinear(nn.Module):
    """ModernBERT's MLP: one Linear gives the value and the gate, split with ``chunk(2, dim=-1)``."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.Wi, self.Wo = nn.Linear(width, 2 * hidden), nn.Linear(hidden, width)

    def forward(self, x):
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(nn.functional.gelu(value) * gate)


class _GatedConv(nn.Module):
    """A gated convolution: one conv gives the value and the gate, split with ``chunk(2, dim=1)``."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.Wi, self.Wo = nn.Conv1d(width, 2 * hidden, 3, padding=1), nn.Conv1d(hidden, width, 1)

    def forward(self, x):
        value, gate = self.Wi(x).chunk(2, dim=1)
        return self.Wo(torch.tanh(value) * torch.sigmoid(gate))


class _GatedClassifier(pl.LightningModule):
    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.conv = conv
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 3)
        self.mlp = _GatedConv() if conv else _GatedLinear()

    def forward(self, x):
        h = self.inp(x)
        if self.conv:  # eight positions of 16 channels
            h = h[:, :, None].expand(-1, -1, 8)
            return self.out((h + self.mlp(h)).mean(-1))
        return self.out(h + self.mlp(h))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _three_classes():
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


@pytest.mark.parametrize("conv", [False, True], ids=["linear-chunk-last-dim", "conv-chunk-dim-1"])
def test_a_gated_layer_split_with_chunk_is_cut_to_the_sparsity_asked_and_its_reader_is_named_narrowed(conv):
    # held-out sweep: ModernBERT's Wi -> chunk(2, dim=-1) -> gelu(a) * g -> Wo was cut in pairs, each level
    # twice the channels asked for (a target of 0.401 removed 70%, final_sparsity 0.5 ended at 0.711); a gated
    # convolution was the same, and a level of 0.5 or more was refused. Its reader Wo was said "left uncut".
    module = _GatedClassifier(conv)
    prune = _prune(mode="structured", exclude_pattern="^inp$|^out$")
    assert _fit(module, _three_classes(), prune).global_step == STEPS
    for event in prune.events:  # every level as asked, up to one channel pair's rounding
        assert abs(event["sparsity"] - event["target_sparsity"]) <= 1 / 32 + 1e-9
    assert prune.events[-1]["sparsity"] == 0.5
    wi, wo = module.mlp.Wi.weight, module.mlp.Wo.weight
    assert wi.shape[0] == 32 and wo.shape[1] == 16  # half of the 32 value/gate pairs, both halves of each
    if conv:  # its output channels are cut too (the trace sees no residual coupling through the expand)
        return
    # Wo leads no group it can cut (the residual ties its outputs to `inp`), and its inputs are cut with Wi's
    assert prune.events[-1]["uncut_layers"] == prune.events[-1]["narrowed_layers"] == ["mlp.Wo"]
    line = pruning.event_summary(prune.events[-1])
    assert "left uncut" not in line and line.endswith(
        "narrowed only by another layer's cut (no channel group of theirs can be cut safely; compare their "
        "shapes): mlp.Wo"
    )


def test_tied_channels_are_removed_a_class_at_a_time_so_the_count_is_the_one_asked():
    model = _GatedLinear(16, 8)
    graph = pruning.build_dependency_graph(model, torch.randn(2, 16))
    assert pruning.tied_channels(graph, model.Wi, 16) == 2 and pruning.tied_channels(graph, model.Wo, 16) == 1
    importances = {"a": torch.tensor([4.0, 1.0, 3.0, 2.0]), "b": torch.tensor([0.5, 5.0, 6.0, 7.0, 8.0])}
    # "a": 4 classes of 2 channels of 8; 0.5 of them is 4 channels, two classes
    removals = pruning.channels_to_remove(importances, {"a": 8, "b": 5}, 0.5, "layer", tied={"a": 2})
    assert removals == {"a": [1, 3], "b": [0, 1]}
    # global: 13 channels, keep 7 (round half up of 6.5), so 6 go: b's 0.5 (one), a's 1.0 and 2.0 (two each),
    # then a 2-channel class would overshoot the one left, so b's 5.0
    removals = pruning.channels_to_remove(importances, {"a": 8, "b": 5}, 0.5, "global", tied={"a": 2})
    assert removals == {"a": [1, 3], "b": [0, 1]}


def test_what_in_an_output_the_trace_cannot_follow_is_named_with_where_it_is():
    tensor = torch.zeros(2)
    assert prune_targets.untraceable_output({"logits": tensor, "hidden": (tensor, [tensor])}) is None
    assert prune_targets.untraceable_output((tensor, None)) == "None at `output[1]`"
    assert prune_targets.untraceable_output({"a": [tensor, 3]}) == "an int at `output.a[1]`"
    assert prune_targets.untraceable_output({"cache": object()}) == "an object at `output.cache`"
