"""StabilityGuard and the parameters a module's own code writes: frozen ones and those no optimizer holds.

An EMA codebook kept in parameters (``nn.Parameter(requires_grad=False)`` written in place, or re-created as a
new ``nn.Parameter`` in each forward: the widely copied ``VectorQuantizerEMA``) goes NaN in a forward over a
NaN sample, as BatchNorm's statistics do. The guard took any non-finite parameter for the model's fault and
rolled back at once, to the same snapshot each time the sample came back, and stopped the run. A momentum
encoder or an ``AveragedModel`` that ``training_step`` updates took a second update from the guard's own
re-run of ``training_step`` (the data check), never given back. Such parameters now count with the forward
state (:func:`~lightning_pulse.core.snapshots.written_outside`): a data fault sets them back to their values
before its step (:class:`~lightning_pulse.core.snapshots.PreStepBuffers`), and every check gives them back.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel

from lightning_pulse import StabilityGuard
from lightning_pulse.core.snapshots import take_snapshot
from tests.conftest import trainer_kwargs

BATCH = 8
BAD_SAMPLE = 29  # in batch 3 of each epoch (no shuffling): past the two applied steps that learn
CODES, WIDTH = 6, 3


class _EmaCodebook(nn.Module):
    """A vector quantiser whose codebook follows its codes' means by EMA in each training forward, held in a
    parameter: a frozen one written in place, or (``recreate``) one re-created as a new ``nn.Parameter``."""

    def __init__(self, recreate: bool) -> None:
        super().__init__()
        self.recreate = recreate
        self.embed = nn.Parameter(torch.randn(CODES, WIDTH), requires_grad=recreate)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        embed = self.embed.detach()
        codes = torch.cdist(z, embed).argmin(dim=1)
        quantised = embed[codes]
        if self.training:
            onehot = F.one_hot(codes, CODES).to(z.dtype)
            counts = onehot.sum(dim=0)[:, None]
            means = torch.where(counts > 0, onehot.t() @ z.detach() / counts.clamp(min=1), embed)
            updated = 0.9 * embed + 0.1 * means
            if self.recreate:
                self.embed = nn.Parameter(updated)
            else:
                with torch.no_grad():
                    self.embed.copy_(updated)
        return z + (quantised - z).detach()


class _VectorQuantised(pl.LightningModule):
    """An encoder, the codebook and a decoder; the optimizer trains the encoder and decoder only.
    ``skip_steps_of``: the batch indices whose step it skips by hand, before the forward."""

    def __init__(self, recreate: bool, skip_steps_of: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.skip_steps_of = skip_steps_of
        self.encoder = nn.Linear(4, WIDTH)
        self.codebook = _EmaCodebook(recreate)
        self.decoder = nn.Linear(WIDTH, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip_steps_of:
            return None
        x, y = batch
        z = self.encoder(x)
        return F.mse_loss(self.decoder(self.codebook(z)).squeeze(-1), y) + F.mse_loss(z, z.detach() * 0.5)

    def configure_optimizers(self):
        trained = [p for name, p in self.named_parameters() if not name.startswith("codebook.")]
        return torch.optim.SGD(trained, lr=0.05)


class _MomentumTeacher(pl.LightningModule):
    """A student, a momentum teacher (frozen, in the optimizer) and an ``AveragedModel`` of the student (held
    by no optimizer), both updated in ``training_step``."""

    def __init__(self, skip_steps_of: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.skip_steps_of = skip_steps_of
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.teacher = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).requires_grad_(False)
        self.average = AveragedModel(self.student)

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip_steps_of:
            return None
        with torch.no_grad():
            for taught, teaching in zip(self.teacher.parameters(), self.student.parameters()):
                taught.mul_(0.9).add_(teaching, alpha=0.1)
        self.average.update_parameters(self.student)
        x, y = batch
        prediction = self.student(x).squeeze(-1)
        return F.mse_loss(prediction, y) + 0.1 * F.mse_loss(prediction, self.teacher(x).squeeze(-1))

    def configure_optimizers(self):  # the average trains nothing (the optimizer does not hold it)
        return torch.optim.SGD([*self.student.parameters(), *self.teacher.parameters()], lr=0.05)


def _loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = x.sum(dim=1)
    x[BAD_SAMPLE, 2] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(model: pl.LightningModule, callbacks: list) -> None:
    pl.seed_everything(0)
    pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=3)).fit(model, _loader())


def _same_state(kept: nn.Module, expected: nn.Module) -> None:
    kept_state, expected_state = kept.state_dict(), expected.state_dict()
    assert kept_state.keys() == expected_state.keys()
    for name, tensor in kept_state.items():
        assert torch.equal(tensor, expected_state[name]), name


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
@pytest.mark.parametrize("recreate", [False, True], ids=["frozen-in-place", "re-created-unheld"])
def test_a_nan_sample_through_an_ema_codebook_held_in_parameters_is_skipped_as_the_datas_fault(recreate):
    """Before, the NaN the bad forward wrote into the codebook was the model's fault: rolled back at once to
    the fit-start snapshot each epoch (no snapshot in the skipped batches), then stopped. Now it is the
    data's, and the codebook goes back to its values before the step: the run ends as one that skipped the
    bad batch's step by hand (``snapshot_every=100``: the snapshot's values would not)."""
    torch.manual_seed(0)
    by_hand = _VectorQuantised(recreate, skip_steps_of=frozenset({BAD_SAMPLE // BATCH}))
    guarded = _VectorQuantised(recreate)
    guarded.load_state_dict(by_hand.state_dict())
    _fit(by_hand, [])
    guard = StabilityGuard(snapshot_every=100, loss_zscore=None, grad_norm_zscore=None)
    with pytest.warns(UserWarning, match="non-finite values in its data") as warnings:
        _fit(guarded, [guard])
    assert guard.rollbacks == 0 and guard.bad_batches == 3  # once an epoch
    assert [event["cause"] for event in guard.events] == ["data"] * 3
    said = next(str(w.message) for w in warnings if "in its data" in str(w.message))
    assert "codebook.embed: set back to their values before this step." in said
    _same_state(guarded, by_hand)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")
def test_a_skipped_data_fault_leaves_a_momentum_teacher_and_an_averaged_model_as_a_skip_by_hand():
    """Before, the data check's re-run of ``training_step`` gave a second momentum update to the teacher and
    to the average (whose ``n_averaged`` buffer was set back): on each skipped step the teacher took two
    updates and the average's weights disagreed with its count. Now both are as if the step never ran."""
    torch.manual_seed(0)
    by_hand = _MomentumTeacher(skip_steps_of=frozenset({BAD_SAMPLE // BATCH}))
    guarded = _MomentumTeacher()
    guarded.load_state_dict(by_hand.state_dict())
    _fit(by_hand, [])
    guard = StabilityGuard(snapshot_every=100, loss_zscore=None, grad_norm_zscore=None)
    with pytest.warns(UserWarning, match="non-finite values in its data"):
        _fit(guarded, [guard])
    assert guard.rollbacks == 0 and guard.bad_batches == 3
    assert int(guarded.average.n_averaged) == int(by_hand.average.n_averaged) == 24 - 3
    _same_state(guarded, by_hand)


def test_the_data_check_gives_back_parameters_its_rerun_writes_or_re_creates():
    """Whatever the guard learned: a parameter the re-run writes in place, or re-creates as a new object, is
    the same object with the same values after the check (the re-run is the guard's, not training)."""
    guard = StabilityGuard()
    model = _VectorQuantised(recreate=True)
    model.teacher = nn.Linear(2, 2).requires_grad_(False)
    optimizers = [model.configure_optimizers()]
    objects = dict(model.named_parameters())
    values = {name: param.detach().clone() for name, param in objects.items()}
    guard.core.start(0, optimizers)
    with guard.core.forward_state_for_a_check(model, guard.core.saved_forward_state(model), optimizers):
        model.codebook(torch.randn(5, WIDTH))  # re-creates the codebook
        with torch.no_grad():
            model.teacher.weight.add_(1.0)
    for name, param in model.named_parameters():
        assert param is objects[name] and torch.equal(param, values[name]), name


def test_a_model_whose_parameters_only_its_optimizer_writes_learns_and_copies_nothing_more():
    """The per-step path is as it was for a model whose every parameter the optimizer trains: nothing to
    fingerprint at a snapshot, nothing copied before a step."""
    guard = StabilityGuard()
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    guard.core.start(0, optimizers)
    guard.core.take_snapshot(0, model, optimizers, [], {})
    model(torch.randn(2, 3)).sum().backward()
    optimizers[0].step()
    guard.core.take_snapshot(1, model, optimizers, [], {})
    assert guard.core.pre_step.fingerprints == {} and guard.core.pre_step.slots == []


def test_a_frozen_backbone_nobody_writes_is_never_copied_before_a_step():
    """Frozen parameters are fingerprinted at snapshots (a sum each, on their device), not copied: only one
    whose sum changed is, and a momentum update counts from the step it first changes a value."""
    guard = StabilityGuard()
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)  # a frozen backbone, left in the optimizer
    model.teacher = nn.Linear(4, 1).requires_grad_(False)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    guard.core.start(0, optimizers)
    guard.core.take_snapshot(0, model, optimizers, [], {})
    assert set(guard.core.pre_step.fingerprints) == {"0.weight", "0.bias", "teacher.weight", "teacher.bias"}
    with torch.no_grad():
        model.teacher.weight.mul_(0.5)
    guard.core.pre_step.learn(model, take_snapshot(1, model), optimizers)
    assert guard.core.pre_step.names == ["teacher.weight"]


def test_a_frozen_backbone_is_summed_not_copied_by_a_data_check_and_set_back_if_the_rerun_writes_it():
    """A review of this pass: the data check copied every frozen parameter to the CPU before its re-run (a
    LoRA fit's whole frozen backbone, at every bad batch). One learned as written by nobody is summed
    before and after instead, and set back from the newest snapshot only if the re-run wrote it."""
    guard = StabilityGuard()
    model = nn.Sequential(nn.Linear(3, 64), nn.Linear(64, 1))
    model[0].requires_grad_(False)  # the frozen backbone
    optimizers = [torch.optim.SGD(model[1].parameters(), lr=0.1)]
    guard.core.start(0, optimizers)
    guard.core.take_snapshot(0, model, optimizers, [], {})
    guard.core.take_snapshot(1, model, optimizers, [], {})  # learned: nobody writes it
    before = model[0].weight.detach().clone()
    copied: list[tuple[int, ...]] = []
    real_to = torch.Tensor.to

    def recording_to(tensor, *args, **kwargs):
        if kwargs.get("copy"):
            copied.append(tuple(tensor.shape))
        return real_to(tensor, *args, **kwargs)

    torch.Tensor.to = recording_to
    try:
        with guard.core.forward_state_for_a_check(model, guard.core.saved_forward_state(model), optimizers):
            with torch.no_grad():
                model[0].weight.add_(1.0)  # a re-run that writes it after all
    finally:
        torch.Tensor.to = real_to
    assert (64, 3) not in copied and torch.equal(model[0].weight, before)


def test_units_a_freezer_releases_and_freezes_again_are_not_learned_as_written():
    """A review of this pass: with GradientCache, a unit frozen, released for a refresh (the optimizer trains
    it) and frozen again between two looks had a new sum, and was learned as written by a forward: copied
    before every step for the rest of the fit. Its optimizer state changed too, so an optimizer step wrote
    it."""
    from lightning_pulse import GradientCache

    class _Deep(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(5)]
            self.net = nn.Sequential(*layers, nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]).squeeze(-1), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    pl.seed_everything(0)
    x = torch.randn(800, 16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0].clone()), batch_size=16)
    guard = StabilityGuard(snapshot_every=10, max_snapshots=3, warmup=5)
    cache = GradientCache(threshold=10.0, check_every=3, freeze_for=6)
    pl.Trainer(callbacks=[cache, guard], **trainer_kwargs(max_steps=100)).fit(_Deep(), loader)
    refreezes = [
        e for e in cache.events if "to" in e and e["to"] > e["from"] and e["from"] == 0 and e["step"] > 20
    ]
    assert refreezes  # a unit froze again after a release
    assert guard.core.pre_step.names == []
