"""GradientCache and custom autograd Functions a frozen prefix could break (held-out sweep A).

HF Reformer's encoder runs in one Function that reaches its layers' parameters through a closure: a frozen
embedding stopped the whole encoder training while GradientCache reported it training. A RevNet-style block
that asks `torch.autograd.grad` for all its parameters crashed once some of them froze.
"""

from __future__ import annotations

import warnings
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import GradientCache, PulseCycle
from lightning_pulse.core.custom_functions import ddp_inner_backward_note
from lightning_pulse.core.layer_freezing import FreezerLifecycle, FreezeSettings
from tests.conftest import trainer_kwargs

torch.set_num_threads(1)


def _fit(module: pl.LightningModule, data: TensorDataset, callbacks: list, steps: int) -> pl.Trainer:
    trainer = pl.Trainer(**trainer_kwargs(max_steps=steps, callbacks=callbacks))
    trainer.fit(module, DataLoader(data, batch_size=16, shuffle=True))
    return trainer


# ------------------------------------------------------------------ Reformer: parameters reached by closure
class _Reformer(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.ReformerConfig(
            vocab_size=64,
            hidden_size=32,
            num_attention_heads=2,
            attention_head_size=16,
            feed_forward_size=64,
            attn_layers=["local", "lsh"],
            axial_pos_embds=False,
            max_position_embeddings=64,
            is_decoder=True,
            local_attn_chunk_length=8,
            lsh_attn_chunk_length=8,
            num_buckets=4,
            num_hashes=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            lsh_attention_probs_dropout_prob=0.0,
            local_attention_probs_dropout_prob=0.0,
        )
        self.net = transformers.ReformerModelWithLMHead(config)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.net(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class _EncoderWatch(pl.Callback):
    """Per step: the units frozen during it, and whether the first encoder layer's feed-forward weight
    moved."""

    def __init__(self, cache: GradientCache) -> None:
        self.cache, self.rows, self.frozen = cache, [], ()

    def _weight(self, module):
        return module.net.reformer.encoder.layers[0].feed_forward.dense.dense.weight.detach().clone()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.frozen, self.before = tuple(self.cache.frozen_units), self._weight(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rows.append((self.frozen, bool((self._weight(module) != self.before).any())))


def test_reformer_encoder_trains_at_every_step_it_is_not_frozen():
    # sweep A: with the embeddings frozen, the encoder weight moved in 2 of 16 steps (vs 21 of 23 before)
    pl.seed_everything(0, verbose=False)
    module = _Reformer()
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (256, 1), generator=generator)
    stride = torch.randint(1, 4, (256, 1), generator=generator)
    tokens = (start + stride * torch.arange(32)) % 64
    cache = GradientCache(threshold=5.0, check_every=5, max_frozen_share=0.2)  # the embeddings alone fit
    watch = _EncoderWatch(cache)
    pulse = PulseCycle(burst=10, replay=6, maintain=2, warmup=0, anneal=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(module, TensorDataset(tokens), [pulse, cache, watch], steps=40)
    encoder = "net.reformer.encoder.layers.0.feed_forward.dense"
    training = [moved for frozen, moved in watch.rows if encoder not in frozen]
    assert len(training) == len(watch.rows) == 40 and all(training)
    said = [str(w.message) for w in caught]
    assert any("_ReversibleFunction in net.reformer.encoder.layers" in note for note in said)
    # the embeddings freeze only with the whole encoder, which exceeds max_frozen_share here
    assert cache.freezer.units[0].frozen_with == ["net.reformer.encoder.layers.1.feed_forward"]


# ------------------------------------------------------------------ reversible blocks: parameters as inputs
class _Reversible(torch.autograd.Function):
    """A RevNet block: activations recomputed from the output in backward, gradients by autograd.grad."""

    @staticmethod
    def forward(ctx, x, f, g, only_trainable, *params):
        ctx.f, ctx.g, ctx.only_trainable = f, g, only_trainable
        with torch.no_grad():
            x1, x2 = x.chunk(2, -1)
            y1 = x1 + f(x2)
            y = torch.cat([y1, x2 + g(y1)], -1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        y1, y2 = y.chunk(2, -1)
        dy1, dy2 = dy.chunk(2, -1)

        def grads(out, inp, module, upstream):
            params = list(module.parameters())
            asked = [p for p in params if p.requires_grad or not ctx.only_trainable]
            found = iter(torch.autograd.grad(out, [inp, *asked], upstream))
            d_inp, ids = next(found), {id(p) for p in asked}
            return d_inp, [next(found) if id(p) in ids else None for p in params]

        with torch.enable_grad():
            y1 = y1.detach().requires_grad_(True)
            gy1 = ctx.g(y1)
            d_y1, dg = grads(gy1, y1, ctx.g, dy2)
            dx1 = dy1 + d_y1
            x2 = (y2 - gy1).detach().requires_grad_(True)
            d_x2, df = grads(ctx.f(x2), x2, ctx.f, dx1)
        return (torch.cat([dx1, dy2 + d_x2], -1), None, None, None, *df, *dg)


class _RevBlock(nn.Module):
    def __init__(self, only_trainable: bool) -> None:
        super().__init__()
        self.only_trainable = only_trainable
        self.f = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.g = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x):
        params = [*self.f.parameters(), *self.g.parameters()]
        return _Reversible.apply(x, self.f, self.g, self.only_trainable, *params)


class _RevNet(pl.LightningModule):
    def __init__(self, only_trainable: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 32)
        self.blocks = nn.Sequential(_RevBlock(only_trainable), _RevBlock(only_trainable))
        self.head = nn.Linear(32, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.blocks(self.stem(x))), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def _digits() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(320, 64, generator=generator)
    return TensorDataset(x, (x[:, :10].argmax(1) + (x[:, 10] > 0).long()) % 10)


def test_a_reversible_block_asking_for_every_parameter_freezes_only_whole_and_never_crashes():
    # sweep A: RuntimeError "One of the differentiated Tensors does not require grad" at step 5
    pl.seed_everything(0, verbose=False)
    module = _RevNet(only_trainable=False)
    cache = GradientCache(threshold=5.0, check_every=5, max_frozen_share=0.3)
    with pytest.warns(UserWarning, match=r"_Reversible in blocks\.0 takes parameters of several units"):
        trainer = _fit(module, _digits(), [cache], steps=40)
    assert trainer.global_step == 40
    frozen = [event["to"] for event in cache.events]
    assert frozen and max(frozen) == 1  # the stem alone: a block's parameters would split at 0.3


def test_a_reversible_block_asking_only_for_trainable_parameters_freezes_whole_and_its_backward_runs_once():
    # a healthy form cannot be told apart without calling the user's backward a second time, which a review
    # showed unsafe (state popped from ctx, checkpointed tensors unpacked once, BatchNorm recomputed): it
    # freezes only whole, and its backward runs exactly once per backward of the fit
    pl.seed_everything(0, verbose=False)
    module = _RevNet(only_trainable=True)
    calls = []
    original = _Reversible.backward

    def counted(ctx, dy):
        calls.append(1)
        return original(ctx, dy)

    cache = GradientCache(threshold=5.0, check_every=5, max_frozen_share=0.3)
    with mock.patch.object(_Reversible, "backward", staticmethod(counted)):
        with pytest.warns(UserWarning, match=r"_Reversible in blocks\.0 takes parameters of several units"):
            trainer = _fit(module, _digits(), [cache], steps=40)
    assert trainer.global_step == 40
    frozen = [event["to"] for event in cache.events]
    assert frozen and max(frozen) == 1  # the stem alone: a block's halves no longer freeze one by one
    assert len(calls) == 2 * 40  # two blocks, one backward each per step: no second call at the first


# ------------------------------------------------------------------ the safety net
class _WritesGradients(torch.autograd.Function):
    """Applies ``layer``, reached by closure; its backward writes the layer's ``.grad`` itself, so the first
    backward sees no autograd accumulation to tie them to the Function."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        params = list(ctx.layer.parameters())
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            found = torch.autograd.grad(ctx.layer(x), [x, *params], dy)
        for param, grad in zip(params, found[1:]):
            param.grad = grad if param.grad is None else param.grad + grad
        return found[0], None


class _ClosureNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.inner, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.head(_WritesGradients.apply(torch.tanh(self.stem(x)), self.inner))


def test_a_freeze_that_cuts_off_gradients_it_could_not_see_is_undone_and_freezing_stops():
    torch.manual_seed(0)
    model = _ClosureNet()
    lifecycle = FreezerLifecycle(FreezeSettings(check_every=2))
    lifecycle.start(None, model)
    x = torch.randn(4, 8)

    def backward() -> bool:
        model.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        lifecycle.begin_backward(loss)
        loss.backward()
        return lifecycle.end_backward()

    backward()
    freezer = lifecycle.freezer
    assert model.inner.weight.grad is not None and lifecycle.may_freeze
    assert freezer.units[0].name == "stem" and not freezer.units[0].frozen_with  # nothing seen to group
    freezer.set_prefix(1)  # the stem: the Function's only input no longer needs a gradient
    assert backward()  # a warning waits for announce
    assert sorted(lifecycle.gradients_lost) == ["inner.bias", "inner.weight"]
    said: list[str] = []
    lifecycle.announce(lambda _: None, said.append)
    assert any("got no gradient (inner." in note and "freezes nothing for the rest" in note for note in said)
    report = lifecycle.step(enabled=True)
    assert report.changed and freezer.frozen_prefix == 0 and not lifecycle.may_freeze
    assert all(param.requires_grad for param in model.parameters())


# ------------------------------------------------------------------ DDP (held-out sweep C)
class _KeepsItsModel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, model):
        ctx.model = model  # kept, not trained through
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_ddps_failure_on_a_parameter_marked_ready_twice_gets_the_note_and_gradient_caches_messages_do_not():
    ddp_error = RuntimeError(
        "Expected to mark a variable ready only once. This error is caused by one of the following reasons"
    )
    note = ddp_inner_backward_note(ddp_error)
    assert note is not None and note.startswith(
        "GradientCache: DDP failed under `find_unused_parameters=True`"
    )
    assert "Reformer" in note and "static_graph=True" in note
    assert ddp_inner_backward_note(RuntimeError(note)) is None  # the refusal quotes DDP's error
    assert ddp_inner_backward_note(RuntimeError("CUDA out of memory")) is None
