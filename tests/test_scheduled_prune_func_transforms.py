"""ScheduledPrune (unstructured) on a module whose ``training_step`` calls pruned layers inside a ``torch.func``
transform: a Jacobian penalty through ``vmap(jacrev(net))``, per-sample gradients through
``vmap(grad(functional_call(...)))``. The mask hook's write check read ``weight.data_ptr()`` of the
transform's wrapped weight, and the fit crashed at its first mask ("Cannot access data pointer of Tensor that
doesn't have storage")."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PulseRefusal, ScheduledPrune
from lightning_pulse.core.func_transforms import unwrapped
from tests.conftest import trainer_kwargs


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(192, 12, generator=generator)
    y = (x @ torch.randn(12, 3, generator=generator)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


def _prune() -> ScheduledPrune:
    return ScheduledPrune(final_sparsity=0.5, start=2, end=10, every=2, probe_batches=0)


def _masked(layer: nn.Module) -> torch.Tensor:
    """The layer's weight with its mask applied by hand (its own ``weight`` when it has no mask)."""
    if hasattr(layer, "weight_mask"):
        return (layer.weight_orig * layer.weight_mask).detach()
    return layer.weight.detach()


class _Transformed(pl.LightningModule):
    """A classifier whose ``training_step`` also runs its net inside a ``torch.func`` transform."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.net = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))
        self.jacobian_error: list[float] = []  # per masked step: the transform's Jacobian against one by hand
        self.unmasked_gap: list[float] = []  # the same Jacobian with `weight_orig` unmasked, against it
        self.pruned_gradient: list[
            float
        ] = []  # per masked step: largest per-sample gradient at a pruned entry
        self.kept_gradient: list[float] = []  # ... and at a kept one

    def _one(self, params, x, y):
        return F.cross_entropy(functional_call(self.net, params, (x[None],)), y[None])

    def _by_hand(self, x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """``(B, 3, 12)``: the net's input Jacobian with ``first`` as the first layer's weight."""
        last = _masked(self.net[2])
        slope = 1 - torch.tanh(x @ first.T + self.net[0].bias.detach()) ** 2  # (B, 24)
        return torch.einsum("oh,bh,hi->boi", last, slope, first)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        masked = hasattr(self.net[0], "weight_mask")
        if self.variant == "jacrev":
            J = vmap(jacrev(self.net))(x)  # (B, 3, 12), the last call of the step
            if masked:
                self.jacobian_error.append(
                    float((J.detach() - self._by_hand(x, _masked(self.net[0]))).abs().max())
                )
                unmasked = self._by_hand(x, self.net[0].weight_orig.detach())
                self.unmasked_gap.append(float((J.detach() - unmasked).abs().max()))
            return loss + 1e-3 * J.pow(2).sum() / len(x)
        params = {name: value.detach() for name, value in self.net.named_parameters()}
        per_sample = vmap(grad(self._one), in_dims=(None, 0, 0))(params, x, y)
        if masked:
            first = per_sample["0.weight_orig"].abs()  # (B, 24, 12)
            keep = self.net[0].weight_mask.bool()
            self.pruned_gradient.append(float(first[:, ~keep].max()))
            self.kept_gradient.append(float(first[:, keep].max()))
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
        weights = (norms / norms.mean()).detach()
        return (F.cross_entropy(self.net(x), y, reduction="none") * weights).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_jacobian_penalty_through_vmap_jacrev_trains_through_the_masks_and_sees_them(tmp_path):
    pl.seed_everything(0)
    model, prune = _Transformed("jacrev"), _prune()
    trainer = pl.Trainer(max_steps=16, callbacks=[prune], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, _data())
    print("jacrev: events", len(prune.events), "sparsity", prune.events[-1]["sparsity"])
    print("max |J - by hand|", max(model.jacobian_error), "min |J - unmasked|", min(model.unmasked_gap))
    assert trainer.global_step == 16
    assert prune.events[-1]["sparsity"] >= 0.49
    assert len(model.jacobian_error) >= 8  # every step from the first mask on ran the transform
    # the transform computed with the masked weight: its pruned entries were zero inside the transform
    assert max(model.jacobian_error) < 1e-5
    assert min(model.unmasked_gap) > 1e-3


def test_per_sample_gradients_through_vmap_grad_functional_call_train_and_pruned_entries_get_none(tmp_path):
    pl.seed_everything(0)
    model, prune = _Transformed("per_sample"), _prune()
    trainer = pl.Trainer(max_steps=16, callbacks=[prune], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, _data())
    print("per-sample: sparsity", prune.events[-1]["sparsity"], "pruned grad", max(model.pruned_gradient))
    assert trainer.global_step == 16
    assert prune.events[-1]["sparsity"] >= 0.49
    assert len(model.pruned_gradient) >= 8
    # `functional_call` swapped the detached `weight_orig` in, and the mask still multiplied it
    assert max(model.pruned_gradient) == 0.0
    assert min(model.kept_gradient) > 0.0


class _MaxNormAfterJacobian(_Transformed):
    """A max-norm constraint written after each optimizer step, on a layer whose last call in the step ran
    inside ``vmap(jacrev(...))``."""

    LIMIT = 0.4

    def __init__(self) -> None:
        super().__init__("jacrev")
        self.wrapped_after_step: list[bool] = []

    @torch.no_grad()
    def on_train_batch_end(self, outputs, batch, batch_idx):
        layer = self.net[0]
        self.wrapped_after_step.append(unwrapped(layer.weight) is not layer.weight)
        layer.weight.data = torch.renorm(layer.weight.data, 2, 0, self.LIMIT)


def test_a_max_norm_write_after_a_jacrev_call_holds_on_the_masked_layer(tmp_path):
    """Inside the transform the mask hook sets the transform's weight; the weight from outside is put back
    when the call ends, so ``layer.weight`` after the step is a plain tensor and a write to it is kept (a
    finished transform's wrapper refused ``.data =``)."""
    pl.seed_everything(0)
    model, prune = _MaxNormAfterJacobian(), _prune()
    trainer = pl.Trainer(max_steps=16, callbacks=[prune], default_root_dir=tmp_path, **trainer_kwargs())
    trainer.fit(model, _data())
    largest = float(model.net[0].weight.detach().norm(dim=1).max())  # folded at fit end
    print("largest row norm at fit end", largest, "zeros", float((model.net[0].weight == 0).float().mean()))
    assert trainer.global_step == 16
    assert not any(model.wrapped_after_step)
    assert largest <= model.LIMIT + 1e-5
    assert float((model.net[0].weight == 0).float().mean()) >= 0.45  # the mask held under the write


class _StackedEnsemble(pl.LightningModule):
    """torch.func's model ensembling: the members' weights stacked (``stack_module_state``) as parameters of the
    module, read through ``vmap(functional_call(base, ...))`` with the base module on 'meta', outside the
    module tree: no layer holds a weight that trains."""

    def __init__(self, members: int = 3) -> None:
        super().__init__()
        nets = [nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(members)]
        stacked, _ = stack_module_state(nets)
        self.names = list(stacked)
        self.stacked = nn.ParameterList([nn.Parameter(stacked[name]) for name in self.names])
        self.base = [copy.deepcopy(nets[0]).to("meta")]

    def forward(self, x):
        params = dict(zip(self.names, self.stacked))
        return vmap(lambda p, xx: functional_call(self.base[0], p, (xx,)), in_dims=(0, None))(params, x).mean(
            0
        )

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_a_stacked_ensemble_is_refused_saying_no_layer_types_can_help_and_what_does(tmp_path, mode):
    """A held-out sweep: the refusal said "Choose other `layer_types`", which no value can satisfy."""
    prune = ScheduledPrune(final_sparsity=0.5, mode=mode, probe_batches=0)
    trainer = pl.Trainer(max_steps=2, callbacks=[prune], **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.raises(PulseRefusal) as refused:
        trainer.fit(_StackedEnsemble(), _data())
    message = str(refused.value)
    assert "No other `layer_types` can help, nor the other `mode`" in message
    assert "`stacked.0`" in message and "Choose other" not in message
    assert "hold the weights in layers" in message and "remove ScheduledPrune" in message
