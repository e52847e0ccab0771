"""StabilityGuard next to updates made inside backward (torch's optimizer-in-backward: per-parameter optimizers
stepped by ``register_post_accumulate_grad_hook``, Lightning's optimizer doing no work): refused at the fit's
first step, since no gradient reaches ``optimizer.step()`` and a skip cannot undo the update. Hooks that only
read gradients, frozen or unused parameters and a first step whose gradients are all zero stay guarded."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse.callbacks.stability_guard import StabilityGuard
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcessesRecordingErrors


def _data(rows: int = 128) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=generator)
    y = (x[:, :4].sum(1) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=8)


class _InBackward(pl.LightningModule):
    """Optimizer-in-backward under automatic optimization: each parameter's own SGD steps in its
    post-accumulate-grad hook, then clears the gradient (``set_to_none``: to ``None``, else to zeros);
    Lightning's optimizer runs at ``lr=0``."""

    def __init__(self, set_to_none: bool = True, mixed: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.set_to_none, self.mixed = set_to_none, mixed

    def setup(self, stage: str) -> None:  # in each DDP process: a pickled parameter loses its hooks
        in_backward = self.net[0].parameters() if self.mixed else self.net.parameters()
        self.opts = {p: torch.optim.SGD([p], lr=0.05) for p in in_backward}
        for p in self.opts:
            p.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: torch.Tensor) -> None:
        self.opts[param].step()
        self.opts[param].zero_grad(set_to_none=self.set_to_none)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):  # mixed: it trains the last layer, the hooks the first
        return torch.optim.SGD(
            self.net[2].parameters() if self.mixed else self.parameters(), lr=0.05 * self.mixed
        )


class _Moves(pl.Callback):
    """Whether the weights moved within the fit's first step (``None``: it did not end)."""

    moved: bool | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            self.before = [p.detach().clone() for p in pl_module.parameters()]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:
            self.moved = any(not torch.equal(p, b) for p, b in zip(pl_module.parameters(), self.before))


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-set-to-none", "grads-zeroed"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_optimizer_in_backward_is_refused_at_the_first_step_instead_of_reporting_skips(
    tmp_path, set_to_none, accumulate
):
    """Held-out sweep: the guard logged `action: skip` for a x1e4 batch whose update the hooks had already
    applied in backward (weights moved by 97), and read `grad_norm=n/a` every step with nothing said."""
    guard, moves = StabilityGuard(warmup=5, max_rollbacks=0), _Moves()
    trainer = pl.Trainer(
        max_steps=6,
        callbacks=[moves, guard],
        accumulate_grad_batches=accumulate,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    with pytest.raises(PulseRefusal, match="StabilityGuard cannot guard this fit") as refused:
        trainer.fit(_InBackward(set_to_none), _data())
    message = str(refused.value)
    assert "at its first optimizer step (step 0)" in message
    assert "register_post_accumulate_grad_hook" in message and "remove StabilityGuard" in message
    assert "net.0.weight" in message  # the parameters updated in backward are named
    assert ("every `.grad` is None" in message) is set_to_none
    assert moves.moved is True and trainer.global_step == 0 and guard.steps_skipped == 0


def test_a_layer_updated_in_backward_beside_one_lightnings_optimizer_trains_is_refused(tmp_path):
    """The optimizer's gradients are there (a gradient norm is read), but the first layer moved in backward:
    a skip would undo only the last layer's update."""
    trainer = pl.Trainer(
        max_steps=6, callbacks=[StabilityGuard(warmup=5)], **trainer_kwargs(default_root_dir=tmp_path)
    )
    with pytest.raises(PulseRefusal, match="hook moved inside backward; net.0.weight, net.0.bias changed"):
        trainer.fit(_InBackward(mixed=True), _data())
    assert trainer.global_step == 0


class _ReadsGradients(pl.LightningModule):
    """Hooks that only read gradients (a post-accumulate-grad hook and a tensor hook), a frozen layer and a
    parameter the loss never reaches; ``zero_first``: the first step's loss is 0 with all-zero gradients (a
    hinge margin met)."""

    def __init__(self, zero_first: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.unused = nn.Parameter(torch.zeros(3))
        self.zero_first, self.norms, self.seen = zero_first, [], 0
        for p in self.net.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.norms.append(p.grad.norm().item()))
        self.net[0].weight.register_hook(self._count)

    def _count(self, grad: torch.Tensor) -> None:
        self.seen += 1

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(self.frozen(batch[0])), batch[1])
        return loss * 0.0 if self.zero_first and self.global_step == 0 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("zero_first", [False, True], ids=["ordinary", "zero-gradients-first"])
def test_hooks_that_read_gradients_and_frozen_or_unused_parameters_stay_guarded(tmp_path, zero_first):
    guard = StabilityGuard(warmup=5)
    model = _ReadsGradients(zero_first)
    start = model.net[0].weight.detach().clone()
    trainer = pl.Trainer(max_steps=6, callbacks=[guard], **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(model, _data())
    assert trainer.global_step == 6 and model.seen == 6 and len(model.norms) == 6 * 4
    assert not torch.equal(model.net[0].weight, start)  # Lightning's optimizer trained it
    assert guard.detector.accepted_steps == 6


class _WritesWeightsOutsideBackward(pl.LightningModule):
    """All-zero gradients at the first step (a fully masked batch), and weights written outside backward: a
    max-norm constraint at batch start, an ``nn.Embedding(max_norm=...)`` in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, max_norm=0.5)
        self.head = nn.Linear(8, 2)
        with torch.no_grad():
            self.head.weight.mul_(10.0)  # above the constraint's norm: the first renorm moves it

    def on_train_batch_start(self, batch, batch_idx):
        with torch.no_grad():
            self.head.weight.copy_(torch.renorm(self.head.weight, 2, 0, 1.0))

    def training_step(self, batch, batch_idx):
        tokens = (batch[0].abs() * 4).long().clamp(max=15)[:, 0]
        loss = F.cross_entropy(self.head(self.emb(tokens)), batch[1], reduction="none")
        return (loss * (0.0 if self.global_step == 0 else 1.0)).mean()  # the first batch fully masked

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def test_weights_written_outside_backward_on_a_zero_gradient_first_step_are_not_refused(tmp_path):
    # a regression sweep: the first-step check compared every parameter on a zero-gradient step and refused
    # a max-norm constraint and an Embedding(max_norm=...) as updates made in backward
    guard = StabilityGuard(warmup=5)
    trainer = pl.Trainer(max_steps=4, callbacks=[guard], **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(_WritesWeightsOutsideBackward(), _data())
    assert trainer.global_step == 4 and guard.detector.accepted_steps == 4


class _LogsGradientNormsAndWritesWeights(pl.LightningModule):
    """Gradient-logging post-accumulate-grad hooks on every parameter (they only read ``p.grad``) and a
    parameter written outside backward: by the forward (``nn.Embedding(max_norm=...)`` renormalises the rows
    it reads in place; a learnable fake quantizer writes its scale and zero point from its observer) or by a
    batch-start hook (a max-norm constraint)."""

    def __init__(self, writer: str) -> None:
        super().__init__()
        from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize
        from torch.ao.quantization.observer import MovingAverageMinMaxObserver

        self.writer, self.norms = writer, {}
        self.emb = nn.Embedding(16, 16, max_norm=0.5)
        self.fq = _LearnableFakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        with torch.no_grad():
            self.net[2].weight.mul_(10.0)  # above the constraint's norm: each renorm moves it
        for name, p in self.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: self.norms.update({name: p.grad.norm()})
            )

    def on_train_batch_start(self, batch, batch_idx):
        if self.writer == "max-norm constraint":
            with torch.no_grad():
                self.net[2].weight.copy_(torch.renorm(self.net[2].weight, 2, 0, 1.0))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        if self.writer == "embedding max_norm":
            x = self.emb((x.abs() * 4).long().clamp(max=15)[:, batch_idx % 16])  # other rows each micro-batch
        elif self.writer == "learnable fake quantizer":
            x = self.fq(x)
        return F.cross_entropy(self.net(x), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("writer", ["embedding max_norm", "max-norm constraint", "learnable fake quantizer"])
def test_gradient_logging_hooks_on_weights_written_outside_backward_stay_guarded(
    tmp_path, writer, accumulate
):
    """Regression sweep: the first-step check compared the hooked parameters with the step's start, before
    the batch-start hooks and the forward, and refused these fits as optimizer-in-backward. Now only what
    moves inside each backward counts (under accumulation a later micro-batch's forward writes between two
    backwards)."""
    model, guard = _LogsGradientNormsAndWritesWeights(writer), StabilityGuard(warmup=5)
    written = {"embedding max_norm": "emb.weight", "max-norm constraint": "net.2.weight"}.get(
        writer, "fq.scale"
    )
    start = model.get_parameter(written).detach().clone()
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[guard],
        accumulate_grad_batches=accumulate,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    trainer.fit(model, _data())
    assert trainer.global_step == 4 and guard.detector.accepted_steps == 4
    assert not torch.equal(model.get_parameter(written), start) and "net.0.weight" in model.norms


@pytest.mark.ddp
def test_optimizer_in_backward_under_ddp_is_refused_on_every_rank(tmp_path):
    import json

    strategy = TwoGlooProcessesRecordingErrors(str(tmp_path))
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[StabilityGuard(warmup=5)],
        **trainer_kwargs(devices=2, strategy=strategy, default_root_dir=tmp_path, limit_val_batches=0),
    )
    with pytest.raises(Exception, match="StabilityGuard cannot guard this fit"):
        trainer.fit(_InBackward(), _data())
    raised = [json.loads((tmp_path / f"rank{rank}-raised.json").read_text()) for rank in (0, 1)]
    assert all(kind == "PulseRefusal" and "first optimizer step" in text for kind, text in raised)
