"""PulseCycle through real Trainer.fit runs on MNIST-1D."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_pulse import Phase, PulseCycle, PulseRefusal, phase_of, pulse_cycle_of
from tests.clients import BatchNormMLP
from tests.conftest import trainer_kwargs


class PhaseRecorder(Callback):
    """Records the phase every training batch runs in, and every change it is told of."""

    def __init__(self) -> None:
        self.batch_phases: list[tuple[int, int, str]] = []
        self.changes = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_phases.append((trainer.global_step, batch_idx, phase_of(trainer).value))

    def on_pulse_phase_change(self, trainer, pl_module, change):
        self.changes.append(change)


def test_phase_of_without_pulse_cycle_returns_the_default():
    trainer = pl.Trainer(**trainer_kwargs())
    assert pulse_cycle_of(trainer) is None
    assert phase_of(trainer) is Phase.BURST
    assert phase_of(trainer, default=Phase.REPLAY) is Phase.REPLAY
    assert phase_of(None) is Phase.BURST


def test_fit_follows_the_step_cycle_and_tells_listeners(mnist1d_small):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=4, replay=2, maintain=1, warmup=0.0, anneal=0.0, maintain_eval="none")
    recorder = PhaseRecorder()
    heard = []
    cycle.add_listener(lambda trainer, module, change: heard.append(change.current))
    trainer = pl.Trainer(callbacks=[cycle, recorder], max_steps=21, **trainer_kwargs())
    trainer.fit(model, data)
    phases = "".join(phase[0] for _, _, phase in recorder.batch_phases)
    assert phases == "bbbbrrm" * 3
    assert [c.current for c in recorder.changes] == heard
    assert recorder.changes[0].reason == "start"
    assert cycle.clock.steps_by_phase == {"burst": 12, "replay": 6, "maintain": 3}


def test_accumulation_windows_are_never_split(mnist1d_small):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=3, replay=2, maintain=0, warmup=0.0, anneal=0.0)
    recorder = PhaseRecorder()
    trainer = pl.Trainer(
        callbacks=[cycle, recorder], max_steps=10, accumulate_grad_batches=3, **trainer_kwargs()
    )
    trainer.fit(model, data)
    by_step: dict[int, set[str]] = {}
    for step, _, phase in recorder.batch_phases:
        by_step.setdefault(step, set()).add(phase)
    assert all(len(phases) == 1 for phases in by_step.values())
    # phases count optimizer steps, not micro-batches
    assert "".join(next(iter(by_step[s]))[0] for s in sorted(by_step)) == "bbbrrbbbrr"


def test_warmup_and_anneal_follow_the_estimated_run_length(mnist1d_small):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=2, replay=2, maintain=0, warmup=0.25, anneal=0.25, maintain_eval="none")
    recorder = PhaseRecorder()
    trainer = pl.Trainer(callbacks=[cycle, recorder], max_epochs=4, **trainer_kwargs())  # 12 batches/epoch
    trainer.fit(model, data)
    phases = "".join(phase[0] for _, _, phase in recorder.batch_phases)
    total = trainer.global_step
    assert total == 48
    assert phases[:12] == "b" * 12 and phases[-12:] == "b" * 12
    assert phases[12:36] == "bbrr" * 6


def test_warmup_and_anneal_follow_the_run_length_under_an_accumulation_scheduler(mnist1d_small):
    # held-out sweep: the run length came from Lightning's estimate, which counts every epoch at the current
    # accumulation (48 steps at the start here, 12 from the second epoch on): warm-up and anneal moved with
    # it. 12 batches an epoch: 12 steps, then 3 an epoch at accumulation 5, 21 in all
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    model, data = mnist1d_small()
    cycle = PulseCycle(burst=3, replay=4, order=("burst", "replay"), warmup=0.1, anneal=0.3)
    scheduler = GradientAccumulationScheduler({0: 1, 1: 5})
    trainer = pl.Trainer(callbacks=[scheduler, cycle], max_epochs=4, **trainer_kwargs())
    trainer.fit(model, data)
    assert trainer.global_step == 21
    # warm-up round(0.1 * 21) = 2 steps, so the first replay starts at 2 + 3; the anneal from round(0.7 * 21)
    # = 15, inside the second replay
    changes = [(change.step, change.reason) for change in cycle.history]
    assert changes == [(0, "start"), (5, "budget"), (9, "budget"), (12, "budget"), (15, "anneal")]


def test_maintain_probe_logs_and_leaves_real_validation_untouched(mnist1d_small, tmp_path):
    def fit(probe: str):
        pl.seed_everything(3)
        model, data = mnist1d_small()
        probe_options = {"probe_batches": 2} if probe == "probe" else {}  # it would do nothing with "none"
        cycle = PulseCycle(
            burst=5, replay=0, maintain=2, warmup=0.0, anneal=0.0, maintain_eval=probe, **probe_options
        )
        logger = CSVLogger(tmp_path, name=probe)
        trainer = pl.Trainer(
            callbacks=[cycle], max_epochs=2, **trainer_kwargs(logger=logger, log_every_n_steps=1)
        )
        trainer.fit(model, data)
        return trainer, cycle, logger

    trainer_probe, cycle, logger = fit("probe")
    trainer_plain, _, _ = fit("none")
    assert set(cycle.last_probe) == {"val_loss", "val_acc"}
    assert 0.0 <= cycle.last_probe["val_acc"] <= 1.0
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    assert any(row.get("pulse/probe/val_loss") for row in rows)
    assert any(row.get("pulse/burst_steps") == "5.0" for row in rows)
    # the probe runs the module's validation_step and metric updates, but the epoch-end validation
    # figures (torchmetrics accuracy included) are exactly those of the run without a probe
    for key in ("val_loss", "val_acc"):
        assert trainer_probe.callback_metrics[key].item() == trainer_plain.callback_metrics[key].item()


def test_a_probe_of_a_validation_step_that_draws_random_numbers_leaves_training_bit_for_bit(mnist1d_small):
    # a diffusion model's or a VAE's validation_step samples noise: the probe used to draw from the training
    # generators, so PulseCycle alone changed the run (a held-out diffusion model: val loss 0.4749 vs 0.4625)
    def fit(probe: str):
        pl.seed_everything(3)
        model, data = mnist1d_small()
        step = model.validation_step

        def noisy_validation_step(batch, batch_idx):
            torch.rand(16)  # the draw a denoising model makes for its timesteps and noise
            return step(batch, batch_idx)

        model.validation_step = noisy_validation_step
        cycle = PulseCycle(burst=5, replay=0, maintain=2, warmup=0.0, anneal=0.0, maintain_eval=probe)
        trainer = pl.Trainer(callbacks=[cycle], max_epochs=2, **trainer_kwargs())
        trainer.fit(model, data)
        assert probe == "none" or cycle.last_probe
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(fit("probe"), fit("none"))


def test_phase_shows_in_progress_bar(mnist1d_small):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=3, replay=2, maintain=0, warmup=0.0, anneal=0.0)
    trainer = pl.Trainer(callbacks=[cycle], max_steps=4, **trainer_kwargs(enable_progress_bar=True))
    trainer.fit(model, data)
    shown = trainer.progress_bar_callback.get_metrics(trainer, model)
    assert shown["phase"] == "replay c0"


def test_bf16_autocast_run_with_probe(mnist1d_small):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=3, replay=1, maintain=1, warmup=0.0, anneal=0.0, probe_batches=1)
    trainer = pl.Trainer(callbacks=[cycle], max_steps=10, precision="bf16-mixed", **trainer_kwargs())
    trainer.fit(model, data)
    assert cycle.last_probe and cycle.clock.steps_by_phase["maintain"] == 2


def test_epoch_durations_on_an_infinite_loader_fail_at_fit_start():
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from examples.mnist1d import MNIST1DClassifier

    class Stream(IterableDataset):
        def __iter__(self):
            while True:
                yield torch.randn(40), torch.tensor(1)

    trainer = pl.Trainer(
        callbacks=[PulseCycle(burst=0.5, warmup=0, anneal=0)], max_steps=3, **trainer_kwargs()
    )
    with pytest.raises(PulseRefusal, match="^PulseCycle: epoch-based phase durations .* in steps or seconds"):
        trainer.fit(MNIST1DClassifier(), DataLoader(Stream(), batch_size=4))
    assert trainer.global_step == 0  # refused before the first step


def test_resume_mid_replay_continues_same_phase(mnist1d_small, tmp_path):
    config = dict(burst=5, replay="0.5epoch", maintain=2, warmup=0.1, anneal=0.1, maintain_eval="none")

    def trainer_for(recorder, **extra):
        return pl.Trainer(callbacks=[PulseCycle(**config), recorder, *extra.pop("callbacks", [])], **extra)

    pl.seed_everything(0)
    model, data = mnist1d_small()
    full = PhaseRecorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last=False)
    trainer = trainer_for(
        full, max_epochs=4, callbacks=[checkpoint], **trainer_kwargs(enable_checkpointing=True)
    )
    trainer.fit(model, data)
    uninterrupted = pulse_cycle_of(trainer)

    # find a checkpoint taken in the middle of a replay phase
    replay_steps = [step for step, _, phase in full.batch_phases if phase == "replay"]
    resume_step = next(s for s in replay_steps if s + 1 in replay_steps and s - 1 in replay_steps) + 1
    ckpt = next(tmp_path.glob(f"*step={resume_step}.ckpt"))

    pl.seed_everything(0)
    model, data = mnist1d_small()
    resumed = PhaseRecorder()
    trainer = trainer_for(resumed, max_epochs=4, **trainer_kwargs())
    trainer.fit(model, data, ckpt_path=str(ckpt))
    cycle = pulse_cycle_of(trainer)
    assert resumed.changes[0].reason == "resume" and resumed.changes[0].current is Phase.REPLAY
    assert resumed.batch_phases[0][2] == "replay"

    def without_seconds(history):
        return [(c.previous, c.current, c.cycle, c.step, c.reason, c.ended_steps) for c in history]

    assert without_seconds(cycle.history) == without_seconds(uninterrupted.history)
    assert cycle.clock.steps_by_phase == uninterrupted.clock.steps_by_phase
    full_after = [(step, phase) for step, _, phase in full.batch_phases if step >= resume_step]
    assert [(step, phase) for step, _, phase in resumed.batch_phases] == full_after


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"burst": "-5min"}, "`burst`"),
        ({"replay": "soon"}, "`replay`"),
        ({"order": ["burst", "siesta"]}, "siesta"),
        ({"warmup": 0.5, "anneal": 0.5}, "`warmup`"),
        ({"maintain_eval": "full"}, "`maintain_eval`"),
        ({"probe_batches": 0}, "`probe_batches`"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PulseCycle(**kwargs)


@pytest.mark.parametrize("swa_first", [False, True])
def test_warmup_and_anneal_next_to_swa_on_batch_norm_are_shares_of_the_training_steps(swa_first):
    """Held-out sweep: SWA raises max_epochs by one on a model with BatchNorm for an epoch that only
    recomputes BatchNorm statistics; warm-up and anneal were shares of 60 steps where 50 train (anneal=0.2
    covered 3 training steps, not 10). They are placed as in the run without that epoch, and its step (no
    backward) does not move the clock."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def fit(with_swa: bool):
        pl.seed_everything(0, verbose=False)
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(80, 10, generator=generator), torch.randint(0, 3, (80,), generator=generator)
        )
        cycle = PulseCycle(burst=3, replay=3, maintain=0, warmup=0.2, anneal=0.2, maintain_eval="none")
        swa = [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=0.6)] if with_swa else []
        callbacks = [*swa, cycle] if swa_first else [cycle, *swa]
        trainer = pl.Trainer(callbacks=callbacks, max_epochs=5, **trainer_kwargs())
        trainer.fit(BatchNormMLP(), torch.utils.data.DataLoader(data, batch_size=8))  # 10 batches a pass
        changes = [(change.step, change.reason) for change in cycle.history]
        return changes, cycle.clock.step, trainer.global_step

    plain, with_swa = fit(False), fit(True)
    assert plain[1:] == (50, 50) and with_swa[1:] == (50, 51)
    # warm-up round(0.2 * 50) = 10 steps and a burst of 3 before the first replay; anneal from round(0.8 * 50)
    assert plain[0][:2] == [(0, "start"), (13, "budget")] and plain[0][-1] == (40, "anneal")
    assert with_swa[0] == plain[0]


class ManualPlayers(pl.LightningModule):
    """Manual optimization stepping each of its ``players`` optimizers once a batch (a GAN's two players):
    Lightning's global_step counts every optimizer's step."""

    def __init__(self, players: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.players = players
        self.body = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        loss = torch.nn.functional.cross_entropy(self(x), y)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()

    def configure_optimizers(self):
        if self.players == 1:
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return [
            torch.optim.SGD(self.body.parameters(), lr=0.05),
            torch.optim.SGD(self.head.parameters(), lr=0.05),
        ]


def ten_batch_loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(80, 10, generator=generator), torch.randint(0, 3, (80,), generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=8)  # 10 batches a pass


@pytest.mark.parametrize(
    ("kwargs", "refused"),
    [
        (
            {"warmup": 0.1, "anneal": 0.1},
            r"`warmup`=0.1 and `anneal`=0.1 are shares of the run's optimizer steps",
        ),
        ({"warmup": 0.0, "anneal": 0.2}, r"`anneal`=0.2 is a share of the run's optimizer steps"),
        (
            {"burst": "0.5epoch", "warmup": 0.0, "anneal": 0.0},
            r"phases counted in epochs \(`burst`=0.5epochs\) need an epoch's length in optimizer steps",
        ),
    ],
)
def test_shares_of_a_manual_run_stepping_two_optimizers_a_batch_are_refused_at_fit_start(kwargs, refused):
    """Held-out sweep: a GAN-style module steps two optimizers a batch, global_step counts both (60 in 30
    batches), and Lightning's estimate counts one a batch (30): anneal=0.1 covered 56% of the batches. The
    length in steps is not known before the run, so shares of it (and of an epoch) are refused."""
    cycle = PulseCycle(**{"burst": 4, "replay": 2, "maintain": 0, "maintain_eval": "none", **kwargs})
    trainer = pl.Trainer(callbacks=[cycle], max_epochs=3, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=rf"^PulseCycle: {refused}, and this module steps its 2 optimizers"
    ) as e:
        trainer.fit(ManualPlayers(players=2), ten_batch_loader())
    assert trainer.global_step == 0
    way_out = "max_steps alone" if "anneal" in refused else "give the durations in steps or seconds"
    assert "global_step counts every optimizer's step" in str(e.value) and way_out in str(e.value)


@pytest.mark.parametrize(
    ("players", "length"),
    [(1, {"max_epochs": 4}), (2, {"max_steps": 80})],
    ids=["one-optimizer", "two-max-steps"],
)
def test_manual_optimization_places_warmup_and_anneal_on_every_optimizer_step(players, length):
    """One optimizer stepped once a batch (40 steps in 40 batches), and two bounded by max_steps alone (80
    steps in 40 batches, global_step and max_steps count both): warm-up and anneal are a tenth of the
    batches."""
    recorder = PhaseRecorder()
    cycle = PulseCycle(
        burst=3 * players, replay=players, maintain=0, warmup=0.1, anneal=0.1, maintain_eval="none"
    )
    trainer = pl.Trainer(callbacks=[cycle, recorder], **length, **trainer_kwargs())
    trainer.fit(ManualPlayers(players=players), ten_batch_loader())
    assert trainer.global_step == 40 * players and len(recorder.batch_phases) == 40
    phases = "".join(phase[0] for _, _, phase in recorder.batch_phases)
    assert phases == "bbbb" + "bbbr" * 8 + "bbbb"  # warm-up, 8 cycles of burst and replay, anneal
    assert [(change.step, change.reason) for change in cycle.history][-1] == (36 * players, "anneal")


class Curriculum(pl.LightningDataModule):
    """A training DataLoader rebuilt every epoch (``reload_dataloaders_every_n_epochs=1``) holding 3 batches
    of 8, then ``grow`` more each epoch: a growing curriculum, or (``grow=0``) a reshuffle at the same
    length."""

    def __init__(self, grow: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = (
            torch.randn(80, 10, generator=generator),
            torch.randint(0, 3, (80,), generator=generator),
        )
        self.grow = grow

    def train_dataloader(self):
        count = 8 * (3 + self.grow * self.trainer.current_epoch)
        data = torch.utils.data.TensorDataset(self.x[:count], self.y[:count])
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


@pytest.mark.parametrize(
    ("grow", "bound", "warned"),
    [(1, {"max_epochs": 4}, True), (0, {"max_epochs": 6}, False), (1, {"max_steps": 18}, False)],
    ids=["growing", "reshuffled", "growing-bounded-by-steps"],
)
def test_a_share_placed_on_a_run_whose_reloaded_epochs_change_length_is_warned_once(
    grow, bound, warned, recwarn
):
    """Held-out sweep: a curriculum's DataLoader, rebuilt each epoch at a new length, moved the run's length
    (Lightning reads `max_epochs` x the current epoch's batches: 12, then 16, 20, 24 for an 18-step run), and
    `anneal=0.2` annealed no step, unsaid. No later epoch's length is known ahead: a warning names the setting
    and the way out (`max_steps` alone: the anneal is then the last 20% of 18 steps). A reload at the same
    length, to reshuffle, says nothing."""
    pl.seed_everything(0, verbose=False)
    cycle = PulseCycle(burst=1, replay=3, maintain=0, warmup=0.0, anneal=0.2, maintain_eval="none")
    trainer = pl.Trainer(callbacks=[cycle], reload_dataloaders_every_n_epochs=1, **bound, **trainer_kwargs())
    trainer.fit(BatchNormMLP(), datamodule=Curriculum(grow))
    assert trainer.global_step == 18  # 3 + 4 + 5 + 6 batches, or 6 epochs of 3
    said = [str(w.message) for w in recwarn if "`reload_dataloaders_every_n_epochs`" in str(w.message)]
    if warned:
        assert len(said) == 1, said
        assert said[0].startswith("PulseCycle: the training DataLoader rebuilt for epoch 1 ")
        assert "holds 4 batches, where the epoch the run's length was read from held 3" in said[0]
        assert "PulseCycle (`anneal`=0.2)" in said[0] and "Set Trainer(max_steps=N)" in said[0]
    else:
        assert said == []
        last = cycle.history[-1]
        assert (last.step, last.reason) == (14, "anneal")  # round(0.8 * 18), mid-replay


class SaveInsideStep(Callback):
    """A user's callback listed before PulseCycle: ``trainer.save_checkpoint`` in its ``on_train_batch_end``
    of the ``at``-th training batch of the fit (0-based), before PulseCycle's batch end counts the step."""

    def __init__(self, path, at: int) -> None:
        self.path, self.at, self.batches, self.saved_at, self.uncounted = path, at, 0, None, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.batches == self.at:
            trainer.save_checkpoint(self.path)
            self.saved_at = trainer.global_step
            self.uncounted = trainer.global_step - pulse_cycle_of(trainer).clock.step  # the step that trained
        self.batches += 1


def _history(cycle):
    return [(c.previous, c.current, c.cycle, c.step, c.reason, c.ended_steps) for c in cycle.history]


@pytest.mark.parametrize(
    ("accumulate", "at", "saved_at"),
    [(1, 4, 5), (2, 9, 5), (2, 10, 5)],
    ids=[
        "the-burst-s-last-step",
        "accumulated-the-burst-s-last-step",
        "accumulated-a-micro-batch-with-no-step",
    ],
)
def test_a_checkpoint_saved_before_pulse_cycles_batch_end_resumes_in_phase(
    mnist1d_small, tmp_path, accumulate, at, saved_at
):
    # sweep of pass 40: the clock saved there had not counted the step that had trained, which Lightning
    # resumes after: every later phase came a step late (replay, replay, replay, maintain... resumed as burst,
    # replay, replay, replay, ...). At a micro-batch with no step there is nothing to count.
    def fit(callbacks, ckpt_path=None):
        model, data = mnist1d_small()
        cycle = PulseCycle(burst=5, replay=3, maintain=2, warmup=0.0, anneal=0.0, maintain_eval="none")
        recorder = PhaseRecorder()
        trainer = pl.Trainer(
            callbacks=[*callbacks, cycle, recorder],
            max_steps=20,
            accumulate_grad_batches=accumulate,
            **trainer_kwargs(),
        )
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return cycle, [(step, phase) for step, _, phase in recorder.batch_phases], recorder.changes

    saver = SaveInsideStep(tmp_path / "user.ckpt", at)
    full, full_rows, _ = fit([saver])
    assert saver.saved_at == saved_at and saver.uncounted == (0 if at == 10 else 1)
    saved = torch.load(saver.path, weights_only=True)
    assert saved["callbacks"]["PulseCycle"]["clock"]["step"] == saved["global_step"] == saved_at

    resumed, rows, told = fit([], ckpt_path=saver.path)
    assert rows == full_rows[at + 1 :]  # the batches after the saved one, each in the same phase
    assert rows[0] == (saved_at, "replay")
    assert _history(resumed) == _history(full)
    assert resumed.clock.steps_by_phase == full.clock.steps_by_phase
    if at != 10:  # the burst's end was not told before the save: the resume tells it, after the burst
        assert [(c.previous, c.current, c.reason) for c in told[:2]] == [
            (None, Phase.BURST, "resume"),
            (Phase.BURST, Phase.REPLAY, "budget"),
        ]
    else:
        assert [(c.current, c.reason) for c in told[:1]] == [(Phase.REPLAY, "resume")]


def _fit_with_replay(first, ckpt_path=None, accumulate=1, cycle=None, listener=None, max_epochs=3, last=None):
    """A fit of ``first`` (a saver), PulseCycle, ``listener``, a step-saving HardSampleReplay and ``last``, in
    that order (the documented one), on a shuffle-free loader: a mid-epoch resume trains the same batches."""
    from lightning_pulse import HardSampleReplay
    from tests.test_step_saving_replay import CYCLE, OneCycleClassifier, ShuffleFreeData

    pl.seed_everything(0)
    model, pulse = OneCycleClassifier(), PulseCycle(**(cycle or CYCLE))
    replay = HardSampleReplay(rule="topk", replay_fraction=0.5, mode="steps")
    callbacks = [c for c in (first, pulse, listener, replay, last) if c is not None]
    trainer = pl.Trainer(
        callbacks=callbacks, max_epochs=max_epochs, accumulate_grad_batches=accumulate, **trainer_kwargs()
    )
    trainer.fit(model, ShuffleFreeData(num_samples=1000, batch_size=64), ckpt_path=ckpt_path)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), trainer.global_step, pulse


@pytest.mark.parametrize(("accumulate", "at"), [(1, 7), (1, 16), (2, 13)])
def test_a_save_before_pulse_cycle_next_to_a_step_saving_replay_resumes_bit_for_bit(tmp_path, accumulate, at):
    # sweep of pass 40, the documented order [saver, PulseCycle, HardSampleReplay]: resumed one step out of
    # phase, the run took 28 steps instead of 29, weights 0.035 off (accumulating 2: 13 instead of 14)
    saver = SaveInsideStep(tmp_path / "user.ckpt", at)
    weights, steps, full = _fit_with_replay(saver, accumulate=accumulate)
    assert saver.uncounted == 1
    resumed_weights, resumed_steps, resumed = _fit_with_replay(None, saver.path, accumulate=accumulate)
    assert resumed_steps == steps
    assert _history(resumed) == _history(full)
    assert torch.equal(resumed_weights, weights)


@pytest.mark.parametrize(
    ("listener", "at", "entered"),
    [("prune", 15, Phase.MAINTAIN), ("cache", 9, Phase.REPLAY)],
    ids=["a-pruning-event-at-a-maintain-entry", "a-freeze-at-a-replay-entry"],
)
def test_a_resume_tells_the_listeners_the_changes_of_the_step_saved_before_pulse_cycles_batch_end(
    tmp_path, listener, at, entered
):
    # the step that trained enters a phase; PulseCycle's batch end tells it after the save, so no listener's
    # state in the checkpoint has it. Resumed with the phase only (reason "resume"), a ScheduledPrune skipped
    # its maintain-entry event (weights 0.088 off), a GradientCache froze 2 steps late (0.037 off) and the
    # maintain probe did not run; told at the resume's start, each acts as in the uninterrupted run
    from lightning_pulse import GradientCache, ScheduledPrune

    class Probes(Callback):
        """The maintain probe's figures at each maintain entry (PulseCycle runs it before telling listeners)."""

        def __init__(self) -> None:
            self.seen = []

        def on_pulse_phase_change(self, trainer, pl_module, change):
            if change.current is Phase.MAINTAIN and change.reason != "resume":
                self.seen.append((change.step, dict(pulse_cycle_of(trainer).last_probe)))

    def made():
        if listener == "prune":
            return ScheduledPrune(final_sparsity=0.5, start=0.0, end=0.8, probe_batches=0)
        return GradientCache(threshold=2.0, check_every=2, freeze_for=20)

    cycle = dict(
        burst=6, replay=6, maintain=3, warmup=0.1, anneal=0.1, maintain_eval="probe", probe_batches=2
    )
    saver, first, probes = SaveInsideStep(tmp_path / "user.ckpt", at), made(), Probes()
    weights, steps, full = _fit_with_replay(saver, cycle=cycle, listener=first, max_epochs=4, last=probes)
    entry = next(c for c in full.history if c.step == saver.saved_at and c.reason == "budget")
    assert entry.current is entered and saver.uncounted == 1
    again, probed_again = made(), Probes()
    resumed_weights, resumed_steps, resumed = _fit_with_replay(
        None, saver.path, cycle=cycle, listener=again, max_epochs=4, last=probed_again
    )
    events = [
        {k: v for k, v in e.items() if k in ("step", "sparsity", "from", "to", "reason")}
        for e in first.events
    ]
    assert [e["step"] for e in events].count(saver.saved_at) == 1  # the entry's event or freeze
    assert [{k: e[k] for k in events[0]} for e in again.events] == events
    assert probed_again.seen == [(step, probe) for step, probe in probes.seen if step >= saver.saved_at]
    assert len(probes.seen) == 2 and _history(resumed) == _history(full)
    assert resumed_steps == steps
    assert torch.equal(resumed_weights, weights)


def test_a_checkpoint_saved_at_a_resumes_start_keeps_the_changes_not_yet_told(tmp_path):
    # review of pass 41: a resumed PulseCycle tells the changes its checkpoint held only after every
    # on_train_start; a checkpoint saved in between (GreenWindow's suspend at a dirty resume's start) held the
    # counted clock with no changes to tell, and its own resume never ran the maintain entry's prune event
    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
    from lightning_pulse import ScheduledPrune

    class SaveAtStartAndStop(Callback):
        def on_train_start(self, trainer, pl_module):
            trainer.save_checkpoint(tmp_path / "start.ckpt")
            trainer.should_stop = True

    def run(first=(), last=(), ckpt=None):
        pl.seed_everything(0, verbose=False)
        cycle = PulseCycle(burst=4, replay=3, maintain=2, warmup=0, anneal=0, maintain_eval="none")
        prune = ScheduledPrune(final_sparsity=0.5, start=0.0, end=0.9, probe_batches=0)
        kwargs = trainer_kwargs(limit_val_batches=0, default_root_dir=tmp_path)
        trainer = pl.Trainer(callbacks=[*first, cycle, prune, *last], max_steps=20, **kwargs)
        datamodule = MNIST1DDataModule(num_samples=1000, batch_size=64)
        trainer.fit(MNIST1DClassifier(arch="mlp"), datamodule, ckpt_path=ckpt)
        return [e["step"] for e in prune.events]

    saver = SaveInsideStep(tmp_path / "user.ckpt", at=6)  # the step that enters maintain (step 7)
    uninterrupted = run(first=[saver])
    assert saver.saved_at == 7 and 7 in uninterrupted
    run(last=[SaveAtStartAndStop()], ckpt=saver.path)
    state = torch.load(tmp_path / "start.ckpt", weights_only=True)["callbacks"]["PulseCycle"]
    assert [change["reason"] for change in state["untold"]] == ["resume", "budget"]
    assert run(ckpt=tmp_path / "start.ckpt") == uninterrupted
