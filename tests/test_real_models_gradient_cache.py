"""GradientCache on client models nobody here designed for (tests/clients.py): correct, or refused at fit start.

Every fit asserts what the callback did: which parameters were frozen (and stayed unchanged while frozen),
which kept learning, and that refusals are a PulseRefusal raised before the first step.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import ScheduledPrune
from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.errors import PulseRefusal
from tests.clients import (
    CLIENTS,
    LBFGSMLP,
    LoRAClassifier,
    PackedBiLSTM,
    PaddedSequencesDataModule,
    linear_rule_data,
)
from tests.conftest import StandInTrainer, stop_after_epochs, trainer_kwargs

pytest.importorskip("transformers")


def eager_cache(**kwargs) -> GradientCache:
    # threshold 1.0 freezes whatever has been scored once: every client gets a frozen prefix within 60 steps
    return GradientCache(**{"threshold": 1.0, "check_every": 10, "freeze_for": 40, **kwargs})


class WatchParameters(Callback):
    """Per optimizer step and parameter: was it frozen during the step (``requires_grad`` off at batch start),
    and did its value change over the step."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, bool, bool]] = []  # step, name, frozen, changed
        self._before: dict[str, tuple[bool, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = {n: (p.requires_grad, p.detach().clone()) for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for name, param in pl_module.named_parameters():
            trains, value = self._before[name]
            self.rows.append((trainer.global_step, name, not trains, not torch.equal(value, param.detach())))

    def frozen(self) -> set[str]:
        return {name for _, name, frozen, _ in self.rows if frozen}

    def changed_while_frozen(self) -> set[str]:
        return {name for _, name, frozen, changed in self.rows if frozen and changed}

    def changed_after(self, step: int) -> set[str]:
        return {name for s, name, _, changed in self.rows if changed and s > step}


def fit_client(module, data, cache: GradientCache, max_steps: int = 60) -> tuple[pl.Trainer, WatchParameters]:
    watch = WatchParameters()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=max_steps, limit_val_batches=1, callbacks=[cache, watch]))
    trainer.fit(module, data)
    return trainer, watch


# ------------------------------------------------------------------------------------------ tied and shared weights
def test_gpt2_tied_embedding_is_pinned_so_lm_head_and_wte_keep_learning():
    torch.manual_seed(0)
    module, data = CLIENTS["hf-gpt2"]()
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    cache = eager_cache()
    with pytest.warns(UserWarning, match=r"GradientCache: the first unit .*wte.*tie_word_embeddings=False"):
        _, watch = fit_client(module, data, cache)

    units = {unit.name: unit for unit in cache.freezer.units}
    assert units["model.transformer.wte"].shared_with == ["model.lm_head.weight"]
    assert [unit.name for unit in cache.freezer.units if unit.pinned] == ["model.transformer.wte"]
    # the old code froze the embedding at the first check (step 10): the tied output layer stopped learning
    assert "model.transformer.wte.weight" not in watch.frozen()
    assert "model.transformer.wte.weight" in watch.changed_after(10)
    # the embedding comes first in forward order, so nothing upstream of the blocks can be frozen
    assert cache.freezer.units[0].name == "model.transformer.wte"
    assert watch.frozen() == set() and cache.events == []
    assert all(p.requires_grad for p in module.parameters())


def test_gpt2_with_untied_head_freezes_the_embedding_and_only_that_stays_unchanged():
    torch.manual_seed(0)
    module, data = CLIENTS["hf-gpt2"]()
    module.model.config.tie_word_embeddings = False
    module.model.lm_head.weight = nn.Parameter(module.model.transformer.wte.weight.detach().clone())
    cache = eager_cache()
    _, watch = fit_client(module, data, cache)

    assert not any(unit.pinned for unit in cache.freezer.units)
    assert "model.transformer.wte.weight" in watch.frozen()
    assert watch.changed_while_frozen() == set()  # what is frozen is frozen
    assert "model.lm_head.weight" not in watch.frozen()
    assert "model.lm_head.weight" in watch.changed_after(10)


class TinyAlbert(pl.LightningModule):
    """Hugging Face ALBERT from a config (no weights downloaded): one layer's weights applied at 4 depths."""

    def __init__(self) -> None:
        from transformers import AlbertConfig, AlbertForSequenceClassification

        super().__init__()
        config = AlbertConfig(
            vocab_size=100,
            embedding_size=16,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=3,
        )
        self.model = AlbertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return self.model(input_ids=tokens, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_albert_never_freezes_part_of_its_shared_layer_while_the_rest_of_it_trains():
    # sweep D: its shared layer is split into attention, ffn, ffn_output and norm, and GradientCache froze
    # attention and ffn while ffn_output and the norm, which feed them at every later depth, trained
    generator = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 100, (128, 16), generator=generator), torch.randint(0, 3, (128,))
    data = DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=16)
    torch.manual_seed(0)
    module, cache = TinyAlbert(), eager_cache()
    _, watch = fit_client(module, data, cache, max_steps=30)
    shared = "model.albert.encoder.albert_layer_groups.0.albert_layers.0."
    assert sum(unit.name.startswith(shared) for unit in cache.freezer.units) == 4
    # the prefix stops before the shared layer (the whole of it and everything after is over the 0.9 share)
    assert {name.rpartition(".")[0] for name in watch.frozen()} == {
        "model.albert.embeddings.word_embeddings",
        "model.albert.embeddings.position_embeddings",
        "model.albert.embeddings.token_type_embeddings",
        "model.albert.embeddings.LayerNorm",
        "model.albert.encoder.embedding_hidden_mapping_in",
    }
    assert watch.changed_while_frozen() == set()


def test_shared_conv_cnn_freezes_the_shared_conv_as_one_and_never_the_tied_linear():
    torch.manual_seed(0)
    module, data = CLIENTS["shared-conv-cnn"]()
    cache = eager_cache()
    _, watch = fit_client(module, data, cache)

    units = {unit.name: unit for unit in cache.freezer.units}
    assert units["mix_a"].shared_with == ["mix_b.weight"] and not units["shared"].pinned
    # the conv applied twice is one unit: both applications freeze together; the prefix stops before mix_a
    assert watch.frozen() == {
        "stem.weight",
        "stem.bias",
        "shared.weight",
        "shared.bias",
        "encode.weight",
        "encode.bias",
    }
    assert watch.changed_while_frozen() == set()
    assert {"mix_a.weight", "mix_b.bias", "head.weight"} <= watch.changed_after(10)


# ------------------------------------------------------------------------------------------ the other clients
@pytest.mark.parametrize(
    ("client", "first_frozen"),
    [
        ("hf-bert", "model.bert.embeddings.word_embeddings.weight"),
        ("transformer-encoder", "embed.weight"),
        ("stateful-lstm", "embed.weight"),
        ("onecycle-per-step", "net.1.weight"),
    ],
)
def test_client_freezes_a_prefix_that_stays_unchanged_while_the_rest_learns(client, first_frozen):
    torch.manual_seed(0)
    module, data = CLIENTS[client]()
    cache = eager_cache()
    trainer, watch = fit_client(module, data, cache)

    assert cache.events and cache.events[0]["step"] == 10
    assert first_frozen in watch.frozen()
    assert watch.changed_while_frozen() == set()
    last = cache.freezer.units[-1]
    assert not set(last.param_names) & watch.frozen()  # the last unit always trains
    assert set(last.param_names) <= watch.changed_after(10)
    assert all(p.requires_grad for p in module.parameters())  # the module leaves fit as it came in
    if client == "onecycle-per-step":  # the per-step schedule ran every step, frozen or not
        assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 60


# ------------------------------------------------------------------------------------------ refusals
def test_manual_optimization_is_refused_before_the_first_step():
    module, data = CLIENTS["manual-optimization"]()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=5, callbacks=[GradientCache()]))
    with pytest.raises(PulseRefusal, match=r"^GradientCache: it needs automatic optimization.*remove"):
        trainer.fit(module, data)
    assert trainer.global_step == 0


@pytest.mark.parametrize("strategy_class", [FSDPStrategy, DeepSpeedStrategy])
def test_sharded_strategies_are_refused_at_setup(strategy_class):
    module, _ = CLIENTS["onecycle-per-step"]()
    trainer = StandInTrainer(strategy_class)
    with pytest.raises(
        PulseRefusal, match=rf"^GradientCache does not support {strategy_class.__name__}: .*requires_grad"
    ):
        GradientCache().setup(trainer, module, stage="fit")


# ------------------------------------------------------------------------------------------ resume after pruning
def _pruned_run(mode: str, tmp_path, ckpt_path: str | None = None, stop_after: int | None = None):
    pl.seed_everything(0)
    data = MNIST1DDataModule(num_samples=1000, batch_size=64)
    data.setup()
    loader = DataLoader(data.train_set, batch_size=64)  # unshuffled: both runs see the same batches
    model = MNIST1DClassifier(arch="cnn")
    prune = ScheduledPrune(
        final_sparsity=0.5,
        mode=mode,
        start=4,
        end=30,
        every=5,
        probe_batches=0,
        options={"make_permanent": False} if mode == "unstructured" else None,  # structured keeps no masks
    )
    cache = GradientCache(threshold=0.9, check_every=4, freeze_for=8)
    callbacks = [prune, cache]
    if stop_after is not None:
        callbacks += [
            stop_after_epochs(stop_after),
            ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1),
        ]
    trainer = pl.Trainer(
        max_epochs=6,
        limit_train_batches=9,
        callbacks=callbacks,
        **trainer_kwargs(enable_checkpointing=stop_after is not None),
    )
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return model, prune, cache


@pytest.mark.parametrize("mode", ["unstructured", "structured"])
def test_resume_after_a_prune_event_reproduces_the_uninterrupted_run(mode, tmp_path):
    whole_model, whole_prune, whole_cache = _pruned_run(mode, tmp_path)
    _pruned_run(mode, tmp_path, stop_after=3)
    checkpoint = next(tmp_path.glob("epoch=2-*.ckpt"))  # step 27: prune events at steps 5-25 lie before it
    saved = torch.load(checkpoint, weights_only=False)
    prune_state = next(v for k, v in saved["callbacks"].items() if k.startswith("ScheduledPrune"))
    cache_state = next(v for k, v in saved["callbacks"].items() if k.startswith("GradientCache"))
    assert len(prune_state["events"]) >= 3 and cache_state["cache"] is not None
    if mode == "unstructured":
        assert "net.1.weight_orig" in saved["state_dict"]
    else:
        assert saved["state_dict"]["net.3.weight"].shape[0] < 25
        # the saved window snapshots follow the cut channels
        sizes = {tuple(t.shape) for item in cache_state["cache"]["snapshot"] for t in item}
        assert tuple(saved["state_dict"]["net.3.weight"].shape) in sizes

    resumed_model, resumed_prune, resumed_cache = _pruned_run(mode, tmp_path, ckpt_path=str(checkpoint))
    assert whole_cache.events and any(event["step"] > 27 for event in whole_cache.events)
    assert resumed_cache.events == whole_cache.events
    assert [e["sparsity"] for e in resumed_prune.events] == [e["sparsity"] for e in whole_prune.events]
    whole, resumed = whole_model.state_dict(), resumed_model.state_dict()
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


def test_structured_prune_mid_run_points_the_units_at_the_new_parameters(tmp_path):
    model, prune, cache = _pruned_run("structured", tmp_path)
    params = {id(p) for p in model.parameters()}
    assert prune.events
    for unit in cache.freezer.units:
        assert all(id(p) in params for p in unit.params), unit.name
        assert [tuple(s.shape) for s in cache.freezer.snapshot[cache.freezer.units.index(unit)]] == [
            tuple(p.shape) for p in unit.params
        ]
    assert cache.freezer.trainable_numel == sum(p.numel() for p in model.parameters())


class HalveFirstConvAt(Callback):
    """Halves the first conv layer's weights in place after optimizer step ``step``: the user's own write to a
    frozen layer, which no callback announces."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.net[1].weight.mul_(0.5)


class MixupFrom(MNIST1DClassifier):
    """Mixes each batch with a permutation of itself (mixup, seeded) from global step ``onset`` on."""

    def __init__(self, onset: int) -> None:
        super().__init__(arch="cnn")
        self.onset = onset
        self.mixing = torch.Generator().manual_seed(1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step < self.onset:
            return super().training_step(batch, batch_idx)
        lam = float(torch.rand((), generator=self.mixing))
        perm = torch.randperm(len(x), generator=self.mixing)
        out = self(lam * x + (1 - lam) * x[perm])
        return lam * nn.functional.cross_entropy(out, y) + (1 - lam) * nn.functional.cross_entropy(
            out, y[perm]
        )


def _cached_prune_run(
    megabytes: float,
    prune: ScheduledPrune | None,
    extra: tuple[Callback, ...] = (),
    model_factory=lambda: MNIST1DClassifier(arch="cnn"),
):
    """The MNIST-1D CNN, unshuffled (12 batches an epoch), whose three conv layers freeze at step 4 for the
    rest of the 60 steps: with ``megabytes`` they are recorded until step 16, verified, then replayed."""
    pl.seed_everything(0)
    data = MNIST1DDataModule(num_samples=1000, batch_size=64)
    data.setup()
    model = model_factory()
    cache = GradientCache(threshold=2.0, check_every=4, freeze_for=64, activation_cache_mb=megabytes)
    callbacks = [prune, cache] if prune is not None else [cache]
    trainer = pl.Trainer(max_steps=60, callbacks=[*callbacks, *extra], **trainer_kwargs())
    trainer.fit(model, train_dataloaders=DataLoader(data.train_set, batch_size=64))
    assert [(event["step"], event["to"]) for event in cache.events] == [(4, 3)]  # one freeze, never released
    return model, cache


def _same_weights(model: nn.Module, other: nn.Module) -> None:
    ours, theirs = model.state_dict(), other.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("events", ["one inside the replays", "every 3 steps from the freeze's first"])
def test_an_unstructured_prune_event_drops_the_cached_activations_so_training_equals_the_run_without_it(
    events,
):
    # held-out sweep: unstructured events mask weights in place and said nothing, so the cache kept replaying
    # the frozen layers' outputs from before the event (max weight difference 0.08 with vs without the cache);
    # events before the cache's first check switched it off, blaming "random data augmentation"
    def prune():
        start, end, every = (24, 24, 5) if events == "one inside the replays" else (6, 30, 3)
        return ScheduledPrune(0.8, "unstructured", start=start, end=end, every=every, probe_batches=0)

    plain, _ = _cached_prune_run(0.0, prune())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*activation cache switched itself off")
        model, cache = _cached_prune_run(8.0, prune())
    _same_weights(model, plain)
    activations = cache.activations
    assert activations.disabled_reason is None and activations.hits >= 10
    assert activations.weight_changes == 0  # each event told the cache (WeightsChangedListener) right away


def test_a_frozen_layer_the_users_code_writes_in_place_is_recorded_again_so_training_equals_the_plain_run():
    # nothing announces this write: the cache sees the weight's version counter move between two forwards
    plain, _ = _cached_prune_run(0.0, None, (HalveFirstConvAt(30),))
    model, cache = _cached_prune_run(8.0, None, (HalveFirstConvAt(30),))
    _same_weights(model, plain)
    assert cache.activations.weight_changes == 1 and cache.activations.hits >= 10


def test_a_transform_started_mid_freeze_switches_the_cache_off_so_training_equals_the_plain_run():
    # held-out sweep: mixup switched on after the cache's one check of the freeze; the cache kept replaying
    # the frozen layers' outputs of the clean inputs it recorded (283 replays, no warning: weights 0.035
    # off, test accuracy 0.482 vs 0.525). Each replay now compares per-row sums of the frozen prefix's input
    # with the recorded ones; the first mixed batch runs for real and the cache switches off
    plain, _ = _cached_prune_run(0.0, None, model_factory=lambda: MixupFrom(30))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, cache = _cached_prune_run(8.0, None, model_factory=lambda: MixupFrom(30))
    _same_weights(model, plain)
    said = [str(w.message) for w in caught if "activation cache switched itself off" in str(w.message)]
    assert (
        len(said) == 1 and "the input of net.1 differs from the one its outputs were recorded for" in said[0]
    )
    assert cache.activations.hits >= 10  # the clean batches before the onset were replayed


def test_the_activation_cache_switches_itself_off_when_each_batch_is_padded_to_its_own_length():
    # held-out sweep: a padded variable-length client crashed the cache's recorder mid-run (index_copy_ of 18
    # positions into rows of 19); the cache now switches itself off and says why, and training goes on
    torch.manual_seed(0)
    cache = eager_cache(activation_cache_mb=16)
    with pytest.warns(
        UserWarning, match="activation cache switched itself off: .*changes shape between batches"
    ):
        trainer, watch = fit_client(PackedBiLSTM(), PaddedSequencesDataModule(), cache, max_steps=60)
    assert trainer.global_step == 60 and "embed.weight" in watch.frozen()
    assert cache.activations is not None and cache.activations.hits == 0


def test_lora_adapters_still_growing_from_their_init_are_not_frozen(caplog):
    # held-out sweep: at its defaults GradientCache froze LoRA adapters from step 60 (their first windows, moving
    # far from a tiny or zero init, set peaks later windows looked small against): val loss 1.8x plain
    def fit(callbacks):
        pl.seed_everything(0)
        module = LoRAClassifier()
        trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(max_epochs=5))
        trainer.fit(module, DataLoader(linear_rule_data(), batch_size=32, shuffle=True))
        return module

    cache = GradientCache()
    with caplog.at_level("INFO"):
        cached = fit([cache])
    plain = fit([])
    assert cache.events == [] and cache.freezer.steps == 315
    assert "its norm was still growing" in caplog.text  # what it measured, and why it waited
    for (name, ours), theirs in zip(cached.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_lbfgs_is_refused_at_fit_start_because_it_moves_parameters_without_a_gradient():
    # held-out sweep: L-BFGS steps every parameter along its curvature history, so a frozen layer changed at each
    # of its 47 frozen steps (train loss 0.89 against plain's 0.11)
    _, data = CLIENTS["onecycle-per-step"]()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=20, callbacks=[eager_cache()]))
    with pytest.raises(PulseRefusal, match=r"^GradientCache: torch.optim.LBFGS .* first-order optimizer"):
        trainer.fit(LBFGSMLP(), data)
    assert trainer.global_step == 0


class CheckpointedBlocks(pl.LightningModule):
    """Two MLP blocks under activation checkpointing, as memory-bound models train."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(20, 64)
        self.b1 = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.b2 = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.inp(x))
        h = checkpoint(self.b1, h, use_reentrant=self.use_reentrant)
        h = checkpoint(self.b2, h, use_reentrant=self.use_reentrant)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class UnfrozenUnitsMove(Callback):
    """Counts steps where a unit GradientCache did not freeze kept its weights (it should have trained)."""

    def __init__(self, cache: GradientCache) -> None:
        self.cache, self.stalled, self.checked = cache, [], 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.frozen = list(self.cache.frozen_units)
        self.before = {name: p.detach().clone() for name, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.frozen:
            return
        self.checked += 1
        for name, parameter in pl_module.named_parameters():
            unit = name.rpartition(".")[0]
            if unit not in self.frozen and torch.equal(parameter.detach(), self.before[name]):
                self.stalled.append((trainer.global_step, name))


def _checkpointed_blocks_data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 20, generator=generator)
    y = (x @ torch.randn(20, 5, generator=generator)).argmax(1)
    return DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_reentrant_activation_checkpointing_is_refused_and_the_non_reentrant_form_freezes_correctly(
    use_reentrant,
):
    # Reentrant checkpointing gives a block's parameters no gradient once its input needs none: a frozen prefix
    # ending before it stalled the (unfrozen) block for 40 steps, reported as training (a held-out sweep).
    loader = _checkpointed_blocks_data()
    pl.seed_everything(0)
    cache = GradientCache(threshold=1.0, check_every=4, freeze_for=8, max_frozen_share=0.9)
    watch = UnfrozenUnitsMove(cache)
    trainer = pl.Trainer(callbacks=[cache, watch], max_steps=64, **trainer_kwargs(limit_val_batches=0))
    if use_reentrant:
        with pytest.raises(PulseRefusal, match="GradientCache: .*use_reentrant=False"):
            trainer.fit(CheckpointedBlocks(use_reentrant), loader)
        assert trainer.global_step == 0
        return
    trainer.fit(CheckpointedBlocks(use_reentrant), loader)
    assert watch.checked > 0 and watch.stalled == []


def test_a_resumed_frozen_prefix_does_not_hide_reentrant_checkpointing_from_the_graph_check(tmp_path):
    # sweep A: resumed with a frozen prefix, the first backward already had it frozen, so the reentrant
    # checkpoints' input needed no gradient and left no node to find: b1 and b2 stood still, reported training
    pl.seed_everything(0)
    settings = dict(threshold=1.0, check_every=4, freeze_for=8, max_frozen_share=0.9)
    cache, path = GradientCache(**settings), str(tmp_path / "frozen.ckpt")
    trainer = pl.Trainer(callbacks=[cache], max_steps=6, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(CheckpointedBlocks(use_reentrant=False), _checkpointed_blocks_data())
    assert cache.freezer.frozen_names[:2] == ["inp", "b1.0"]  # saved mid-freeze: the prefix ends inside b1
    trainer.save_checkpoint(path)
    resumed = pl.Trainer(
        callbacks=[GradientCache(**settings)], max_steps=12, **trainer_kwargs(limit_val_batches=0)
    )
    with pytest.raises(
        PulseRefusal, match="GradientCache: the loss goes through reentrant .*use_reentrant=False"
    ):
        resumed.fit(CheckpointedBlocks(use_reentrant=True), _checkpointed_blocks_data(), ckpt_path=path)
    assert resumed.global_step == 6  # refused before its first optimizer step


class BackboneClassifier(pl.LightningModule):
    """A fine-tuning module as Lightning's ``BackboneFinetuning`` expects: ``self.backbone`` and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Sequential(
            nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.05)


class FreezeAt(Callback):
    """The user freezes ``head.2`` at the start of epoch ``epoch`` (a schedule of their own)."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.value = epoch, None

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            pl_module.head[2].requires_grad_(False)
            self.value = pl_module.head[2].weight.detach().clone()


def test_what_the_user_or_backbone_finetuning_freezes_and_unfreezes_stays_theirs():
    pl.seed_everything(0)
    data = MNIST1DDataModule(num_samples=1000, batch_size=50)
    module, user = BackboneClassifier(), FreezeAt(epoch=2)
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=3, backbone_initial_ratio_lr=0.5)
    # max_frozen_share: the cache's prefix is head.0 at most, so head.2 is the user's alone (a parameter the
    # user freezes while the cache holds it frozen looks unchanged to it: docs/gradient-cache.md)
    cache, watch = eager_cache(check_every=4, freeze_for=8, max_frozen_share=0.5), WatchParameters()
    trainer = pl.Trainer(
        **trainer_kwargs(max_epochs=6, limit_val_batches=1, callbacks=[finetuning, user, cache, watch])
    )
    trainer.fit(module, data)
    assert cache.freezer.freezes > 0  # it froze and released its own prefix meanwhile
    # the user's freeze held to the end: never trained again, still off after the fit
    assert torch.equal(module.head[2].weight, user.value) and not module.head[2].weight.requires_grad
    # the backbone, frozen by BackboneFinetuning until epoch 3, trains from then on
    steps_per_epoch = trainer.global_step // 6
    assert not any(name.startswith("backbone") for name in watch.changed_while_frozen())
    assert {"backbone.0.weight", "backbone.2.weight"} <= watch.changed_after(3 * steps_per_epoch)
    assert all(p.requires_grad for p in module.backbone.parameters())


class FunctionallyTiedLM(pl.LightningModule):
    """A hand-written LM whose output projection is the embedding, read with ``F.linear(h, embed.weight)``:
    tied without a second parameter name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        logits = nn.functional.linear(self.norm(h + self.blocks(h)), self.embed.weight)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_an_embedding_read_again_as_the_output_projection_is_pinned_like_a_named_tie(tmp_path):
    # it was frozen first in the prefix, and the output projection stopped learning with it
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (256, 9), generator=generator)
    data = DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=16)
    cache = eager_cache()
    trainer, watch = fit_client(FunctionallyTiedLM(), data, cache, max_steps=60)
    assert cache.freezer.units[0].name == "embed" and cache.freezer.units[0].pinned
    assert "embed.weight" not in watch.frozen()
    assert "Embedding" in cache.freezer.units[0].shared_with[0]
    # a fit resumed from its checkpoint pins it the same way (its freezer comes from the checkpoint, not a trace)
    path = str(tmp_path / "tied.ckpt")
    trainer.save_checkpoint(path)
    resumed_cache = eager_cache()
    resumed = pl.Trainer(
        **trainer_kwargs(max_steps=80, limit_val_batches=1, callbacks=[resumed_cache, WatchParameters()])
    )
    resumed.fit(FunctionallyTiedLM(), data, ckpt_path=path)
    assert resumed_cache.freezer.units[0].pinned and resumed_cache.freezer.frozen_prefix == 0


class CheckpointedLlama(pl.LightningModule):
    """A tiny Hugging Face Llama with gradient_checkpointing_enable() (non-reentrant, HF's default)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        self.model = LlamaForCausalLM(config)
        # gradient_checkpointing_enable() on older transformers (where both exist, the old name warns)
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        (enable or self.model.gradient_checkpointing_enable)()
        # transformers 5 installs this hook (the embeddings' output requires grad) for every model under
        # gradient checkpointing, 4.x only for PEFT: installed here, the setup is the same on every version
        self.model.enable_input_require_grads()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_hf_gradient_checkpointing_keeps_only_the_embeddings_in_the_activation_cache_and_trains_on():
    """Held-out sweep: this Llama with activation_cache_mb=16 crashed at the first replayed batch
    (CheckpointError: "Recomputed values ... have different metadata", saved [32, 16, 64], recomputed
    [32, 16]): transformers 5 makes the embeddings' output require grad, so the replayed input_layernorm inside the
    checkpointed decoder layer saved no tensors where its recompute in backward did."""
    starts = torch.randint(0, 64, (32, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts * 3 + torch.arange(16)) % 64
    cache = GradientCache(check_every=4, freeze_for=16, threshold=1.0, activation_cache_mb=16)
    watch = WatchParameters()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=20, callbacks=[cache, watch]))
    with pytest.warns(
        UserWarning, match=r"cannot replay the frozen module `model\.model\.layers\.0\.input_layernorm`"
    ):
        trainer.fit(CheckpointedLlama(), DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8))
    assert trainer.global_step == 20 and cache.activations.hits > 0
    assert list(cache.activations.uncached) == ["model.model.layers.0.input_layernorm"]
    assert "model.model.embed_tokens.weight" in watch.frozen() and not watch.changed_while_frozen()
    assert watch.changed_after(12) - watch.frozen()  # the rest keeps learning


class TinyWav2Vec2CTC(pl.LightningModule):
    """Hugging Face's wav2vec2 for CTC from a small config, trained on variable-length tones."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

        config = Wav2Vec2Config(
            vocab_size=12, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2, pad_token_id=0, mask_time_prob=0.0, layerdrop=0.0,
        )  # fmt: skip
        self.model = Wav2Vec2ForCTC(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def tones(count: int = 48) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    items = []
    for _ in range(count):
        length, labels = int(torch.randint(400, 800, (1,), generator=generator)), torch.randint(1, 12, (4,))
        audio = torch.sin(torch.arange(length) * 0.05 * labels.repeat_interleave(length // 4 + 1)[:length])
        items.append(
            {"input_values": audio + 0.3 * torch.randn(length, generator=generator), "labels": labels}
        )
    return items


def pad_audio(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    length = max(len(item["input_values"]) for item in items)
    audio, mask = torch.zeros(len(items), length), torch.zeros(len(items), length, dtype=torch.long)
    for row, item in enumerate(items):
        audio[row, : len(item["input_values"])], mask[row, : len(item["input_values"])] = (
            item["input_values"],
            1,
        )
    return {
        "input_values": audio,
        "attention_mask": mask,
        "labels": torch.stack([i["labels"] for i in items]),
    }


def test_wav2vec2_feature_encoder_is_not_replayed_and_the_warning_names_freeze_feature_encoder():
    """Held-out sweep: wav2vec2's feature encoder sets ``requires_grad`` on its own output while training
    (until ``freeze_feature_encoder()``), so the activation cache cannot replay it once frozen; the warning
    blamed gradient checkpointing, PEFT or an input-gradient penalty, none of them in play, and named no way
    out."""
    cache = GradientCache(check_every=5, freeze_for=10, threshold=1.0, start_at=5, activation_cache_mb=8)
    trainer = pl.Trainer(**trainer_kwargs(max_steps=20, callbacks=[cache]))
    loader = DataLoader(tones(), batch_size=8, shuffle=True, collate_fn=pad_audio)
    with pytest.warns(UserWarning, match=r"`model\.wav2vec2\.feature_extractor`.*freeze_feature_encoder\(\)"):
        trainer.fit(TinyWav2Vec2CTC(), loader)
    assert trainer.global_step == 20
    assert "model.wav2vec2.feature_extractor" in cache.activations.uncached


def test_a_model_whose_config_always_ties_its_embeddings_is_told_the_untie_does_nothing():
    # a held-out sweep: on T5 the warning's way out, `tie_word_embeddings=False`, was already set and did
    # nothing (transformers 5's T5Config sets True itself): the same warning came back, and nothing froze
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    from lightning_pulse.core.layer_freezing import forced_tie_note

    config = T5Config(
        d_model=16, num_layers=1, num_heads=2, d_ff=32, d_kv=8, vocab_size=50, tie_word_embeddings=False
    )
    t5 = T5ForConditionalGeneration(config)
    assert t5.lm_head.weight is t5.shared.weight  # the setting did nothing
    note = forced_tie_note(nn.Sequential(t5))
    assert note.startswith("; but T5Config ties them whatever it is given") and "leave it out" in note
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    assert forced_tie_note(gpt2) == ""  # GPT-2 unties with the setting: the warning's way out stands
