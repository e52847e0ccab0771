"""The ways out a structured ScheduledPrune refusal names, from a held-out sweep: each ``exclude_pattern`` it
offers was checked by a trial cut, and following it fits. A break in the LightningModule's own ``forward`` (a
fixed ``.view`` after a layer) named no pattern; on HF Swin, ``exclude_pattern='downsample'`` was answered with
``'downsample|downsample'`` failing; on a channel-shuffle CNN the module holding the whole model (``'net'``)
was named; and an old-style ``weight_norm`` layer was told to run ``remove_parametrizations``, which raises
on it."""

from __future__ import annotations

import dataclasses
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def _vectors() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, :4].argmax(dim=1))), batch_size=16)


def _images(channels: int = 1) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, channels, 16, 16, generator=generator)
    return DataLoader(TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 0).long()), batch_size=8)


def _prune(**overrides) -> ScheduledPrune:
    options = {
        "final_sparsity": 0.5,
        "mode": "structured",
        "start": 2,
        "end": 6,
        "every": 2,
        "probe_batches": 0,
    }
    return ScheduledPrune(**{**options, **overrides})


def _fit(module: pl.LightningModule, data: DataLoader, prune: ScheduledPrune, steps: int = 8) -> None:
    trainer = pl.Trainer(callbacks=[prune], max_steps=steps, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)


def _offered(message: str) -> list[str]:
    return [eval(found) for found in re.findall(r"`exclude_pattern`=('(?:[^'\\]|\\.)*')", message)]


class _Classifier(pl.LightningModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _FixedHeadsInForward(_Classifier):
    """A fixed head layout after layer `b`, written in the LightningModule's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.h = (
            nn.Linear(16, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 32),
            nn.Linear(32, 4),
        )
        self.example_input_array = torch.randn(2, 16)

    def forward(self, x):
        z = self.a(x).relu()
        z = self.b(z).view(x.shape[0], 8, 4).softmax(-1).reshape(x.shape[0], 32)
        return self.h(self.c(z).relu())


def test_a_break_in_the_modules_own_forward_names_a_checked_pattern_that_fits():
    # before: "pruning a copy of the model failed (RuntimeError: shape '[2, 8, 4]' is invalid ...)" and no pattern
    with pytest.raises(PulseRefusal, match=r"the trial cut passes") as refused:
        _fit(_FixedHeadsInForward(), _vectors(), _prune())
    (pattern,) = _offered(str(refused.value))
    assert re.search(pattern, "b") and not re.search(pattern, "a") and not re.search(pattern, "c")
    module = _FixedHeadsInForward()
    _fit(module, _vectors(), _prune(exclude_pattern=pattern))
    assert module.b.out_features == 32 and module.a.out_features < 32


class _ChannelShuffle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.out = (
            nn.Conv2d(1, 16, 3, padding=1),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.Linear(16, 2),
        )

    def forward(self, x):
        h = self.c1(x).relu()
        b, c, height, width = h.shape
        h = h.view(b, 2, c // 2, height, width).transpose(1, 2).reshape(b, c, height, width)
        return self.out(self.c2(h).relu().mean((2, 3)))


class _Wrapped(_Classifier):
    def __init__(self, net: nn.Module, example: torch.Tensor) -> None:
        super().__init__()
        self.net, self.example_input_array = net, example

    def forward(self, x):
        out = self.net(x)
        return out.logits if hasattr(out, "logits") else out


def test_a_pattern_leaving_out_the_whole_model_is_never_offered_and_the_offered_one_fits():
    # before: "it broke in net (_ChannelShuffle); the trial cut does not pass with `exclude_pattern`='net' either"
    with pytest.raises(PulseRefusal, match=r"it broke in net \(_ChannelShuffle\)") as refused:
        _fit(_Wrapped(_ChannelShuffle(), torch.randn(2, 1, 16, 16)), _images(), _prune())
    message = str(refused.value)
    assert "'net'" not in message
    (pattern,) = _offered(message)
    module = _Wrapped(_ChannelShuffle(), torch.randn(2, 1, 16, 16))
    _fit(module, _images(), _prune(exclude_pattern=pattern))
    assert module.net.c2.out_channels < 16


def test_swin_is_never_told_its_own_pattern_again_and_the_offered_one_fits():
    transformers = pytest.importorskip("transformers")
    config = transformers.SwinConfig(
        image_size=16,
        patch_size=2,
        num_channels=3,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=2,
    )

    def swin() -> _Wrapped:
        torch.manual_seed(0)
        return _Wrapped(transformers.SwinForImageClassification(config), torch.randn(2, 3, 16, 16))

    # before: "the trial cut does not pass with `exclude_pattern`='downsample|downsample' either", no pattern
    with pytest.raises(PulseRefusal, match=r"it broke in .*downsample") as refused:
        _fit(swin(), _images(3), _prune(exclude_pattern="downsample"))
    message = str(refused.value)
    assert "downsample|downsample" not in message
    (pattern,) = _offered(message)
    module = swin()
    parameters = sum(p.numel() for p in module.parameters())
    _fit(module, _images(3), _prune(exclude_pattern=pattern))
    assert sum(p.numel() for p in module.parameters()) < parameters


class _OldStyleWeightNorm(_Classifier):
    """Both kinds of weight_norm keep every channel group of this MLP from being cut (`out` gives the logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.utils.weight_norm(nn.Linear(16, 32))  # the deprecated hook form
        self.fc2 = nn.utils.parametrizations.weight_norm(nn.Linear(32, 32))
        self.out = nn.Linear(32, 4)
        self.example_input_array = torch.randn(2, 16)

    def forward(self, x):
        return self.out(self.fc2(self.fc1(x).relu()).relu())


def test_each_kind_of_computed_weight_is_named_with_the_call_that_removes_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = _OldStyleWeightNorm()
    # before: `torch.nn.utils.parametrize.remove_parametrizations` for both, which raises on fc1
    with pytest.raises(
        PulseRefusal, match=r"`torch\.nn\.utils\.remove_weight_norm\(layer\)` for fc1"
    ) as refused:
        _fit(module, _vectors(), _prune())
    assert re.search(r"remove_parametrizations\(layer, 'weight'\)` for fc2", str(refused.value))
    nn.utils.remove_weight_norm(module.fc1)  # the calls named work
    nn.utils.parametrize.remove_parametrizations(module.fc2, "weight")


class _SpectralMixInForward(_Classifier):
    """An FFT over the features after layer `b` (as FNet mixes tokens): a cut of `b` changes every output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.fft.fft(self.b(torch.relu(self.a(x)))).real)


def test_a_module_with_its_own_forward_is_not_told_to_give_itself_one():
    # sweep (FNet, T5, BART with `forward(**inputs)`): the refusal's closing advice said "or give the module a
    # `forward`" to modules that had one
    with pytest.raises(PulseRefusal, match="^ScheduledPrune: structured pruning cannot run") as refused:
        _fit(_SpectralMixInForward(), _vectors(), _prune())
    assert "give the module a `forward`" not in str(refused.value)
    assert "narrow `layer_types`/`exclude_pattern`" in str(refused.value)


class _BertWithReshapingHead(_Classifier):
    """An HF BERT backbone under a head whose root `forward` reshapes `proj`'s output with a fixed `.view`: the
    cut breaks in the head, and, once `proj` is left out, in BERT's attention."""

    def __init__(self, transformers) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
        self.net, self.proj, self.head = transformers.BertModel(config), nn.Linear(32, 32), nn.Linear(8, 2)
        self.example_input_array = torch.randint(0, 64, (2, 8))

    def forward(self, x):
        hidden = self.net(x).last_hidden_state[:, 0]
        return self.head(self.proj(hidden).view(x.shape[0], 8, 4).mean(-1))


def _tokens() -> DataLoader:
    x = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x[:, 0] % 2), batch_size=8)


def test_a_break_in_the_modules_own_forward_over_an_hf_backbone_names_a_pattern_with_its_attention_that_fits():
    transformers = pytest.importorskip("transformers")
    # before: "it broke in head (Linear); no `exclude_pattern` it checked lets the trial cut pass ('attention',
    # chosen layers left out by name)": 'attention' alone still broke in the head, and every half of the layers
    # that left `proj` out broke in BertSelfAttention
    with pytest.raises(PulseRefusal, match=r"it broke in head \(Linear\); .*the trial cut passes") as refused:
        _fit(_BertWithReshapingHead(transformers), _tokens(), _prune())
    (pattern,) = _offered(str(refused.value))
    assert re.search(pattern, "proj") and re.search(pattern, "net.encoder.layer.0.attention.self.query")
    module = _BertWithReshapingHead(transformers)
    parameters = sum(p.numel() for p in module.parameters())
    _fit(module, _tokens(), _prune(exclude_pattern=pattern))
    assert module.proj.out_features == 32 and sum(p.numel() for p in module.parameters()) < parameters


def test_after_one_slow_trial_cut_the_search_for_a_way_out_starts_no_further_one(monkeypatch):
    from lightning_pulse.core import pruning

    # every cut counts as slow: the search stops after its first, which leaves `a` out and breaks again
    # (the next, leaving `b` and `c` out, would pass)
    monkeypatch.setattr(pruning, "SLOW_TRIAL_SECONDS", 1e-9)
    with pytest.raises(PulseRefusal, match=r"no `exclude_pattern` it checked") as refused:
        _fit(_FixedHeadsInForward(), _vectors(), _prune())
    assert _offered(str(refused.value)) == []


class _DictRows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 16, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"values": self.x[index], "labels": self.x[index, :4].argmax()}


class _HandsTheBatchOn(pl.LightningModule):
    """A wrapper written as many wrap an HF model: `forward(self, batch)` hands the dict batch on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, batch):
        return self.net(batch["values"])

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_forward_taking_the_batch_whole_is_traced_on_the_batch():
    # sweep (wav2vec2 and Whisper wrapped as `forward(self, batch): return self.model(**batch)`): the dict batch
    # was read as keyword arguments, refused ("missing ['batch']"), and the way out offered, narrowing
    # `layer_types`, gave the same refusal word for word
    prune = _prune()
    _fit(_HandsTheBatchOn(), DataLoader(_DictRows(), batch_size=16), prune)
    assert prune.events and prune.events[-1]["sparsity"] > 0.2


class _TakesTheLabelsOut(_HandsTheBatchOn):
    """`forward(self, batch)` popping the labels out of the batch it is handed, as HF wrappers often do."""

    def forward(self, batch):
        logits = self.net(batch["values"])
        return logits, nn.functional.cross_entropy(logits, batch.pop("labels"))

    def training_step(self, batch, batch_idx):
        return self(batch)[1]


class _TakesTheLabelsOutIfThere(_TakesTheLabelsOut):
    def forward(self, batch):
        labels = batch.pop("labels", None)
        logits = self.net(batch["values"])
        return logits if labels is None else (logits, nn.functional.cross_entropy(logits, labels))


@pytest.mark.parametrize("module_type", [_TakesTheLabelsOut, _TakesTheLabelsOutIfThere])
def test_a_forward_taking_entries_out_of_the_batch_it_is_handed_is_traced_and_cut(module_type):
    # sweep: every call of the check got the same dict, so the first call's `pop` took the labels from the next:
    # refused as "pruning a copy of the model failed (KeyError: 'labels'); it broke in net.4 (Linear)", or, with
    # `pop("labels", None)`, as a cut that "changes the model's output shapes from [(2, 4), ()] to [(2, 4)]"
    prune = _prune()
    _fit(module_type(), DataLoader(_DictRows(), batch_size=16), prune)
    assert prune.events and prune.events[-1]["sparsity"] > 0.2


def test_a_dict_handed_whole_to_forward_is_moved_and_converted_as_a_top_level_input():
    # review: only top-level tensors went to the model's device and dtype, so a `(batch,)` example's tensors
    # stayed as loaded (on a GPU run: the trace on another device than the copy of the model)
    from lightning_pulse.core.pruning import inputs_for

    model = nn.Linear(4, 2).to(torch.bfloat16)
    (moved,) = inputs_for(model, ({"values": torch.randn(2, 4), "labels": torch.tensor([0, 1])},))
    assert moved["values"].dtype == torch.bfloat16 and moved["labels"].dtype == torch.int64


class _SqueezeBert(_Classifier):
    """HF SqueezeBERT from a tiny config: every encoder layer a grouped ``Conv1d``, whose groups must divide
    the channels a neighbour's cut leaves."""

    def __init__(self, transformers) -> None:
        super().__init__()
        config = transformers.SqueezeBertConfig(
            vocab_size=64,
            hidden_size=32,
            embedding_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=2,
            q_groups=2,
            k_groups=2,
            v_groups=2,
            post_attention_groups=2,
            intermediate_groups=2,
            output_groups=2,
        )
        self.model = transformers.SqueezeBertForSequenceClassification(config)
        self.example_input_array = torch.randint(3, 64, (2, 8))

    def forward(self, x):
        return self.model(input_ids=x).logits


def test_a_refusal_offers_the_same_pattern_whichever_layer_the_sparsity_breaks_first_and_says_what_it_leaves(
    monkeypatch,
):
    transformers = pytest.importorskip("transformers")
    from lightning_pulse.core import pruning

    # a shared, loaded machine: the search's answer is checked here, not its time
    monkeypatch.setattr(pruning, "WAY_OUT_SECONDS", 600.0)
    monkeypatch.setattr(pruning, "SLOW_TRIAL_SECONDS", 600.0)
    # sweep (HF SqueezeBERT): at 0.3 the cut broke in `output.conv1d`, and the refusal said no pattern it
    # checked passes; at 0.5 it broke in `attention.query` and offered 'attention|layers', which leaves out
    # every encoder layer: only the pooler was cut (2.5% of the parameters) under a logged sparsity of 0.5
    messages = {}
    for sparsity in (0.3, 0.5):
        with pytest.raises(PulseRefusal, match=r"the trial cut passes") as refused:
            # the sweep's schedule: its levels (0.211, 0.289, 0.3 at 0.3) decide where the first cut breaks
            prune = _prune(final_sparsity=sparsity, start=4, end=28, every=8)
            torch.manual_seed(0)  # the weights rank the channels, and so say which layer breaks first
            _fit(_SqueezeBert(transformers), _tokens(), prune, steps=40)
        messages[sparsity] = str(refused.value)
    assert re.search(r"broke in model\.transformer\.encoder\.layers\.\d\.output\.conv1d", messages[0.3])
    assert re.search(r"broke in model\.transformer\.encoder\.layers\.\d\.attention\.query", messages[0.5])
    assert _offered(messages[0.3]) == _offered(messages[0.5]) == ["layers"]
    for message in messages.values():
        assert (
            "the trial cut passes and leaves 2 layers holding 7.6% of the model's weights to cut "
            "(model.transformer.pooler.dense, model.classifier)"
        ) in message


@dataclasses.dataclass
class _Rows:
    """A batch as a dataclass: it holds the model's input, but not where a tuple, list or dict batch does."""

    x: torch.Tensor
    y: torch.Tensor


class _RowsClassifier(_Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch.x), batch.y)


def _rows() -> DataLoader:
    x, y = _vectors().dataset.tensors
    return DataLoader(
        list(zip(x, y)), batch_size=16, collate_fn=lambda items: _Rows(*map(torch.stack, zip(*items)))
    )


class _SourceAndTarget(_Classifier):
    """`forward(src, tgt_in)` over a dict batch {'src', 'tgt'}: the decoder input is made in `training_step`,
    as a seq2seq model shifts its target."""

    def __init__(self) -> None:
        super().__init__()
        self.encode, self.decode = nn.Linear(16, 32), nn.Linear(16, 32)
        self.mid, self.head = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, src, tgt_in):
        return self.head(torch.relu(self.mid(torch.relu(self.encode(src) + self.decode(tgt_in)))))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch["src"], batch["tgt"] * 0.5), batch["y"])


def _source_and_target() -> DataLoader:
    x, y = _vectors().dataset.tensors
    rows = [{"src": row, "tgt": row.flip(0), "y": label} for row, label in zip(x, y)]
    return DataLoader(rows, batch_size=16)


class _WithPadding(_Classifier):
    """`forward(x, pad)` over a tuple batch (x, pad, y), as a set model with a padding mask takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x, pad):
        return self.head(torch.relu(self.b(torch.relu(self.a(x.masked_fill(pad, 0.0))))))

    def training_step(self, batch, batch_idx):
        x, pad, y = batch
        return nn.functional.cross_entropy(self(x, pad), y)


def _with_padding() -> DataLoader:
    x, y = _vectors().dataset.tensors
    return DataLoader(TensorDataset(x, x.abs() > 2.0, y), batch_size=16)


def _example(module: pl.LightningModule, data: DataLoader) -> pl.LightningModule:
    """``module`` with the ``example_input_array`` the refusal asks for: what its ``forward`` takes."""
    batch = next(iter(data))
    if isinstance(module, _RowsClassifier):
        module.example_input_array = batch.x
    elif isinstance(module, _SourceAndTarget):  # a dict: keyword arguments
        module.example_input_array = {"src": batch["src"], "tgt_in": batch["tgt"] * 0.5}
    else:  # a tuple: positional arguments
        module.example_input_array = (batch[0], batch[1])
    return module


@pytest.mark.parametrize(
    ("module_type", "data", "reason"),
    [
        (_RowsClassifier, _rows, "no model input found in a batch of type _Rows"),
        (_SourceAndTarget, _source_and_target, r"cannot be called with the batch's entries .* \['tgt_in'\]"),
        (_WithPadding, _with_padding, r"takes 2 arguments \(x, pad\), and a list batch gives one input"),
    ],
)
def test_a_batch_without_forwards_arguments_is_told_of_example_input_array_which_then_prunes(
    module_type, data, reason
):
    # sweep (a dataclass batch, nn.Transformer's `forward(src, tgt_in)`, an MHA set model's `forward(x, pad)`):
    # the refusal ended "Use mode='unstructured'; or narrow `layer_types`/`exclude_pattern` to layers that can
    # be cut", and narrowing gave the same refusal word for word: the input is read before any layer is chosen.
    # The two ways out that work, `example_input_array` (named for none but the tuple batch) and unstructured
    messages = []
    for narrowed in ({}, {"exclude_pattern": "head|net\\.4"}):
        with pytest.raises(PulseRefusal, match=reason) as refused:
            _fit(module_type(), data(), _prune(**narrowed))
        messages.append(str(refused.value))
    assert messages[0] == messages[1]
    assert messages[0].endswith(
        "Give the LightningModule an `example_input_array` that its `forward` takes (a tuple is passed as "
        "positional arguments, a dict as keyword arguments, anything else as the one argument): the model is "
        "traced with it instead of the batch. Or use mode='unstructured' (its masks need no trace)."
    )
    assert "narrow" not in messages[0]
    module = _example(module_type(), data())
    parameters = sum(p.numel() for p in module.parameters())
    prune = _prune()
    _fit(module, data(), prune)
    assert prune.events[-1]["sparsity"] > 0.2 and sum(p.numel() for p in module.parameters()) < parameters
    prune = _prune(mode="unstructured")
    _fit(module_type(), data(), prune)
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.01)


class _FakeQuantized(_Classifier):
    """Eager-mode QAT (`prepare_qat`): every Linear has a per-channel fake quantizer of its weight, whose
    scales no cut of the Linear's channels reaches."""

    def __init__(self) -> None:
        super().__init__()
        from torch.ao import quantization

        net = nn.Sequential(
            quantization.QuantStub(),
            nn.Linear(16, 32),
            nn.ReLU(),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Linear(32, 4),
            quantization.DeQuantStub(),
        )
        net.qconfig = quantization.get_default_qat_qconfig("x86")
        self.net = quantization.prepare_qat(net.train())

    def forward(self, x):
        return self.net(x)


def test_a_fake_quantized_model_whose_every_cut_fails_names_unstructured_first_which_prunes(monkeypatch):
    from lightning_pulse.core import pruning

    # a shared, loaded machine: the search must run its course, as it does on a free one
    monkeypatch.setattr(pruning, "WAY_OUT_SECONDS", 600.0)
    monkeypatch.setattr(pruning, "SLOW_TRIAL_SECONDS", 600.0)
    # sweep (eager QAT): every narrowing the search tried failed (each Linear's fake quantizer breaks its
    # cut). The narrowing advice stays after unstructured: the search is bounded (three tries, halving the
    # layers), and a review found models where a pattern it never tried passes (a QAT MLP with two blocks
    # left out, a CNN with one grouped conv)
    with pytest.raises(
        PulseRefusal, match=r"broke in net\.1\.weight_fake_quant .*it checked lets"
    ) as refused:
        _fit(_FakeQuantized(), _vectors(), _prune())
    assert re.search(
        r"it checked lets the trial cut pass \([^)]*\)\. Use mode='unstructured'; or narrow",
        str(refused.value),
    ), str(refused.value)
    # narrowing breaks in the next layer's quantizer, and leaves nothing else to leave out
    with pytest.raises(PulseRefusal, match=r"broke in net\.3\.weight_fake_quant") as refused:
        _fit(_FakeQuantized(), _vectors(), _prune(exclude_pattern="1"))
    assert "it found no `exclude_pattern` to check. Use mode='unstructured'; or narrow" in str(refused.value)
    prune = _prune(mode="unstructured")
    _fit(_FakeQuantized(), _vectors(), prune)
    assert prune.events[-1]["sparsity"] == pytest.approx(0.5, abs=0.01)


class _NarrowCNN(_Classifier):
    """Two 16-channel convs and a head: every group the cut could take is 16 channels wide."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16 * 16 * 16, 2)

    def forward(self, x):
        return self.head(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


def test_a_min_channels_floor_that_holds_every_group_back_is_named_with_the_range_that_prunes():
    """A held-out CNN of 16-channel convs with ``min_channels=16`` was told to narrow
    ``layer_types``/``exclude_pattern``, which cannot help: the floor is named, with the values that cut, and
    the highest of them prunes."""
    module = _NarrowCNN()
    with pytest.raises(PulseRefusal) as refused:
        _fit(module, _images(), _prune(options={"min_channels": 16}))
    message = str(refused.value)
    assert "above `min_channels`=16: every group would keep all its channels" in message
    assert "a `min_channels` from 1 to 15 lets them be cut (the trial cut passes with 15)" in message
    assert "Lower `min_channels`" in message and "narrow" not in message
    assert module.c1.out_channels == 16  # refused before any cut
    _fit(module, _images(), _prune(options={"min_channels": 15}))  # the top of the range named
    assert module.c1.out_channels == 15 and module.c2.out_channels == 15


class _LinearsWithConv1DAdapter(_Classifier):
    """Linear layers and a Hugging Face ``Conv1D`` side adapter, applied on request only."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.a, self.b, self.h = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.adapter = Conv1D(32, 32)

    def forward(self, x):
        return self.h(torch.relu(self.b(torch.relu(self.a(x)))))


def test_conv1d_layers_next_to_others_are_told_the_layer_types_a_trial_cut_passes_with_which_then_prunes():
    pytest.importorskip("transformers")
    module = _LinearsWithConv1DAdapter()
    with pytest.raises(PulseRefusal) as refused:
        _fit(module, _vectors(), _prune())
    assert str(refused.value).endswith(
        "torch-pruning cannot cut Hugging Face Conv1D layers (adapter). Use mode='unstructured'; or "
        "`layer_types`=['Linear'] to leave them out (the trial cut passes)."
    )
    _fit(module, _vectors(), _prune(layer_types=["Linear"]))  # followed as written
    assert module.a.out_features == 16 and module.b.out_features == 16
