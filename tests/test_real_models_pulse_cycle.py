"""PulseCycle on client models nobody here designed for: the rhythm runs, the probe evaluates, nothing leaks."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pulse import Phase, PulseCycle
from tests.clients import CLIENTS, StatefulLSTM
from tests.conftest import trainer_kwargs

pytest.importorskip("transformers")


def _cycle(**kwargs):
    return PulseCycle(
        **{"burst": 10, "replay": 8, "maintain": 2, "warmup": 0, "anneal": 0, "probe_batches": 2, **kwargs}
    )


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_the_rhythm_and_the_probe_run_on_every_client(name):
    pl.seed_everything(0, verbose=False)
    module, data = CLIENTS[name]()
    cycle = _cycle()
    trainer = pl.Trainer(max_steps=60, limit_val_batches=2, callbacks=[cycle], **trainer_kwargs())
    trainer.fit(module, data)
    # phases advance on optimizer steps, also under manual optimization
    assert cycle.clock.steps_by_phase == {"burst": 30, "replay": 24, "maintain": 6}
    assert [c.current for c in cycle.history[:4]] == [Phase.BURST, Phase.REPLAY, Phase.MAINTAIN, Phase.BURST]
    # the maintain probe evaluated the module's own validation_step
    assert math.isfinite(cycle.last_probe["val_loss"])


class _StateAt(Callback):
    """Records the module's carried hidden state after each training batch."""

    def __init__(self) -> None:
        self.states: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states.append(pl_module.state)


def test_the_probe_gives_a_stateful_module_its_training_state_back():
    pl.seed_everything(0, verbose=False)
    module, data = CLIENTS["stateful-lstm"]()
    before, after, cycle = _StateAt(), _StateAt(), _cycle()
    trainer = pl.Trainer(
        max_steps=40, limit_val_batches=2, callbacks=[before, cycle, after], **trainer_kwargs()
    )
    trainer.fit(module, data)
    maintain_entries = [change.step for change in cycle.history if change.current is Phase.MAINTAIN]
    assert maintain_entries  # the probe ran on the validation stream in the middle of training
    for step in maintain_entries:
        # the hidden state the next training batch continues from is the training stream's, not the probe's
        assert after.states[step - 1] is before.states[step - 1]


@pytest.mark.parametrize("validation_batch", [8, 16], ids=["same-batch-size", "other-batch-size"])
def test_the_probe_evaluates_a_stateful_module_from_the_state_its_validation_starts_from(validation_batch):
    """Sweep: the probe calls none of the module's validation hooks as they are, so the client's reset of its
    hidden state in ``on_validation_epoch_start`` never ran: a validation batch of another size crashed the fit
    at the first maintain phase (``Expected hidden[0] size (1, 16, 64), got [2, 8, 64]``), one of the same size
    was measured from the training stream's state (a ``val_loss`` no validation gives). The probe learns, once
    a fit, what the module's validation-start hooks set its carried state to, and starts from it."""
    from torch.utils.data import DataLoader

    from tests.clients import _ContiguousStreams

    pl.seed_everything(0, verbose=False)
    module, data = CLIENTS["stateful-lstm"]()
    data.max_chars = 20_000
    data.val_dataloader = lambda: DataLoader(
        data.val_set, batch_sampler=_ContiguousStreams(len(data.val_set), validation_batch)
    )
    before, after, cycle = _StateAt(), _StateAt(), _cycle()
    trainer = pl.Trainer(
        max_steps=22, limit_val_batches=2, callbacks=[before, cycle, after], **trainer_kwargs()
    )
    trainer.fit(module, data)
    maintain_entries = [change.step for change in cycle.history if change.current is Phase.MAINTAIN]
    assert maintain_entries and math.isfinite(cycle.last_probe["val_loss"])
    for step in maintain_entries:  # training went on from the training stream's state
        assert after.states[step - 1] is before.states[step - 1]
    # at the fit's final weights, the probe gives what Lightning's validation of those batches gives
    training_state = module.state
    probed = cycle.probe.run(trainer, module)
    assert module.state is training_state
    validated = pl.Trainer(limit_val_batches=2, **trainer_kwargs()).validate(module, data, verbose=False)
    assert probed["val_loss"] == pytest.approx(validated[0]["val_loss"], rel=1e-5)
    assert cycle.probe.start.state == {"state": None}  # learnt once, from the module's own hook


def _zero_state_lstm(validation_batch: int):
    """The stateful-lstm client with a state that is never ``None``: zeros made in its epoch-start hooks, for
    the training batch (8) and for ``validation_batch``; its step indexes the state unconditionally."""
    from torch.utils.data import DataLoader

    from tests.clients import StatefulLSTM, _ContiguousStreams

    class ZeroStateLSTM(StatefulLSTM):
        def _step(self, x, y):
            hidden, state = self.lstm(self.embed(x), (self.state[0], self.state[1]))
            self.state = tuple(s.detach() for s in state)
            return torch.nn.functional.cross_entropy(self.out(hidden).flatten(0, 1), y.flatten())

        def on_train_epoch_start(self):
            self.state = (torch.zeros(2, 8, 64), torch.zeros(2, 8, 64))

        def on_validation_epoch_start(self):
            self._train_state = self.state
            self.state = (torch.zeros(2, validation_batch, 64), torch.zeros(2, validation_batch, 64))

    _, data = CLIENTS["stateful-lstm"]()
    data.max_chars = 20_000
    data.val_dataloader = lambda: DataLoader(
        data.val_set, batch_sampler=_ContiguousStreams(len(data.val_set), validation_batch)
    )
    return ZeroStateLSTM(), data


@pytest.mark.parametrize("validation_batch", [8, 16], ids=["same-batch-size", "other-batch-size"])
def test_the_probe_starts_a_state_of_zeros_as_the_modules_own_hook_makes_it(validation_batch):
    """A module whose validation state is zeros of the validation batch's size, made in its own
    ``on_validation_epoch_start`` (its step cannot take ``None``): the probe starts from those (a first design
    set such state to ``None``, and the probe switched itself off for a validation batch of another size)."""
    pl.seed_everything(0, verbose=False)
    module, data = _zero_state_lstm(validation_batch)
    cycle = _cycle()
    trainer = pl.Trainer(max_steps=22, limit_val_batches=2, callbacks=[cycle], **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="PulseCycle: the module's")
        trainer.fit(module, data)
    assert trainer.global_step == 22 and math.isfinite(cycle.last_probe["val_loss"])
    probed = cycle.probe.run(trainer, module)
    validated = pl.Trainer(limit_val_batches=2, **trainer_kwargs()).validate(module, data, verbose=False)
    assert probed["val_loss"] == pytest.approx(validated[0]["val_loss"], rel=1e-5)


def test_a_module_whose_validation_keeps_the_training_state_is_probed_from_it_as_lightning_validates():
    """A review: guessing the validation streams' state from shapes set aside a state that a module without a
    reset hook carries into its validation (Lightning's validation continues from the training stream's state),
    and a running centre that matched the batch size by chance. Without a validation-start hook nothing is
    changed: the probe reads what Lightning's validation reads."""

    class NoReset(StatefulLSTM):
        def on_validation_epoch_start(self) -> None:  # Lightning's own: the state carries on
            pass

        def on_validation_epoch_end(self) -> None:
            pass

    pl.seed_everything(0, verbose=False)
    _, data = CLIENTS["stateful-lstm"]()
    data.max_chars = 20_000
    module, cycle = NoReset(), _cycle()
    trainer = pl.Trainer(max_steps=22, limit_val_batches=2, callbacks=[cycle], **trainer_kwargs())
    trainer.fit(module, data)
    state = module.state
    probed = cycle.probe.run(trainer, module)
    assert module.state is state
    validated = pl.Trainer(limit_val_batches=2, **trainer_kwargs()).validate(module, data, verbose=False)
    assert probed["val_loss"] == pytest.approx(validated[0]["val_loss"], rel=1e-5)
    assert cycle.probe.start.state == {}


def test_a_validation_start_hook_that_swaps_weights_in_leaves_training_and_the_probe_on_the_trained_ones():
    """The probe runs the module's validation-start hooks once a fit to learn its carried state's start; a hook
    that copies EMA weights into the model (its end hook copies them back) must leave neither training nor the
    probe on them."""

    class SwapsWeights(StatefulLSTM):
        def on_validation_epoch_start(self) -> None:
            super().on_validation_epoch_start()
            self._kept = [p.detach().clone() for p in self.parameters()]
            with torch.no_grad():
                for p in self.parameters():
                    p.mul_(0.5)  # stands for the EMA weights

        def on_validation_epoch_end(self) -> None:
            with torch.no_grad():
                for p, kept in zip(self.parameters(), self._kept):
                    p.copy_(kept)
            super().on_validation_epoch_end()

    weights = []
    for maintain_eval in ("none", "probe"):
        pl.seed_everything(0, verbose=False)
        _, data = CLIENTS["stateful-lstm"]()
        data.max_chars = 20_000
        module = SwapsWeights()
        cycle = _cycle(maintain_eval="probe" if maintain_eval == "probe" else "none", probe_batches=4)
        trainer = pl.Trainer(max_steps=22, limit_val_batches=2, callbacks=[cycle], **trainer_kwargs())
        trainer.fit(module, data)
        weights.append([p.detach().clone() for p in module.parameters()])
    assert cycle.last_probe and cycle.probe.start.state == {"state": None}
    assert all(torch.equal(a, b) for a, b in zip(*weights))


class _NormalisedInHook(pl.LightningModule):
    """Scales raw pixels in ``on_before_batch_transfer``, as users put preprocessing in Lightning's batch hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return (x / 16.0 - 0.3) / 0.4, y

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_the_probe_prepares_its_batches_as_lightnings_validation_does(precision):
    # the probe fed raw batches to validation_step: a float64 model got float32 inputs (a crash at the first
    # maintain phase), and batch-hook preprocessing was skipped (a figure on unnormalised inputs)
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pulse.probe import first_validation_batches, run_validation_probe

    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32), torch.tensor(digits.target)
    train = DataLoader(TensorDataset(x[:600], y[:600]), batch_size=32)
    val = DataLoader(TensorDataset(x[600:800], y[600:800]), batch_size=64)
    pl.seed_everything(0, verbose=False)
    module, cycle = _NormalisedInHook(), _cycle()
    trainer = pl.Trainer(max_steps=40, precision=precision, callbacks=[cycle], **trainer_kwargs())
    trainer.fit(module, train, val)
    assert math.isfinite(cycle.last_probe["val_loss"])
    probed = run_validation_probe(trainer, module, *first_validation_batches(trainer, module, 1))
    first = pl.Trainer(precision=precision, limit_val_batches=1, **trainer_kwargs()).validate(
        module, val, verbose=False
    )
    assert probed["val_loss"] == pytest.approx(first[0]["val_loss"], rel=1e-3)


class _TwoValidationSets(_NormalisedInHook):
    def validation_step(self, batch, batch_idx, dataloader_idx):  # required: Lightning passes it with several
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))


@pytest.mark.parametrize("as_dict", [False, True])
def test_the_probe_evaluates_the_first_of_several_validation_dataloaders_as_lightning_calls_it(as_dict):
    # the probe iterated a dict's keys as batches, and called validation_step without dataloader_idx
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    digits = load_digits()
    x, y = torch.tensor(digits.data, dtype=torch.float32), torch.tensor(digits.target)
    first, second = (
        DataLoader(TensorDataset(x[a:b], y[a:b]), batch_size=64) for a, b in ((600, 700), (700, 800))
    )
    val = {"a": first, "b": second} if as_dict else [first, second]
    pl.seed_everything(0, verbose=False)
    cycle = _cycle()
    trainer = pl.Trainer(max_steps=40, callbacks=[cycle], **trainer_kwargs())
    trainer.fit(_TwoValidationSets(), DataLoader(TensorDataset(x[:600], y[:600]), batch_size=32), val)
    assert math.isfinite(cycle.last_probe["val_loss"])
