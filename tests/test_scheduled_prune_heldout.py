"""ScheduledPrune on the models of a held-out sweep: in structured mode a gated MLP whose Linear output is
split with ``chunk(2, dim=-1)``, a Hugging Face causal LM that returns its key/value cache, the usual Hugging
Face wrapper ``forward(self, **inputs)`` fed dict batches; in both modes an EMA of the weights kept as
buffers; in unstructured mode a max-norm constraint written to ``layer.weight``, and ``load_pruned``'s
``layer.weight``."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import prune_targets, pruning
from lightning_pulse.core.pruning import UNTRACEABLE_OUTPUT
from lightning_pulse.errors import PulseRefusal
from tests.clients import HFSequenceClassifier, TextWindowsDataModule
from tests.conftest import trainer_kwargs
from tests.test_real_models_scheduled_prune import STEPS, _count_training_steps, _fit, _prune


# ---------------------------------------------------------------------------------------- forward(**inputs)
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


# ------------------------------------------------------------------------------------------ an output cache
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


def _structured_refusal(module: pl.LightningModule, data: Any) -> tuple[str, list, pl.Trainer]:
    """The refusal a structured ScheduledPrune fit of ``module`` raises, the training steps it ran, and the
    trainer."""
    calls = _count_training_steps(module)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[_prune(mode="structured")]))
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(module, data)
    return str(refusal.value), calls, trainer


def _token_dicts():
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=8)


def test_an_output_holding_a_key_value_cache_is_refused_naming_it_and_use_cache_and_the_way_out_trains():
    # held-out sweep: the refusal quoted "'tuple' object has no attribute 'grad_fn'" and blamed model.lm_head,
    # a layer the callback had left out, with an `exclude_pattern` that could not help
    module = _TinyQwen2(use_cache=True)
    message, calls, trainer = _structured_refusal(module, _token_dicts())
    assert message.startswith(
        f"ScheduledPrune: structured pruning cannot run on this model: {UNTRACEABLE_OUTPUT}"
    )
    assert "DynamicCache at `output." in message and "`use_cache=False`" in message
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


@pytest.mark.parametrize("conv", [False, True], ids=["linear-chunk-last-dim", "conv-chunk-dim-1"])
def test_a_gated_layer_cut_over_several_events_loads_and_resumes_with_the_outputs_of_the_fit(
    conv, tmp_path, monkeypatch
):
    # held-out sweep: a WaveNet's gated `conv(x).chunk(2, 1)` cut over several events saved a checkpoint that
    # neither load_pruned nor fit(ckpt_path=...) could load (torch's bare "size mismatch ... [16, 16, 2] from
    # checkpoint, [11, 16, 2]"): the replay traced one graph for every event, whose split offsets were those
    # of the uncut widths, so the second event's pairs took other channels. One event loaded.
    torch.manual_seed(0)
    module = _GatedClassifier(conv)
    prune = _prune(mode="structured", exclude_pattern="^inp$|^out$")
    trainer = _fit(module, _three_classes(), prune)
    assert len([e for e in prune.events if e["sparsity"] > 0]) >= 2 and module.mlp.Wi.weight.shape[0] == 32
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    x = torch.randn(4, 8)
    module.eval()
    # the replay itself gives the saved shapes: no fallback to the widths read from them
    monkeypatch.setattr(pruning.prune_widths, "fit_widths", lambda *args: pytest.fail("replay fell back"))
    fresh = ScheduledPrune.load_pruned(_GatedClassifier(conv), path).eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), module(x))
    resumed = _GatedClassifier(conv)
    resume = _prune(mode="structured", exclude_pattern="^inp$|^out$")
    pl.Trainer(**trainer_kwargs(max_steps=STEPS, limit_val_batches=0, callbacks=[resume])).fit(
        resumed, _three_classes(), ckpt_path=path
    )
    with torch.no_grad():  # nothing left to train: the resume restored the fit's model
        assert torch.equal(resumed.eval()(x), module(x))


def _without_event_counts(value: Any) -> Any:
    """A checkpoint as saved before the events' entries were counted apart (no ``history_events``)."""
    if isinstance(value, dict):
        return {key: _without_event_counts(item) for key, item in value.items() if key != "history_events"}
    return value


def test_a_run_resumed_from_a_checkpoint_without_event_counts_saves_one_that_loads(tmp_path):
    # a review: an older checkpoint of a gated model (its events' entries merged into one) resumed past another
    # event saved history_events [merged, new]; the merged entries replayed on one graph gave other widths and
    # the next event's trace failed inside the model's forward (torch's bare "The size of tensor a (7) must
    # match the size of tensor b (6)"), so that checkpoint neither loaded nor resumed
    torch.manual_seed(0)
    module = _GatedClassifier(True)
    prune = _prune(mode="structured", exclude_pattern="^inp$|^out$")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=16, limit_val_batches=0, callbacks=[prune]))
    trainer.fit(module, _three_classes())  # the events at 10 and 15
    assert len([e for e in prune.events if e["sparsity"] > 0]) == 2
    old = tmp_path / "old.ckpt"
    trainer.save_checkpoint(old)
    torch.save(_without_event_counts(torch.load(old, weights_only=False)), old)
    resumed, resume = _GatedClassifier(True), _prune(mode="structured", exclude_pattern="^inp$|^out$")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, limit_val_batches=0, callbacks=[resume]))
    trainer.fit(resumed, _three_classes(), ckpt_path=old)  # the event at 20 cuts again
    assert resume.events[-1]["step"] >= 20
    path = tmp_path / "new.ckpt"
    trainer.save_checkpoint(path)
    x = torch.randn(4, 8)
    fresh = ScheduledPrune.load_pruned(_GatedClassifier(True), path).eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), resumed.eval()(x))


class _LastMeans(nn.Module):
    """Keeps the last batch's feature means (empty before the first), resized on load to the saved shape."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(0))

    def forward(self, x):
        if self.training:
            self.last = x.detach().mean(0)
        return x

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "last" in state_dict:
            self.last = torch.empty_like(state_dict[prefix + "last"])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _MeansThenMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.means = _LastMeans()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        return self.net(self.means(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_buffer_its_module_resizes_on_load_does_not_stop_a_replayed_checkpoint_from_loading(tmp_path):
    # a review: after a full replay, a shape left different only by such a buffer sent the load to the widths
    # read from the saved shapes, which cannot set a buffer's: "the channel removals the checkpoint records
    # cannot be replayed on this module" for a replay that was right
    torch.manual_seed(0)
    module, prune = _MeansThenMLP(), _prune(mode="structured")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, limit_val_batches=0, callbacks=[prune]))
    trainer.fit(module, _three_classes())
    assert prune.events[-1]["sparsity"] > 0
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    fresh = ScheduledPrune.load_pruned(_MeansThenMLP(), path).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(fresh(x), module.eval()(x))


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


# ----------------------------------------------------------------------------------- copies kept as buffers
class _EMABuffers(pl.LightningModule):
    """A held-out sweep's module: an EMA of every parameter kept as a buffer named after it, updated by
    name."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
        for name, parameter in self.net.named_parameters():
            self.register_buffer("ema_" + name.replace(".", "_"), parameter.detach().clone())

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_idx):
        for name, parameter in self.net.named_parameters():
            getattr(self, "ema_" + name.replace(".", "_")).mul_(0.9).add_(parameter.detach(), alpha=0.1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_structured_mode_refuses_a_copy_of_the_weights_kept_as_buffers_naming_it_before_the_first_step():
    # held-out sweep: the cut shrank net.0 and not its EMA buffers: "size of tensor a (32) must match the size
    # of tensor b (16)" at step 28 of 40
    module = _EMABuffers()
    message, calls, trainer = _structured_refusal(module, _three_classes())
    assert message.startswith(
        f"ScheduledPrune: structured pruning cannot run on this model: {pruning.UNCUT_BUFFER}: `ema_0_weight` "
        "(and 1 more such buffer) has the shape (32, 8) of `net.0.weight`, which the cut changes"
    )
    assert "`exclude_pattern`='net\\\\.0'" in message and "mode='unstructured'" in message
    assert "on_pulse_parameters_replaced" in message
    assert calls == [] and trainer.global_step == 0


def test_a_buffer_the_cut_shrinks_with_its_layer_or_shaped_like_no_cut_parameter_is_no_copy():
    # a BatchNorm's running statistics are cut with it; class weights shaped like the output layer's bias
    # (never cut), a step count and a boolean mask are not copies of weights
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model.register_buffer("class_weights", torch.ones(3))
    model.register_buffer("seen", torch.zeros((), dtype=torch.long))
    model.register_buffer("keep", torch.ones(16, 8, dtype=torch.bool))
    model.register_buffer("scale", torch.ones(16))  # one dimension: shaped like many biases, not a copy
    assert (
        pruning.check_structured(model.eval(), pruning.Pruner("structured"), [0.25, 0.5], torch.randn(4, 8))
        is None
    )
    # review: a table or a mask of a cut weight's shape (a sinusoidal positional table (256, 64) next to a
    # feed-forward Linear(64, 256)) was refused as a copy; only a buffer holding the weight's values is one
    positions = torch.arange(16.0)[:, None] * torch.exp(-torch.arange(0, 8, 2.0) / 8)[None, :]
    model.register_buffer("table", torch.cat([positions.sin(), positions.cos()], dim=1))  # (16, 8)
    model.register_buffer("causal", torch.ones(16, 8).tril())
    assert (
        pruning.check_structured(model.eval(), pruning.Pruner("structured"), [0.25, 0.5], torch.randn(4, 8))
        is None
    )
    model.register_buffer("frozen_first", model[0].weight.detach().clone())
    reason = pruning.check_structured(model, pruning.Pruner("structured"), [0.25, 0.5], torch.randn(4, 8))
    assert reason.startswith(f"{pruning.UNCUT_BUFFER}: `frozen_first` has the shape (16, 8) of `0.weight`")


def test_unstructured_mode_warns_at_fit_start_of_buffers_shaped_like_a_weight_to_mask_naming_weight_orig():
    # held-out sweep: the same module in unstructured mode failed at the first event looking up
    # `ema_0_weight_orig` (`named_parameters()` gives the masked layer's parameter as `weight_orig` from then
    # on), with no word before
    module = _EMABuffers()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=4, callbacks=[_prune(start=3, end=20)]))  # no event
    with pytest.warns(UserWarning, match="shaped like the weights of layers it will mask") as warned:
        trainer.fit(module, _three_classes())
    message = next(str(w.message) for w in warned if "shaped like the weights" in str(w.message))
    assert "(`ema_0_weight`, `ema_2_weight`; `ema_0_weight` like `net.0.weight`)" in message
    assert "`net.0.weight` is computed from `net.0.weight_orig * net.0.weight_mask`" in message
    assert "must use `weight_orig`" in message
    # a BatchNorm's statistics and a mask's own `weight_mask` are in their layers: no warning
    plain = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    pruning.add_mask(plain[0])
    layers = {"0": plain[0], "2": plain[2]}
    assert prune_targets.weight_shaped_buffers(plain, layers) == {}


# -------------------------------------------------------------------------------- writes to a masked weight
class _MaxNorm(pl.LightningModule):
    """A held-out sweep's max-norm constraint, written the usual way after every optimizer step."""

    LIMIT = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 3)
        self.largest: list[float] = []  # fc1's largest row norm in each training forward

    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(x)))
        if self.training:
            self.largest.append(float(self.fc1.weight.detach().norm(dim=1).max()))
        return out

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0] * 3), batch[1])

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.fc1.weight.data = torch.renorm(self.fc1.weight.data, 2, 0, self.LIMIT)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=5e-2)


def test_a_write_to_a_masked_layers_weight_after_the_step_holds_as_on_an_unpruned_layer():
    # held-out sweep: after the first event the constraint went nowhere (`weight` is recomputed from
    # `weight_orig * weight_mask` at the next forward): the largest row norm grew to 0.95 against 0.5
    module = _MaxNorm()
    prune = _prune()
    _fit(module, _three_classes(), prune)
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5)
    assert max(module.largest[1:]) <= _MaxNorm.LIMIT + 1e-5  # every forward after the first step
    assert float(module.fc1.weight.detach().norm(dim=1).max()) <= _MaxNorm.LIMIT + 1e-5  # folded at fit end
    assert float((module.fc1.weight == 0).float().mean()) >= 0.5  # pruned entries stayed zero


def test_write_keeping_mask_carries_data_assignments_and_no_grad_writes_and_nothing_else():
    layer = nn.Linear(4, 3)
    pruning.add_mask(layer, (torch.arange(12).view(3, 4) % 2).float())
    mask = layer.weight_mask.bool()
    layer.weight.data = torch.full((3, 4), 7.0)  # a `.data` assignment
    layer(torch.randn(2, 4))
    assert torch.equal(layer.weight_orig[mask], torch.full((6,), 7.0)) and not layer.weight[~mask].any()
    with torch.no_grad():
        layer.weight.clamp_(max=2.0)  # an in-place write
    pruning.refresh_masked_weights(pruning.masked_weights(layer), grad=False)
    assert torch.equal(layer.weight[mask], torch.full((6,), 2.0))
    before = layer.weight_orig.detach().clone()
    layer.weight_orig.data.add_(1.0)  # an optimizer step: `weight` is only stale, not written
    layer(torch.randn(2, 4))
    assert torch.equal(layer.weight_orig, before + 1.0)
    layer.weight.data = torch.zeros(3, 4)  # written, then a loaded state supersedes it
    pruning.fit_to_state_dict(layer, {"weight_orig": before, "weight_mask": layer.weight_mask})
    layer.load_state_dict({"weight_orig": before, "weight_mask": layer.weight_mask, "bias": layer.bias})
    layer(torch.randn(2, 4))
    assert torch.equal(layer.weight_orig, before)
    # review: a plain load_state_dict (an EMA or best-weights callback swapping weights in) after a write: the
    # write was carried over the loaded weights at the next forward
    layer.weight.data = torch.zeros(3, 4)
    layer.load_state_dict({"weight_orig": before, "weight_mask": layer.weight_mask, "bias": layer.bias})
    layer(torch.randn(2, 4))
    assert torch.equal(layer.weight_orig, before)
    # a copy neither carries the original's record nor fails to pickle
    copied = pruning.copy_without_hooks(layer)
    assert copied._forward_pre_hooks and all(
        hook._written_check is None for hook in copied._forward_pre_hooks.values()
    )
    pickle.loads(pickle.dumps(copied))
    with torch.inference_mode():
        copied(torch.randn(2, 4))  # under inference mode: no version counter to read, no failure
    layer.weight.data = torch.full((3, 4), 0.25)  # folding the mask keeps a last write
    pruning.make_masks_permanent(layer)
    assert torch.equal(layer.weight, torch.where(mask, 0.25, 0.0))


def test_a_folded_layer_keeps_no_hook_of_ours_and_a_masked_one_one_load_hook_however_often_masked():
    # review: the load pre-hook outlived the fold, held the old mask, grew by one per fold and re-mask, and
    # made `torch.save(model)` of the folded model need lightning_pulse to load
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for _ in range(3):
        for layer in (model[0], model[2]):
            pruning.add_mask(layer, (torch.rand_like(layer.weight) > 0.5).float())
        assert [len(layer._load_state_dict_pre_hooks) for layer in (model[0], model[2])] == [1, 1]
        model(torch.randn(2, 16))
        pruning.make_masks_permanent(model)
        assert [len(layer._load_state_dict_pre_hooks) for layer in (model[0], model[2])] == [0, 0]
    saved = io.BytesIO()
    torch.save(model, saved)
    assert b"lightning_pulse" not in saved.getvalue()


_LOAD_WITHOUT_LIGHTNING_PULSE = """
import importlib.abc, sys
class NoLightningPulse(importlib.abc.MetaPathFinder):  # a deployment server: torch, lightning, the model
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "lightning_pulse":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoLightningPulse())
sys.path.insert(0, sys.argv[1])
import torch
model = torch.load(sys.argv[2], weights_only=False)
model.load_state_dict(model.state_dict())
print(sum(len(m._load_state_dict_pre_hooks) for m in model.modules()))
"""


def test_a_whole_model_saved_mid_fit_with_structured_prune_loads_where_lightning_pulse_is_not_installed(
    tmp_path,
):
    # held-out sweep: the load pre-hook pickled as lightning_pulse.core.pruning._inert_hook, so a
    # torch.save(pl_module) made by a user's callback before any cut needed lightning_pulse to load
    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule

    saved = tmp_path / "mid_fit.pt"

    class SaveWholeModel(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                torch.save(pl_module, saved)

    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=14, end=24, every=2)
    trainer = pl.Trainer(
        callbacks=[prune, SaveWholeModel()], max_steps=24, default_root_dir=tmp_path, **trainer_kwargs()
    )
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=1000, batch_size=64))
    assert trainer.global_step == 24 and prune.sparsity == pytest.approx(0.5)
    repo_root = str(Path(__file__).resolve().parents[1])
    loaded = subprocess.run(
        [sys.executable, "-I", "-c", _LOAD_WITHOUT_LIGHTNING_PULSE, repo_root, str(saved)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["1"]  # the fitter's hook came along, as a no-op


def test_load_pruned_leaves_weight_equal_to_the_masked_loaded_weights_before_any_forward(tmp_path):
    # held-out sweep: `layer.weight` held the fresh module's random values (no zeros) until the first forward
    module, prune = _MaxNorm(), _prune()
    trainer = _fit(module, _three_classes(), prune, enable_checkpointing=True, default_root_dir=tmp_path)
    del trainer
    checkpoint = next(tmp_path.rglob("*.ckpt"))  # saved before the fit's end folds the masks
    loaded = ScheduledPrune.load_pruned(_MaxNorm(), checkpoint)
    layer = loaded.fc1
    assert hasattr(layer, "weight_mask")
    assert torch.equal(layer.weight, layer.weight_orig * layer.weight_mask)
    assert float((layer.weight == 0).float().mean()) >= 0.5
