"""ScheduledPrune on a model whose every prunable layer the user froze (prompt tuning, LoRA adapters held as
bare parameters): the refusal says no `layer_types` can help and names ways out that work."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


class _Adapter(nn.Module):
    """A low-rank adapter next to a frozen ``nn.Linear``: ``lora_A``/``lora_B`` as bare parameters, or as
    ``nn.Linear`` layers (as peft holds them)."""

    def __init__(self, base: nn.Linear, as_linear: bool) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        if as_linear:
            self.lora_A = nn.Linear(base.in_features, 4, bias=False)
            self.lora_B = nn.Linear(4, base.out_features, bias=False)
        else:
            self.lora_A = nn.Parameter(torch.randn(4, base.in_features) * 0.1)
            self.lora_B = nn.Parameter(torch.randn(base.out_features, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lora_A, nn.Linear):
            return self.base(x) + self.lora_B(self.lora_A(x))
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


class _Tuned(pl.LightningModule):
    """A frozen MLP with a trained soft prompt added to its input (``"prompt"``), or LoRA adapters on its
    layers (``"bare"``, ``"linear"``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4))
        self.requires_grad_(False)
        self.prompt = nn.Parameter(torch.zeros(2, 16)) if kind == "prompt" else None
        if kind != "prompt":
            self.net[0] = _Adapter(self.net[0], as_linear=kind == "linear")
            self.net[3] = _Adapter(self.net[3], as_linear=kind == "linear")

    def training_step(self, batch, batch_idx):
        x = self.embed(batch[0])
        if self.prompt is not None:  # two soft tokens before the input's
            x = torch.cat([self.prompt.expand(len(x), -1, -1), x], dim=1)
        return nn.functional.cross_entropy(self.net(x.mean(dim=1)), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _tokens() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 10, (64, 6), generator=generator)
    return DataLoader(TensorDataset(x, x[:, 0] % 4), batch_size=16)


def _fit(module: pl.LightningModule, **prune_kwargs) -> ScheduledPrune:
    prune = ScheduledPrune(final_sparsity=0.5, start=2, end=6, every=2, probe_batches=0, **prune_kwargs)
    trainer = pl.Trainer(callbacks=[prune], max_steps=8, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _tokens())
    return prune


@pytest.mark.parametrize(
    ("kind", "layer_types"),
    [("prompt", "default"), ("prompt", None), ("bare", "default"), ("bare", None), ("bare", [_Adapter])],
)
def test_a_model_whose_every_layer_is_frozen_is_refused_saying_no_layer_types_helps_and_what_does(
    kind, layer_types
):
    # held-out sweep: prompt tuning on a frozen GPT-2 and LoRA on a frozen Llama (adapters as bare
    # nn.Parameter) were told "Choose other `layer_types`"; `layer_types=None` gave the same refusal and the
    # adapter class was refused for having no `weight`: a loop
    chosen = {} if layer_types == "default" else {"layer_types": layer_types}
    with pytest.raises(PulseRefusal) as refused:
        _fit(_Tuned(kind), **chosen)
    said = str(refused.value)
    assert "no other `layer_types` can help: every layer with a `weight`" in said
    assert "is frozen by the user (`requires_grad=False`: `embed`, " in said
    trained = "`prompt`" if kind == "prompt" else "`net.0.lora_A`, `net.0.lora_B`, `net.3.lora_A` and 1 more"
    assert f"What trains is {trained}: parameters held outside a layer's `weight`" in said
    assert said.endswith(
        "Way out: unfreeze the layers to prune, hold trained adapter matrices in `nn.Linear` layers (as "
        "peft's LoRA holds them) or remove ScheduledPrune."
    )
    assert "Choose other `layer_types`" not in said


def test_the_ways_out_a_frozen_model_is_offered_prune(recwarn):
    held_in_linear = _Tuned("linear")
    prune = _fit(held_in_linear)
    assert prune.events and set(prune.core.pruner.layers(held_in_linear)) == {
        "net.0.lora_A",
        "net.0.lora_B",
        "net.3.lora_A",
        "net.3.lora_B",
    }
    unfrozen = _Tuned("bare")
    unfrozen.net[0].base.requires_grad_(True)
    prune = _fit(unfrozen)
    assert prune.events and set(prune.core.pruner.layers(unfrozen)) == {"net.0.base"}


def test_where_other_layer_types_would_help_the_refusal_still_says_to_choose_them():
    # a trained nn.Linear of a frozen model's adapters, left out by the types named: other types do help
    with pytest.raises(PulseRefusal) as refused:
        _fit(_Tuned("linear"), layer_types=["Conv1d"])
    said = str(refused.value)
    assert said.endswith("Choose other `layer_types` or remove ScheduledPrune.")
    assert "no other `layer_types` can help" not in said


def test_a_frozen_model_whose_trained_layers_exclude_pattern_leaves_out_is_told_to_narrow_it():
    # review: the message said "no other `layer_types` can help" (true) because "every layer with a `weight`
    # is frozen" (false: the trained adapters are, but `exclude_pattern` left them out)
    with pytest.raises(PulseRefusal) as refused:
        _fit(_Tuned("linear"), exclude_pattern="lora")
    said = str(refused.value)
    assert (
        "no other `layer_types` can help: the layers with a trained `weight` are left out by "
        "`exclude_pattern`='lora' (`layer_types`=None: `net.0.lora_A`, `net.0.lora_B`, `net.3.lora_A` and 1 "
        "more), and the rest are frozen by the user (`requires_grad=False`: `embed`, `net.0.base`, `net.2` "
        "and 1 more)" in said
    )
    assert "every layer with a `weight`" not in said and "What trains" not in said
    assert said.endswith(
        "Way out: narrow `exclude_pattern` so that it leaves `net.0.lora_A`, `net.0.lora_B`, `net.3.lora_A` "
        "and 1 more in, unfreeze the layers to prune or remove ScheduledPrune."
    )


class _BackboneAndHead(pl.LightningModule):
    """A frozen backbone and a trained head (``"head"``), or a trained LayerNorm between frozen layers
    (``"norm"``)."""

    def __init__(self, trained: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)
        self.requires_grad_(False)
        (self.head if trained == "head" else self.backbone[2]).requires_grad_(True)

    def forward(self, x):
        return self.head(self.backbone(self.embed(x).mean(dim=1)))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_a_trained_layers_weight_is_never_called_frozen_or_held_outside_a_layer():
    # review: a frozen backbone's trained `head`, left out by exclude_pattern='head', was said to be frozen
    # ("every layer with a `weight`") and `head.bias` the only thing trained, "held outside a layer's weight"
    with pytest.raises(PulseRefusal) as refused:
        _fit(_BackboneAndHead("head"), exclude_pattern="head")
    said = str(refused.value)
    assert (
        "the layer with a trained `weight` is left out by `exclude_pattern`='head' "
        "(`layer_types`=None: `head`)" in said
    )
    assert "What trains besides is `head.bias`" in said and "every layer with a `weight`" not in said
    assert "narrow `exclude_pattern` so that it leaves `head` in" in said
    # structured mode: a trained LayerNorm's `weight` is a per-channel scale it never cuts on its own; it was
    # left out of what trains, and the LayerNorm counted among the frozen layers
    with pytest.raises(PulseRefusal) as refused:
        _fit(_BackboneAndHead("norm"), mode="structured")
    said = str(refused.value)
    assert (
        "every layer with a `weight` (`layer_types`=None), per-channel scales aside, is frozen by the user"
        in said
    )
    assert "`backbone.2.weight` (per-channel scales) train too" in said
    assert "What trains besides is `backbone.2.bias`" in said
    assert "use mode='unstructured' with `layer_types`=None" in said
    prune = _fit(_BackboneAndHead("norm"), mode="unstructured", layer_types=None)  # the way out it names
    assert prune.events and set(prune.core.pruner.layers(_BackboneAndHead("norm"))) == {"backbone.2"}


class _PromptEmbedding(_Tuned):
    """A frozen model tuned through a soft prompt held in an ``nn.Embedding``, as peft's PromptEmbedding."""

    def __init__(self) -> None:
        super().__init__("prompt")
        self.prompt = None
        self.soft = nn.Embedding(2, 16)

    def training_step(self, batch, batch_idx):
        x = torch.cat([self.soft.weight.expand(len(batch[0]), -1, -1), self.embed(batch[0])], dim=1)
        return nn.functional.cross_entropy(self.net(x.mean(dim=1)), batch[1])


def test_a_soft_prompt_in_an_embedding_is_named_as_all_other_layer_types_would_prune():
    # review: the refusal said "Choose other `layer_types`", and `layer_types=None` prunes the prompt itself
    with pytest.raises(PulseRefusal) as refused:
        _fit(_PromptEmbedding())
    assert "Other `layer_types` (None) would select only `soft`, an `nn.Embedding`" in str(refused.value)
    assert "that prunes the prompt itself" in str(refused.value)
    with pytest.raises(PulseRefusal) as refused:  # other types select trained `nn.Linear` layers: not said
        _fit(_Tuned("linear"), layer_types=["Conv1d"])
    assert "`nn.Embedding`" not in str(refused.value)
