"""HardSampleReplay through real Trainer.fit runs on MNIST-1D (720 training samples, batches of 64)."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.core.per_sample_loss import ForwardLossScorer, OutputKeyScorer
from lightning_pulse.core.replay import UNTOUCHED, HardSampleSelector, ReplayConfig
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.errors import PulseRefusal
from tests.conftest import RecordingLogger, trainer_kwargs

BATCHES_PER_EPOCH = 12  # 720 training samples in batches of 64 (the last one holds 16)

pytestmark = pytest.mark.filterwarnings(
    "ignore:You defined a `validation_step` but have no `val_dataloader`",
    "ignore:The number of training batches",
)


class SizeProbe(MNIST1DClassifier):
    """The example classifier, recording how many samples each training_step receives."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(int(batch[0].shape[0]))
        return super().training_step(batch, batch_idx)


def _data(**kwargs) -> MNIST1DDataModule:
    return MNIST1DDataModule(num_samples=1000, batch_size=64, **kwargs)


def _parameters(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_replay_batches_shrink_but_steps_per_epoch_and_onecycle_schedule_hold():
    pl.seed_everything(0)
    model = SizeProbe(scheduler="onecycle")
    replay = HardSampleReplay(mode="batch", replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    trainer.fit(model, _data())
    # every step ran: OneCycleLR was built for 36 steps and stepped exactly 36 times (InfoBatch issue #27)
    assert trainer.global_step == 3 * BATCHES_PER_EPOCH
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 3 * BATCHES_PER_EPOCH
    # epoch 1 trains on everything (nothing scored yet); afterwards batches of 64 keep their 32 hardest
    assert model.sizes[:BATCHES_PER_EPOCH] == [64] * 11 + [16]
    assert model.sizes[BATCHES_PER_EPOCH:] == ([32] * 11 + [8]) * 2
    metrics = replay.metrics()
    assert metrics["replay_fraction"] == pytest.approx((720 + 2 * 360) / (3 * 720))
    assert metrics["table_seen"] == metrics["table_samples"] == 720
    # top-k trains on the samples that were hardest last time they were seen
    assert metrics["loss_replayed"] > replay.threshold


class _WeightsAt(pl.Callback):
    """Copies the module's weights when the given optimizer step starts."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.weights: torch.Tensor | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.weights is None:
            self.weights = _parameters(pl_module).clone()


def test_burst_phases_train_exactly_as_without_the_callback():
    burst_steps = BATCHES_PER_EPOCH + 2

    def run(callbacks):
        pl.seed_everything(1)
        model, snapshot = SizeProbe(), _WeightsAt(burst_steps)
        cycle = PulseCycle(
            burst=burst_steps, replay=4, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none"
        )
        trainer = pl.Trainer(
            callbacks=[cycle, *callbacks, snapshot], max_steps=burst_steps + 4, **trainer_kwargs()
        )
        trainer.fit(model, _data())
        return model, snapshot.weights

    plain, plain_after_burst = run([])
    replayed, replayed_after_burst = run([HardSampleReplay(mode="batch", replay_fraction=0.25)])
    # the burst saw the same batches and made bit-identical updates: capture changes no value and no gradient
    assert replayed.sizes[:burst_steps] == plain.sizes[:burst_steps]
    assert torch.equal(replayed_after_burst, plain_after_burst)
    # the replay phase then trains on a quarter of each batch
    assert replayed.sizes[burst_steps:] == [16] * 4
    assert not torch.equal(_parameters(replayed), _parameters(plain))


class HandWrittenLoss(MNIST1DClassifier):
    """A loss built from tensor ops, which no torch.nn.functional loss call reveals."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = ((self(x).softmax(-1) - F.one_hot(y, 10).float()) ** 2).sum(-1)
        return {"loss": per_sample.mean(), "per_sample": per_sample.detach()}


def test_a_module_without_a_capturable_loss_fails_at_the_first_step():
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_steps=3, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match="scorer") as error:
        trainer.fit(HandWrittenLoss(), _data())
    assert "none of the losses it captures was called" in str(error.value)
    assert trainer.global_step == 0


class HandWrittenLossAndALoggedMetric(HandWrittenLoss):
    """A held-out module: a hand-written loss, and an F.mse_loss computed for self.log only."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        output = super().training_step(batch, batch_idx)
        self.log("prob_mse", F.mse_loss(self(x).softmax(-1).max(-1).values, torch.ones(len(y))))
        return output


class WeightedAuxiliaryLoss(MNIST1DClassifier):
    """A held-out module: cross-entropy plus a tenth of an auxiliary regression loss."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y) + 0.1 * F.mse_loss(logits[:, 0], y.float())


def test_a_logged_metric_next_to_a_hand_written_loss_is_not_taken_for_the_loss():
    # held-out sweep: the logged F.mse_loss was the whole score (rank correlation -0.69): refused instead
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_steps=3, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match="not part of the loss that is backpropagated"):
        trainer.fit(HandWrittenLossAndALoggedMetric(), _data())
    assert trainer.global_step == 0


def _assert_scores_are_ce_and_a_tenth_of_mse(replay, model, data) -> None:
    """Every training sample's score is its `ce + 0.1 * mse` on ``model`` (trained with lr=0: scores are final)."""
    x, y = data.train_set.tensors
    with torch.no_grad():
        logits = model(x)
        expected = F.cross_entropy(logits, y, reduction="none") + 0.1 * (logits[:, 0] - y.float()) ** 2
    scores = torch.as_tensor(replay.table.scores, dtype=torch.float32)
    assert torch.allclose(scores, expected, rtol=1e-4, atol=1e-5)


def test_the_terms_of_a_weighted_loss_are_scored_with_their_weights():
    # held-out sweep: `ce + 0.1 * mse` was scored `ce + mse` (max error 12.2 per sample)
    pl.seed_everything(0)
    model = WeightedAuxiliaryLoss(arch="mlp", lr=0.0)  # no update: every score is the final model's loss
    replay = HardSampleReplay(mode="batch", score_half_life=None)
    data = _data()
    trainer = pl.Trainer(callbacks=[replay], max_epochs=1, accumulate_grad_batches=2, **trainer_kwargs())
    trainer.fit(model, data)
    _assert_scores_are_ce_and_a_tenth_of_mse(replay, model, data)


class TwoBackwardCalls(MNIST1DClassifier):
    """A held-out module with manual optimization: a hand-written penalty and the task loss are backpropagated by
    two calls, in either order, then a tenth of an auxiliary loss by a third."""

    def __init__(self, penalty_first: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.penalty_first = penalty_first

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        logits = self(x)
        ce, aux = F.cross_entropy(logits, y), F.mse_loss(logits[:, 0], y.float())
        penalty = 1e-4 * sum((p**2).sum() for p in self.parameters())
        optimizer.zero_grad()
        for loss in [penalty, ce] if self.penalty_first else [ce, penalty]:
            self.manual_backward(loss, retain_graph=True)
        self.manual_backward(0.1 * aux)
        optimizer.step()


@pytest.mark.parametrize("penalty_first", [True, False])
def test_every_backward_call_of_a_step_counts_under_manual_optimization(penalty_first):
    # regression sweep: the parts were read from the first backward's loss only, so a first call that backprops
    # a hand-written penalty refused the fit ("a value computed for logging?"), and a later call's term was
    # left out of the scores
    pl.seed_everything(0)
    model = TwoBackwardCalls(penalty_first, arch="mlp", lr=0.0)  # no update: every score is the final model's
    replay = HardSampleReplay(mode="batch", score_half_life=None)
    data = _data()
    pl.Trainer(callbacks=[replay], max_epochs=1, **trainer_kwargs()).fit(model, data)
    _assert_scores_are_ce_and_a_tenth_of_mse(replay, model, data)


@pytest.mark.parametrize("scorer", [OutputKeyScorer("per_sample"), ForwardLossScorer("cross_entropy")])
def test_a_configured_scorer_covers_any_other_loss(scorer):
    replay = HardSampleReplay(mode="batch", scorer=scorer)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(HandWrittenLoss(), _data())
    assert replay.metrics()["table_seen"] == 720
    assert replay.metrics()["replay_fraction"] < 0.8


def test_infobatch_weights_the_captured_loss_next_to_a_scorer():
    model = SizeProbe()
    replay = HardSampleReplay(rule="infobatch", prune_ratio=0.5, scorer=ForwardLossScorer("cross_entropy"))
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(model, _data())
    assert sum(model.sizes[BATCHES_PER_EPOCH:]) < 0.9 * 720
    # a loss the capture cannot see cannot be weighted: refused at the first pruned step, not ignored
    replay = HardSampleReplay(rule="infobatch", prune_ratio=0.5, scorer=ForwardLossScorer("cross_entropy"))
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match="infobatch"):
        trainer.fit(HandWrittenLoss(), _data())


class _DictClassifier(MNIST1DClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(int(batch["signal"].shape[0]))
        loss = F.cross_entropy(self(batch["signal"]), batch["label"])
        return loss


class _CollatedData(pl.LightningDataModule):
    """MNIST-1D with a custom collate: dict batches or tuple batches."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inner = _data()

    def setup(self, stage=None):
        self.inner.setup(stage)

    def _collate(self, samples):
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        return {"signal": x, "label": y} if self.kind == "dict" else (x, y)

    def train_dataloader(self):
        return DataLoader(self.inner.train_set, batch_size=64, shuffle=True, collate_fn=self._collate)


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_dict_and_tuple_batches_are_composed_in_place(kind):
    model = _DictClassifier() if kind == "dict" else SizeProbe()
    replay = HardSampleReplay(mode="batch", replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, limit_val_batches=0, **trainer_kwargs())
    trainer.fit(model, _CollatedData(kind))
    assert model.sizes[BATCHES_PER_EPOCH:] == [32] * 11 + [8]


def test_gradient_accumulation_and_bf16_autocast():
    replay = HardSampleReplay(mode="batch", rule="random", replay_fraction=0.5)
    model = SizeProbe()
    trainer = pl.Trainer(
        callbacks=[replay],
        max_epochs=2,
        accumulate_grad_batches=2,
        precision="bf16-mixed",
        **trainer_kwargs(),
    )
    trainer.fit(model, _data())
    assert trainer.global_step == 2 * math.ceil(BATCHES_PER_EPOCH / 2)
    assert model.sizes[BATCHES_PER_EPOCH:] == [32] * 11 + [8]
    assert replay.metrics()["table_seen"] == 720
    assert math.isfinite(replay.metrics()["loss_replayed"])


def test_a_pulse_cycles_anneal_trains_the_last_steps_on_whole_batches():
    # what `anneal=` did before: the cycle is all replay, its anneal pure burst
    model = SizeProbe()
    cycle = PulseCycle(burst=0, replay=1, maintain=0, warmup=0.0, anneal=0.25, maintain_eval="none")
    replay = HardSampleReplay(mode="batch", replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[cycle, replay], max_epochs=4, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(model, _data())
    # epoch 1 is unseen (whole batches), epochs 2-3 are selected, the last quarter of the steps is whole again
    assert model.sizes[BATCHES_PER_EPOCH : 3 * BATCHES_PER_EPOCH] == ([32] * 11 + [8]) * 2
    assert model.sizes[3 * BATCHES_PER_EPOCH :] == [64] * 11 + [16]


def test_infobatch_prunes_below_mean_samples_and_keeps_the_step_count():
    model = SizeProbe(scheduler="onecycle")
    replay = HardSampleReplay(rule="infobatch", prune_ratio=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    trainer.fit(model, _data())
    assert trainer.global_step == 3 * BATCHES_PER_EPOCH
    later = model.sizes[BATCHES_PER_EPOCH:]
    assert all(size <= 64 for size in later) and sum(later) < 0.9 * 2 * 720
    assert replay.threshold == pytest.approx(replay.table.mean_score(trainer.global_step), rel=0.2)


class _Stream(IterableDataset):
    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        order = torch.randperm(len(self.dataset))
        for index in order.tolist():
            yield self.dataset[index]


class _StreamData(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _data()

    def setup(self, stage=None):
        self.inner.setup(stage)

    def train_dataloader(self):
        return DataLoader(_Stream(self.inner.train_set), batch_size=64)


class _ShuffleFreeData(MNIST1DDataModule):
    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=64, shuffle=False)


def test_resume_from_a_checkpoint_continues_as_the_uninterrupted_run(tmp_path):
    # batch mode here; steps mode's resume mid-epoch is tests/test_step_saving_replay.py's
    def trainer(epochs):
        return pl.Trainer(
            callbacks=[HardSampleReplay(rule="random", replay_fraction=0.4, mode="batch")],
            max_epochs=epochs,
            **trainer_kwargs(),
        )

    pl.seed_everything(3)
    uninterrupted = MNIST1DClassifier()
    full = trainer(4)
    full.fit(uninterrupted, _ShuffleFreeData(num_samples=1000, batch_size=64))

    pl.seed_everything(3)
    first_half = MNIST1DClassifier()
    interrupted = trainer(2)
    interrupted.fit(first_half, _ShuffleFreeData(num_samples=1000, batch_size=64))
    checkpoint = tmp_path / "half.ckpt"
    interrupted.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]
    assert any("table" in state for state in saved.values())

    resumed_model = MNIST1DClassifier()
    resumed = trainer(4)
    resumed.fit(resumed_model, _ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=checkpoint)
    assert torch.equal(_parameters(resumed_model), _parameters(uninterrupted))
    table_full, table_resumed = full.callbacks[0].table, resumed.callbacks[0].table
    assert table_full.scores.tobytes() == table_resumed.scores.tobytes()


def _replay_state(checkpoint) -> dict:
    saved = torch.load(checkpoint, weights_only=False)["callbacks"]
    return next(state for key, state in saved.items() if key.startswith("HardSampleReplay"))


def test_a_checkpoint_saved_after_a_steps_mode_fit_holds_its_data_stream_and_resumes_exactly(tmp_path):
    # a checkpoint saved after a steps-mode fit (trainer.save_checkpoint), or after a resumed fit with nothing
    # left to train (held-out sweep), had no data stream: its resume planned the run again from its start and
    # trained other weights with no word (a held-out CNN: 31 steps, 29 from the epoch-end checkpoint)
    def fit(epochs, ckpt_path=None, callbacks=()):
        pl.seed_everything(0)
        model = MNIST1DClassifier()
        cycle = PulseCycle(burst=4, replay=3, maintain=1, warmup=0.0, anneal=0.0, maintain_eval="none")
        trainer = pl.Trainer(
            callbacks=[cycle, HardSampleReplay(mode="steps"), *callbacks],
            max_epochs=epochs,
            **trainer_kwargs(enable_checkpointing=bool(callbacks)),
        )
        trainer.fit(model, _ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
        return model, trainer

    every_epoch = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    _, done = fit(2, callbacks=[every_epoch])
    done.save_checkpoint(tmp_path / "done.ckpt")
    _, again = fit(
        2, ckpt_path=str(tmp_path / "done.ckpt")
    )  # Lightning skips on_train_start: nothing to train
    assert again.global_step == done.global_step
    again.save_checkpoint(tmp_path / "again.ckpt")
    finished, held = _replay_state(tmp_path / "done.ckpt"), _replay_state(tmp_path / "again.ckpt")
    assert held.keys() == finished.keys() and held["stream"] == finished["stream"]
    torch.testing.assert_close(held["table"], finished["table"], rtol=0, atol=0, equal_nan=True)
    assert held["stream"]["epoch"] == _replay_state(tmp_path / "epoch=1.ckpt")["stream"]["epoch"] == 1

    reference_model, reference = fit(3, ckpt_path=str(tmp_path / "epoch=1.ckpt"))
    resumed_model, resumed = fit(3, ckpt_path=str(tmp_path / "again.ckpt"))
    assert resumed.global_step == reference.global_step
    assert torch.equal(_parameters(resumed_model), _parameters(reference_model))


def test_replay_metrics_reach_the_loggers():
    logger = RecordingLogger()
    kwargs = {**trainer_kwargs(), "logger": logger}
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(mode="batch", log_every_n_steps=6)], max_epochs=2, **kwargs
    )
    trainer.fit(MNIST1DClassifier(), _data())
    logged = [m for m in logger.metrics if "hard_sample_replay/replay_fraction" in m]
    assert len(logged) == 2 * BATCHES_PER_EPOCH // 6
    for name in ("threshold", "table_bytes", "table_seen", "loss_replayed", "learned_rate", "came_back_rate"):
        assert f"hard_sample_replay/{name}" in logged[-1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rule": "hardest"}, "rule"),
        ({"rule": "proportional"}, "rule"),
        ({"replay_fraction": 0.0}, "replay_fraction"),
        ({"replay_fraction": 1.5}, "replay_fraction"),
        ({"prune_ratio": 1.0}, "prune_ratio"),
        ({"score_half_life": "10s"}, "score_half_life"),
        ({"score_half_life": 0}, "score_half_life"),
        ({"phases": ["warmup"]}, "phases"),
        ({"phases": []}, "phases"),
        ({"scorer": "cross_entropy"}, "scorer"),
        ({"seed": 0.5}, "seed"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"mode": "step"}, "mode"),
        ({"mode": "steps", "rule": "infobatch"}, "mode"),
        ({"mode": "epoch"}, "`mode`='epoch' was removed: mode='steps' .* without a PulseCycle"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        HardSampleReplay(**kwargs)


def test_a_loader_without_dataset_indices_is_refused_before_the_first_step():
    model = SizeProbe()
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], max_steps=2, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match="^HardSampleReplay needs .*IterableDataset"):
        trainer.fit(model, _StreamData())
    assert model.sizes == []


class _TwoLoaders(pl.LightningModule):
    """Trains on a dict of two DataLoaders (Lightning's CombinedLoader): each batch is ``{"a": ..., "b": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return sum(F.cross_entropy(self.net(x), y) for x, y in batch.values())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("with_cycle", [False, True])
def test_several_training_loaders_are_refused_before_the_first_step(with_cycle):
    # held-out sweep: alone it trained 12.5% and 25% of the two datasets with no word (each loader had its own
    # index tracker); next to a PulseCycle it failed at step 0 with a RuntimeError about the collate function
    def loader(seed):
        generator = torch.Generator().manual_seed(seed)
        data = TensorDataset(
            torch.randn(96, 8, generator=generator), torch.randint(0, 2, (96,), generator=generator)
        )
        return DataLoader(data, batch_size=16, shuffle=True)

    model = _TwoLoaders()
    callbacks = (
        [PulseCycle(burst=4, replay=4, maintain=1), HardSampleReplay()]
        if with_cycle
        else [HardSampleReplay()]
    )
    trainer = pl.Trainer(callbacks=callbacks, max_epochs=3, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay needs one training DataLoader, .* several DataLoaders"
    ):
        trainer.fit(model, {"a": loader(0), "b": loader(1)})
    assert model.steps == 0


class _LabelledOnly(pl.LightningModule):
    """The loss covers the labelled samples of a batch only (a flag in the batch says which)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y, labelled = batch
        return F.cross_entropy(self.net(x)[labelled], y[labelled])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_later_step_whose_loss_does_not_split_trains_on_unscored_and_says_so_once():
    # held-out sweep: a loss over the labelled part of a batch, whole in the first ten batches, stopped the run
    # with a PulseRefusal at step 10, after ten updates
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=generator)
    labelled = torch.ones(128, dtype=torch.bool)
    labelled[[100, 127]] = False  # in the seventh and the eighth batch of each pass
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long(), labelled), batch_size=16)
    replay = HardSampleReplay(mode="batch")
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    with pytest.warns(
        UserWarning, match=r"the loss of step 6 did not split .* keep the scores they had"
    ) as said:
        trainer.fit(_LabelledOnly(), data)
    assert trainer.global_step == 16 and replay.batches.unscored_steps == 4  # two a pass, two passes
    assert len([w for w in said if "did not split" in str(w.message)]) == 1
    scores = replay.selector.table.scores
    assert np.isnan(scores[96:128]).all() and np.isfinite(scores[:96]).all()
    # the same loss at the first step is refused before any update
    labelled[3] = False
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long(), labelled), batch_size=16)
    trainer = pl.Trainer(callbacks=[HardSampleReplay(mode="batch")], max_epochs=1, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match="found no per-sample loss"):
        trainer.fit(_LabelledOnly(), data)
    assert trainer.global_step == 0


class _SquareVocabularyLM(pl.LightningModule):
    """A next-token LM over 64 tokens: 4 sequences of 16 tokens give a square 64 x 64 matrix of logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.head(torch.tanh(self.embed(tokens)))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, 64), tokens.roll(-1, 1).reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_token_lm_whose_flattened_logits_are_square_is_scored_not_taken_for_a_contrastive_loss():
    # held-out sweep: replay batches cut to 4 of 8 sequences gave 64 x 64 logits, read as a contrastive matrix
    # over 16 views of each sample: every cut step went unscored (loss_replayed NaN, stale scores), and a run
    # whose own batches held 4 sequences was refused at its first step
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
    replay = HardSampleReplay(mode="batch", replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(_SquareVocabularyLM(), DataLoader(TensorDataset(tokens), batch_size=8))
    metrics = replay.metrics()
    assert replay.batches.unscored_steps == 0 and metrics["replay_fraction"] == 0.75
    assert math.isfinite(metrics["loss_replayed"]) and replay.selector.end_run() is None
    replay = HardSampleReplay(mode="batch")
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(_SquareVocabularyLM(), DataLoader(TensorDataset(tokens), batch_size=4))
    assert trainer.global_step == 32 and replay.batches.unscored_steps == 0


def test_the_end_note_tells_cut_steps_recorded_without_scores_from_steps_that_had_nothing_scored():
    # held-out sweep: replay steps that cut their batches but were recorded without scores (their loss did not
    # split) ended with "nothing was selected ... none of their samples had a score yet ... so all of them
    # trained"
    selector = HardSampleSelector(SampleScoreTable(16), ReplayConfig(replay_fraction=0.5))
    batch = torch.arange(8)
    selector.record(batch, torch.rand(8), np.full(8, UNTOUCHED), 0, active=False, offered=8)  # scores all 8
    selector.apply()
    chosen = selector.compose(batch, step=1, batch_idx=0)
    unscored = torch.full((chosen.indices.numel(),), math.nan)  # what the callback records for such a step
    selector.record(chosen.indices, unscored, chosen.roles, 1, active=True, offered=8)
    assert selector.end_run().startswith(
        "no selected sample was counted in this run. 1 steps were in a replay phase and trained 4 of the 8 "
        "samples offered to them, but the 4 selected among them have no loss recorded"
    )
    # a non-finite loss of a never-scored sample is no selected sample left uncounted (a review of this pass:
    # one NaN among never-scored samples turned the true note into "no selected sample was counted")
    selector = HardSampleSelector(SampleScoreTable(16), ReplayConfig(replay_fraction=0.5))
    chosen = selector.compose(batch, step=0, batch_idx=0)
    losses = torch.rand(chosen.indices.numel())
    losses[0] = math.nan
    selector.record(chosen.indices, losses, chosen.roles, 0, active=True, offered=8)
    assert selector.end_run().startswith(
        "nothing was selected in this run. 1 steps were in a replay phase, but none of their samples had a "
        "score"
    )
    # top-k keeps never-scored samples first: a batch of 6 of them and 2 scored ones trains the 6 alone
    selector = HardSampleSelector(SampleScoreTable(16), ReplayConfig(replay_fraction=0.5))
    selector.record(batch[:2], torch.rand(2), np.full(2, UNTOUCHED), 0, active=False, offered=2)
    selector.apply()
    offered = torch.cat([batch[:2], torch.arange(8, 14)])
    chosen = selector.compose(offered, step=1, batch_idx=0)
    selector.record(chosen.indices, torch.rand(6), chosen.roles, 1, active=True, offered=8)
    assert chosen.indices.tolist() == list(range(8, 14))
    assert selector.end_run().startswith(
        "nothing was selected in this run. 1 steps were in a replay phase and trained 6 of the 8 samples "
        "offered to them: only samples that had no score yet"
    )


def test_scores_table_covers_a_tensor_dataset_used_directly():
    x = torch.randn(96, 40)
    y = torch.randint(0, 10, (96,))
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    replay = HardSampleReplay()
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(MNIST1DClassifier(), train_dataloaders=loader)
    assert replay.metrics()["table_seen"] == 96


def test_steps_mode_alone_shortens_epochs_and_tells_lightning_and_onecycle_up_front():
    # what epoch mode did before its removal: full batches on replay_fraction of every epoch, planned up front
    pl.seed_everything(4)
    model = SizeProbe(scheduler="onecycle")
    replay = HardSampleReplay(replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=4, **trainer_kwargs())
    trainer.fit(model, _data())
    # 720 samples per epoch in windows of 128 (the last of 80), each cut to a full batch of 64: 6 steps an epoch
    assert model.sizes == [64] * 24
    assert trainer.global_step == trainer.max_steps == 24
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == scheduler.last_epoch == 24
    metrics = replay.metrics()
    assert metrics["replay_fraction"] == pytest.approx(24 * 64 / (4 * 720))
    # never-scored samples come first, so every sample was scored; after that, scored ones were chosen
    assert metrics["table_seen"] == 720
    assert metrics["replayed_distinct"] > 0


class _FullgraphNet(MNIST1DClassifier):
    """Its network compiled with ``fullgraph=True`` in ``__init__`` or in ``configure_model`` (Lightning's place for
    torch.compile, after the callbacks' setup); ``loss_inside``: the compiled part computes the loss too. ``how``:
    ``torch.compile(net)`` (a wrapper), ``net.compile()`` or ``model.compile()`` (compiled in place; the
    LightningModule's forward then takes the targets and ``training_step`` calls it)."""

    def __init__(
        self, where: str, loss_inside: bool = False, fullgraph: bool = True, how: str = "torch.compile(net)"
    ) -> None:
        super().__init__()
        self.where, self.loss_inside, self.fullgraph, self.how = where, loss_inside, fullgraph, how
        self.compiled = False
        # Module.compile(fullgraph=True) of a module whose forward is torch's own (nn.Sequential) fails in torch
        # itself ("found no compiled frames": dynamo skips torch's files); _NetWithLoss's forward is ours
        if how == "net.compile()" or (self.loss_inside and how != "model.compile()"):
            self.net = _NetWithLoss(self.net)
        if where == "__init__":
            self.configure_model()

    def configure_model(self) -> None:
        if self.compiled:
            return
        self.compiled = True
        if self.how == "torch.compile(net)":
            self.net = torch.compile(self.net, backend="aot_eager", fullgraph=self.fullgraph)
        elif self.how == "net.compile()":
            self.net.compile(backend="aot_eager", fullgraph=self.fullgraph)
        else:
            self.compile(backend="aot_eager", fullgraph=self.fullgraph)

    def forward(self, x, y=None):
        return super().forward(x) if y is None else F.cross_entropy(super().forward(x), y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.how == "model.compile()":
            return self(x, y) if self.loss_inside else F.cross_entropy(self(x), y)
        return self.net(x, y) if self.loss_inside else F.cross_entropy(self.net(x), y)


class _NetWithLoss(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x, y=None):
        return self.net(x) if y is None else F.cross_entropy(self.net(x), y)


@pytest.mark.parametrize(
    "where, how",
    [
        ("__init__", "torch.compile(net)"),
        ("configure_model", "torch.compile(net)"),
        ("configure_model", "net.compile()"),
    ],
)
def test_a_fullgraph_part_without_the_loss_trains_wherever_it_is_compiled(where, how):
    # the loss in training_step is captured outside the compiled part: nothing breaks its graph. It used to be
    # refused when compiled in __init__ and never checked when compiled in configure_model
    torch._dynamo.reset()
    replay = HardSampleReplay(mode="batch")
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(_FullgraphNet(where, how=how), _data())
    assert trainer.global_step == 24
    assert replay.metrics()["table_seen"] == 720  # every training sample's loss captured in the first epoch


@pytest.mark.parametrize(
    "where, how",
    [
        ("__init__", "torch.compile(net)"),
        ("configure_model", "torch.compile(net)"),
        ("configure_model", "net.compile()"),
        ("configure_model", "model.compile()"),
    ],
)
def test_a_loss_inside_a_fullgraph_part_is_refused_at_the_first_step_naming_the_way_out(where, how):
    # the capture runs the patched loss at a graph break, which fullgraph=True makes dynamo's own error. A part
    # compiled in place (Module.compile) crashed with that error: the watch found only torch.compile's wrappers
    torch._dynamo.reset()
    part = "the LightningModule" if how == "model.compile()" else "net"
    trainer = pl.Trainer(callbacks=[HardSampleReplay(mode="batch")], max_epochs=1, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal,
        match=rf"^HardSampleReplay cannot capture the F.cross_entropy called inside {part}, compiled with "
        r"torch.compile\(\.\.\., fullgraph=True\).* compile without fullgraph=True",
    ):
        trainer.fit(_FullgraphNet(where, loss_inside=True, how=how), _data())
    assert trainer.global_step == 0
    # the way out: compiled without fullgraph=True, the loss is captured at its graph break
    torch._dynamo.reset()
    replay = HardSampleReplay(mode="batch")
    trainer = pl.Trainer(callbacks=[replay], max_epochs=1, **trainer_kwargs())
    trainer.fit(_FullgraphNet(where, loss_inside=True, fullgraph=False, how=how), _data())
    assert replay.metrics()["table_seen"] == 720


def test_a_training_step_compiled_with_fullgraph_is_refused_at_fit_start():
    # trainer.fit(torch.compile(model)): Lightning compiles training_step, which holds the loss
    trainer = pl.Trainer(callbacks=[HardSampleReplay(mode="batch")], max_epochs=1, **trainer_kwargs())
    model = torch.compile(MNIST1DClassifier(), backend="aot_eager", fullgraph=True)
    with pytest.raises(
        PulseRefusal,
        match=r"^HardSampleReplay cannot capture the loss of the LightningModule, whose training_step",
    ):
        trainer.fit(model, _data())
    assert trainer.global_step == 0


class _FullgraphPerSampleLoss(_FullgraphNet):
    """The loss inside a fullgraph part, per sample; training_step returns it for an OutputKeyScorer."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = self.net(x, y)
        return {"loss": per_sample.mean(), "per_sample": per_sample.detach()}


class _PerSampleLossNet(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x, y=None):
        return self.net(x) if y is None else F.cross_entropy(self.net(x), y, reduction="none")


@pytest.mark.parametrize(
    "where, how",
    [
        ("__init__", "torch.compile(net)"),
        ("configure_model", "torch.compile(net)"),
        ("configure_model", "net.compile()"),
    ],
)
def test_a_loss_inside_a_fullgraph_part_trains_next_to_a_scorer(where, how):
    # a scorer reads the per-sample losses the module returns: nothing is captured, so the loss functions are
    # not patched for the fit (their graph break failed the fullgraph part), and the fit is not refused
    torch._dynamo.reset()
    model = _FullgraphPerSampleLoss("configure_model", loss_inside=True, how=how)
    model.net = _PerSampleLossNet(model.net.net)
    if where == "__init__":
        model.configure_model()
    replay = HardSampleReplay(mode="batch", scorer=OutputKeyScorer("per_sample"))
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(model, _data())
    assert replay.metrics()["table_seen"] == 720
    # InfoBatch weights the module's loss through the capture, next to a scorer too: still refused
    torch._dynamo.reset()
    model = _FullgraphPerSampleLoss("configure_model", loss_inside=True, how=how)
    model.net = _PerSampleLossNet(model.net.net)
    replay = HardSampleReplay(rule="infobatch", mode="batch", scorer=OutputKeyScorer("per_sample"))
    trainer = pl.Trainer(callbacks=[replay], max_epochs=1, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^HardSampleReplay cannot capture the F.cross_entropy called inside"
    ):
        trainer.fit(model, _data())


class _SmallPerSample(pl.LightningModule):
    """Returns its per-sample losses for an OutputKeyScorer and logs nothing (Lightning's `self.log` inside a
    fullgraph-compiled training_step is a graph break of its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = F.cross_entropy(self.net(x), y, reduction="none")
        return {"loss": per_sample.mean(), "per_sample": per_sample.detach()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("how", ["model.compile(fullgraph=True)", "torch.compile(model, fullgraph=True)"])
def test_a_whole_module_compiled_with_fullgraph_trains_next_to_a_scorer(how):
    # a scorer needs no capture: the fullgraph training_step that is refused without one trains with one
    torch._dynamo.reset()
    model = _SmallPerSample()
    if how.startswith("model."):
        model.compile(fullgraph=True)
    else:
        model = torch.compile(model, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    )
    replay = HardSampleReplay(mode="batch", scorer=OutputKeyScorer("per_sample"))
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(model, DataLoader(data, batch_size=8))
    assert trainer.global_step == 16 and replay.metrics()["table_seen"] == 64


class _TokenTagger(pl.LightningModule):
    """Tags every token of a sequence; targets of -100 are ignored. Records the samples each step trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 3)
        self.trained: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        tokens, tags, index = batch
        self.trained.append(index.tolist())
        logits = self.head(self.embed(tokens))
        return F.cross_entropy(logits.reshape(-1, 3), tags.reshape(-1), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_sample_whose_every_token_is_ignored_is_scored_easiest_not_kept_unseen():
    # held-out sweep: such a sample's per-sample loss is 0/0; left unscored it counted as unseen, and unseen
    # samples are always trained, so it was replayed in every light batch while adding nothing to the loss
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (64, 6), generator=generator)
    tags = tokens % 3
    tags[:8] = -100  # samples 0-7: no token counts (padding-only sequences)
    data = DataLoader(TensorDataset(tokens, tags, torch.arange(64)), batch_size=16, shuffle=False)
    module, replay = _TokenTagger(), HardSampleReplay(mode="batch", replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    trainer.fit(module, data)
    scores = replay.selector.table.scores
    assert (scores[:8] == 0).all() and np.isfinite(scores).all()
    later = [i for step in module.trained[4:] for i in step]  # epochs 2 and 3: scored batches, cut in half
    assert len(later) == 64 and not set(later) & set(range(8))


class _Sequences(torch.utils.data.Dataset):
    """Token sequences of lengths 3 to 10 with a class label each (a sequence classifier's data)."""

    def __init__(self, count: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 11, (count,), generator=generator)
        self.tokens = [torch.randint(0, 20, (int(n),), generator=generator) for n in lengths]
        self.labels = torch.randint(0, 3, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index], self.labels[index]


def _time_major(samples):
    tokens, labels = zip(*samples)
    return torch.nn.utils.rnn.pad_sequence(list(tokens)), torch.stack(labels)  # (T, B), torch's default


def _listed_with_a_count_first(samples):
    tokens, labels = zip(*samples)
    return {
        "num_tokens": torch.tensor(sum(len(t) for t in tokens)),
        "tokens": list(tokens),
        "label": torch.stack(labels),
    }


class _SequenceClassifier(pl.LightningModule):
    """Mean-pooled embeddings; reads time-major (T, B) batches or dicts holding a list of sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 3)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):
            pooled = torch.stack([self.embed(tokens).mean(0) for tokens in batch["tokens"]])
            labels = batch["label"]
        else:
            pooled, labels = self.embed(batch[0]).mean(0), batch[1]
        self.sizes.append(len(labels))
        return F.cross_entropy(self.head(pooled), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _sequence_fit(mode: str, collate, **loader) -> tuple[pl.Trainer, _SequenceClassifier, HardSampleReplay]:
    module, replay = _SequenceClassifier(), HardSampleReplay(mode=mode, replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    trainer.fit(module, DataLoader(_Sequences(), batch_size=8, collate_fn=collate, **loader))
    return trainer, module, replay


@pytest.mark.parametrize(
    "collate", [_time_major, _listed_with_a_count_first], ids=["time-major", "dict-list"]
)
def test_steps_mode_trains_batches_whose_first_tensor_is_not_the_batch(collate):
    # held-out sweep: the batch size was read from the first tensor (the time-major batch's longest sequence,
    # the dict's 0-dim count) and the run failed with a RuntimeError, after training started for time-major
    trainer, module, replay = _sequence_fit("steps", collate, shuffle=True)
    assert trainer.global_step == trainer.max_steps == 12  # 3 epochs of 4 full batches, from windows of 16
    assert module.sizes == [8] * 12 and replay.table.seen == 64


def test_batch_mode_cuts_a_dict_holding_a_list_of_sequences_and_a_count():
    trainer, module, _ = _sequence_fit("batch", _listed_with_a_count_first, shuffle=True)
    assert trainer.global_step == 24 and module.sizes == [8] * 8 + [4] * 16


def test_batch_mode_refuses_a_time_major_batch_before_the_first_step():
    # cut along its first dimension, a (T, B) batch is cut along time: refused, naming the shapes and the way
    # out
    with pytest.raises(PulseRefusal, match=r"^HardSampleReplay cannot cut .*\(10, 8\).*mode='steps'"):
        _sequence_fit("batch", _time_major, shuffle=False)


def _with_class_weights_and_a_count(samples):
    xs, ys = zip(*samples)
    y = torch.stack(ys)
    return [torch.stack(xs), (y, torch.bincount(y, minlength=5).float() + 1.0, torch.tensor(len(y)))]


class _WeightedClassifier(pl.LightningModule):
    """Reads ``[x, (y, class_w, count)]``: a ``(B,)`` target, a ``(5,)`` class weight, a 0-dim count."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, 5)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        x, (y, class_w, count) = batch
        assert class_w.shape == (5,) and count.dim() == 0 and len(y) == len(x)
        self.sizes.append(len(y))
        return F.cross_entropy(self.head(x), y, weight=1.0 / class_w)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batch_mode_cuts_a_short_last_batch_as_long_as_its_target_tuple_as_it_cut_the_full_ones():
    # held-out sweep: batches of 8 passed the check at the first batch, then the last batch of 3 read the
    # target tuple (y, class_w, count) as 3 samples' items and cut it to 2 of them: the run crashed mid-epoch
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(19, 4, generator=generator), torch.randint(0, 5, (19,), generator=generator)
    )
    module, replay = _WeightedClassifier(), HardSampleReplay(mode="batch", replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(module, DataLoader(data, batch_size=8, collate_fn=_with_class_weights_and_a_count))
    assert trainer.global_step == 6 and module.sizes[:3] == [8, 8, 3]
    assert module.sizes[3:] == [4, 4, 2]  # the last batch is cut too, its class weights and count kept


_CLASS_WEIGHTS = torch.arange(1.0, 11.0)


def _with_class_weights(samples):
    xs, ys = zip(*samples)
    return {"x": torch.stack(xs), "y": torch.stack(ys), "class_weights": _CLASS_WEIGHTS.clone()}


class _ClassWeighted(pl.LightningModule):
    """Reads ``{"x", "y", "class_weights"}``: a ``(10,)`` class weight the collate_fn adds to every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, 10)
        self.seen: list[tuple[int, list[float]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((len(batch["y"]), batch["class_weights"].tolist()))
        return F.cross_entropy(self.head(batch["x"]), batch["y"], weight=batch["class_weights"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batch_mode_keeps_a_class_weight_vector_whole_on_a_short_last_batch_as_long_as_it():
    # sweep: batches of 16 kept the (10,) weights whole, but the epoch's last batch of 10 samples read them as
    # per-sample and cut them to 5 with the samples: cross_entropy raised at the first cut last batch
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(42, 4, generator=generator), torch.randint(0, 10, (42,), generator=generator)
    )
    module, replay = _ClassWeighted(), HardSampleReplay(mode="batch", replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    trainer.fit(module, DataLoader(data, batch_size=16, collate_fn=_with_class_weights))
    assert trainer.global_step == 6
    assert [size for size, _ in module.seen] == [16, 16, 10, 8, 8, 5]  # the last batch is cut too
    assert all(weights == _CLASS_WEIGHTS.tolist() for _, weights in module.seen)


class _FocalLoss(pl.LightningModule):
    """A hand-written focal loss over F.cross_entropy(reduction="none"); each InfoBatch-weighted step checks
    its gradient against the intended one, the gradient of mean_i(w_i * focal_i) over the true
    cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.expected: list[torch.Tensor] | None = None
        self.gaps: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        ce = F.cross_entropy(logits, y, reduction="none")
        loss = ((1 - torch.exp(-ce)) ** 2 * ce).mean()
        replay = next(c for c in self.trainer.callbacks if isinstance(c, HardSampleReplay))
        weights, self.expected = replay.batches.current.plan.weights, None
        if weights is not None:
            true_ce = -torch.log_softmax(logits, -1).gather(1, y[:, None])[:, 0]  # no captured call
            assert torch.equal(ce.detach(), true_ce.detach())  # the module sees its true losses
            intended = (weights * (1 - torch.exp(-true_ce)) ** 2 * true_ce).mean()
            self.expected = torch.autograd.grad(intended, list(self.parameters()), retain_graph=True)
        return loss

    def on_after_backward(self):
        if self.expected is not None:
            gaps = [
                (p.grad - e).abs().max() / e.abs().max() for p, e in zip(self.parameters(), self.expected)
            ]
            self.gaps.append(float(max(gaps)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_infobatch_weights_each_term_of_a_focal_loss_without_changing_the_cross_entropy_it_sees():
    # held-out sweep: the weights multiplied the cross-entropy the module received, so the focal factor was
    # computed from w * ce: it trained on (1 - exp(-w ce))^2 w ce instead of w (1 - exp(-ce))^2 ce
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(256, 10, generator=generator), torch.randint(0, 3, (256,), generator=generator)
    )
    module = _FocalLoss()
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(rule="infobatch", prune_ratio=0.5)], max_epochs=3, **trainer_kwargs()
    )
    trainer.fit(module, DataLoader(data, batch_size=32, shuffle=True))
    assert len(module.gaps) >= 8 and max(module.gaps) < 1e-4  # the pruned steps of epochs 2 and 3


class _CTCRecognizer(pl.LightningModule):
    """A GRU with a CTC head over variable-length frames, its targets concatenated (``torch.cat``, the 1-D
    layout nn.CTCLoss documents) or padded to ``(B, S)``; ``mismatched`` counts steps whose targets are not as
    long as their lengths say."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = torch.nn.GRU(4, 8, batch_first=True), torch.nn.Linear(8, 6)
        self.mismatched = 0

    def training_step(self, batch, batch_idx):
        targets, lengths = batch["targets"], batch["tgt_len"]
        if targets.dim() == 1:
            self.mismatched += int(targets.numel() != int(lengths.sum()))
        log_probs = self.head(self.rnn(batch["x"])[0]).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(log_probs, targets, batch["in_len"], lengths)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _ctc_loader(layout: str) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(32):
        frames = int(torch.randint(10, 14, (1,), generator=generator))
        count = int(torch.randint(2, 5, (1,), generator=generator))
        labels = torch.randint(1, 6, (count,), generator=generator)
        samples.append((torch.randn(frames, 4, generator=generator), labels))

    def collate(items):
        xs, ys = zip(*items)
        pad = torch.nn.utils.rnn.pad_sequence
        return {
            "x": pad(list(xs), batch_first=True),
            "in_len": torch.tensor([len(x) for x in xs]),
            "targets": torch.cat(ys) if layout == "concatenated" else pad(list(ys), batch_first=True),
            "tgt_len": torch.tensor([len(y) for y in ys]),
        }

    return DataLoader(samples, batch_size=8, shuffle=True, collate_fn=collate)


@pytest.mark.parametrize(
    ("layout", "mode"), [("concatenated", "batch"), ("padded", "batch"), ("concatenated", "steps")]
)
def test_ctc_targets_concatenated_are_refused_in_batch_mode_at_the_second_batch_naming_the_ways_out(
    layout, mode
):
    # held-out sweep: batch mode cut the (B,) target lengths but kept the 1-D targets whole; CTC stopped the
    # fit at the first cut step (epoch 2) with a size error that did not name HardSampleReplay
    pl.seed_everything(0)
    module = _CTCRecognizer()
    replay = HardSampleReplay(mode=mode, replay_fraction=0.5)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    if (layout, mode) == ("concatenated", "batch"):
        with pytest.raises(PulseRefusal) as refusal:
            trainer.fit(module, _ctc_loader(layout))
        assert trainer.global_step == 1  # before the second batch trained, long before the first cut
        message = str(refusal.value)
        assert message.startswith("HardSampleReplay cannot cut a batch of 8 samples in mode='batch'")
        assert "batch['targets']" in message and "the sum of batch['tgt_len']" in message
        assert "mode='steps'" in message and "(B, S)" in message
        return
    trainer.fit(module, _ctc_loader(layout))  # the ways out train, light steps included
    assert module.mismatched == 0 and trainer.current_epoch == 3
    assert replay.metrics()["replay_fraction"] < 1.0


@pytest.mark.parametrize("half_life", [5.0, "400steps"], ids=["epochs", "steps"])
def test_a_half_life_in_epochs_warns_where_a_manual_module_steps_two_optimizers_a_batch(half_life):
    """A review: under manual optimization with two optimizers global_step counts both players' steps, so a
    half-life of 5 epochs read as one step a batch aged the scores in 2.5 epochs, silently. It warns with the
    way out (steps); a half-life in steps says nothing."""
    from tests.test_pulse_cycle import ManualPlayers, ten_batch_loader

    replay = HardSampleReplay(mode="batch", score_half_life=half_life)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=2, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ManualPlayers(players=2), ten_batch_loader())
    warnings_seen = [str(w.message) for w in caught if "score_half_life" in str(w.message)]
    if half_life == 5.0:
        assert len(warnings_seen) == 1 and "steps its 2 optimizers itself" in warnings_seen[0]
        assert "score_half_life='400steps'" in warnings_seen[0]
    else:
        assert warnings_seen == []


class _PlateauOnTrainLoss(MNIST1DClassifier):
    """The example classifier with Lightning's documented ReduceLROnPlateau config, on its training loss."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss_mean", loss, on_step=False, on_epoch=True)  # `train_loss_mean` (no fork)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss_mean"}}


def _replay_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("HardSampleReplay:")]


def test_monitors_of_a_training_loss_are_warned_once_that_replay_phases_raise_it(tmp_path):
    """Sweep 41: replay phases train the hardest samples, so a loss logged in training_step rises in every
    epoch holding one while the model improves; `ReduceLROnPlateau(monitor="train_loss_epoch")` cut a pulse
    run's learning rate 4x (a plain run's never), with no word. Now one warning, at the fit's first epoch end
    (the logged keys are known then, before any epoch-end monitor reads them), names each monitor of a
    training-loop key, why, and the way out; a monitor of a validation metric is not named."""
    pl.seed_everything(0)
    cycle = PulseCycle(burst=6, replay=6, maintain=0, warmup=0.0, anneal=0.0)
    stop = EarlyStopping(monitor="train_loss", patience=100)
    best = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss_mean")
    fine = EarlyStopping(monitor="val_loss", patience=100)  # a validation metric: not named
    trainer = pl.Trainer(
        callbacks=[cycle, HardSampleReplay(), stop, best, fine],
        max_epochs=3,
        **trainer_kwargs(enable_checkpointing=True, limit_val_batches=1, default_root_dir=tmp_path),
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(_PlateauOnTrainLoss(arch="mlp"), _data())

    lines = [line for line in _replay_warnings(record) if "a figure logged in the training loop" in line]
    assert len(lines) == 1, lines  # once a fit, not at every epoch end
    line = lines[0]
    assert line.startswith(
        "HardSampleReplay: EarlyStopping(monitor='train_loss'); ModelCheckpoint(monitor='train_loss_mean'); "
        "ReduceLROnPlateau (lr_scheduler config monitor='train_loss_mean') monitor a figure logged in the "
        "training loop"
    )
    assert "['replay']" in line and "hardest samples" in line and "Monitor a validation metric" in line
    assert "val_loss'" not in line


@pytest.mark.parametrize("rule", ["topk", "random"])
def test_no_monitor_warning_for_validation_monitors_or_a_rule_that_keeps_the_loss_the_datas(rule):
    """`rule="random"` trains a uniform subset (the figure stays an estimate of the data's): not warned,
    nor is a monitor of a validation metric under any rule."""
    pl.seed_everything(0)
    cycle = PulseCycle(burst=6, replay=6, maintain=0, warmup=0.0, anneal=0.0)
    monitor = "train_loss" if rule == "random" else "val_loss"
    trainer = pl.Trainer(
        callbacks=[cycle, HardSampleReplay(rule=rule), EarlyStopping(monitor=monitor, patience=100)],
        max_epochs=2,
        **trainer_kwargs(limit_val_batches=1),
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(MNIST1DClassifier(arch="mlp"), _data())
    assert trainer.current_epoch == 2
    assert not [line for line in _replay_warnings(record) if "monitor" in line]
