"""The evaluation probe (PulseCycle's maintain probe, ScheduledPrune's event probes) runs the module's own
``validation_step`` in the middle of training; what that step writes on the module (the Lightning docs'
``self.validation_step_outputs``, counters, buffers) is given back, so neither training nor the real
validation loop sees the probe."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from examples.mnist1d import MNIST1DClassifier
from lightning_pulse import PulseCycle, ScheduledPrune
from tests.conftest import trainer_kwargs


class _DocsPatternClassifier(MNIST1DClassifier):
    """The Lightning docs' pattern for an epoch-end metric: outputs appended in ``validation_step``,
    averaged and cleared in ``on_validation_epoch_end``; ``as_numbers`` keeps them as floats (``.item()``).
    It also counts validation batches in a number and samples in a buffer, and (``running_mean``) shifts its
    logits by a running mean that every forward updates, in eval mode too (a test-time normaliser); with
    ``plain_mean`` that mean is a plain tensor attribute, not a buffer, written in place all the same."""

    def __init__(
        self, as_numbers: bool = False, running_mean: bool = False, plain_mean: bool = False
    ) -> None:
        super().__init__(arch="cnn")
        self.as_numbers, self.running_mean = as_numbers, running_mean
        self.validation_step_outputs: list = []
        self.outputs_list_id = id(self.validation_step_outputs)
        self.validation_batches = 0
        self.epoch_ends: list[tuple[int, float]] = []  # (outputs averaged, their mean) at every epoch end
        self.register_buffer("validation_samples", torch.zeros((), dtype=torch.long))
        if plain_mean:
            self.logit_mean = torch.zeros(10)
        else:
            self.register_buffer("logit_mean", torch.zeros(10))

    def forward(self, x):
        logits = self.net(x)
        if not self.running_mean:
            return logits
        with torch.no_grad():
            self.logit_mean.lerp_(logits.mean(0), 0.1)
        return logits - self.logit_mean

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.validation_step_outputs.append(loss.item() if self.as_numbers else loss)
        self.validation_batches += 1
        self.validation_samples += len(x)
        self.log("val_loss", loss)

    def on_validation_epoch_end(self):
        outputs = self.validation_step_outputs
        assert id(outputs) == self.outputs_list_id  # the user's own list, never replaced
        mean = float(sum(outputs) / len(outputs))
        self.epoch_ends.append((len(outputs), mean))
        self.log("val_outputs_mean", mean)
        outputs.clear()


def _fit(mnist1d_small, callback, **model_kwargs):
    pl.seed_everything(3)
    _, data = mnist1d_small()
    model = _DocsPatternClassifier(**model_kwargs)
    trainer = pl.Trainer(callbacks=[callback], max_epochs=2, **trainer_kwargs())
    trainer.fit(model, data)
    return model, trainer


def _cycle(probe: str = "probe") -> PulseCycle:
    return PulseCycle(burst=5, replay=0, maintain=2, warmup=0.0, anneal=0.0, maintain_eval=probe)


@pytest.mark.parametrize(
    "make_callback",
    [_cycle, lambda: ScheduledPrune(start=3, end=15, every=4)],
    ids=["pulse-cycle", "scheduled-prune"],
)
def test_the_docs_validation_outputs_list_survives_the_probe(mnist1d_small, make_callback):
    """Sweep: the probe's ``kept_carried_state`` saw tensors appear in a list that was empty on entry and
    deleted the attribute; the next ``validation_step`` raised AttributeError mid-run."""
    callback = make_callback()
    probes = []
    run = callback.probe.run
    callback.probe.run = lambda *args: probes.append(run(*args)) or probes[-1]
    model, _ = _fit(mnist1d_small, callback)
    assert len([figures for figures in probes if figures]) >= 2  # several probes ran, each with its figures
    assert id(model.validation_step_outputs) == model.outputs_list_id
    assert model.validation_step_outputs == []
    validation_batches = model.validation_batches // len(model.epoch_ends)
    assert [count for count, _ in model.epoch_ends] == [validation_batches] * 2


@pytest.mark.parametrize("as_numbers", [False, True], ids=["tensors", "numbers"])
def test_a_run_with_the_probe_trains_and_validates_as_the_run_without_it(mnist1d_small, as_numbers):
    """Sweep: the probe's outputs stayed in the list (the real epoch averaged 8 stale probe outputs with its
    3: val_loss 20% off), its counts in a number and a buffer, and its forwards in a running mean that every
    forward updates, which then changed training."""
    probed, probed_trainer = _fit(mnist1d_small, _cycle(), as_numbers=as_numbers, running_mean=True)
    plain, plain_trainer = _fit(mnist1d_small, _cycle("none"), as_numbers=as_numbers, running_mean=True)
    assert probed.validation_batches == plain.validation_batches
    assert torch.equal(probed.validation_samples, plain.validation_samples)
    assert probed.epoch_ends == plain.epoch_ends
    for name, parameter in plain.state_dict().items():
        assert torch.equal(probed.state_dict()[name], parameter), name
    for key in ("val_loss", "val_outputs_mean"):
        assert torch.equal(probed_trainer.callback_metrics[key], plain_trainer.callback_metrics[key]), key


def test_a_plain_tensor_attribute_written_in_place_comes_back_after_the_probe(mnist1d_small):
    """Sweep: the probe gave back a plain tensor attribute's reference, not its values: a running mean kept as
    ``self.logit_mean = torch.zeros(10)`` and moved in place by the probe's eval forwards changed training
    (weights 5e-3 apart from the run without the probe), though a buffer written so came back."""
    probed, probed_trainer = _fit(mnist1d_small, _cycle(), running_mean=True, plain_mean=True)
    plain, plain_trainer = _fit(mnist1d_small, _cycle("none"), running_mean=True, plain_mean=True)
    assert "logit_mean" not in plain._buffers
    assert torch.equal(probed.logit_mean, plain.logit_mean)
    for name, parameter in plain.state_dict().items():
        assert torch.equal(probed.state_dict()[name], parameter), name
    assert torch.equal(
        probed_trainer.callback_metrics["val_loss"], plain_trainer.callback_metrics["val_loss"]
    )


class _RerunSpy(pl.Callback):
    """At one batch end, re-runs that batch's ``training_step`` as StabilityGuard's rollback test does and
    records the module's plain running mean before and after."""

    def __init__(self, at: int) -> None:
        self.at, self.means = at, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_pulse.probe import training_losses

        if trainer.global_step == self.at:
            before = pl_module.logit_mean.clone()
            losses = training_losses(trainer, pl_module, [(batch_idx, batch)])
            self.means = [before, pl_module.logit_mean.clone()]
            assert len(losses) == 1


def test_stability_guards_rerun_of_training_step_gives_a_plain_attribute_its_values_back(mnist1d_small):
    """The rollback test's re-run of ``training_step`` (``probe.training_losses``) went through the same
    reference-only restore: its training forward moved the plain running mean for good."""
    spy = _RerunSpy(at=3)
    _fit(mnist1d_small, spy, running_mean=True, plain_mean=True)
    before, after = spy.means
    assert torch.equal(before, after)


class _SparseAdjacency(pl.LightningModule):
    """A graph model holding its adjacency as a plain sparse attribute (`self.adj = ...to_sparse()`), common in
    GCN code: read by every forward, never written."""

    def __init__(self) -> None:
        super().__init__()
        self.adj = (torch.eye(8) + torch.diag(torch.ones(7), 1)).to_sparse()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):  # x: (B, 8 nodes, 4 features)
        mixed = torch.stack([torch.sparse.mm(self.adj, sample) for sample in x])
        return self.lin(mixed).mean(1)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("callback", ["probe", "guard"])
def test_a_sparse_plain_attribute_is_carried_through_probes_and_guard_checks(callback):
    # a review and a sweep: the probe's value write-back read it with torch.equal (no sparse kernel) and crashed
    # the first probe; the guard's forward-state evidence did the same at the first step end (an older crash)
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pulse import StabilityGuard

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 8, 4, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    )
    loaders = DataLoader(data, batch_size=8), DataLoader(data, batch_size=8)
    cycle = PulseCycle(burst=4, replay=2, maintain=2, warmup=0, anneal=0, probe_batches=2)
    trainer = pl.Trainer(
        max_steps=16, callbacks=[cycle if callback == "probe" else StabilityGuard()], **trainer_kwargs()
    )
    module = _SparseAdjacency()
    trainer.fit(module, *loaders)
    assert trainer.global_step == 16 and module.adj.is_sparse
    if callback == "probe":
        assert "val_loss" in cycle.last_probe
