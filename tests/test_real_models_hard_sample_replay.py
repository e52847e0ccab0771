"""HardSampleReplay on client models nobody in the project wrote (tests/clients.py): correct, or refused
before it could do harm."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.core.carried_state import CarriedStateCheck, batch_shaped_attributes
from lightning_pulse.core.per_sample_loss import LossCapture, time_major_losses
from lightning_pulse.core.replay import HardSampleSelector, ReplayConfig, shorter_than_an_epoch
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.errors import PulseRefusal
from tests.clients import CLIENTS, StatefulLSTM, StreamDataModule, TextWindowsDataModule
from tests.conftest import RecordingLogger, StandInTrainer, trainer_kwargs


class _Trained(Callback):
    """After HardSampleReplay (later in the callbacks list): the size of every batch training_step gets."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        first = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        self.sizes.append(int(first.shape[0]))


def _replay(callbacks) -> HardSampleReplay:
    return next(c for c in callbacks if isinstance(c, HardSampleReplay))


def _no_dropout(module: nn.Module) -> nn.Module:
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    return module


# ------------------------------------------------------------------------------ stateful modules
class _StreamOrdered(StreamDataModule):
    """The same streams in a plain DataLoader (no shuffle, default batch sampler): dataset index
    ``step * B + row`` holds window ``step`` of stream ``row``, so batch ``k`` continues batch ``k - 1``."""

    def setup(self, stage=None):
        super().setup(stage)
        x, y = self.train_set.tensors
        steps = len(x) // self.batch_size
        order = torch.arange(steps * self.batch_size).view(self.batch_size, steps).T.reshape(-1)
        self.train_set = TensorDataset(x[order], y[order])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False, drop_last=True)


def test_a_stateful_lstm_is_refused_before_its_first_replay_step_naming_the_state():
    sizes = _Trained()
    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=4, replay=8, maintain=0), HardSampleReplay(mode="batch"), sizes],
        max_steps=40,
        limit_val_batches=0,
        **trainer_kwargs(),
    )
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(StatefulLSTM(), _StreamOrdered(max_chars=3_000))  # 10 batches per epoch
    message = str(refusal.value)
    assert message.startswith("HardSampleReplay cannot cut the batches of a module that carries state")
    assert "`state` (tensors of shape (2, 8, 64), (2, 8, 64))" in message
    assert "Remove HardSampleReplay" in message
    # found over the first two batches, both trained in full: no replay step ever ran
    assert trainer.global_step == 2 < 4
    assert sizes.sizes == [8, 8]


def test_the_stateful_lstm_client_is_refused_at_setup_for_its_stream_batch_sampler():
    module, data = CLIENTS["stateful-lstm"]()
    trainer = pl.Trainer(callbacks=[HardSampleReplay(mode="batch")], max_steps=40, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay needs .*custom batch sampler \(_ContiguousStreams\)"
    ):
        trainer.fit(module, data)
    assert trainer.global_step == 0


class _LSTMCore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, num_layers=2, batch_first=True)
        self.state = None  # carried: read by the next batch, replaced by it
        self.positions = None  # a cache built once: read every batch, never replaced
        self.last_output = None  # kept for logging: replaced every batch, never read by the next

    def forward(self, x):
        if self.positions is None:
            self.positions = torch.zeros(x.shape[1], 4)
        out, state = self.lstm(x + self.positions, self.state)
        self.state = tuple(s.detach() for s in state)
        self.last_output = out.detach()
        return out


def test_the_carried_state_check_tells_carried_state_from_caches_and_logged_outputs():
    torch.manual_seed(0)
    module, check = nn.Sequential(_LSTMCore()), CarriedStateCheck()
    module(torch.randn(5, 5, 4))
    check.after_first_batch(module, batch_size=5)
    assert set(check.candidates) == {"0.state", "0.positions", "0.last_output"}  # (5, 4) holds 5 too
    check.watch()
    module(torch.randn(5, 5, 4))
    check.after_second_batch(module)
    assert check.done and check.found == {"0.state": ((2, 5, 6), (2, 5, 6))}


class _StateHeldElsewhere(nn.Module):
    """An LSTM whose carried state is a buffer assigned anew at every batch (``store="buffer"``) or a dict of
    tensors (``store="dict"``), next to a BatchNorm whose running statistics (updated in place) happen to be
    batch-shaped too."""

    def __init__(self, store: str) -> None:
        super().__init__()
        self.lstm, self.norm, self.store = nn.LSTM(4, 5, batch_first=True), nn.BatchNorm1d(5), store
        if store == "buffer":
            self.register_buffer("h", torch.zeros(1, 5, 5), persistent=False)
            self.register_buffer("c", torch.zeros(1, 5, 5), persistent=False)
        else:
            self.state = None

    def forward(self, x):
        state = (
            (self.h, self.c) if self.store == "buffer" else self.state and (self.state["h"], self.state["c"])
        )
        out, (h, c) = self.lstm(x, state)
        if self.store == "buffer":
            self.h, self.c = h.detach(), c.detach()
        else:
            self.state = {"h": h.detach(), "c": c.detach()}
        return self.norm(out[:, -1])


def test_a_look_at_the_old_states_shape_is_not_a_read_of_it():
    """A buffer recomputed from every batch, whose forward checks the old value's shape before replacing it, was
    called carried state: the shape check went through the read watch like a use of its values."""

    class ShapeChecked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("centred", torch.zeros(5, 4), persistent=False)

        def forward(self, x):
            if self.centred.shape != x.shape or self.centred.dtype != x.dtype or self.centred.dim() != 2:
                raise AssertionError
            self.centred = x - x.mean(dim=0)
            return self.centred

    module, check = ShapeChecked(), CarriedStateCheck()
    module(torch.randn(5, 4))
    check.after_first_batch(module, batch_size=5)
    check.watch()
    module(torch.randn(5, 4))
    check.after_second_batch(module)
    assert check.done and check.found == {}


@pytest.mark.parametrize("store", ["buffer", "dict"])
def test_carried_state_kept_in_a_buffer_or_a_dict_is_found(store):
    """Held there, a stateful LSTM's state was not found: batch mode crashed at its first cut batch with torch's
    hidden-size error, and steps mode trained on reordered windows, each row's state another stream's."""
    torch.manual_seed(0)
    module, check = _StateHeldElsewhere(store), CarriedStateCheck()
    module(torch.randn(5, 3, 4))
    check.after_first_batch(module, batch_size=5)
    check.watch()
    module(torch.randn(5, 3, 4))
    check.after_second_batch(module)
    assert check.found == (
        {"h": ((1, 5, 5),), "c": ((1, 5, 5),)} if store == "buffer" else {"state": ((1, 5, 5),) * 2}
    )


def test_state_reset_at_every_batch_is_not_carried_and_nothing_batch_shaped_ends_the_check_early():
    core, check = _LSTMCore(), CarriedStateCheck()
    core(torch.randn(3, 5, 4))
    check.after_first_batch(core, batch_size=3)
    check.watch()
    core.state = None  # the module starts every batch afresh
    core(torch.randn(3, 5, 4))
    check.after_second_batch(core)
    assert check.found == {}
    plain = CarriedStateCheck()
    plain.after_first_batch(nn.Linear(3, 3), batch_size=3)
    assert plain.done and batch_shaped_attributes(nn.Linear(3, 3), 3) == {}


@pytest.mark.parametrize("name", [n for n in CLIENTS if n != "stateful-lstm"])
def test_no_other_client_is_refused_and_each_is_checked_for_carried_state(name):
    torch.manual_seed(0)
    module, data = CLIENTS[name]()
    callbacks = [HardSampleReplay(mode="batch")]
    trainer = pl.Trainer(callbacks=callbacks, max_steps=3, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(module, data)
    check = _replay(callbacks).state_check
    assert check.done and check.found == {} and trainer.global_step == 3


# ------------------------------------------------------------------------------ runs shorter than an epoch
def test_a_run_shorter_than_an_epoch_says_at_fit_start_that_it_cannot_select_and_that_it_did_not():
    torch.manual_seed(0)
    module, data = CLIENTS["hf-gpt2"]()  # 106 batches of 16 per epoch
    sizes = _Trained()
    callbacks = [PulseCycle(burst=3, replay=3, maintain=0), HardSampleReplay(mode="batch"), sizes]
    trainer = pl.Trainer(callbacks=callbacks, max_steps=12, limit_val_batches=0, **trainer_kwargs())
    with pytest.warns(UserWarning) as record:
        trainer.fit(module, data)
    messages = [str(w.message) for w in record if "HardSampleReplay" in str(w.message)]
    assert messages[0].startswith(
        "HardSampleReplay: this run plans 12 optimizer steps and one epoch is 106 steps, so no sample trains twice"
    )
    assert "replay_fraction stays 1.0" in messages[0]
    assert messages[-1].startswith(
        "HardSampleReplay: nothing was selected in this run. 4 steps were in a replay"
    )
    assert len(messages) == 2
    assert sizes.sizes == [16] * 12
    assert _replay(callbacks).metrics()["replay_fraction"] == 1.0


def test_a_run_longer_than_an_epoch_does_not_warn(recwarn):
    module, data = CLIENTS["onecycle-per-step"]()
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch")], max_steps=25, limit_val_batches=0, **trainer_kwargs()
    )
    trainer.fit(module, data)
    assert not [w for w in recwarn if "HardSampleReplay" in str(w.message)]


# ------------------------------------------------------------------------------ HF models: loss inside the model
class _PerSampleTruth(Callback):
    """After HardSampleReplay: the per-sample losses of the batch as trained, computed independently before
    the step, and the scores the offered samples had when the batch was cut."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.expected: torch.Tensor | None = None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (computed here, stored in the table)
        self.cuts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (trained scores, dropped scores)

    @torch.no_grad()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        replay = _replay(trainer.callbacks)
        out = pl_module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # the loss by hand (log_softmax + gather), so that the capture, active during the step, does not see it
        if self.kind == "lm":  # HF shifts the labels: token t predicts token t + 1
            out, labels = out[:, :-1], batch["labels"][:, 1:]
        else:
            out, labels = out[:, None], batch["labels"][:, None]
        picked = out.log_softmax(-1).gather(-1, labels[..., None])[..., 0]
        losses = -picked.mean(dim=1)
        self.expected, self.trained = losses, replay.trained_indices
        offered = replay.tracker.batch_indices(batch_idx)
        trained = replay.trained_indices
        if trained.numel() < offered.numel():
            scores = replay.table.effective(offered, trainer.global_step)
            kept = torch.isin(offered, trained)
            self.cuts.append((scores[kept], scores[~kept]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        replay = _replay(trainer.callbacks)
        stored = torch.from_numpy(replay.table.scores[self.trained.numpy()])
        self.pairs.append((self.expected, stored))


@pytest.mark.parametrize(("name", "kind"), [("hf-gpt2", "lm"), ("hf-bert", "classify")])
def test_hf_models_computing_their_own_loss_give_real_per_sample_losses_and_replay_selects_the_hardest(
    name, kind
):
    torch.manual_seed(0)
    module, _ = CLIENTS[name]()
    data = TextWindowsDataModule(kind, max_chars=8_000)  # 225 windows: 14 batches of 16 and 1 of 1 per epoch
    truth, logger = _PerSampleTruth(kind), RecordingLogger()
    callbacks = [HardSampleReplay(mode="batch", replay_fraction=0.5, log_every_n_steps=1), truth]
    trainer = pl.Trainer(
        callbacks=callbacks,
        max_steps=30,
        limit_val_batches=0,
        **trainer_kwargs(logger=logger, log_every_n_steps=1),
    )
    trainer.fit(_no_dropout(module), data)
    # what the table holds after each step is each trained sample's own loss, not the batch mean broadcast
    assert len(truth.pairs) == 30
    for step, (expected, stored) in enumerate(truth.pairs):
        assert torch.allclose(stored, expected, atol=1e-4), step
    assert min(float(expected.std()) for expected, _ in truth.pairs if expected.numel() > 1) > 1e-5
    # the second epoch trains half of each batch, and the half it trains are its highest scores
    assert len(truth.cuts) == 14  # the epoch's last batch holds 1 sample: nothing to cut
    for kept, dropped in truth.cuts:
        assert kept.numel() == 8 and float(kept.min()) >= float(dropped.max())
    logged = [
        m["hard_sample_replay/replay_fraction"]
        for _, m in logger.rows
        if "hard_sample_replay/replay_fraction" in m
    ]
    assert logged[:15] == [1.0] * 15 and logged[15:] == [0.5] * 14 + [1.0]


# ------------------------------------------------------------------------------ optimization modes and schedules
def test_manual_optimization_trains_the_selected_half():
    torch.manual_seed(0)
    module, data = CLIENTS["manual-optimization"]()  # 21 batches per epoch, the last of 15
    sizes = _Trained()
    callbacks = [HardSampleReplay(mode="batch", replay_fraction=0.5), sizes]
    trainer = pl.Trainer(callbacks=callbacks, max_steps=42, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(module, data)
    assert trainer.global_step == 42
    assert sizes.sizes[:21] == [64] * 20 + [15] and sizes.sizes[21:] == [32] * 20 + [8]
    metrics = _replay(callbacks).metrics()
    assert metrics["replay_fraction"] == pytest.approx((1295 + 20 * 32 + 8) / 2590)


def test_onecycle_per_step_keeps_its_planned_steps_while_batches_shrink():
    module, data = CLIENTS["onecycle-per-step"]()
    sizes = _Trained()
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch", replay_fraction=0.25), sizes],
        max_epochs=2,
        limit_val_batches=0,
        **trainer_kwargs(),
    )
    trainer.fit(module, data)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == scheduler.last_epoch == trainer.global_step == 42
    assert sizes.sizes[21:] == [16] * 20 + [4]


@pytest.mark.parametrize("name", ["transformer-encoder", "shared-conv-cnn"])
def test_attention_and_shared_weight_models_replay_in_replay_phases(name):
    torch.manual_seed(0)
    module, data = CLIENTS[name]()
    sizes = _Trained()
    cycle = PulseCycle(burst=21, replay=21, maintain=0, warmup=0.0, anneal=0.0)
    callbacks = [cycle, HardSampleReplay(mode="batch", replay_fraction=0.5), sizes]
    trainer = pl.Trainer(callbacks=callbacks, max_steps=42, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(module, data)
    assert sizes.sizes == [64] * 20 + [15] + [32] * 20 + [8]
    assert _replay(callbacks).metrics()["replay_fraction"] == pytest.approx(0.5, abs=0.01)


def test_bf16_autocast_on_an_hf_classifier_captures_finite_per_sample_losses():
    torch.manual_seed(0)
    module, _ = CLIENTS["hf-bert"]()
    callbacks = [HardSampleReplay(mode="batch", replay_fraction=0.5)]
    trainer = pl.Trainer(
        callbacks=callbacks, max_steps=20, limit_val_batches=0, **trainer_kwargs(precision="bf16-mixed")
    )
    trainer.fit(module, TextWindowsDataModule("classify", max_chars=8_000))
    table, metrics = _replay(callbacks).table, _replay(callbacks).metrics()
    assert table.seen == 225 and bool(torch.isfinite(torch.from_numpy(table.scores)).all())
    assert 0.5 < metrics["replay_fraction"] < 1.0  # steps 15-19 trained half their batch


# ------------------------------------------------------------------------------ strategies
def test_model_parallel_is_refused_at_setup_naming_the_strategy_and_the_way_out():
    trainer = StandInTrainer(ModelParallelStrategy)
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay does not support ModelParallelStrategy, whatever its .*'ddp'"
    ) as refused:
        HardSampleReplay(mode="batch").setup(trainer, None, "fit")
    # a sweep: it spoke of tensor-parallel peers at tensor_parallel_size=1 and named 'fsdp', refused on a CPU
    assert "tensor-parallel peers" not in str(refused.value) and "'fsdp'" not in str(refused.value)


@pytest.mark.parametrize("strategy_class", [FSDPStrategy, DeepSpeedStrategy])
def test_fsdp_and_deepspeed_pass_setup(strategy_class):
    # they shard parameters, not batches: the cut batch, the per-sample losses and the gathered scores are
    # what DDP sees (all_gather over the whole world, which is the data-parallel group)
    replay = HardSampleReplay(mode="batch")
    replay.setup(StandInTrainer(strategy_class), None, "fit")
    assert replay._remove_hook is not None
    replay._remove_hook()
    assert math.isnan(replay.threshold)


# ------------------------------------------------------------------------------ time-major token losses
class _TimeMajorLM(pl.LightningModule):
    """A character LSTM with ``batch_first=False``: its token loss is flattened time-major, ``(T*B, V)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm, self.out = nn.Embedding(128, 16), nn.LSTM(16, 32), nn.Linear(32, 128)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, T) each
        hidden, _ = self.lstm(self.embed(x.t()))  # (T, B, H)
        return F.cross_entropy(self.out(hidden).reshape(-1, 128), y.t().reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _ShuffledStreams(StreamDataModule):
    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


def test_a_time_major_token_loss_is_refused_after_the_first_batch_before_any_replay_step():
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch")], max_steps=40, limit_val_batches=0, **trainer_kwargs()
    )
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay (cannot split the module.s cross_entropy into samples|found no per-sample loss).*"
        r"time-major",
    ):
        trainer.fit(_TimeMajorLM(), _ShuffledStreams(max_chars=20_000))
    assert trainer.global_step <= 1  # at the first step's loss, or after the first batch's check


def test_time_major_losses_tells_the_two_flattenings_apart():
    logits, y = torch.randn(4, 6, 10), torch.randint(0, 10, (4, 6))  # (B, T, V), (B, T)
    batch_first, time_major = LossCapture(batch_size=4), LossCapture(batch_size=4)
    with batch_first:
        F.cross_entropy(logits.reshape(-1, 10), y.reshape(-1))
    with time_major:
        F.cross_entropy(logits.transpose(0, 1).reshape(-1, 10), y.t().reshape(-1))
    assert time_major_losses(batch_first, [logits, y]) == []
    assert time_major_losses(time_major, {"x": logits, "y": y}) == ["cross_entropy"]
    # a classification loss (one target per sample) and targets found nowhere in the batch are not judged
    assert time_major_losses(time_major, [logits]) == []


# ------------------------------------------------------------------------------ core, without a Trainer
def test_a_cut_before_the_check_is_done_is_refused_when_something_batch_shaped_is_held():
    core, check = _LSTMCore(), CarriedStateCheck()
    assert check.before_batch(cut=True) is None  # the first batch: nothing is known, nothing held yet
    core(torch.randn(3, 5, 4))
    assert check.after_batch(core, batch_size=3) is None and check.first_batch is False
    reason = check.before_batch(cut=True)
    assert reason.startswith("cannot cut the batches of a module that carries state") and "`state`" in reason
    check.stop()


def test_the_run_length_note_names_both_figures_and_only_when_no_sample_comes_back():
    note = shorter_than_an_epoch(12, 106)
    assert note.startswith("this run plans 12 optimizer steps and one epoch is 106 steps")
    assert shorter_than_an_epoch(107, 106) is None
    assert shorter_than_an_epoch(math.inf, 106) is None and shorter_than_an_epoch(5, None) is None


def test_nothing_selected_is_said_only_when_replay_steps_selected_nothing():
    selector = HardSampleSelector(SampleScoreTable(8), ReplayConfig(replay_fraction=0.5))
    indices = torch.arange(4)
    chosen = selector.compose(indices, step=0, batch_idx=0)  # never scored: all kept, none "selected"
    selector.record(chosen.indices, torch.rand(4), chosen.roles, 0, active=True, offered=4)
    selector.apply()
    assert selector.nothing_selected().startswith("nothing was selected in this run. 1 steps")
    chosen = selector.compose(indices, step=1, batch_idx=0)
    selector.record(
        chosen.indices, torch.rand(chosen.indices.numel()), chosen.roles, 1, active=True, offered=4
    )
    selector.apply()
    assert chosen.indices.numel() == 2 and selector.nothing_selected() is None


class _FrozenBatchData(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return index


def test_a_batch_mode_cut_of_a_batch_that_cannot_change_in_place_is_refused_before_the_first_step():
    from sklearn.datasets import load_digits

    class Batch:  # an object of its own, as graph libraries collate (Lightning passes it through)
        def __init__(self, x, y):
            self.x, self.y = x, y

    digits = load_digits()
    x, y = torch.tensor(digits.data[:64], dtype=torch.float32) / 16, torch.tensor(digits.target[:64])

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(64, 10)
            self.steps = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return torch.nn.functional.cross_entropy(self.net(batch.x), batch.y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(
        _FrozenBatchData(), batch_size=16, collate_fn=lambda ids: Batch(x[ids], y[ids])
    )
    module = Classifier()
    trainer = pl.Trainer(**trainer_kwargs(max_epochs=2, callbacks=[HardSampleReplay(mode="batch")]))
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay cannot cut a batch of type Batch in mode='batch'"
    ):
        trainer.fit(module, loader)
    assert module.steps == 0 and trainer.global_step == 0


class _BatchShapedButNotCarried(pl.LightningModule):
    """Batch-shaped state that carries nothing to the next batch: BatchNorm statistics with as many channels as
    the batch has samples (updated in place), a dict of outputs kept for logging (replaced, never read by the
    next batch), a dict cached once (read, never replaced) and a non-persistent buffer recomputed from each
    batch."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, batch_size), nn.BatchNorm1d(batch_size), nn.ReLU())
        self.head = nn.Linear(batch_size, 10)
        self.register_buffer("centred", torch.zeros(batch_size, 64), persistent=False)
        self.cache: dict[str, torch.Tensor] | None = None
        self.last: dict[str, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.cache is None:
            self.cache = {"scale": torch.ones(x.shape[0], 1)}
        self.centred = x - x.mean(dim=0)  # assigned anew from this batch only
        logits = self.head(self.net(self.centred * self.cache["scale"][: x.shape[0]]))
        self.last = {"logits": logits.detach(), "y": y}
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("mode", ["steps", "batch"])
def test_batch_shaped_state_that_carries_nothing_is_not_refused(mode):
    """When buffers and dicts joined the carried-state check, steps mode refused all of these at its first cut
    batch, before the check's read/replace test could clear them; only a plain tensor, tuple or list attribute
    blocks an early cut now, and the rest waits for the test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = torch.tensor(digits.data[:1024], dtype=torch.float32) / 16, torch.tensor(digits.target[:1024])
    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=3, callbacks=[HardSampleReplay(mode=mode)], **trainer_kwargs())
    trainer.fit(_BatchShapedButNotCarried(64), DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))
    assert trainer.global_step == (trainer.max_steps if mode == "steps" else 48) and trainer.global_step > 0
