"""ScheduledPrune(mode="structured") cuts parameters in place: the objects stay, and what holds them too.

The user's hooks on parameters and lists of them, a wrapper optimizer's inner optimizer (its state is cut
too), ``ZeroRedundancyOptimizer`` (its shard optimizer holds the same objects; its bucket view is refused),
and a weights-only checkpoint, loaded by reading each layer's width from its shapes.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import prune_widths
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def _data(rows: int = 128) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=generator)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)


class Net(pl.LightningModule):
    """Three linear layers; ``optimizer`` builds the optimizer from the parameters."""

    def __init__(self, optimizer=None) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 3)
        self.example_input_array = torch.zeros(2, 16)
        self.make_optimizer = optimizer or (lambda parameters: torch.optim.SGD(parameters, lr=0.1))

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def _prune(**overrides) -> ScheduledPrune:
    kwargs = dict(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    return ScheduledPrune(**{**kwargs, **overrides})


class HookedNet(Net):
    """Clips each gradient in a post-accumulate hook, counts tensor hooks, and keeps a list for an L2 term."""

    def __init__(self) -> None:
        super().__init__()
        self.post_calls: dict[str, int] = {}
        self.pre_calls: dict[str, int] = {}
        self.decay = [self.fc1.weight, self.fc2.weight]
        for name, parameter in self.named_parameters():
            parameter.register_post_accumulate_grad_hook(lambda p, name=name: self._clip(name, p))
            parameter.register_hook(lambda grad, name=name: self._count(name, grad))

    def _clip(self, name, parameter):
        self.post_calls[name] = self.post_calls.get(name, 0) + 1
        parameter.grad.clamp_(-0.01, 0.01)

    def _count(self, name, grad):
        self.pre_calls[name] = self.pre_calls.get(name, 0) + 1
        return grad

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 1e-3 * sum(p.pow(2).sum() for p in self.decay)


def test_cut_keeps_the_parameters_hooks_and_references(tmp_path):
    model = HookedNet()
    largest: list[float] = []

    class Largest(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            largest.append(max(p.grad.abs().max().item() for p in pl_module.parameters()))

    prune = _prune()
    trainer = pl.Trainer(
        max_steps=12, callbacks=[prune, Largest()], **trainer_kwargs(default_root_dir=tmp_path)
    )
    trainer.fit(model, _data())
    assert len(prune.events) >= 2 and model.fc1.out_features < 32
    # every hook fired at every step, before and after the cuts, and kept clipping
    assert set(model.post_calls.values()) == {12} and set(model.pre_calls.values()) == {12}
    assert max(largest) <= 0.01
    # the user's list still holds the model's (cut) weights
    assert model.decay[0] is model.fc1.weight and model.decay[1] is model.fc2.weight
    assert model.fc1.weight.shape == (model.fc1.out_features, 16)


class Lookahead(torch.optim.Optimizer):
    """A wrapper sharing the inner optimizer's ``param_groups``, with slow weights in a state of its own."""

    def __init__(self, inner: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        self.optimizer, self.k, self.alpha, self.steps = inner, k, alpha, 0
        self.param_groups, self.defaults = inner.param_groups, inner.defaults
        self.state: dict = {}

    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        for group in self.param_groups:
            for parameter in group["params"]:
                slow = self.state.setdefault(parameter, {"slow": parameter.detach().clone()})["slow"]
                if self.steps % self.k == 0:
                    slow.add_(parameter.detach() - slow, alpha=self.alpha)
                    parameter.data.copy_(slow)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self):
        index = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        slow = {index[id(p)]: state["slow"] for p, state in self.state.items()}
        return {"inner": self.optimizer.state_dict(), "slow": slow, "steps": self.steps}


def test_a_wrapper_optimizers_inner_state_is_cut_too(tmp_path):
    model = Net(lambda parameters: Lookahead(torch.optim.Adam(parameters, lr=0.01)))
    seen: list[tuple[int, int, bool]] = []

    class InnerState(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            inner = trainer.optimizers[0].optimizer
            live = list(pl_module.parameters())
            fits = all(inner.state[p]["exp_avg"].shape == p.shape for p in live if p in inner.state)
            seen.append((sum(p in inner.state for p in live), len(inner.state), fits))

    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4)
    prune = _prune()
    kwargs = trainer_kwargs(default_root_dir=tmp_path, enable_checkpointing=True)
    trainer = pl.Trainer(max_steps=10, callbacks=[prune, InnerState(), checkpoints], **kwargs)
    trainer.fit(model, _data())  # a checkpoint after each cut saves the inner optimizer's state
    assert len(prune.events) >= 2
    # the inner Adam's moments follow the cut (kept, cut, keyed by the live parameters) at every step
    assert seen == [(6, 6, True)] * 10
    state = torch.load(checkpoints.last_model_path or checkpoints.best_model_path, weights_only=False)
    assert state["optimizer_states"]


class OptimizerInBackward(Net):
    """torch's optimizer-in-backward recipe: an Adam per parameter, held by the module in a dict and stepped by
    a post-accumulate-grad hook; the Trainer's optimizer (lr=0) only counts the steps."""

    def __init__(self) -> None:
        super().__init__(lambda parameters: torch.optim.SGD(parameters, lr=0.0))
        self.automatic_optimization = False
        self.opts = {p: torch.optim.Adam([p], lr=0.01) for p in self.parameters()}
        for parameter in self.parameters():
            parameter.register_post_accumulate_grad_hook(self._step)

    def _step(self, parameter):
        self.opts[parameter].step()
        self.opts[parameter].zero_grad()

    def training_step(self, batch, batch_idx):
        self.manual_backward(super().training_step(batch, batch_idx))
        self.optimizers().step()


def test_the_modules_own_optimizers_are_cut_too(tmp_path):
    """A held-out sweep: the module's own per-parameter Adams kept their moments at the uncut shapes, and the
    first backward after the first cut raised torch's size mismatch inside the hook, naming no callback."""
    model = OptimizerInBackward()
    moved: list[bool] = []

    class Moves(Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            self.before = pl_module.fc1.weight.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, *args):
            weight = pl_module.fc1.weight
            moved.append(weight.shape == self.before.shape and not torch.equal(weight, self.before))

    prune = _prune()
    pl.Trainer(max_steps=10, callbacks=[prune, Moves()], **trainer_kwargs(default_root_dir=tmp_path)).fit(
        model, _data()
    )
    assert len(prune.events) >= 2 and model.fc1.out_features < 32
    for parameter, optimizer in model.opts.items():
        assert optimizer.param_groups[0]["params"][0] is parameter
        assert optimizer.state[parameter]["exp_avg"].shape == parameter.shape
    assert moved[-3:] == [True] * 3  # the hooks kept stepping the cut weights


@pytest.fixture
def one_rank_group(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_zero_redundancy_optimizer_keeps_training_the_cut_parameters(tmp_path, one_rank_group):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def zero(parameters):
        return ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.Adam, lr=0.01)

    model = Net(zero)
    still: list[list[str]] = []

    class Moves(Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step > 7:  # after the last cut
                named = pl_module.named_parameters()
                still.append([n for n, p in named if torch.equal(p, self.before[n])])

    prune = _prune()
    pl.Trainer(max_steps=10, callbacks=[prune, Moves()], **trainer_kwargs(default_root_dir=tmp_path)).fit(
        model, _data()
    )
    assert len(prune.events) >= 2 and model.fc1.out_features < 32
    assert still == [[], [], []]


def test_zero_redundancy_optimizer_with_bucket_view_is_refused(tmp_path, one_rank_group):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def zero(parameters):
        return ZeroRedundancyOptimizer(
            parameters, optimizer_class=torch.optim.Adam, lr=0.01, parameters_as_bucket_view=True
        )

    trainer = pl.Trainer(max_steps=4, callbacks=[_prune()], **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.raises(PulseRefusal, match="ZeroRedundancyOptimizer with parameters_as_bucket_view=True"):
        trainer.fit(Net(zero), _data())
    assert trainer.global_step == 0


class NormNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.bn = nn.BatchNorm1d(32)

    def forward(self, x):
        return self.fc3(F.relu(self.bn(self.fc2(self.norm(F.relu(self.fc1(x)))))))


def test_a_weights_only_checkpoint_of_a_structured_run_loads_into_a_fresh_module(tmp_path):
    torch.manual_seed(0)
    model = NormNet()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_weights_only=True, save_last=True)
    kwargs = trainer_kwargs(default_root_dir=tmp_path, enable_checkpointing=True)
    pl.Trainer(max_steps=10, callbacks=[_prune(), checkpoints], **kwargs).fit(model, _data())
    assert model.fc1.out_features < 32 and model.fc2.out_features < 32
    saved = torch.load(os.path.join(tmp_path, "last.ckpt"), weights_only=False)
    assert "callbacks" not in saved  # no record of the removals
    fresh = ScheduledPrune.load_pruned(NormNet(), os.path.join(tmp_path, "last.ckpt"))
    model.eval(), fresh.eval()
    x = torch.randn(5, 16)
    assert torch.equal(fresh(x), model(x))
    assert (fresh.fc1.out_features, fresh.fc2.in_features) == (model.fc1.out_features, model.fc2.in_features)
    assert (
        fresh.norm.normalized_shape == model.norm.normalized_shape
        and fresh.bn.num_features == model.bn.num_features
    )


def test_a_layer_whose_width_its_shapes_do_not_tell_names_the_way_out():
    class Grouped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(8, 8, 3, groups=2)

    cut = {"conv.weight": torch.zeros(6, 4, 3), "conv.bias": torch.zeros(6)}
    module = Grouped()
    with pytest.raises(RuntimeError, match="conv .Conv1d. cannot be read from their shapes") as raised:
        prune_widths.fit_widths(module, cut)
    assert "save_weights_only=False" in str(raised.value)
    assert module.conv.weight.shape == (8, 4, 3)  # nothing changed


def test_load_pruned_of_a_full_checkpoint_keeps_the_fresh_modules_hooks_and_references(tmp_path):
    """Review: replaying the recorded cuts on a fresh module (a resume, ``load_pruned``) let torch-pruning put
    new parameters in, so the fresh module's gradient hooks and its list for the L2 term went dead again."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    kwargs = trainer_kwargs(default_root_dir=tmp_path, enable_checkpointing=True)
    pl.Trainer(max_steps=8, callbacks=[_prune(), checkpoints], **kwargs).fit(HookedNet(), _data())
    fresh = ScheduledPrune.load_pruned(HookedNet(), os.path.join(tmp_path, "last.ckpt"))
    assert fresh.fc1.out_features < 32
    assert fresh.decay[0] is fresh.fc1.weight and fresh.decay[1] is fresh.fc2.weight
    x, y = next(iter(_data()))
    fresh.training_step((x, y), 0).backward()
    assert set(fresh.post_calls.values()) == {1} and len(fresh.post_calls) == 6
    assert max(p.grad.abs().max().item() for p in fresh.parameters()) <= 0.01


def test_a_layer_norm_without_weights_as_wide_as_a_cut_width_names_the_way_out():
    """Review: a LayerNorm without affine weights holds a width but no tensor, so a weights-only load left it
    at the old width and returned a model whose first forward failed."""

    class PlainNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 32)
            self.ln = nn.LayerNorm(32, elementwise_affine=False)

    cut = {"fc.weight": torch.zeros(16, 8), "fc.bias": torch.zeros(16)}
    with pytest.raises(RuntimeError, match="ln .LayerNorm. cannot be read from their shapes"):
        prune_widths.fit_widths(PlainNorm(), cut)
