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
        "Way out: unfreeze the layers to prune, hold trained matrices in `nn.Linear` layers (as peft's LoRA "
        "holds its adapters) or remove ScheduledPrune."
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
    with pytest.raises(PulseRefusal) as refused:
        _fit(_Tuned("linear"), exclude_pattern="lora")
    said = str(refused.value)
    assert "no other `layer_types` can help" in said and "What trains" not in said
    assert said.endswith(
        "Way out: unfreeze the layers to prune, narrow `exclude_pattern` or remove ScheduledPrune."
    )
