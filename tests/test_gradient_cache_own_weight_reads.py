"""GradientCache on layers that read their own weight twice inside their forward (spectral norm, weight
standardisation): no tie, so they freeze; a weight read again by another module is still a tie.

Held-out sweep: a GAN discriminator's MLP with spectral norm on every layer never froze anything, and the
warning said its first layer was "a tied input and output layer" to untie with `tie_word_embeddings=False`.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.gradient_cache import GradientCache
from tests.conftest import trainer_kwargs

LAYERS = ["layers.0", "layers.1", "layers.2", "layers.3"]


class WSLinear(nn.Linear):
    """A linear layer with weight standardisation written in its forward (as BiT's and NFNet's layers do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(x, (w - w.mean(1, keepdim=True)) / (w.std(1, keepdim=True) + 1e-5), self.bias)


def spectral(layer: nn.Linear) -> nn.Module:
    return parametrizations.spectral_norm(layer)


def spectral_hook(layer: nn.Linear) -> nn.Module:
    return nn.utils.spectral_norm(layer)  # the older form: a forward pre-hook computes `weight`


def standardised(layer: nn.Linear) -> nn.Module:
    new = WSLinear(layer.in_features, layer.out_features)
    new.load_state_dict(layer.state_dict())
    return new


class NormalisedMLP(pl.LightningModule):
    """A discriminator-like MLP whose every layer is wrapped by ``wrap``."""

    def __init__(self, wrap) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)]
        self.layers = nn.ModuleList(wrap(layer) for layer in layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return F.cross_entropy(self.layers[-1](x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def rule_data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=32)


class WatchFirstLayer(Callback):
    """Per optimizer step: which parameters were frozen (``requires_grad`` off at batch start) and changed
    over the step; for a spectral-normed first layer also how far its power-iteration vector ``u`` moved and
    how far its estimate ``u . (W v)`` of the weight's largest singular value is from the true one."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, bool, bool]] = []  # step, name, frozen, changed
        self.first: list[
            tuple[bool, float, float]
        ] = []  # first layer's weight frozen, u moved, estimate error

    @staticmethod
    def _power_iteration(module):
        layer = module.layers[0]
        if hasattr(layer, "parametrizations"):
            norm = layer.parametrizations.weight[0]
            return layer.parametrizations.weight.original, norm._u, norm._v
        if hasattr(layer, "weight_u"):
            return layer.weight_orig, layer.weight_u, layer.weight_v
        return None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = {n: (p.requires_grad, p.detach().clone()) for n, p in pl_module.named_parameters()}
        if (found := self._power_iteration(pl_module)) is not None:
            self._frozen, self._u = not found[0].requires_grad, found[1].clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for name, param in pl_module.named_parameters():
            trains, value = self._before[name]
            self.rows.append((trainer.global_step, name, not trains, not torch.equal(value, param.detach())))
        if (found := self._power_iteration(pl_module)) is not None:
            weight, u, v = found
            weight = weight.detach()
            true = torch.linalg.matrix_norm(weight, 2)
            error = float((torch.vdot(u, torch.mv(weight, v)) - true).abs() / true)
            self.first.append((self._frozen, float((u - self._u).abs().max()), error))

    def frozen(self) -> set[str]:
        return {name for _, name, frozen, _ in self.rows if frozen}

    def changed_while_frozen(self) -> set[str]:
        return {name for _, name, frozen, changed in self.rows if frozen and changed}

    def changed(self) -> set[str]:
        return {name for _, name, _, changed in self.rows if changed}


def fit(wrap, units=None) -> tuple[GradientCache, WatchFirstLayer, list[str], pl.LightningModule]:
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, units=units)
    watch = WatchFirstLayer()
    module = NormalisedMLP(wrap)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=60, callbacks=[cache, watch]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, rule_data())
    said = [str(w.message) for w in caught if "GradientCache" in str(w.message)]
    return cache, watch, said, module


@pytest.mark.parametrize(
    ("wrap", "units"),
    [(spectral, None), (spectral, LAYERS), (spectral_hook, None)],
    ids=["auto", "units", "hook"],
)
def test_a_spectral_normed_discriminator_freezes_and_its_frozen_layers_stand_still(wrap, units):
    """Spectral norm reads its weight twice in the layer's own forward (``sigma = u . (W v)``, then
    ``W / sigma``): that was taken for a tie, every layer was pinned and nothing ever froze, whatever
    ``units`` said. While frozen, the weight stands still and the power iteration goes on (``u``, ``v`` are
    buffers, updated by each training forward), so the estimate of the frozen weight's norm converges to the
    true one."""
    cache, watch, said, module = fit(wrap, units)
    assert said == []  # no "tied input and output layer ... untie them"
    assert not any(unit.pinned for unit in cache.freezer.units)
    assert any(event["to"] > 0 for event in cache.events) and cache.ledger.skipped_share > 0.3
    weight = next(
        name for name, _ in module.named_parameters() if name.startswith("layers.0.") and "bias" not in name
    )
    assert weight in watch.frozen()
    assert watch.changed_while_frozen() == set()  # frozen parameters stand still
    assert watch.changed() == {
        name for name, _ in module.named_parameters()
    }  # and each trains when not frozen
    # the first frozen span of the first layer: u keeps moving, and the norm estimate gets closer to the truth
    start = next(i for i, row in enumerate(watch.first) if row[0])
    span = watch.first[start : next(i for i in range(start, len(watch.first)) if not watch.first[i][0])]
    assert len(span) > 2 and all(moved > 0 for _, moved, _ in span)
    assert span[-1][2] < span[0][2]


def test_hand_written_weight_standardisation_is_no_tie_and_freezes():
    """``(w - mean(w)) / std(w)`` in the layer's forward reads its weight by three kinds of op, all inside its
    own forward: it was pinned like a tied embedding and nothing froze."""
    cache, watch, said, module = fit(standardised)
    assert said == [] and not any(unit.pinned for unit in cache.freezer.units)
    assert [unit.name for unit in cache.freezer.units] == LAYERS
    assert "layers.0.weight" in watch.frozen() and any(event["to"] > 0 for event in cache.events)
    assert watch.changed_while_frozen() == set()
    assert watch.changed() == {name for name, _ in module.named_parameters()}


class SpectralTiedLM(pl.LightningModule):
    """A spectral-normed embedding read again as the output projection, ``F.linear(h, embed.weight)``: its
    spectral norm runs again there, outside the embedding's forward, so it is still a tie."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = parametrizations.spectral_norm(nn.Embedding(32, 16))
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        logits = F.linear(h + self.blocks(h), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_a_spectral_normed_embedding_read_again_as_the_output_projection_stays_pinned():
    tokens = torch.randint(0, 32, (128, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=16)
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0)
    with pytest.warns(
        UserWarning, match=r"GradientCache: the first unit in forward order, embed.* \(Div, Mv\)"
    ):
        pl.Trainer(**trainer_kwargs(max_steps=24, callbacks=[cache])).fit(SpectralTiedLM(), data)
    assert cache.freezer.units[0].name.startswith("embed") and cache.freezer.units[0].pinned
    assert cache.events == []


class TiedEmbed(nn.Module):
    """A tied embedding whose own forward does both the lookup and, with ``decode=True``, the output
    projection: one module, called twice, reading its weight by one kind of op in each call."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * 0.1)

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if decode else F.embedding(x, self.weight)


class DecodeFlagLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = TiedEmbed(32, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        logits = self.embed(h + self.blocks(h), decode=True)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_a_tied_embedding_projecting_in_another_call_of_its_own_forward_stays_pinned():
    """Review of 086bbd3: a read counted as the embedding's own if it lay in any call of it, so the lookup in
    ``embed(x)`` and the projection in ``embed(h, decode=True)`` (a real tie: freezing the unit stops the
    output layer too) pinned nothing and the "untie" warning was gone. Each call must read the weight by
    every kind of op it is read by (a spectral-normed layer applied twice still does)."""
    tokens = torch.randint(0, 32, (128, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=16)
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0)
    with pytest.warns(UserWarning, match=r"GradientCache: the first unit in forward order, embed, shares"):
        pl.Trainer(**trainer_kwargs(max_steps=8, callbacks=[cache])).fit(DecodeFlagLM(), data)
    assert cache.freezer.units[0].name == "embed" and cache.freezer.units[0].pinned


def test_without_autograd_sequence_numbers_a_weight_read_by_two_kinds_is_pinned_as_before(monkeypatch):
    """Review of 086bbd3: the private ``Node._sequence_nr()`` was called unguarded at the first backward of
    every GradientCache fit; a torch without it would crash there. Read in one place
    (``forward_calls.sequence_number``), it now gives ``None`` and the reads are judged as before the record
    of calls: the spectral-normed layers are pinned, with the tie warning, and the fit runs."""
    from lightning_pulse.core import forward_calls

    # another torch's autograd node: the method is missing
    monkeypatch.setattr(forward_calls, "_SEQUENCE_NR", "_no_such_method")
    assert forward_calls.sequence_number(torch.ones(1, requires_grad=True).exp().grad_fn) is None
    cache, _, said, _ = fit(spectral)
    assert cache.freezer.units[0].pinned and all(event["to"] == 0 for event in cache.events)
    assert any("the first unit in forward order, layers.0" in message for message in said), said


class CompiledTeacherKD(pl.LightningModule):
    """A student distilled from a frozen teacher compiled with ``torch.compile`` (``in_place``: with
    ``teacher.compile()``), which the docs say trains as usual next to GradientCache."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).requires_grad_(False)
        if in_place:
            teacher.compile(backend="eager")
            self.teacher = teacher
        else:
            self.teacher = torch.compile(teacher, backend="eager")
        self.student = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 0:  # the forward whose calls GradientCache records: the hooks on each side
            self.hooks = {name: _hooks(getattr(self, name)) for name in ("teacher", "student")}
        with torch.no_grad():
            t = self.teacher(x)
        s = self.student(x)
        kd = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
        return F.cross_entropy(s, y) + kd

    def configure_optimizers(self):
        return torch.optim.Adam(self.student.parameters(), lr=3e-3)


def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


@pytest.mark.parametrize("in_place", [False, True], ids=["wrapper", "in-place"])
def test_a_compiled_frozen_teacher_next_to_gradient_cache_compiles_as_one_graph(in_place):
    """Review of 086bbd3: the hooks recording the first forward's calls went on every module, the compiled
    teacher's too; dynamo traced them and broke the graph at their autograd node (3 graphs, 10 breaks, for
    the whole fit; 1 graph without GradientCache). Only modules holding a unit's parameter, outside compiled
    parts, are hooked now."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0)
    module = CompiledTeacherKD(in_place)
    pl.Trainer(**trainer_kwargs(max_steps=4, callbacks=[cache])).fit(module, rule_data())
    assert [unit.name for unit in cache.freezer.units] == ["student.0", "student.2", "student.4"]
    assert module.hooks["teacher"] == 0 and module.hooks["student"] > 0
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    if not in_place:  # a module compiled in place shows no graph in these counters (torch 2.13)
        assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
