"""GradientCache through real Trainer.fit runs on MNIST-1D: FLOPs, phases, resume, accumulation, bf16, setup."""

from __future__ import annotations

import copy
import csv
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from examples.mnist1d import MNIST1DClassifier
from lightning_pulse import PulseCycle, phase_of
from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.core.freeze_units import ForwardOrderTrace
from lightning_pulse.core.layer_freezing import GradlessStepCheck
from lightning_pulse.core.snapshots import StepThrough
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

# plasticity threshold 2.0: every unit counts as stable once it has one window of cache, so freezes are certain
EAGER = dict(threshold=2.0, check_every=5, freeze_for=20)


class BackwardFlops(Callback):
    """Counts the FLOPs of every backward with its own FlopCounterMode (independent of GradientCache's)."""

    def __init__(self) -> None:
        self.per_backward: list[int] = []
        self._counter: FlopCounterMode | None = None

    def on_before_backward(self, trainer, pl_module, loss):
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def on_after_backward(self, trainer, pl_module):
        self._counter.__exit__(None, None, None)
        self.per_backward.append(self._counter.get_total_flops())


class Watch(Callback):
    """Per training batch: step, phase and whether the first conv layer trains; plus that layer's weights."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, bool]] = []
        self.first_weights: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        first = pl_module.net[1].weight
        self.rows.append((trainer.global_step, phase_of(trainer).value, first.requires_grad))
        self.first_weights.append(first.detach().clone())


def fit(model, data, callbacks, **overrides):
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(**overrides))
    trainer.fit(model, data)
    return trainer


def test_standalone_freezing_skips_the_backward_flops_it_reports(mnist1d_small):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    baseline_counter = BackwardFlops()
    fit(model, data, [baseline_counter], max_steps=60, limit_train_batches=10)

    pl.seed_everything(0)
    model, data = mnist1d_small()
    cache, counter = GradientCache(**EAGER), BackwardFlops()
    fit(model, data, [cache, counter], max_steps=60, limit_train_batches=10)

    assert all(p.requires_grad for p in model.parameters())  # the module leaves fit as it came in
    assert cache.events and cache.events[0] == {"step": 5, "from": 0, "to": 3, "reason": "check"}
    measured_skipped = sum(baseline_counter.per_backward) - sum(counter.per_backward)
    assert measured_skipped > 0.4 * sum(baseline_counter.per_backward)
    # every batch has the same size, so the ledger's per-prefix figures add up exactly
    assert cache.ledger.skipped == pytest.approx(measured_skipped)
    assert [unit.name for unit in cache.freezer.units] == ["net.1", "net.3", "net.5", "net.8"]
    assert 0.4 < cache.ledger.skipped_share < 1.0
    assert 0.0 < cache.freezer.mean_frozen_share < 1.0


def test_burst_releases_everything_and_replay_freezes(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    cycle = PulseCycle(burst=15, replay=15, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
    cache, watch = GradientCache(**EAGER), Watch()
    logger = CSVLogger(tmp_path, name="gc")
    fit(model, data, [cycle, cache, watch], max_steps=60, logger=logger, log_every_n_steps=1)
    for step, phase, trains in watch.rows:
        if phase == "burst":
            assert trains, f"step {step}: frozen in a burst"
    replay_frozen = [not trains for _, phase, trains in watch.rows if phase == "replay"]
    assert sum(replay_frozen) >= 20  # frozen for most of both replay phases (steps 15-29, 45-59)
    reasons = {event["reason"] for event in cache.events}
    assert "phase:burst" in reasons and "phase:replay" in reasons
    # the frozen conv layer does not move while frozen
    for (step, _, trains), (_, _, trains_next), before, after in zip(
        watch.rows, watch.rows[1:], watch.first_weights, watch.first_weights[1:]
    ):
        if not trains and not trains_next:
            assert torch.equal(before, after), f"step {step}: frozen weights moved"
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    for name in (
        "frozen_share",
        "backward_flops_skipped",
        "staleness",
        "backward_flops_skipped_share",
        "cache_hit_rate",
    ):
        assert f"gradient_cache/{name}" in logged


def test_release_at_ends_freezing_for_the_rest_of_the_run(mnist1d_small):
    model, data = mnist1d_small()
    cache, watch = GradientCache(**EAGER, release_at=0.5), Watch()
    fit(model, data, [cache, watch], max_steps=40)
    assert any(not trains for step, _, trains in watch.rows if step < 20)
    assert all(trains for step, _, trains in watch.rows if step >= 20)


def test_accumulation_clipping_and_bf16_change_the_frozen_set_only_between_optimizer_steps(mnist1d_small):
    model, data = mnist1d_small()
    cache, watch = GradientCache(**EAGER), Watch()
    fit(
        model,
        data,
        [cache, watch],
        max_steps=30,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        precision="bf16-mixed",
    )
    assert cache.events and cache.ledger.skipped > 0
    by_step: dict[int, set[bool]] = {}
    for step, _, trains in watch.rows:
        by_step.setdefault(step, set()).add(trains)
    assert all(len(states) == 1 for states in by_step.values())  # never split inside an accumulation window
    assert len(watch.rows) == 60


@pytest.mark.parametrize("first_resumed_batch_returns_none", [False, True])
def test_resume_mid_freeze_reproduces_the_uninterrupted_run(
    mnist1d_small, tmp_path, first_resumed_batch_returns_none
):
    def run(max_epochs: int, ckpt_path: str | None = None, save: Path | None = None):
        pl.seed_everything(7)
        model, data = mnist1d_small()
        data.setup("fit")
        if first_resumed_batch_returns_none:  # review 5: no backward closed the opened prefix: "taken back"
            step = model.training_step

            def training_step(batch, batch_idx):  # the resumed run's first batch: the 28th step's first
                return None if model.global_step == 27 and batch_idx == 0 else step(batch, batch_idx)

            model.training_step = training_step
        loader = DataLoader(data.train_set, batch_size=64, shuffle=False)  # order independent of RNG state
        cycle = PulseCycle(burst=6, replay=14, maintain=0, warmup=0.0, anneal=0.0, maintain_eval="none")
        cache = GradientCache(threshold=0.9, check_every=4, freeze_for=8)
        trainer = pl.Trainer(
            callbacks=[cycle, cache], max_epochs=max_epochs, limit_train_batches=9, **trainer_kwargs()
        )
        trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
        if save is not None:
            trainer.save_checkpoint(save)
        return model, cache

    whole_model, whole_cache = run(max_epochs=6)
    checkpoint = tmp_path / "half.ckpt"
    _, half_cache = run(max_epochs=3, save=checkpoint)
    assert half_cache.events, "the run must have frozen something before the checkpoint"
    saved = torch.load(checkpoint, weights_only=False)
    state = next(value for key, value in saved["callbacks"].items() if key.startswith("GradientCache"))
    assert any(state["cache"]["frozen"]), "the checkpoint must be written mid-freeze"
    resumed_model, resumed_cache = run(max_epochs=6, ckpt_path=str(checkpoint))
    assert resumed_cache.events == whole_cache.events
    # the resumed run's first backward ran in full (its graph is checked whole), and its ledger says so
    flops = whole_cache.ledger.flops_by_prefix
    first_backward_skipped = flops[0] - flops[sum(state["cache"]["frozen"])]
    assert resumed_cache.ledger.skipped == whole_cache.ledger.skipped - first_backward_skipped > 0
    for name, param in whole_model.named_parameters():
        assert torch.equal(param, dict(resumed_model.named_parameters())[name]), name


def test_resume_from_a_checkpoint_written_before_the_first_backward(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    trainer = pl.Trainer(callbacks=[GradientCache(**EAGER)], max_steps=0, **trainer_kwargs())
    trainer.fit(model, data)
    trainer.save_checkpoint(tmp_path / "early.ckpt")
    cache = GradientCache(**EAGER)
    resumed = pl.Trainer(callbacks=[cache], max_steps=12, **trainer_kwargs())
    resumed.fit(model, data, ckpt_path=str(tmp_path / "early.ckpt"))
    assert cache.freezer is not None and cache.events


def test_a_resumed_fit_with_nothing_left_to_train_keeps_the_restored_state(mnist1d_small, tmp_path):
    # held-out sweep: Lightning skips on_train_start when a finished run's checkpoint is resumed to the same
    # length; the state waiting there to apply was lost: no events, no ledger, and the next checkpoint had
    # neither them nor the frozen set
    def saved_state(path: Path) -> dict:
        saved = torch.load(path, weights_only=False)["callbacks"]
        return next(state for key, state in saved.items() if key.startswith("GradientCache"))

    model, data = mnist1d_small()
    cache = GradientCache(**EAGER)
    trainer = pl.Trainer(callbacks=[cache], max_steps=12, **trainer_kwargs())
    trainer.fit(model, data)
    trainer.save_checkpoint(tmp_path / "done.ckpt")
    assert cache.events and any(saved_state(tmp_path / "done.ckpt")["cache"]["frozen"])

    resumed_cache = GradientCache(**EAGER)
    resumed = pl.Trainer(callbacks=[resumed_cache], max_steps=12, **trainer_kwargs())
    resumed.fit(model, data, ckpt_path=str(tmp_path / "done.ckpt"))
    assert resumed.global_step == 12
    assert resumed_cache.events == cache.events and resumed_cache.ledger.skipped == cache.ledger.skipped > 0
    resumed.save_checkpoint(tmp_path / "again.ckpt")
    again, done = saved_state(tmp_path / "again.ckpt"), saved_state(tmp_path / "done.ckpt")
    assert again["events"] == done["events"] and again["ledger"] == done["ledger"]
    assert again["optimizer_check"] == done["optimizer_check"]
    snapshots = again["cache"].pop("snapshot"), done["cache"].pop("snapshot")
    assert again["cache"] == done["cache"]  # units, scores, timers, the frozen set
    assert all(torch.equal(a, b) for unit in zip(*snapshots) for a, b in zip(*unit))


def test_ddp_without_unused_parameter_detection_fails_at_setup_naming_the_fix(mnist1d_small, monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    # without it, Lightning's DDP set-up raises torch's intra-op threads for every later test in the process
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    model, data = mnist1d_small()
    trainer = pl.Trainer(
        callbacks=[GradientCache()],
        max_steps=2,
        **trainer_kwargs(strategy=DDPStrategy(find_unused_parameters=False, process_group_backend="gloo")),
    )
    try:
        with pytest.raises(PulseRefusal, match="find_unused_parameters=True"):
            trainer.fit(model, data)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_ddp_with_a_static_graph_is_refused_naming_the_models_for_which_its_advice_fails(
    mnist1d_small, monkeypatch
):
    # held-out sweep C: the refusal sent a Reformer user to `find_unused_parameters=True`, on which DDP itself
    # fails at the first backward ("marked as ready twice"); plain DDP with `static_graph=True` trains it
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    model, data = mnist1d_small()
    strategy = DDPStrategy(find_unused_parameters=True, static_graph=True, process_group_backend="gloo")
    trainer = pl.Trainer(callbacks=[GradientCache()], max_steps=2, **trainer_kwargs(strategy=strategy))
    try:
        with pytest.raises(PulseRefusal, match="static_graph") as caught:
            trainer.fit(model, data)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    text = str(caught.value)
    assert "Reformer" in text and "fails under `find_unused_parameters=True` in DDP itself" in text
    assert "train it without GradientCache" in text and "on one process" in text


def test_manual_optimization_is_refused_at_setup(mnist1d_small):
    model, data = mnist1d_small()
    model.automatic_optimization = False
    with pytest.raises(PulseRefusal, match="^GradientCache: it needs automatic optimization"):
        fit(model, data, [GradientCache()], max_steps=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"threshold": -1.0}, "threshold"),
        ({"freeze_for": 30, "check_every": 20}, "freeze_for"),
        ({"max_frozen_share": 0.0}, "max_frozen_share"),
        ({"phases": ["rest"]}, "phases"),
        ({"phases": "replay"}, "phases"),
        ({"release_at": 1.5}, "release_at"),
        ({"start_at": "half"}, "start_at"),
        ({"release_at": -3}, "release_at"),
        ({"units": []}, "units"),
        ({"units": "net.1"}, "units"),
        ({"activation_cache_mb": -1}, "activation_cache_mb"),
        ({"measure_flops": "yes"}, "measure_flops"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        GradientCache(**kwargs)


def test_unknown_unit_name_fails_at_fit_start(mnist1d_small):
    model, data = mnist1d_small()
    with pytest.raises(
        PulseRefusal, match=r"^GradientCache: `units` entry 'net.99' is neither .* top level: \['net'\]"
    ):
        fit(model, data, [GradientCache(units=["net.1", "net.99"])], max_steps=1)


def test_a_units_entry_holding_only_frozen_parameters_is_said_to_be_left_out(mnist1d_small, caplog):
    # a held-out sweep (LoRA on a frozen model): a `units` name holding only frozen parameters vanished from
    # the units unsaid, while a name the model lacks is refused
    model, data = mnist1d_small()
    model.net[1].requires_grad_(False)
    with caplog.at_level("INFO"):
        fit(model, data, [GradientCache(units=["net.1", "net.3", "net.5"])], max_steps=2)
    said = [
        record.getMessage()
        for record in caplog.records
        if "hold no parameter that trains" in record.getMessage()
    ]
    assert said == [
        "GradientCache: `units` entries ['net.1'] hold no parameter that trains (frozen by the user), so "
        "they are left out of the units, as frozen parameters are."
    ]


class TrainingFlops(Callback):
    """Total FLOPs of training batches (forward and backward), counted like the benchmark harness does."""

    def __init__(self) -> None:
        self.total = 0
        self._counter: FlopCounterMode | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._counter.__exit__(None, None, None)
        self.total += self._counter.get_total_flops()


class NoisyInputs(torch.utils.data.Dataset):
    """MNIST-1D samples with fresh noise at every visit: a stand-in for random data augmentation."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        x, y = self.dataset[index]
        return x + 0.1 * torch.randn_like(x), y


def _fit_with_activation_cache(mnist1d_small, megabytes: float, noisy: bool = False):
    pl.seed_everything(5)
    model, data = mnist1d_small()
    data.setup("fit")
    dataset = NoisyInputs(data.train_set) if noisy else data.train_set
    loader = DataLoader(dataset, batch_size=60, shuffle=True)
    cache = GradientCache(threshold=2.0, check_every=6, freeze_for=60, activation_cache_mb=megabytes)
    flops = TrainingFlops()
    trainer = pl.Trainer(callbacks=[cache, flops], max_steps=60, **trainer_kwargs())
    trainer.fit(model, train_dataloaders=loader)
    return model, cache, flops


def test_activation_cache_replays_frozen_outputs_exactly_and_skips_their_forward(mnist1d_small):
    plain_model, plain, plain_flops = _fit_with_activation_cache(mnist1d_small, 0.0)
    model, cache, flops = _fit_with_activation_cache(mnist1d_small, 4.0)
    assert plain.activations is None
    assert cache.events == plain.events and cache.events[0]["to"] == 3
    assert cache.activations.hits > 0 and cache.activations.disabled_reason is None
    # 720 samples x (25x19 + 25x10 + 25x5) floats of the three frozen conv layers, and two float64 sums of
    # each layer's input per sample
    assert cache.activations.bytes_used == 720 * 850 * 4 + 720 * 3 * 2 * 8
    assert flops.total < plain_flops.total
    for (name, param), other in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.allclose(param, other, rtol=0, atol=1e-6), name
    assert all(hasattr(type(m), "forward") and "forward" not in vars(m) for m in model.modules())


def test_activation_cache_replays_the_loaded_cut_under_step_saving_replay(mnist1d_small):
    """Next to HardSampleReplay(mode="steps") a light batch is the cut of a wider window: the cache keys its
    rows by the samples loaded, and replays them exactly (the tracker once gave the window's indices)."""
    from lightning_pulse import HardSampleReplay

    def run(megabytes):
        pl.seed_everything(5)
        model, data = mnist1d_small()
        cache = GradientCache(threshold=2.0, check_every=6, freeze_for=120, activation_cache_mb=megabytes)
        # without a PulseCycle every epoch trains half its data, in full batches cut from two batches' worth
        replay = HardSampleReplay(rule="random", replay_fraction=0.5)
        trainer = pl.Trainer(callbacks=[cache, replay], max_epochs=12, **trainer_kwargs())
        trainer.fit(model, data)
        return model, cache, trainer.global_step

    plain_model, plain, plain_steps = run(0.0)
    model, cache, steps = run(4.0)
    assert steps == plain_steps < 12 * 12  # the steps were saved: cut batches throughout
    assert cache.events == plain.events and cache.events[0]["to"] == 3
    assert cache.activations.disabled_reason is None and cache.activations.hits > 0
    for (name, param), other in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.allclose(param, other, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("replay_first", [False, True], ids=["cache-first", "replay-first"])
def test_activation_cache_keys_a_batch_cut_in_place_by_batch_mode_replay_by_the_samples_that_train(
    mnist1d_small, replay_first
):
    """Held-out sweep: next to HardSampleReplay(mode="batch") the cache keyed a batch by the 64 samples
    loaded, and the batch was cut in place to 32 before the forward: a replayed frozen prefix gave 64 rows for
    32 ("Expected input batch_size (64) to match target batch_size (32)"), or, recorded cut, every module left
    the cache with no word. It keys by the samples that train, whichever callback's batch start runs first."""
    from lightning_pulse import HardSampleReplay

    def run(megabytes):
        pl.seed_everything(5)
        model, data = mnist1d_small()
        cache = GradientCache(threshold=2.0, check_every=6, freeze_for=120, activation_cache_mb=megabytes)
        replay = HardSampleReplay(mode="batch", replay_fraction=0.5)
        # burst one epoch, maintain two (frozen, whole batches: recorded, verified), then replay (frozen, cut)
        cycle = PulseCycle(
            burst=12, maintain=24, replay=12, order=["burst", "maintain", "replay"], warmup=0.0, anneal=0.0
        )
        callbacks = [cycle, replay, cache] if replay_first else [cycle, cache, replay]
        trainer = pl.Trainer(callbacks=callbacks, max_epochs=5, limit_val_batches=0, **trainer_kwargs())
        trainer.fit(model, data)
        return model, cache

    plain_model, plain = run(0.0)
    model, cache = run(4.0)
    assert cache.events == plain.events and cache.events[0]["to"] == 3
    assert (
        cache.activations.disabled_reason is None and cache.activations.hits > 12
    )  # replay too, not maintain only
    for (name, param), other in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.allclose(param, other, rtol=0, atol=1e-6), name


def test_a_replayed_frozen_output_never_stands_in_for_an_input_of_other_samples():
    """The safety net under the keying: records of four samples are not given for an input of two (a batch
    cut after it was keyed); the module runs for real, and the batch counts as a miss. Keyed by a function,
    the batch is keyed when its forward starts, as cut by then."""
    from lightning_pulse.core.activation_cache import PrefixActivationCache

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    data = torch.randn(6, 4)
    indices, cut = torch.tensor([4, 1, 3, 0]), torch.tensor([4, 1])
    expected = model(data[cut])
    cache = PrefixActivationCache(capacity=6, dataset_size=6, budget_bytes=2**20)
    cache.plan([("0", model[0])])
    for _ in range(2):  # record, verify
        cache.begin_batch(indices)
        model(data[indices])
        cache.end_batch()
    assert cache.begin_batch(indices) == "hit"
    assert torch.equal(model(data[cut]), expected)  # computed: the records' four rows would not fit two
    cache.end_batch()
    assert cache.hits == 0 and cache.batches == 3 and cache.disabled_reason is None

    assert cache.begin_batch(lambda: cut) == "pending"
    assert torch.equal(model(data[cut]), expected)  # replayed: the records of the cut's two samples
    cache.end_batch()
    assert cache.hits == 1 and "forward" not in vars(model[0])


def test_activation_cache_switches_itself_off_when_samples_change_between_visits(mnist1d_small):
    plain_model, _, _ = _fit_with_activation_cache(mnist1d_small, 0.0, noisy=True)
    with pytest.warns(UserWarning, match="differs between two visits"):
        model, cache, _ = _fit_with_activation_cache(mnist1d_small, 4.0, noisy=True)
    assert cache.activations.hits == 0
    for param, other in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(param, other)


class UnreadableAt(torch.utils.data.Dataset):
    """``None`` for the samples at ``unreadable`` (files that fail to load), the others as they are."""

    def __init__(self, dataset, unreadable: set[int]) -> None:
        self.dataset, self.unreadable = dataset, unreadable

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return None if index in self.unreadable else self.dataset[index]


def skip_unreadable(items):
    """The usual collate_fn that drops the samples that failed to load: 59 rows for 60 drawn indices."""
    return torch.utils.data.default_collate([item for item in items if item is not None])


def _fit_dropping_samples(mnist1d_small, megabytes: float, unreadable: set[int]):
    pl.seed_everything(5)
    model, data = mnist1d_small()
    data.setup("fit")
    loader = DataLoader(
        UnreadableAt(data.train_set, unreadable), batch_size=60, shuffle=True, collate_fn=skip_unreadable
    )
    cache = GradientCache(threshold=2.0, check_every=6, freeze_for=60, activation_cache_mb=megabytes)
    trainer = pl.Trainer(callbacks=[cache], max_steps=60, **trainer_kwargs())
    trainer.fit(model, train_dataloaders=loader)
    return model, cache


def test_a_batch_a_collate_fn_dropped_a_sample_from_is_not_recorded_and_the_cache_keeps_replaying(
    mnist1d_small,
):
    """Held-out sweep: a collate_fn that drops unreadable samples gave a batch of 59 rows for 60 indices; the
    cache dropped every module for the rest of the run, with no word (0 hits). Now only that batch is left
    unrecorded; the others replay, and the weights are those of the run without the cache."""
    unreadable = {13, 400}
    plain_model, plain = _fit_dropping_samples(mnist1d_small, 0.0, unreadable)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model, cache = _fit_dropping_samples(mnist1d_small, 4.0, unreadable)
    activations = cache.activations
    assert cache.events == plain.events and cache.events[0]["to"] == 3
    assert activations.disabled_reason is None and [e.name for e in activations.entries] == [
        "net.1",
        "net.3",
        "net.5",
    ]
    assert activations.unmatched_batches >= 2 and activations.hits >= 5  # 0 before: every module dropped
    assert not [w for w in said if "activation cache" in str(w.message)]
    for (name, param), other in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.allclose(param, other, rtol=0, atol=1e-6), name


def test_the_cache_switches_itself_off_naming_the_rows_when_most_batches_lost_a_sample(mnist1d_small):
    """When most batches hold fewer rows than drawn indices, nothing can be replayed: the cache says so, once,
    naming the mismatch and the way out, instead of emptying itself with no word."""
    unreadable = set(range(0, 720, 45))  # 16 samples: most batches of 60 lose one
    plain_model, _ = _fit_dropping_samples(mnist1d_small, 0.0, unreadable)
    with pytest.warns(UserWarning) as said:
        model, cache = _fit_dropping_samples(mnist1d_small, 4.0, unreadable)
    notes = [str(w.message) for w in said if "activation cache switched itself off" in str(w.message)]
    assert len(notes) == 1
    assert re.search(
        r"\d+ of \d+ frozen batches held another number of rows .* \(the last: 59 rows for 60", notes[0]
    )
    assert "collate_fn that drops samples" in notes[0] and "return a stand-in sample" in notes[0]
    assert cache.activations.disabled_reason in notes[0]
    for (name, param), other in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.allclose(param, other, rtol=0, atol=1e-6), name


def test_without_flop_measurement_the_same_units_freeze_and_no_flop_figure_is_logged(mnist1d_small, tmp_path):
    runs = {}
    for measure_flops in (True, False):
        pl.seed_everything(0)
        model, data = mnist1d_small()
        cache = GradientCache(**EAGER, measure_flops=measure_flops)
        logger = CSVLogger(tmp_path, name=f"flops-{measure_flops}")
        fit(model, data, [cache], max_steps=12, logger=logger, log_every_n_steps=1)
        rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
        runs[measure_flops] = cache, {key for row in rows for key, value in row.items() if value}
    (measured, logged), (unmeasured, unlogged) = runs[True], runs[False]
    assert unmeasured.events == measured.events and measured.events
    assert measured.ledger.skipped > 0 and unmeasured.ledger.flops_by_prefix == {}
    assert "gradient_cache/backward_flops_skipped" in logged
    assert "gradient_cache/backward_flops_skipped" not in unlogged
    assert "gradient_cache/frozen_share" in unlogged


def test_defaults_that_froze_nothing_say_what_they_measured_and_why_they_waited(mnist1d_small, caplog):
    pl.seed_everything(0)
    model, data = mnist1d_small()
    cache = GradientCache()  # the defaults: score every 20 steps, freeze at plasticity <= 0.2
    with caplog.at_level("INFO"):
        fit(model, data, [cache], max_steps=45, limit_train_batches=10)
    assert cache.events == []  # early in training every layer still moves: nothing froze
    notes = [r.getMessage() for r in caplog.records if "froze nothing" in r.getMessage()]
    assert len(notes) == 1
    first_score = cache.freezer.scores[0]
    assert first_score is not None and first_score > 0.2
    assert f"net.1, last scored {first_score:.3g} (stable at <= threshold=0.2)" in notes[0]

    pl.seed_everything(0)
    model, data = mnist1d_small()
    caplog.clear()
    with caplog.at_level("INFO"):
        fit(model, data, [GradientCache()], max_steps=10, limit_train_batches=10)
    assert any("no unit trained a whole window of check_every=20" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["submodule", "lightning_module"])
def test_a_compiled_module_is_refused_at_setup(mnist1d_small, how):
    # a compiled backward hands the gradients out together in its own order: a held-out compiled CNN froze
    # layers whose inputs still trained, and a compiled GPT-2 lost its tied-embedding pin
    model, data = mnist1d_small()
    if how == "submodule":
        model.net = torch.compile(model.net, backend="aot_eager")
    else:
        model = torch.compile(model, backend="aot_eager")  # Lightning unwraps it and compiles forward
    trainer = pl.Trainer(callbacks=[GradientCache()], max_steps=4, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=r"^GradientCache: .* runs under torch.compile, .*Remove GradientCache"
    ):
        trainer.fit(model, data)
    assert trainer.global_step == 0


@pytest.mark.parametrize("how", ["torch.compile(net)", "net.compile()", "model.compile()"])
def test_a_module_compiled_in_configure_model_is_refused_before_the_first_step(mnist1d_small, how):
    # Lightning calls configure_model (its documented place for torch.compile) after the callbacks' setup: the
    # setup check missed it, and the units were read in the compiled backward's order (nothing ever froze).
    # Compiled in place (Module.compile), there is no wrapper to find: it trained unrefused, and
    # model.compile() read the units in the wrong order and blamed the compiled graph's autograd Function
    torch._dynamo.reset()
    model, data = mnist1d_small()

    def compile_in_configure_model() -> None:
        if how == "torch.compile(net)":
            model.net = torch.compile(model.net, backend="aot_eager")
        elif how == "net.compile()":
            model.net.compile(backend="aot_eager")
        else:
            model.compile(backend="aot_eager")

    model.configure_model = compile_in_configure_model
    part = "the LightningModule" if how == "model.compile()" else "net"
    trainer = pl.Trainer(callbacks=[GradientCache()], max_steps=4, **trainer_kwargs())
    with pytest.raises(
        PulseRefusal, match=rf"^GradientCache: {part} runs under torch.compile, .*Remove GradientCache"
    ):
        trainer.fit(model, data)
    assert trainer.global_step == 0


class WithCompiledLossAndTeacher(MNIST1DClassifier):
    """A distillation step: a loss module and a frozen teacher (run under ``no_grad``), either compiled in
    ``where`` (``"__init__"`` or ``"configure_model"``); the student trains uncompiled."""

    def __init__(self, where: str, part: str) -> None:
        super().__init__(arch="cnn")
        self.where, self.part = where, part
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
        self.teacher = copy.deepcopy(self.net).requires_grad_(False)
        if where == "__init__":
            self.compile_part()

    def compile_part(self) -> None:
        setattr(self, self.part, torch.compile(getattr(self, self.part), backend="eager"))

    def configure_model(self) -> None:
        if self.where == "configure_model" and not hasattr(getattr(self, self.part), "_orig_mod"):
            self.compile_part()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        with torch.no_grad():
            teacher = self.teacher(x)
        distill = torch.nn.functional.kl_div(
            logits.log_softmax(-1), teacher.softmax(-1), reduction="batchmean"
        )
        return self.loss_fn(logits, y) + distill

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.05)


@pytest.mark.parametrize("where", ["__init__", "configure_model"])
@pytest.mark.parametrize("part", ["loss_fn", "teacher"])
def test_a_compiled_part_with_nothing_to_train_is_not_refused(mnist1d_small, where, part):
    # only a compiled part holding trainable parameters hands their gradients out in its own order: a compiled
    # loss module or frozen teacher used to be refused (at setup, and at fit start from configure_model)
    torch._dynamo.reset()
    pl.seed_everything(0)
    _, data = mnist1d_small()
    model = WithCompiledLossAndTeacher(where, part)
    cache = GradientCache(threshold=1.0, check_every=2, freeze_for=4, phases=("replay",))
    trainer = fit(model, data, [cache], max_steps=8, limit_train_batches=8)
    assert trainer.global_step == 8
    assert hasattr(getattr(model, part), "_orig_mod")  # it did run compiled
    assert cache.events and cache.events[0]["to"] > 0  # froze as usual


class CompiledBackboneUnfrozenAtEpochOne(MNIST1DClassifier):
    """A compiled backbone frozen in ``__init__`` and trained again from epoch 1 on."""

    def __init__(self) -> None:
        super().__init__(arch="cnn")
        self.backbone = torch.compile(self.net[:4].requires_grad_(False), backend="eager")
        self.head = self.net[4:]
        del self.net  # the parts train under their own names only

    def forward(self, x):
        return self.head(self.backbone(x))

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.backbone.requires_grad_(True)


def test_a_compiled_part_unfrozen_during_the_fit_is_refused_before_it_trains(mnist1d_small):
    # frozen at setup it is no reason to refuse; once it trains, its compiled backward would order the units
    torch._dynamo.reset()
    _, data = mnist1d_small()
    trainer = pl.Trainer(callbacks=[GradientCache()], max_steps=8, limit_train_batches=4, **trainer_kwargs())
    with pytest.raises(PulseRefusal, match=r"^GradientCache: backbone runs under torch.compile, "):
        trainer.fit(CompiledBackboneUnfrozenAtEpochOne(), data)
    assert trainer.global_step == 4


class BackboneUnfrozenAtEpochOne(MNIST1DClassifier):
    """The usual transfer-learning recipe: the first two convolutions frozen in ``__init__``, trained again
    from epoch 1 on (a plain ``on_train_epoch_start`` hook, no callback)."""

    def __init__(self) -> None:
        super().__init__(arch="cnn")
        for layer in (self.net[1], self.net[3]):
            layer.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            for layer in (self.net[1], self.net[3]):
                layer.requires_grad_(True)


class TrainableLayers(Callback):
    """At every backward (after GradientCache's hooks): which of the CNN's layers train, in forward order."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, list[bool]]] = []

    def on_before_backward(self, trainer, pl_module, loss):
        layers = (pl_module.net[i] for i in (1, 3, 5, 8))
        self.rows.append((trainer.global_step, [layer.weight.requires_grad for layer in layers]))


def test_a_backbone_unfrozen_mid_fit_becomes_units_and_nothing_frozen_has_a_training_layer_before_it(
    mnist1d_small, caplog
):
    # before: the units were found once, without the frozen backbone, and GradientCache kept net.5 frozen
    # while net.1 and net.3 trained before it (no backward saved; a layer held still under changing inputs),
    # with the FLOP reference of the backbone-frozen model
    pl.seed_everything(0)
    _, data = mnist1d_small()
    model, cache, layers, flops = (
        BackboneUnfrozenAtEpochOne(),
        GradientCache(**EAGER),
        TrainableLayers(),
        BackwardFlops(),
    )
    with caplog.at_level("INFO"):
        trainer = fit(model, data, [cache, layers, flops], max_epochs=3, limit_val_batches=0)
    unfrozen_at = trainer.num_training_batches  # the first step of epoch 1
    assert any(not trains[2] for step, trains in layers.rows if step < unfrozen_at)  # net.5 froze in epoch 0
    for step, trains in layers.rows:
        # frozen layers (False) all come before the training ones in forward order
        assert step < unfrozen_at or trains == sorted(trains), f"step {step}: {trains} is no frozen prefix"
    assert {"step": unfrozen_at, "from": 1, "to": 0, "reason": "retrace"} in cache.events
    # the backbone joined the units in forward order, and GradientCache froze it once it was scored again
    assert [unit.name for unit in cache.freezer.units] == ["net.1", "net.3", "net.5", "net.8"]
    assert any(not trains[0] for step, trains in layers.rows if step >= unfrozen_at)
    # the FLOP reference is the full backward of epoch 1's first step (nothing frozen), not epoch 0's
    assert cache.ledger.flops_by_prefix[0] == flops.per_backward[unfrozen_at] > flops.per_backward[0]
    notes = [r.getMessage() for r in caplog.records if "outside its units started training" in r.getMessage()]
    assert len(notes) == 1 and "(net.1.weight, net.1.bias, net.3.weight and 1 more)" in notes[0]
    assert all(p.requires_grad for p in model.parameters())  # the module leaves fit as the user left it


class UnitsTurnedBackOnEveryEpoch(MNIST1DClassifier):
    """The recipe run at every epoch from epoch 1 on: ``requires_grad_(True)`` on the first two convolutions,
    which GradientCache may have frozen meanwhile (they are units here: trainable from the start)."""

    def on_train_epoch_start(self) -> None:
        if self.current_epoch >= 1:
            for layer in (self.net[1], self.net[3]):
                layer.requires_grad_(True)


def test_a_unit_the_users_code_turns_back_on_is_a_release_in_the_events(mnist1d_small):
    # before: the release the user's code caused was never recorded, so the events showed two freezes in a
    # row and no release, and the epoch's first backward was counted as skipping the prefix it did not skip
    pl.seed_everything(0)
    _, data = mnist1d_small()
    cache, layers, flops = GradientCache(**EAGER), TrainableLayers(), BackwardFlops()
    trainer = fit(
        UnitsTurnedBackOnEveryEpoch(), data, [cache, layers, flops], max_epochs=4, limit_train_batches=10
    )
    taken_back = [event for event in cache.events if event["reason"] == "taken back"]
    assert taken_back and all(event["to"] == 0 for event in taken_back)
    for earlier, later in zip(cache.events, cache.events[1:]):
        assert later["from"] == earlier["to"], cache.events  # every change of the prefix is in the log
    epoch_starts = {trainer.num_training_batches * epoch for epoch in range(1, 4)}
    assert {event["step"] for event in taken_back} <= epoch_starts  # caught before the epoch's first forward
    for event in taken_back:
        assert dict(layers.rows)[event["step"]][:2] == [True, True]  # that backward ran through them
    # the ledger counts only what was skipped (equal batches: the per-prefix figures add up exactly)
    full = cache.ledger.flops_by_prefix[0]
    assert cache.ledger.skipped == pytest.approx(sum(full - flops_of for flops_of in flops.per_backward))


def test_a_resumed_fit_opens_its_restored_prefix_only_after_looking_for_units_turned_back_on(
    mnist1d_small, tmp_path
):
    # a resumed fit's first forward trains the restored prefix (so its graph is checked whole); opened before
    # the epoch-start look, the user's requires_grad_(True) would not show, and the prefix would freeze again
    # over it
    def run(max_epochs: int, ckpt_path: str | None = None):
        pl.seed_everything(0)
        _, data = mnist1d_small()
        data.setup("fit")
        loader = DataLoader(data.train_set, batch_size=64, shuffle=False)  # order independent of RNG state
        model, cache = UnitsTurnedBackOnEveryEpoch(), GradientCache(**EAGER)
        trainer = pl.Trainer(
            callbacks=[cache], max_epochs=max_epochs, limit_train_batches=10, **trainer_kwargs()
        )
        trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
        trainer.save_checkpoint(tmp_path / f"{max_epochs}.ckpt")
        return model, cache

    whole_model, whole = run(max_epochs=4)
    run(max_epochs=2)
    resumed_model, resumed = run(max_epochs=4, ckpt_path=str(tmp_path / "2.ckpt"))
    assert {"step": 20, "from": 3, "to": 0, "reason": "taken back"} in resumed.events
    assert resumed.events == whole.events
    for param, other in zip(whole_model.parameters(), resumed_model.parameters()):
        assert torch.equal(param, other)


def _small_data(batch_size: int = 32) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(1)
    return DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class DecayEveryParameter(torch.optim.Optimizer):
    """Decoupled weight decay on every parameter, before its ``grad is None`` test (sweep C's optimizer)."""

    def __init__(self, params, lr: float = 0.05, wd: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, wd=wd))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 - group["lr"] * group["wd"])
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class HandWrittenSGD(torch.optim.Optimizer):
    """Plain SGD outside ``torch.optim`` (so GradientCache checks it); skips parameters without a gradient."""

    def __init__(self, params, lr: float = 0.05, wd: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, wd=wd))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class DecayBeforeItsClosure(HandWrittenSGD):
    """Decoupled weight decay on every parameter before ``super().step(closure)`` evaluates the closure (the
    held-out sweep's hand-written Lion): Lightning's ``on_before_optimizer_step`` runs inside that closure."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 - group["lr"] * group["wd"])
        return super().step(closure)


class LookaheadWithoutOptimizerInit(torch.optim.Optimizer):
    """Lookahead as pytorch_optimizer, lonePatient and alphadl write it: ``Optimizer.__init__`` is never called
    (so torch has no step hooks for it), and every ``k`` steps the fast weights are pulled to the slow ones."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 5, alpha: float = 0.5) -> None:
        self.optimizer, self.k, self.alpha, self.steps = optimizer, k, alpha, 0
        self.param_groups, self.defaults, self.state = optimizer.param_groups, optimizer.defaults, {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step(closure)
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                slow = self.state.setdefault(p, {"slow": p.detach().clone()})["slow"]
                if self.steps % self.k == 0:
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self):
        return {"inner": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state) -> None:
        self.optimizer.load_state_dict(state["inner"])
        self.steps = state["steps"]


class HookedLookahead(LookaheadWithoutOptimizerInit):
    """The same Lookahead built through ``Optimizer.__init__``: torch runs its step hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 5, alpha: float = 0.5) -> None:
        torch.optim.Optimizer.__init__(self, [p for g in optimizer.param_groups for p in g["params"]], {})
        super().__init__(optimizer, k, alpha)


class _MLP(pl.LightningModule):
    def __init__(self, optimizer: str = "decay-all") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 4),
        )
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.5)
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        if self.optimizer == "lookahead":
            return LookaheadWithoutOptimizerInit(torch.optim.Adam(self.parameters(), lr=0.01))
        if self.optimizer == "hooked-lookahead":
            return HookedLookahead(torch.optim.Adam(self.parameters(), lr=0.01))
        if self.optimizer == "hand-written-sgd":
            return HandWrittenSGD(self.parameters())
        if self.optimizer == "decay-before-closure":
            return DecayBeforeItsClosure(self.parameters())
        return DecayEveryParameter(self.parameters())


class FrozenMovement(Callback):
    """Steps whose backward ran with ``net.0`` frozen (no gradient) and whose optimizer step still moved
    it."""

    def __init__(self) -> None:
        self.frozen_steps: list[int] = []
        self.moved: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weight = pl_module.net[0].weight.detach().clone()
        self.frozen = not pl_module.net[0].weight.requires_grad

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.frozen:
            self.frozen_steps.append(trainer.global_step)
            if not torch.equal(self.weight, pl_module.net[0].weight):
                self.moved.append(trainer.global_step)


def _fit_frozen_under(optimizer: str) -> tuple[GradientCache, FrozenMovement, list[str]]:
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0)
    movement = FrozenMovement()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = pl.Trainer(max_steps=30, callbacks=[cache, movement], **trainer_kwargs())
        trainer.fit(_MLP(optimizer), _small_data())
    return cache, movement, [str(w.message) for w in record if "GradientCache" in str(w.message)]


def test_an_optimizer_that_moves_gradless_parameters_is_caught_at_the_first_frozen_step_and_freezing_stops():
    """Sweep C: an optimizer applying weight decay to every parameter moved the units GradientCache reported
    frozen at every frozen step (steps 4-11, 16-23, 28-...), while the events and FLOP ledger claimed a
    freeze."""
    cache, movement, messages = _fit_frozen_under("decay-all")
    assert movement.frozen_steps == [5] and movement.moved == []  # checked, put back, then never frozen again
    assert [(e["step"], e["to"], e["reason"]) for e in cache.events] == [(4, 2, "check"), (5, 0, "optimizer")]
    (message,) = messages
    assert "DecayEveryParameter moved the parameters of frozen units" in message
    assert "remove GradientCache" in message
    state = cache.state_dict()["optimizer_check"]
    assert state == {"checked": True, "moved": True, "optimizer": "DecayEveryParameter"}
    resumed = GradientCache()
    resumed.load_state_dict({**cache.state_dict(), "cache": None})
    lifecycle = resumed._lifecycle
    lifecycle.load_optimizer_check(resumed._lifecycle.pending["optimizer_check"])  # what on_train_start does
    assert not lifecycle.may_freeze


def test_an_optimizer_that_moves_frozen_parameters_before_evaluating_its_closure_is_caught_the_same_way():
    """Held-out sweep: the copy was taken in ``on_before_optimizer_step``, inside Lightning's closure, after
    such an optimizer had already decayed the frozen units: ``moved: False``, and 80 of 104 frozen
    parameter-steps moved. It is taken as the step begins now (a step pre hook)."""
    HandWrittenSGD([torch.nn.Parameter(torch.zeros(1))])  # torch hooks the base's step too: hooks run nested
    cache, movement, messages = _fit_frozen_under("decay-before-closure")
    assert movement.frozen_steps == [5] and movement.moved == []  # checked, put back, then never frozen again
    assert [(e["step"], e["to"], e["reason"]) for e in cache.events] == [(4, 2, "check"), (5, 0, "optimizer")]
    (message,) = messages
    assert "DecayBeforeItsClosure moved the parameters of frozen units" in message
    state = cache.state_dict()["optimizer_check"]
    assert state == {"checked": True, "moved": True, "optimizer": "DecayBeforeItsClosure"}


def test_the_optimizer_check_hooks_only_the_first_frozen_step_and_no_step_after_it():
    """The copy taken as the step begins needs a step pre hook: on the step that checks the frozen units only,
    none before or after (nor after the fit), so a checked optimizer costs nothing per step."""

    class PreHooks(Callback):  # per optimizer step: whether net.0 was frozen at its start, its step pre hooks
        rows: list[tuple[int, bool, int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.frozen = not pl_module.net[0].weight.requires_grad

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            hooks = len(trainer.optimizers[0]._optimizer_step_pre_hooks)
            self.rows.append((trainer.global_step, self.frozen, hooks))

    cache, watch = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0), PreHooks()
    trainer = pl.Trainer(max_steps=30, callbacks=[cache, watch], **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_MLP("hand-written-sgd"), _small_data())
    frozen = [step for step, is_frozen, _ in watch.rows if is_frozen]
    assert len(frozen) > 10 and [step for step, _, hooks in watch.rows if hooks] == frozen[:1]
    check = cache._lifecycle.optimizer_check
    assert check.checked and not check.moved and cache._lifecycle.may_freeze
    assert (
        not trainer.optimizers[0]._optimizer_step_pre_hooks
        and not trainer.optimizers[0]._optimizer_step_post_hooks
    )


def test_torch_adamw_with_weight_decay_skips_gradless_parameters_and_is_never_copied(monkeypatch):
    copied = []
    before_step = GradlessStepCheck.before_step

    def spy(self, optimizers, params, *rest):
        before_step(self, optimizers, params, *rest)
        copied.append(len(self._held) + len(self._copies))

    monkeypatch.setattr(GradlessStepCheck, "before_step", spy)
    cache, movement, messages = _fit_frozen_under("adamw")
    assert movement.frozen_steps and movement.moved == [] and messages == []
    assert copied and set(copied) == {0}  # at every frozen step: never a copy for a torch optimizer
    assert cache.state_dict()["optimizer_check"]["checked"] and cache._lifecycle.may_freeze


class FrozenMovementPerLayer(Callback):
    """Per linear layer of ``_MLP``: the steps run with it frozen, and those of them that moved it."""

    def __init__(self) -> None:
        self.frozen_steps: dict[int, list[int]] = {0: [], 2: [], 4: []}
        self.moved: dict[int, list[int]] = {0: [], 2: [], 4: []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = {
            i: (pl_module.net[i].weight.detach().clone(), not pl_module.net[i].weight.requires_grad)
            for i in self.frozen_steps
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for i, (weight, frozen) in self.before.items():
            if frozen:
                self.frozen_steps[i].append(trainer.global_step)
                if not torch.equal(weight, pl_module.net[i].weight):
                    self.moved[i].append(trainer.global_step)


def test_a_lookahead_without_optimizer_init_freezes_as_adam_does_and_its_sync_never_moves_a_frozen_layer():
    """Sweep D: a Lookahead that never calls ``Optimizer.__init__`` crashed the fit at its first freeze
    (``'Lookahead' object has no attribute '_optimizer_step_post_hooks'``). Its slow-weight sync every 5 steps
    falls inside the freezes (from steps 4, 16, 28) and would pull the frozen layers towards the slow copy."""
    runs = {}
    for optimizer in ("adam", "lookahead"):
        cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0)
        movement = FrozenMovementPerLayer()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            pl.Trainer(max_steps=30, callbacks=[cache, movement], **trainer_kwargs()).fit(
                _MLP(optimizer), _small_data()
            )
        messages = [str(w.message) for w in record if "GradientCache" in str(w.message)]
        runs[optimizer] = (cache, movement, messages)
    (adam, adam_movement, _), (lookahead, movement, messages) = runs["adam"], runs["lookahead"]
    assert movement.frozen_steps == adam_movement.frozen_steps and movement.frozen_steps[0]
    assert [(e["step"], e["to"]) for e in lookahead.events] == [(e["step"], e["to"]) for e in adam.events]
    assert movement.moved == {0: [], 2: [], 4: []}  # the syncs at steps 10, 20 (and 25) were put back
    assert lookahead._lifecycle.optimizer_check.put_back > 0 and lookahead._lifecycle.may_freeze
    assert not any("moved the parameters" in message for message in messages)


@pytest.mark.parametrize("optimizer", ["lookahead", "hooked-lookahead"])
def test_a_callback_listed_before_gradient_cache_never_reads_a_frozen_layer_a_lookahead_sync_moved(optimizer):
    """Review of the Lookahead fix: the sync's writes were put back in GradientCache's own batch end, so a
    callback listed before it (EMA / WeightAveraging, StabilityGuard's snapshot) read the frozen layers as the
    sync moved them. They are put back right after the step now: a step post hook, or the wrapped ``step`` of
    a Lookahead torch never hooks (unwrapped at the fit's end)."""
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0)
    movement = FrozenMovementPerLayer()
    model = _MLP(optimizer)
    trainer = pl.Trainer(max_steps=30, callbacks=[movement, cache], **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _small_data())
    assert movement.frozen_steps[0] and movement.moved == {0: [], 2: [], 4: []}
    check = cache._lifecycle.optimizer_check
    assert check.put_back > 0 and cache._lifecycle.may_freeze
    lookahead = trainer.optimizers[0]
    assert "step" not in vars(lookahead) and not getattr(lookahead, "_optimizer_step_post_hooks", None)


@pytest.mark.parametrize("guard_first", [True, False])
def test_gradient_cache_and_stability_guard_both_wrap_a_lookahead_step_and_both_unwrap(guard_first):
    """Both callbacks wrap the ``step`` of a Lookahead torch never hooks; in either order both run, the frozen
    layers stay put, and the fit leaves the optimizer's ``step`` as it came."""
    from lightning_pulse import StabilityGuard

    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0)
    guard = StabilityGuard(warmup=8, grad_norm_zscore=None, snapshot_every=10)
    movement = FrozenMovementPerLayer()
    model = _MLP("lookahead")
    chains = []

    class StepChain(Callback):  # the wrappers around the optimizer's step, outermost first
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step, chain = vars(trainer.optimizers[0]).get("step"), []
            while isinstance(step, StepThrough):
                chain.append(type(step.hooks).__name__)
                step = step.previous
            chains.append(chain)

    callbacks = [movement, StepChain(), *([guard, cache] if guard_first else [cache, guard])]
    trainer = pl.Trainer(max_steps=30, callbacks=callbacks, **trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _small_data())
    assert sorted(chains[0]) == ["GradlessStepCheck", "StepChanges"]  # both wrapped from the first step
    assert movement.frozen_steps[0] and movement.moved == {0: [], 2: [], 4: []}
    assert cache._lifecycle.optimizer_check.put_back > 0
    assert "step" not in vars(trainer.optimizers[0])  # both unwrapped, whichever ended first
    assert "step" not in vars(trainer.optimizers[0])


class _LayerDrop(pl.LightningModule):
    """``inp -> blocks[0..3] (residual) -> out``; ``blocks.1`` is dropped on every 5th step, step 0
    included."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(4)])
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for k, block in enumerate(self.blocks):
            if not (self.training and k == 1 and self.global_step % 5 == 0):
                h = h + torch.relu(block(h))
        return self.out(h)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class FrozenPattern(Callback):
    """Per batch, which of the modules (in true forward order) were frozen during its backward."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.frozen = names, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        modules = dict(pl_module.named_modules())
        self.frozen.append(tuple(not modules[name].weight.requires_grad for name in self.names))


def _fit_with_pattern(module, names, max_steps, caplog, max_frozen_share=1.0):
    """A fit under GradientCache's test settings; returns the cache and which of ``names`` were frozen per batch."""
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=max_frozen_share)
    pattern = FrozenPattern(names)
    with caplog.at_level("INFO"):
        pl.Trainer(max_steps=max_steps, callbacks=[cache, pattern], **trainer_kwargs()).fit(
            module, _small_data()
        )
    return cache, pattern


def test_a_block_skipped_by_the_ordering_backward_gets_its_place_before_anything_after_it_freezes(caplog):
    """Sweep C: the units were ordered from the first backward only, in which LayerDrop skipped blocks.1, so
    it was ordered last and GradientCache froze inp, blocks.0, blocks.2, blocks.3 while blocks.1 trained."""
    forward_order = ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "out"]
    cache, pattern = _fit_with_pattern(_LayerDrop(), forward_order, 30, caplog)
    assert [unit.name for unit in cache.freezer.units] == forward_order
    prefixes = {sum(frozen) for frozen in pattern.frozen}
    assert all(frozen == tuple(i < sum(frozen) for i in range(6)) for frozen in pattern.frozen)  # a prefix
    assert max(prefixes) >= 4  # blocks.2 and blocks.3 froze, with blocks.1 before them
    assert "blocks.1 got no gradient in the backward that put the units into forward order" in caplog.text


class _OddBatchAdapter(_MLP):
    """``pre`` (an input adapter) runs on every ``period``-th batch only (odd batches by default), before ``net``;
    trained with Adam."""

    def __init__(self, period: int = 2) -> None:
        super().__init__()
        self.period = period
        self.pre = torch.nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        if batch_idx % self.period == 1:
            x = x + self.pre(x)
        return torch.nn.functional.cross_entropy(self.net(x), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_a_unit_used_on_odd_batches_only_is_placed_at_the_next_backward_that_uses_it(caplog):
    """A review of this pass: ordering again from the very next backward (an even batch) missed the adapter
    again, so it was "missed" every 2 steps, the note repeated 32 times and nothing froze in 64 steps."""
    forward_order = ["pre", "net.0", "net.2", "net.4"]
    cache, pattern = _fit_with_pattern(_OddBatchAdapter(), forward_order, 64, caplog)
    assert [unit.name for unit in cache.freezer.units] == forward_order
    assert caplog.text.count("pre got no gradient in the backward") == 1
    assert all(frozen == tuple(i < sum(frozen) for i in range(4)) for frozen in pattern.frozen)  # a prefix
    assert max(sum(frozen) for frozen in pattern.frozen) >= 2  # freezing happens


def test_a_unit_no_waited_backward_sees_stays_last_and_freezing_goes_on(caplog, monkeypatch):
    """A review of this pass: an adapter used every 40th batch outlived the 32 backwards the ordering waits,
    was found "missed" again at each use, and nothing froze for 213 of 300 steps. Here the wait is 4
    backwards."""
    monkeypatch.setattr(ForwardOrderTrace, "MAX_BACKWARDS", 4)
    cache, pattern = _fit_with_pattern(_OddBatchAdapter(period=10), ["net.0", "net.2", "net.4"], 60, caplog)
    assert cache.freezer is not None and cache.freezer.rare == ["pre"]
    assert [unit.name for unit in cache.freezer.units][-1] == "pre"
    assert caplog.text.count("pre got no gradient in the backward") == 1  # not at each of its uses
    assert sum(any(frozen) for frozen in pattern.frozen) >= 20


class _LoopedBlocks(pl.LightningModule):
    """``inp``, then blocks ``a`` and ``b`` applied as a, b, a, b (ALBERT-style weight sharing), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 32)
        self.a = torch.nn.Linear(32, 32)
        self.b = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = h + torch.tanh(self.b(h + torch.tanh(self.a(h))))
        return self.head(h)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_block_applied_again_after_a_later_block_never_freezes_while_that_block_trains(caplog):
    """Sweep D: GradientCache froze inp and a (57% of the parameters, within the share) while b trained,
    though b's output is the input of a's second application; the events reported an ordinary prefix
    freeze."""
    names = ["inp", "a", "b", "head"]
    cache, pattern = _fit_with_pattern(_LoopedBlocks(), names, 30, caplog, max_frozen_share=0.6)
    assert [unit.name for unit in cache.freezer.units] == names
    # a, b and a again would be 95% of the parameters: over the share, so the prefix stops before the loop
    assert set(pattern.frozen) == {(False, False, False, False), (True, False, False, False)}
    assert "freeze only together with everything up to the last of those" in caplog.text
    assert caplog.text.count("a (after b)") == 1


class _TiedTokens(pl.LightningModule):
    """A token model whose output layer ties its weight to the input embedding (GPT-2's ``lm_head``), or, with
    ``tie="middle"``, a tied pair of inner layers (``mix_b.weight = mix_a.weight``) and no tied embedding."""

    def __init__(self, tie: str = "embedding") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 32)
        self.mix_a, self.mix_b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 16)
        if tie == "embedding":
            self.head.weight = self.embed.weight
        else:
            self.mix_b.weight = self.mix_a.weight

    def training_step(self, batch, batch_idx):
        tokens = batch[0].abs().mul(4).long().clamp(max=15)  # (B, 16) token ids from the features
        h = torch.tanh(self.mix_b(torch.tanh(self.mix_a(self.embed(tokens)))))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.roll(1, 1).flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_a_tied_first_unit_is_said_once_and_a_tie_further_on_is_named_when_the_units_are_ordered(caplog):
    """Sweep F: on GPT-2 one fact came twice at start-up: an info line naming the pinned embedding and the
    warning that nothing can freeze before it."""
    with caplog.at_level("INFO"), pytest.warns(UserWarning) as warned:
        pl.Trainer(max_steps=3, callbacks=[GradientCache()], **trainer_kwargs()).fit(
            _TiedTokens(), _small_data()
        )
    tie_warnings = [str(w.message) for w in warned if "GradientCache" in str(w.message)]
    assert len(tie_warnings) == 1 and "the first unit in forward order, embed, shares" in tie_warnings[0]
    assert "head.weight" in tie_warnings[0] and "never freeze" not in caplog.text

    caplog.clear()
    with caplog.at_level("INFO"):
        pl.Trainer(max_steps=3, callbacks=[GradientCache()], **trainer_kwargs()).fit(
            _TiedTokens("middle"), _small_data()
        )
    pinned = [r.getMessage() for r in caplog.records if "never freeze" in r.getMessage()]
    assert pinned == [
        "GradientCache: units holding a tied or shared parameter never freeze, so the frozen prefix stops "
        "before them: mix_a (also mix_b.weight)."
    ]


class _GRUClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.GRU(8, 16, batch_first=True)  # returns a tuple (output, h_n)
        self.head = torch.nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        out, _ = self.rnn(batch[0])
        return torch.nn.functional.cross_entropy(self.head(out[:, -1]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_a_frozen_gru_the_activation_cache_cannot_replay_is_named_once_with_why():
    """Held-out sweep: a frozen GRU (tuple output) stayed frozen ~100 steps with activation_cache_mb=16, and
    the cache held nothing with no word (0 hits, no module cached, disabled_reason None, no warning)."""
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 10, 8, generator=generator), torch.randint(0, 3, (48,), generator=generator)
    )
    cache = GradientCache(
        check_every=4, freeze_for=8, threshold=1.0, activation_cache_mb=16, max_frozen_share=0.97
    )
    trainer = pl.Trainer(callbacks=[cache], max_steps=36, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit(_GRUClassifier(), DataLoader(data, batch_size=8, shuffle=True))
    assert sum(event["to"] == 1 for event in cache.events) >= 2  # frozen, released and frozen again
    about_cache = [str(w.message) for w in said if "activation cache" in str(w.message)]
    assert about_cache == [
        "GradientCache: the activation cache cannot replay the frozen module `rnn`: its output is a tuple, "
        "not one tensor (as from GRU, LSTM or MultiheadAttention), and only a single tensor output is "
        "replayed; to cache it, wrap it in a module returning the one tensor the model reads and name that "
        "module in `units`, or name its enclosing layer (e.g. `encoder.layers.0`) in `units`. It runs for "
        "real, as do the frozen modules after it, and the cache holds "
        "nothing while it is frozen."
    ]
    assert list(cache.activations.uncached) == ["rnn"] and cache.activations.hits == 0


class _LoopedStem(pl.LightningModule):
    """A stem held in an ``nn.ModuleList`` that ``training_step`` loops over, as HF PoolFormer's
    ``encoder.block.0`` and ConvNeXtV2's ``stages.1.downsampling_layer`` are looped over."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)])
        self.head = torch.nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        h = batch[0]
        for layer in self.stem:
            h = torch.tanh(layer(h))
        return torch.nn.functional.cross_entropy(self.head(h), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _ScalesReadDirectly(_LoopedStem):
    """An ``nn.ParameterList`` the step reads directly: no forward, no children to call instead."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16, 16))]
        )

    def training_step(self, batch, batch_idx):
        h = batch[0]
        for weight in self.stem:
            h = torch.tanh(h @ weight)
        return torch.nn.functional.cross_entropy(self.head(h), batch[1])


def _fit_looped_stem(units: list[str], module: type = _LoopedStem) -> tuple[GradientCache, list[str]]:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(24, 8, generator=generator), torch.randint(0, 3, (24,), generator=generator)
    )
    # three batches an epoch and eight steps frozen: frozen samples come back while frozen, to be replayed
    cache = GradientCache(
        check_every=4, freeze_for=8, threshold=1.0, activation_cache_mb=16, max_frozen_share=0.97, units=units
    )
    trainer = pl.Trainer(callbacks=[cache], max_steps=36, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit(module(), DataLoader(data, batch_size=8, shuffle=True))
    assert any(event["to"] >= 1 for event in cache.events)  # the stem froze
    return cache, [str(w.message) for w in said if "activation cache" in str(w.message)]


def test_a_frozen_module_list_unit_is_named_a_container_with_no_forward_and_its_children_as_the_way_out():
    """Held-out sweep (HF PoolFormer, ConvNeXtV2): a frozen ``nn.ModuleList`` unit was said to have its
    "weights read directly, or the module skipped on some batches"; it has no forward, its children run on
    every batch, and no way out was named. Naming its children in `units` lets the cache reach them."""
    cache, about_cache = _fit_looped_stem(["stem", "head"])
    assert about_cache == [
        "GradientCache: the activation cache cannot replay the frozen module `stem`: it is a container "
        "(`nn.ModuleList`) with no forward of its own: its parent loops over it and calls its children, so "
        "there is no call of it whose inputs can be cached; to cache them, name its parts in `units` "
        "(`stem.0`, `stem.1`). It runs for real, as do the frozen modules after it, and the cache holds "
        "nothing while it is frozen."
    ]
    assert list(cache.activations.uncached) == ["stem"] and cache.activations.hits == 0
    # the way out named: the children, which the parent calls, are cached
    cache, about_cache = _fit_looped_stem(["stem.0", "stem.1", "head"])
    assert about_cache == [] and cache.activations.hits > 0
    # a review: parameters the step reads directly (no children to call) keep the first reason
    cache, about_cache = _fit_looped_stem(["stem", "head"], _ScalesReadDirectly)
    assert len(about_cache) == 1 and "its weights read directly" in about_cache[0]


class _ParameterListsInADict(_ScalesReadDirectly):
    """An ``nn.ModuleDict`` holding an ``nn.ParameterList``, every weight read directly: no part is called."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.ModuleDict({"w": self.stem})

    def training_step(self, batch, batch_idx):
        h = batch[0]
        for weight in self.stem["w"]:
            h = torch.tanh(h @ weight)
        return torch.nn.functional.cross_entropy(self.head(h), batch[1])


def test_a_module_dict_of_parameter_lists_read_directly_keeps_the_weights_read_directly_reason():
    # a review: any child holding parameters made a unit a container, and an nn.ParameterList is one; the
    # warning said its parent "calls its children", though nothing under it is called
    cache, about_cache = _fit_looped_stem(["stem", "head"], _ParameterListsInADict)
    assert len(about_cache) == 1 and "its weights read directly" in about_cache[0]
    assert "container" not in about_cache[0] and list(cache.activations.uncached) == ["stem"]


class _ScaledBlocks(torch.nn.Module):  # no forward: a scale read directly beside layers the step calls
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)])


class _ScaledBlocksStem(_LoopedStem):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = _ScaledBlocks()

    def training_step(self, batch, batch_idx):
        h = torch.tanh(self.stem.blocks[0](batch[0])) * self.stem.scale
        return torch.nn.functional.cross_entropy(self.head(torch.tanh(self.stem.blocks[1](h))), batch[1])


def test_a_containers_parameters_read_directly_are_named_beside_its_parts_to_name():
    # a review: the way out named only the called parts, and following it left `stem.scale` in no unit
    # named (in `<rest>`) without a word
    cache, about_cache = _fit_looped_stem(["stem", "head"], _ScaledBlocksStem)
    assert len(about_cache) == 1
    assert (
        "name its parts in `units` (`stem.blocks.0`, `stem.blocks.1`); `stem.scale` is read directly: name it "
        "too, or it joins `<rest>` (not cached either way)."
    ) in about_cache[0]
    cache, about_cache = _fit_looped_stem(
        ["stem.blocks.0", "stem.scale", "stem.blocks.1", "head"], _ScaledBlocksStem
    )
    assert about_cache == [] and cache.activations.hits > 0


class _Backbone(pl.LightningModule):  # a pretrained LightningModule reused as a part: no forward of its own
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)


class _PretrainedStem(_LoopedStem):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = _Backbone()

    def training_step(self, batch, batch_idx):
        h = torch.tanh(self.stem.mid(torch.tanh(self.stem.enc(batch[0]))))
        return torch.nn.functional.cross_entropy(self.head(h), batch[1])


def test_a_lightning_module_reused_as_a_part_without_forward_is_a_container_with_its_parts_as_the_way_out():
    """A review of a6dbbb4: ``LightningModule``'s placeholder ``forward`` counts as no forward, so a
    pretrained backbone without one, used as a unit, is a container whose parts the step calls (it was told
    its "weights [are] read directly", with no way out); its parts, so named, are replayed."""
    cache, about_cache = _fit_looped_stem(["stem", "head"], _PretrainedStem)
    assert len(about_cache) == 1 and "container (`_Backbone`) with no forward of its own" in about_cache[0]
    assert "name its parts in `units` (`stem.enc`, `stem.mid`)." in about_cache[0]
    cache, about_cache = _fit_looped_stem(["stem.enc", "stem.mid", "head"], _PretrainedStem)
    assert about_cache == [] and cache.activations.hits > 0


class _CheckpointedLayer(torch.nn.Module):
    """A decoder layer shaped like Hugging Face's under gradient checkpointing: its body runs in a
    non-reentrant activation checkpoint, its children are the units, and its attention returns a tuple."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.ff = torch.nn.Linear(width, width)

    def forward(self, h):
        return torch.utils.checkpoint.checkpoint(self._body, h, use_reentrant=False)

    def _body(self, h):
        x = self.norm(h)
        h = h + self.attn(x, x, x, need_weights=False)[0]
        return h + self.ff(h)


class _CheckpointedTokenModel(pl.LightningModule):
    """Next-token prediction with Hugging Face's gradient checkpointing pattern and no Hugging Face: its
    enable_input_require_grads() hook makes the embeddings' output require grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 16)
        self.embed.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
        self.layers = torch.nn.ModuleList(_CheckpointedLayer(16) for _ in range(2))
        self.head = torch.nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        h = self.embed(tokens[:, :-1])
        for layer in self.layers:
            h = layer(h)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_a_frozen_module_inside_a_checkpointed_layer_is_not_replayed_and_training_goes_on():
    """Held-out sweep: a Hugging Face Llama with gradient_checkpointing_enable() and activation_cache_mb=16
    crashed at the first replayed batch (CheckpointError: "Recomputed values ... have different metadata"):
    the replayed input_layernorm in the checkpointed layer saved no tensors, its recompute in backward did."""
    starts = torch.randint(0, 16, (32, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts * 3 + torch.arange(9)) % 16  # a rule to learn
    cache = GradientCache(
        check_every=4,
        freeze_for=16,
        threshold=1.0,
        activation_cache_mb=16,
        units=["embed", "layers.0.norm", "layers.0.attn", "layers.0.ff", "layers.1", "head"],
    )
    model = _CheckpointedTokenModel()
    trainer = pl.Trainer(callbacks=[cache], max_steps=24, **trainer_kwargs())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8, shuffle=True))
    assert trainer.global_step == 24 and cache.events[0]["to"] >= 2  # trained on with layers.0.norm frozen
    assert list(cache.activations.uncached) == ["layers.0.norm"] and cache.activations.hits > 0
    about_cache = [str(w.message) for w in said if "activation cache" in str(w.message)]
    assert len(about_cache) == 1 and about_cache[0].startswith(
        "GradientCache: the activation cache cannot replay the frozen module `layers.0.norm`: its output "
        "requires grad"
    )
    assert "the ones before it (`embed`) stay cached" in about_cache[0]


class _ResidualBlock(torch.nn.Module):
    """``h + b(tanh(a(h)))`` (``(B, D) -> (B, D)``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, h):
        return h + self.b(torch.tanh(self.a(h)))


class _WholeBlockCheckpointed(pl.LightningModule):
    """Three residual blocks, each run whole in a non-reentrant activation checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(12, 16)
        self.blocks = torch.nn.ModuleList(_ResidualBlock(16) for _ in range(3))
        self.head = torch.nn.Linear(16, 3)

    def training_step(self, batch, batch_idx):
        h = self.inp(batch[0])
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return torch.nn.functional.cross_entropy(self.head(h), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_whole_blocks_in_a_non_reentrant_checkpoint_are_replayed_bit_for_bit_like_the_run_without_the_cache():
    # review: the docs said such blocks replay bit for bit, with no test; their input needs no grad, so the
    # input check does not keep them out of the cache
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 12, generator=generator), torch.randint(0, 3, (64,))
    )

    def fit_with(cache_mb: float) -> tuple[_WholeBlockCheckpointed, GradientCache]:
        cache = GradientCache(
            check_every=4,
            freeze_for=16,
            threshold=1.0,
            activation_cache_mb=cache_mb,
            units=["inp", "blocks.0", "blocks.1", "blocks.2", "head"],
        )
        model = _WholeBlockCheckpointed()
        pl.seed_everything(0)
        trainer = pl.Trainer(callbacks=[cache], max_steps=48, **trainer_kwargs())
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
        return model, cache

    (plain, _), (cached, cache) = fit_with(0), fit_with(16)
    assert cache.events and cache.activations.hits > 0 and cache.activations.uncached == {}
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), cached.parameters()))


@pytest.mark.parametrize("fault_step", [13, 17, 21])
def test_a_guard_rollback_listed_before_gradient_cache_is_not_undone_for_the_frozen_layers(fault_step):
    """Review of the put-back after the step: the batch end put the frozen layers back a second time, after
    StabilityGuard (listed first) had rolled back in its own batch end: frozen layers from after the snapshot,
    the others from the snapshot, and the copy re-stamped so that this mix stayed."""
    from lightning_pulse import StabilityGuard

    class NaNWeight(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == fault_step:
                with torch.no_grad():
                    pl_module.net[4].weight[0, 0] = float("nan")

    class AfterGuard(Callback):  # what the rollback restored, right after the guard's batch end
        def __init__(self) -> None:
            self.rollbacks, self.restored = 0, None

        def on_train_batch_end(self, trainer, pl_module, *args):
            if guard.rollbacks > self.rollbacks:
                self.rollbacks = guard.rollbacks
                self.restored = {k: v.clone() for k, v in pl_module.state_dict().items()}

    class Last(Callback):  # the model at the end of that batch, after every callback
        def __init__(self) -> None:
            self.differing = None

        def on_train_batch_end(self, trainer, pl_module, *args):
            if after.restored is not None and self.differing is None:
                state = pl_module.state_dict()
                self.differing = [k for k, v in state.items() if not torch.equal(v, after.restored[k])]

    pl.seed_everything(0)
    cache = GradientCache(check_every=4, freeze_for=8, threshold=1.0, max_frozen_share=1.0)
    guard = StabilityGuard(warmup=5, window=10, snapshot_every=6, rollback_margin=1)
    after, last = AfterGuard(), Last()
    callbacks = [NaNWeight(), guard, after, cache, last]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(max_steps=34, callbacks=callbacks, **trainer_kwargs()).fit(
            _MLP("lookahead"), _small_data(16)
        )
    assert guard.rollbacks >= 1 and last.differing == []


def test_a_containers_parts_to_name_leave_out_parameters_read_directly():
    # a review: a ModuleDict holding an nn.ParameterList the step reads directly named that list as a part to
    # give in `units`, where the cache can no more reach it
    from lightning_pulse.core.activation_cache import _called_parts, _no_forward_of_its_own

    stem = torch.nn.ModuleDict(
        {
            "scales": torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4))]),
            "proj": torch.nn.Linear(4, 4),
            "blocks": torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Identity()]),
        }
    )
    assert _called_parts("stem", stem) == ["stem.proj", "stem.blocks.0"]
    # one whose parameters are all read directly is no container: nothing under it is called
    assert not _no_forward_of_its_own(torch.nn.ModuleDict({"scales": stem["scales"]}))
    assert _no_forward_of_its_own(stem)
