"""A structured cut and the optimizer state of a square weight: one value per weight (Adam's moments, SGD's
momentum, a hand-written Lion's) is cut to the kept rows and columns; a matrix over one side of the weight
(a Shampoo or K-FAC preconditioner, an eigenbasis) is not one value per weight and is reset with a message."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import pruning
from tests.conftest import trainer_kwargs


class ShampooLike(torch.optim.Optimizer):
    """Shampoo as often hand-written: preconditioners ``L`` (out, out) and ``R`` (in, in) for 2-D weights."""

    def __init__(self, params, lr=1e-3, eps=1e-4):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if g.dim() != 2:
                    p.add_(g, alpha=-group["lr"])
                    continue
                if not state:
                    state["L"] = group["eps"] * torch.eye(g.shape[0])
                    state["R"] = group["eps"] * torch.eye(g.shape[1])
                # shapes checked here as Shampoo's matrix products would: a cut like the weight's broke them
                state["L"].add_(g @ g.T)
                state["R"].add_(g.T @ g)
                p.add_(_inverse_root(state["L"]) @ g @ _inverse_root(state["R"]), alpha=-group["lr"])
        return loss


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _inverse_root(matrix):
    values, vectors = torch.linalg.eigh(matrix)
    return vectors @ torch.diag(values.clamp_min(1e-12) ** -0.25) @ vectors.T


class Lion(torch.optim.Optimizer):
    """Lion as often hand-written: one momentum ``exp_avg`` per weight."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                b1, b2 = group["betas"]
                p.add_(state["exp_avg"].mul(b1).add(p.grad, alpha=1 - b1).sign_(), alpha=-group["lr"])
                state["exp_avg"].mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


class SophiaLike(torch.optim.Optimizer):
    """Sophia-like: a momentum and a diagonal Hessian estimate per weight, ``step`` a tensor."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(
                        step=torch.zeros(()), exp_avg=torch.zeros_like(p), hessian=torch.zeros_like(p)
                    )
                state["step"] += 1
                state["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["hessian"].mul_(0.99).addcmul_(p.grad, p.grad, value=0.01)
                ratio = (state["exp_avg"].abs() / (0.04 * state["hessian"] + 1e-15)).clamp(None, 1)
                p.addcmul_(state["exp_avg"].sign(), ratio, value=-group["lr"])
        return loss


class AdamSubclass(torch.optim.Adam):
    """A subclass: not one of torch.optim's own, so its state is read as any other optimizer's."""


def _square_middle(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


def _steps(model, optimizer, steps=3):
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 16, generator=generator), torch.randint(0, 5, (64,), generator=generator)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _rows_and_columns(remap, parameter):
    """The rows and columns of ``parameter`` (square before the cut) that the cut kept."""
    (kept,) = [kept for old, _, kept in remap if old is parameter]
    n = remap.shape_before(parameter)[0]
    grid = kept.reshape(parameter.shape)
    return grid[:, 0] // n, grid[0, :] % n


def test_a_square_weights_preconditioners_are_reset_with_a_message_not_cut_as_the_weight():
    # both sides of the (32, 32) weight are cut: its L and R were cut rows x columns as the weight, so they
    # went on non-symmetric (L[rows][:, columns]), with no word
    model = _square_middle()
    optimizer = ShampooLike(model.parameters())
    _steps(model, optimizer)
    square = model[2].weight
    outcome = pruning.Pruner(mode="structured").prune(model, 0.5, [optimizer], example=torch.randn(2, 16))
    rows, columns = _rows_and_columns(outcome.remap, square)
    assert square.shape == (16, 16) and not torch.equal(rows, columns)
    assert square not in optimizer.state
    said = [problem for problem in outcome.problems if "'2.weight'" in problem]
    assert len(said) == 1
    assert (
        "optimizer state 'L' of ShampooLike for parameter '2.weight' of shape (32, 32) is symmetric"
        in said[0]
    )
    assert said[0].endswith("that parameter's state was reset.")
    _steps(model, optimizer, steps=1)  # fresh preconditioners over the kept sides
    left, right = optimizer.state[square]["L"], optimizer.state[square]["R"]
    assert left.shape == right.shape == (16, 16) and torch.allclose(left, left.T)


def test_an_eigenbasis_over_one_side_of_a_square_weight_is_reset_with_a_message():
    # an orthonormal basis (SOAP keeps its preconditioners' eigenvectors) is not symmetric, nor per weight
    model = _square_middle()
    optimizer = Lion(model.parameters())
    _steps(model, optimizer)
    square = model[2].weight
    optimizer.state[square]["basis"] = torch.linalg.qr(torch.randn(32, 32))[0]
    outcome = pruning.Pruner(mode="structured").prune(model, 0.5, [optimizer], example=torch.randn(2, 16))
    assert square not in optimizer.state
    assert outcome.problems == [
        "optimizer state 'basis' of Lion for parameter '2.weight' of shape (32, 32) has orthonormal rows and "
        "columns, so it reads as a matrix over the weight's outputs or its inputs (a Shampoo or K-FAC "
        "preconditioner), not one value per weight; the cut kept other rows than columns, so which side it "
        "covers is unknown and cut as the weight it would be wrong; that parameter's state was reset."
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        lambda p: torch.optim.Adagrad(p),
        lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
        lambda p: torch.optim.NAdam(p),
        lambda p: torch.optim.RAdam(p),
        lambda p: torch.optim.Adamax(p),
        lambda p: torch.optim.Rprop(p),
        lambda p: torch.optim.ASGD(p, t0=0),
        lambda p: Lion(p),
        lambda p: SophiaLike(p),
        lambda p: AdamSubclass(p, lr=1e-2),
    ],
    ids=[
        "Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Rprop", "ASGD",
        "Lion", "SophiaLike", "AdamSubclass",
    ],
)  # fmt: skip
def test_per_weight_state_of_a_square_weight_is_still_cut_to_the_kept_rows_and_columns(make):
    model = _square_middle()
    optimizer = make(model.parameters())
    _steps(model, optimizer)
    square = model[2].weight
    before = {key: value.clone() for key, value in optimizer.state[square].items() if torch.is_tensor(value)}
    outcome = pruning.Pruner(mode="structured").prune(model, 0.5, [optimizer], example=torch.randn(2, 16))
    rows, columns = _rows_and_columns(outcome.remap, square)
    assert not torch.equal(rows, columns)  # the cut that cannot tell a one-sided matrix's side
    assert outcome.problems == []
    state = optimizer.state[square]
    per_weight = [key for key, value in before.items() if value.shape == (32, 32)]
    assert per_weight and set(before) <= set(state)
    for key in per_weight:
        assert torch.equal(state[key], before[key][rows][:, columns]), key
    _steps(model, optimizer, steps=1)


class _Residual(nn.Module):
    """A square layer inside a residual block: the cut keeps the same rows as columns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.block, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x):
        h = self.stem(x)
        return self.head(F.relu(h + self.block(F.relu(h))))


def test_a_square_weight_cut_alike_on_both_sides_keeps_its_preconditioners_cut_over_the_kept_side():
    # rows == columns: L[rows][:, rows], R[columns][:, columns] and the weight's cut are the same elements
    model = _Residual()
    optimizer = ShampooLike(model.parameters())
    _steps(model, optimizer)
    square = model.block.weight
    left, right = optimizer.state[square]["L"].clone(), optimizer.state[square]["R"].clone()
    outcome = pruning.Pruner(mode="structured").prune(model, 0.5, [optimizer], example=torch.randn(2, 16))
    rows, columns = _rows_and_columns(outcome.remap, square)
    assert square.shape == (16, 16) and torch.equal(rows, columns)
    assert not [problem for problem in outcome.problems if "'block.weight'" in problem]
    assert torch.equal(optimizer.state[square]["L"], left[rows][:, rows])
    assert torch.equal(optimizer.state[square]["R"], right[columns][:, columns])


class _SquareFirst(pl.LightningModule):
    """A square first layer: a cut can reach only its outputs (its inputs are the model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(8, 3)
        self.example_input_array = torch.zeros(2, 16)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return ShampooLike(self.parameters(), lr=1e-3)


def test_a_square_weight_cut_on_its_outputs_only_keeps_training_under_a_shampoo_like_optimizer(tmp_path):
    # its (16, 16) L and R were cut to the weight's (n, 16): the next step crashed mid-run
    # ("The size of tensor a (16) must match the size of tensor b (8)")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=generator)
    data = DataLoader(
        TensorDataset(x, (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()), batch_size=16
    )
    model = _SquareFirst()
    prune = ScheduledPrune(final_sparsity=0.5, mode="structured", start=2, end=6, every=2, probe_batches=0)
    trainer = pl.Trainer(max_steps=10, callbacks=[prune], **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.warns(UserWarning) as warned:
        trainer.fit(model, data)
    assert trainer.global_step == 10 and model.fc1.weight.shape[0] < 16 == model.fc1.weight.shape[1]
    said = [str(w.message) for w in warned if "'fc1.weight'" in str(w.message)]
    assert (
        said and "optimizer state 'L' of ShampooLike for parameter 'fc1.weight' of shape (16, 16)" in said[0]
    )
    state = trainer.optimizers[0].state[model.fc1.weight]
    out_features, in_features = model.fc1.weight.shape
    assert state["L"].shape == (out_features, out_features) and state["R"].shape == (in_features, in_features)
