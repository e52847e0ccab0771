"""StabilityGuard's one read of the step's loss and gradient norm (lightning_pulse.core.grad_norm)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pulse.core.grad_norm import grad_norm, step_loss_and_grad_norm
from tests.conftest import trainer_kwargs


def _model_with_gradients(accumulate: int = 1, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2), nn.Linear(2, 2)).to(dtype)
    model[3].weight.requires_grad_(False)  # a parameter without a gradient is left out
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(accumulate):  # each micro-batch loss divided by the window, as Lightning does
        loss = model(torch.randn(8, 4, dtype=dtype)).pow(2).mean() / accumulate
        loss.backward()
        losses.append(loss.detach())
    return model, optimizer, losses


@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_read_gives_clip_grad_norms_value_and_the_window_mean_loss(accumulate):
    model, optimizer, losses = _model_with_gradients(accumulate)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == 5
    expected = torch.cat([g.double().flatten() for g in grads]).norm().item()
    loss, norm = step_loss_and_grad_norm(optimizer.param_groups, losses)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert norm == pytest.approx(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item(), rel=1e-6)
    assert loss == pytest.approx(sum(value.item() for value in losses), rel=1e-6)


def test_bf16_gradients_and_losses_are_read_in_float32():
    model, optimizer, losses = _model_with_gradients(accumulate=2, dtype=torch.bfloat16)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(g.dtype is torch.bfloat16 for g in grads)
    expected = torch.cat([g.double().flatten() for g in grads]).norm().item()
    loss, norm = step_loss_and_grad_norm(optimizer.param_groups, losses)
    assert norm == pytest.approx(expected, rel=1e-2)  # bf16 carries 3 significant digits
    assert loss == pytest.approx(sum(value.double().item() for value in losses), rel=1e-6)


def test_a_sparse_gradient_counts_by_its_coalesced_values():
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1, 1, 2])).sum().backward()  # index 1 twice: an uncoalesced gradient
    assert embedding.weight.grad.is_sparse and not embedding.weight.grad.is_coalesced()
    dense = nn.Linear(3, 1)
    dense(torch.ones(1, 3)).sum().backward()
    grads = [embedding.weight.grad, *[p.grad for p in dense.parameters()]]
    expected = torch.cat(
        [embedding.weight.grad.to_dense().flatten(), *[p.grad.flatten() for p in dense.parameters()]]
    )
    assert grad_norm(grads).item() == pytest.approx(expected.norm().item(), rel=1e-6)


def test_nothing_to_read_gives_none_and_non_finite_entries_a_non_finite_norm():
    model, optimizer, losses = _model_with_gradients()
    assert step_loss_and_grad_norm(optimizer.param_groups, [])[0] is None
    for param in model.parameters():
        param.grad = None
    assert step_loss_and_grad_norm(optimizer.param_groups, losses) == (pytest.approx(losses[0].item()), None)
    assert step_loss_and_grad_norm(optimizer.param_groups, []) == (None, None)
    model, optimizer, losses = _model_with_gradients()
    model[0].weight.grad[0, 0] = float("nan")
    assert math.isnan(step_loss_and_grad_norm(optimizer.param_groups, losses)[1])
    model[0].weight.grad[0, 0] = float("inf")
    losses[0].fill_(float("nan"))
    loss, norm = step_loss_and_grad_norm(optimizer.param_groups, losses)
    assert math.isnan(loss) and norm == math.inf


def test_the_read_makes_one_device_to_host_transfer(monkeypatch):
    model, optimizer, losses = _model_with_gradients(accumulate=2)
    calls = {"tolist": 0, "item": 0}
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "tolist", counting("tolist", tolist))
    monkeypatch.setattr(torch.Tensor, "item", counting("item", item))
    step_loss_and_grad_norm(optimizer.param_groups, losses)
    assert calls == {"tolist": 1, "item": 0}


def test_under_ddp_the_loss_is_the_mean_over_ranks_and_the_norm_stays_the_shared_one():
    model, optimizer, losses = _model_with_gradients()
    _, norm = step_loss_and_grad_norm(optimizer.param_groups, losses)
    other_rank_loss = 3.0
    reduced = []

    def all_reduce_sum(stats):  # a second rank with the same (all-reduced) gradients and its own loss
        reduced.append(stats.clone())
        other = stats.clone()
        other[0] = other_rank_loss
        return stats + other

    loss, ddp_norm = step_loss_and_grad_norm(optimizer.param_groups, losses, all_reduce_sum, world_size=2)
    assert len(reduced) == 1 and reduced[0].numel() == 3  # one collective of three numbers
    assert loss == pytest.approx((losses[0].item() + other_rank_loss) / 2)
    assert ddp_norm == pytest.approx(norm, rel=1e-6)


@pytest.mark.parametrize(("precision", "accumulate"), [("32-true", 1), ("bf16-mixed", 2)])
def test_the_guard_judges_the_loss_and_gradient_norm_of_every_optimizer_step(precision, accumulate):
    """In a real fit, the values entering the guard's windows are each step's window loss and total norm."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
    from lightning_pulse.callbacks.stability_guard import StabilityGuard
    from lightning_pulse.phase import Phase

    class Reference(Callback):
        def __init__(self):
            self.losses, self.norms, self._window = [], [], 0.0

        def on_before_backward(self, trainer, pl_module, loss):
            self._window += loss.item()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(torch.nn.utils.get_total_norm(grads, 2.0).item())
            self.losses.append(self._window)
            self._window = 0.0

    guard, reference = StabilityGuard(window=50), Reference()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        callbacks=[guard, reference],
        precision=precision,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs(max_steps=8, limit_val_batches=0),
    )
    trainer.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=600, batch_size=32))
    # every step was quiet, so each entered the burst baseline's windows (log values, in step order)
    seen_losses = [math.exp(value) for value in guard.detector._loss[Phase.BURST.value].values]
    seen_norms = [math.exp(value) for value in guard.detector._grad_norm[Phase.BURST.value].values]
    assert len(reference.losses) == len(reference.norms) == 8
    assert seen_losses == pytest.approx(reference.losses, rel=1e-5)
    assert seen_norms == pytest.approx(reference.norms, rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_read_synchronises_once():
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(torch.randn(8, 4, device="cuda")).pow(2).mean() / 2
        loss.backward()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # every synchronising CUDA call warns
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, norm = step_loss_and_grad_norm(optimizer.param_groups, losses)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
    expected = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm().item()
    assert norm == pytest.approx(expected, rel=1e-5)
    assert loss == pytest.approx(sum(value.item() for value in losses), rel=1e-6)
