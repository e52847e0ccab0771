"""HyperConnectionMonitor through real Trainers on the stdlib char LM."""

from __future__ import annotations

import copy
import csv
import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from examples.charlm import CharLMDataModule, CharTransformerLM
from lightning_pulse import HyperConnectionMonitor
from tests.conftest import trainer_kwargs


def tiny_lm(residual: str = "mhc", lr: float = 3e-2, **kwargs) -> tuple[CharTransformerLM, CharLMDataModule]:
    pl.seed_everything(0, verbose=False)
    data = CharLMDataModule(max_chars=20_000, seq_len=16, batch_size=8)
    model = CharTransformerLM(
        d_model=16, n_layers=2, n_heads=2, seq_len=16, lr=lr, residual=residual, **kwargs
    )
    return model, data


def fixed_order_loader(data: CharLMDataModule, batches: int) -> DataLoader:
    """Unshuffled training batches, so a resumed run sees the same data as an uninterrupted one."""
    data.setup("fit")
    subset = torch.utils.data.Subset(data.train_set, range(batches * data.hparams.batch_size))
    return DataLoader(subset, batch_size=data.hparams.batch_size)


def test_logs_gains_and_off_diagonal_mass_every_n_steps_to_the_trainer_logger(tmp_path):
    model, data = tiny_lm("mhc")
    monitor = HyperConnectionMonitor(every_n_steps=3, per_layer=True)
    logger = CSVLogger(tmp_path, name="run")
    kwargs = trainer_kwargs(logger=logger, log_every_n_steps=1, limit_val_batches=0)
    pl.Trainer(callbacks=[monitor], max_steps=8, **kwargs).fit(model, data)
    assert [entry["step"] for entry in monitor.history] == [0, 3, 6]
    rows = list(csv.DictReader(open(Path(logger.log_dir, "metrics.csv"))))
    logged = [row for row in rows if row.get("mhc/forward_gain")]
    assert [int(row["step"]) for row in logged] == [0, 3, 6]
    for row in logged:
        assert float(row["mhc/forward_gain"]) == pytest.approx(1.0, abs=1e-3)  # doubly stochastic product
        assert 1.0 - 1e-3 <= float(row["mhc/backward_gain"]) <= 1.5
        assert 0.0 < float(row["mhc/off_diagonal_mass"]) < 0.75
        assert all(row[f"mhc/layer_{i:02d}/off_diagonal_mass"] for i in range(4))
    assert monitor.history[0]["off_diagonal_mass"] == pytest.approx(0.1, abs=0.01)  # H_res starts at diag 0.9


def test_leaves_training_bit_for_bit_unchanged_and_sees_hc_gain_grow_past_one():
    results = {}
    for name, callbacks in (("without", []), ("with", [HyperConnectionMonitor(every_n_steps=2)])):
        model, data = tiny_lm("hc", lr=5e-2)
        pl.Trainer(callbacks=callbacks, max_steps=12, **trainer_kwargs(limit_val_batches=0)).fit(model, data)
        results[name] = (model, callbacks)
    for (key, with_value), without_value in zip(
        results["with"][0].state_dict().items(), results["without"][0].state_dict().values()
    ):
        assert torch.equal(with_value, without_value), key
    monitor = results["with"][1][0]
    assert monitor.history[0]["forward_gain"] == pytest.approx(1.0, abs=0.1)  # H_res starts at the identity
    # unconstrained H_res drifts off norm 1
    assert max(entry["forward_gain"] for entry in monitor.history) > 1.2


def test_measures_once_per_optimizer_step_with_gradient_accumulation_and_under_bf16_autocast():
    model, data = tiny_lm("mhc")
    monitor = HyperConnectionMonitor(every_n_steps=2)
    kwargs = trainer_kwargs(limit_val_batches=0, accumulate_grad_batches=3, precision="bf16-mixed")
    pl.Trainer(callbacks=[monitor], max_steps=5, **kwargs).fit(model, data)
    assert [entry["step"] for entry in monitor.history] == [0, 2, 4]
    for entry in monitor.history:
        assert entry["forward_gain"] == pytest.approx(1.0, abs=1e-3)  # Sinkhorn stays fp32 under autocast
        assert entry["layers"] == 4


def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_history(tmp_path):
    kwargs = trainer_kwargs(limit_val_batches=0)
    model, data = tiny_lm("hc")
    full = HyperConnectionMonitor(every_n_steps=2)
    pl.Trainer(callbacks=[full], max_epochs=2, **kwargs).fit(model, fixed_order_loader(data, 5))

    model, data = tiny_lm("hc")
    first = HyperConnectionMonitor(every_n_steps=2)
    trainer = pl.Trainer(callbacks=[first], max_epochs=1, **kwargs)
    trainer.fit(model, fixed_order_loader(data, 5))
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")

    model, data = tiny_lm("hc")
    resumed = HyperConnectionMonitor(every_n_steps=2)
    trainer = pl.Trainer(callbacks=[resumed], max_epochs=2, **kwargs)
    trainer.fit(model, fixed_order_loader(data, 5), ckpt_path=tmp_path / "epoch1.ckpt")

    assert [e["step"] for e in full.history] == [0, 2, 4, 6, 8]
    assert [e["step"] for e in resumed.history] == [e["step"] for e in full.history]
    for got, want in zip(resumed.history, full.history):
        assert got["forward_gain"] == pytest.approx(want["forward_gain"], rel=1e-5)
        assert got["backward_gain"] == pytest.approx(want["backward_gain"], rel=1e-5)
        assert got["stream_rms"] == pytest.approx(want["stream_rms"], rel=1e-5)
        assert got["off_diagonal_mass"] == pytest.approx(want["off_diagonal_mass"], rel=1e-5)


def test_a_monitor_reused_for_a_second_fit_measures_its_step_zero_again():
    """The step measured last (0, in a fit shorter than ``every_n_steps``) carried over to the next fit, which
    took its own step 0 as measured already and logged nothing."""
    monitor = HyperConnectionMonitor(every_n_steps=5)
    for _ in range(2):
        model, data = tiny_lm("mhc")
        pl.Trainer(callbacks=[monitor], max_steps=3, **trainer_kwargs(limit_val_batches=0)).fit(model, data)
    assert [entry["step"] for entry in monitor.history] == [0, 0]


def test_the_measured_step_a_checkpoint_holds_still_wins_on_resume(tmp_path):
    """The per-fit reset runs before the checkpoint's state is loaded: a step the checkpoint says was measured
    (saved inside that step) is not measured twice."""
    kwargs = trainer_kwargs(limit_val_batches=0)
    monitor = HyperConnectionMonitor(every_n_steps=3)
    model, data = tiny_lm("mhc")
    trainer = pl.Trainer(callbacks=[monitor], max_steps=3, **kwargs)
    trainer.fit(model, data)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    checkpoint = torch.load(tmp_path / "step3.ckpt", weights_only=False)
    checkpoint["callbacks"][monitor.state_key]["last_measured_step"] = 3  # as if saved inside step 3
    torch.save(checkpoint, tmp_path / "step3.ckpt")

    model, data = tiny_lm("mhc")
    pl.Trainer(callbacks=[monitor], max_steps=7, **kwargs).fit(model, data, ckpt_path=tmp_path / "step3.ckpt")
    assert [entry["step"] for entry in monitor.history] == [0, 6]


def test_warns_once_and_logs_nothing_for_a_model_without_hyper_connections():
    model, data = tiny_lm("plain")
    monitor = HyperConnectionMonitor(every_n_steps=1)
    with pytest.warns(UserWarning, match="found no HyperConnection"):
        pl.Trainer(callbacks=[monitor], max_steps=3, **trainer_kwargs(limit_val_batches=0)).fit(model, data)
    assert monitor.history == [] and monitor.last is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"every_n_steps": 2.5}, "every_n_steps"),
        ({"prefix": ""}, "prefix"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        HyperConnectionMonitor(**kwargs)


class HoldingStrategy:
    """A two-rank strategy stand-in whose 'backend' keeps a C++ reference to each reduced tensor (an autograd node
    that saved it), as gloo's worker thread does for a moment after a collective returns."""

    def __init__(self) -> None:
        self.held: list[torch.Tensor] = []  # graph outputs whose backward node saved the reduced tensor
        self.handed: list[torch.Tensor] = []
        self.weight = torch.ones(1, dtype=torch.float64, requires_grad=True)

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self.held.append(tensor * self.weight)  # MulBackward saves `tensor`: its use count goes up
        self.handed.append(tensor)
        return tensor.copy_(torch.maximum(tensor, 2 * tensor))  # the other rank measured twice these figures

    def release(self) -> None:
        self.held.clear()


def _measure_under_two_ranks(
    monitor: HyperConnectionMonitor, strategy: HoldingStrategy, step: int = 0
) -> None:
    trainer = SimpleNamespace(
        strategy=strategy, world_size=2, is_global_zero=True, loggers=[], global_step=step
    )
    model, _ = tiny_lm("mhc")
    monitor.on_train_batch_start(trainer, model, None, 0)
    model(torch.zeros(1, 4, dtype=torch.long))
    monitor.on_train_batch_end(trainer, model, None, None, 0)


def test_reduced_tensors_stay_referenced_until_the_backend_lets_go_and_teardown_waits_for_that(monkeypatch):
    # If Python dropped a reduced tensor first, the backend's thread would free it under the GIL, which aborts
    # the rank ("terminate called without an active exception") when it happens while the rank exits.
    from lightning_pulse import _lightning_compat as compat

    monitor, strategy = HyperConnectionMonitor(every_n_steps=1), HoldingStrategy()
    _measure_under_two_ranks(monitor, strategy)
    assert monitor.last["forward_gain"] > 1.5  # the 'reduced' figures were used: mHC's own gain is 1
    assert len(strategy.handed) == 2
    assert all(any(t is h for t in monitor._held.tensors) for h in strategy.handed)

    # teardown returns only once the backend has let go: here it lets go at the first yield of the wait
    yields = []

    def backend_releases_when_yielded_to(seconds: float) -> None:
        yields.append(seconds)
        strategy.release()

    monkeypatch.setattr(compat.time, "sleep", backend_releases_when_yielded_to)
    monitor.teardown(SimpleNamespace(), None, "fit")
    assert yields and monitor._held.tensors == []

    # a backend that never lets go: the wait is bounded and the tensors stay referenced
    monkeypatch.setattr(compat.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(compat.CollectiveHold, "timeout_s", 0.01)
    strategy = HoldingStrategy()
    _measure_under_two_ranks(monitor, strategy, step=1)
    monitor.teardown(SimpleNamespace(), None, "fit")
    assert len(monitor._held.tensors) == 2


class HistoryDump(HyperConnectionMonitor):
    """Writes each rank's measurement history to ``<directory>/rank<r>.json`` (spawned ranks import this)."""

    def __init__(self, directory: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.history))


@pytest.mark.ddp
def test_ranks_agree_on_the_reduced_figures_under_ddp(tmp_path):
    model, data = tiny_lm("hc")
    monitor = HistoryDump(str(tmp_path), every_n_steps=2)
    kwargs = trainer_kwargs(devices=2, strategy="ddp_spawn", limit_val_batches=0)
    pl.Trainer(callbacks=[monitor], max_steps=5, **kwargs).fit(model, data)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert [entry["step"] for entry in rank0] == [0, 2, 4]
    assert rank0 == rank1  # each rank saw different tokens; max/mean reduction makes the figures agree


# ---------------------------------------------------------------------------------------------- sweep A fixes
class TwoLayerNet(torch.nn.Module):
    def __init__(self, kind: str = "mhc", keyword: bool = False, gain: float | None = None) -> None:
        super().__init__()
        from lightning_pulse.nn import residual_connection

        self.layers = torch.nn.ModuleList(
            [
                residual_connection(
                    kind, torch.nn.Linear(16, 16), 16, 4, alpha_init=0.3 if gain is None else 0.0
                )
                for _ in range(2)
            ]
        )
        if gain is not None:  # HC layers with forward gain `gain` each
            with torch.no_grad():
                for layer in self.layers:
                    layer.b_res.copy_(gain * torch.eye(4))
        self.keyword = keyword

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lightning_pulse.nn import collapse_streams, expand_streams

        streams = expand_streams(x, 4)
        for layer in self.layers:
            streams = layer(streams=streams) if self.keyword else layer(streams)
        return collapse_streams(streams)


class TwoLayerModule(pl.LightningModule):
    def __init__(self, net: torch.nn.Module, forwards: int = 1, lr: float = 0.1) -> None:
        super().__init__()
        self.net, self.forwards, self.lr = net, forwards, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return sum((self.net(x * (i + 1)) - y).pow(2).mean() for i in range(self.forwards))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _fit_two_layer(module: pl.LightningModule, *monitors: HyperConnectionMonitor, steps: int = 6, **kwargs):
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 5, 16, generator=generator), torch.randn(48, 5, 16, generator=generator)
    )
    trainer = pl.Trainer(
        callbacks=list(monitors), max_steps=steps, **trainer_kwargs(limit_val_batches=0, **kwargs)
    )
    trainer.fit(module, DataLoader(data, batch_size=8))
    return trainer


def test_measures_every_n_steps_when_the_layers_run_inside_a_torch_compiled_module():
    # Hooks registered anew per measurement ran in the graph traced with the first one: only step 0 was
    # recorded.
    torch._dynamo.reset()
    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        net = TwoLayerNet("hc")
        monitor = HyperConnectionMonitor(every_n_steps=2)
        _fit_two_layer(TwoLayerModule(torch.compile(net, backend="aot_eager") if compiled else net), monitor)
        results[compiled] = monitor.history
        assert all(len(layer._forward_hooks) == 0 for layer in net.layers)  # the hooks leave with the fit
    assert [entry["step"] for entry in results[True]] == [0, 2, 4]
    for got, want in zip(results[True], results[False]):
        assert got["forward_gain"] == pytest.approx(want["forward_gain"], rel=1e-5)
        assert got["stream_rms"] == pytest.approx(want["stream_rms"], rel=1e-5)
    assert results[False][-1]["forward_gain"] != pytest.approx(results[False][0]["forward_gain"], rel=1e-3)


def test_a_compiled_model_is_measured_after_an_unmonitored_fit_in_the_same_process():
    # dynamo does not guard on hooks added after it traced a graph, and a fresh model of the same classes reuses
    # the graph of the unmonitored fit: the monitor recorded nothing and blamed the training_step
    torch._dynamo.reset()

    def fit(*monitors: HyperConnectionMonitor) -> None:
        torch.manual_seed(0)
        _fit_two_layer(TwoLayerModule(torch.compile(TwoLayerNet("mhc"), backend="eager")), *monitors)

    first, last = HyperConnectionMonitor(every_n_steps=2), HyperConnectionMonitor(every_n_steps=2)
    fit(first)
    fit()  # a baseline without the monitor
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "recorded nothing"
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        fit(last)
    assert [entry["step"] for entry in last.history] == [0, 2, 4]
    for got, want in zip(last.history, first.history):
        assert got["stream_rms"] == pytest.approx(want["stream_rms"], rel=1e-5)


def test_the_hooks_leave_the_model_when_the_training_loop_never_runs():
    # hooks are registered at fit start; Lightning skips on_train_end when the loop does not run
    net = TwoLayerNet("mhc")
    _fit_two_layer(TwoLayerModule(net), HyperConnectionMonitor(every_n_steps=2), steps=0)
    assert all(len(layer._forward_hooks) == 0 for layer in net.layers)


def test_measures_layers_called_with_their_streams_as_a_keyword():
    monitor = HyperConnectionMonitor(every_n_steps=2)
    _fit_two_layer(TwoLayerModule(TwoLayerNet("mhc", keyword=True)), monitor, steps=3)
    assert [(entry["step"], entry["layers"]) for entry in monitor.history] == [(0, 2), (2, 2)]


def test_a_training_step_that_runs_the_model_twice_is_scored_per_forward_pass_not_as_one_deeper_stack():
    monitor = HyperConnectionMonitor(every_n_steps=1)
    _fit_two_layer(TwoLayerModule(TwoLayerNet("hc", gain=1.5), forwards=2, lr=0.0), monitor, steps=1)
    assert monitor.last["forward_gain"] == pytest.approx(2.25)  # 1.5 ** 2, not 1.5 ** 4 over both passes
    assert monitor.last["layers"] == 2


def test_warns_once_when_a_measured_step_records_nothing():
    class SkipsTheLayers(TwoLayerModule):
        def training_step(self, batch, batch_idx):
            return sum(p.sum() for p in self.parameters()) * 0.0

    monitor = HyperConnectionMonitor(every_n_steps=1)
    with pytest.warns(UserWarning, match="HyperConnectionMonitor recorded nothing at step 0") as record:
        _fit_two_layer(SkipsTheLayers(TwoLayerNet()), monitor, steps=3)
    assert sum("recorded nothing" in str(w.message) for w in record) == 1 and monitor.history == []


def test_two_monitors_with_different_prefixes_coexist_and_each_restores_its_own_history(tmp_path):
    cheap, detailed = (
        HyperConnectionMonitor(2),
        HyperConnectionMonitor(3, per_layer=True, prefix="mhc_layers"),
    )
    assert cheap.state_key != detailed.state_key
    trainer = _fit_two_layer(TwoLayerModule(TwoLayerNet()), cheap, detailed, steps=4)
    trainer.save_checkpoint(tmp_path / "both.ckpt")
    assert [e["step"] for e in cheap.history] == [0, 2] and [e["step"] for e in detailed.history] == [0, 3]

    resumed = HyperConnectionMonitor(2), HyperConnectionMonitor(3, per_layer=True, prefix="mhc_layers")
    trainer = pl.Trainer(callbacks=list(resumed), max_steps=7, **trainer_kwargs(limit_val_batches=0))
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, 16, generator=generator), torch.randn(64, 5, 16))
    trainer.fit(
        TwoLayerModule(TwoLayerNet()), DataLoader(data, batch_size=8), ckpt_path=tmp_path / "both.ckpt"
    )
    assert [e["step"] for e in resumed[0].history] == [0, 2, 4, 6]
    assert [e["step"] for e in resumed[1].history] == [0, 3, 6]


def test_a_checkpoint_saved_under_the_old_class_name_key_still_restores_the_history(tmp_path):
    monitor = HyperConnectionMonitor(every_n_steps=2)
    trainer = _fit_two_layer(TwoLayerModule(TwoLayerNet()), monitor, steps=3)
    trainer.save_checkpoint(tmp_path / "new.ckpt")
    checkpoint = torch.load(tmp_path / "new.ckpt", weights_only=False)
    callbacks = checkpoint["callbacks"]
    callbacks["HyperConnectionMonitor"] = callbacks.pop(monitor.state_key)  # as written before the prefix key
    torch.save(checkpoint, tmp_path / "old.ckpt")

    resumed = HyperConnectionMonitor(every_n_steps=2)
    trainer = pl.Trainer(callbacks=[resumed], max_steps=5, **trainer_kwargs(limit_val_batches=0))
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, 16, generator=generator), torch.randn(64, 5, 16))
    trainer.fit(
        TwoLayerModule(TwoLayerNet()), DataLoader(data, batch_size=8), ckpt_path=tmp_path / "old.ckpt"
    )
    assert [e["step"] for e in resumed.history] == [0, 2, 4]
    assert resumed.history[:2] == monitor.history


# ---------------------------------------------------------------------------------------------- sweep D fixes
def test_a_measured_step_whose_streams_hold_a_nan_logs_nan_gains_not_a_healthy_looking_number():
    # Python's max(0.0, nan) is 0.0: one NaN feature made the step log forward/backward gain 0.0
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 5, 16, generator=generator), torch.randn(24, 5, 16, generator=generator)
    x[16 + 3, 2, 0] = torch.nan  # one position of the third (last) batch
    monitor = HyperConnectionMonitor(every_n_steps=1)
    trainer = pl.Trainer(callbacks=[monitor], max_steps=3, **trainer_kwargs(limit_val_batches=0))
    trainer.fit(
        TwoLayerModule(TwoLayerNet("mhc")), DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    )
    healthy, poisoned = monitor.history[:2], monitor.history[2]
    assert all(entry["forward_gain"] == pytest.approx(1.0, abs=1e-3) for entry in healthy)
    assert poisoned["step"] == 2
    assert math.isnan(poisoned["forward_gain"]) and math.isnan(poisoned["backward_gain"])
    assert math.isnan(poisoned["stream_rms"])


class HealthyOtherRankStrategy:
    """A two-rank strategy stand-in: the other rank measured the same figures without NaN, and max keeps a number
    over NaN, as gloo's max does in one rank order (seen with a real two-process gloo all_reduce)."""

    def reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        other_rank = tensor.nan_to_num(nan=1.0)
        return torch.fmax(tensor, other_rank) if reduce_op == "max" else (tensor + other_rank) / 2


def test_a_nan_on_one_rank_stays_nan_after_the_max_reduction_over_ranks():
    trainer = SimpleNamespace(
        strategy=HealthyOtherRankStrategy(), world_size=2, is_global_zero=True, loggers=[], global_step=0
    )
    net, monitor = TwoLayerNet("mhc"), HyperConnectionMonitor(every_n_steps=1)
    module = TwoLayerModule(net)
    x = torch.randn(2, 5, 16)
    x[1, 3, 0] = torch.nan
    monitor.on_train_batch_start(trainer, module, None, 0)
    net(x)
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    assert math.isnan(monitor.last["forward_gain"]) and math.isnan(monitor.last["backward_gain"])
    assert math.isnan(monitor.last["stream_rms"])
    monitor.teardown(SimpleNamespace(), None, "fit")


# ------------------------------------------------------------------------------------ held-out sweep s11
class LayerDropModule(TwoLayerModule):
    """Two mHC layers and a head; ``drops[step]`` lists the layers rank 1 skips at that step, as LayerDrop or
    stochastic depth with per-rank draws (or an early exit) does."""

    def __init__(self, drops: dict[int, set[int]]) -> None:
        super().__init__(TwoLayerNet("mhc"))
        self.head, self.drops = torch.nn.Linear(16, 16), drops

    def training_step(self, batch, batch_idx):
        from lightning_pulse.nn import collapse_streams, expand_streams

        x, y = batch
        skipped = self.drops.get(self.global_step, set()) if self.global_rank == 1 else set()
        streams = expand_streams(x, 4)
        for index, layer in enumerate(self.net.layers):
            if index not in skipped:
                streams = layer(streams)
        return (self.head(collapse_streams(streams)) - y).pow(2).mean()


class RankFigures(pl.Callback):
    """Writes this rank's own recorded figures (before any reduction) at each measured step, with its own
    recorder, to ``<directory>/local<r>.json``."""

    def __init__(self, directory: str, every_n_steps: int) -> None:
        self.directory, self.every_n_steps, self.figures = directory, every_n_steps, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_pulse.nn.diagnostics import HyperConnectionRecorder

        self.recorder = None
        if trainer.global_step % self.every_n_steps == 0:
            self.recorder = HyperConnectionRecorder(pl_module).attach()

    def on_before_backward(self, trainer, pl_module, loss):
        if self.recorder is not None:
            self.recorder.detach()
            names = {id(layer): name for name, layer in pl_module.named_modules()}
            stats = self.recorder.diagnostics()
            if stats is not None:
                stats["names"] = [names[id(layer)] for layer in dict.fromkeys(self.recorder.called)]
            self.figures[trainer.global_step] = stats

    def on_train_end(self, trainer, pl_module):
        Path(self.directory, f"local{trainer.global_rank}.json").write_text(json.dumps(self.figures))


@pytest.mark.ddp
def test_ranks_that_ran_different_layers_or_none_agree_on_figures_over_the_layers_each_ran(tmp_path):
    # A rank that ran fewer layers sent a shorter per-layer list to the reduction, and one that recorded
    # nothing skipped it: DDP hung at the first such step. The process group's timeout turns a hang into a
    # failure.
    from datetime import timedelta

    from tests.ddp_workers import TwoGlooProcesses

    torch.manual_seed(0)
    module = LayerDropModule({0: {0}, 2: {0, 1}})  # rank 1: layer 0 skipped at step 0, both at step 2
    monitor = HistoryDump(str(tmp_path), every_n_steps=2)
    strategy = TwoGlooProcesses(find_unused_parameters=True, timeout=timedelta(seconds=45))
    _fit_two_layer(module, monitor, RankFigures(str(tmp_path), 2), steps=5, devices=2, strategy=strategy)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    local0, local1 = (json.loads((tmp_path / f"local{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1 and [entry["step"] for entry in rank0] == [0, 2, 4]
    assert local1["2"] is None and local1["0"]["names"] == ["net.layers.1"]
    for entry in rank0:
        mine, other = local0[str(entry["step"])], local1[str(entry["step"])]
        others = dict(zip(other["names"], other["off_diagonal_mass"])) if other else {}
        # each layer's mass: the mean over the ranks that ran it; the gains: the max over those ranks
        masses = [
            (mass + others[name]) / 2 if name in others else mass
            for name, mass in zip(mine["names"], mine["off_diagonal_mass"])
        ]
        assert entry["layers"] == 2
        assert entry["off_diagonal_mass"] == sum(masses) / 2
        for key in ("forward_gain", "backward_gain", "stream_rms"):
            assert entry[key] == max(mine[key], other[key] if other else -math.inf)


class EmptyExpertNet(TwoLayerNet):
    """Two mHC layers, then, with ``empty_expert``, a third one called on zero positions (an MoE expert that
    got no tokens), whose output is not used."""

    def __init__(self, empty_expert: bool) -> None:
        super().__init__("mhc")
        from lightning_pulse.nn import ManifoldHyperConnection

        self.expert = ManifoldHyperConnection(torch.nn.Linear(16, 16), 16, 4) if empty_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.expert is not None:
            from lightning_pulse.nn import expand_streams

            self.expert(expand_streams(x, 4)[:0])
        return out


def test_a_layer_called_on_zero_positions_in_a_measured_step_adds_nothing_to_the_figures():
    # amax() of the empty call's gain raised and killed the fit; its off-diagonal mass would have been NaN
    histories = []
    for empty_expert in (False, True):
        torch.manual_seed(0)  # the expert is built last: the two layers start the same in both runs
        monitor = HyperConnectionMonitor(every_n_steps=2)
        _fit_two_layer(TwoLayerModule(EmptyExpertNet(empty_expert)), monitor, steps=4)
        histories.append(monitor.history)
    without, with_empty_call = histories
    assert [entry["step"] for entry in with_empty_call] == [0, 2]
    assert with_empty_call == without  # figures of the two layers that ran on positions, bit for bit
    assert all(entry["layers"] == 2 and math.isfinite(entry["off_diagonal_mass"]) for entry in without)


def test_a_teacher_deep_copied_in_a_measured_step_does_not_record_its_forwards():
    # a mean teacher made lazily in the first training_step (step 0 is measured): the copy carried the hooks
    # and a recorder stuck in recording mode, which kept every later teacher forward's H_res (24 after the fit)
    class LazyTeacher(TwoLayerModule):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__(net)
            self.teacher: list[torch.nn.Module] = []

        def training_step(self, batch, batch_idx):
            if not self.teacher:  # kept out of the module tree, as EMA teachers often are
                self.teacher.append(copy.deepcopy(self.net).requires_grad_(False))
            with torch.no_grad():
                self.teacher[0](batch[0])
            return super().training_step(batch, batch_idx)

    monitor = HyperConnectionMonitor(every_n_steps=4)
    module = LazyTeacher(TwoLayerNet())
    _fit_two_layer(module, monitor, steps=6)
    assert [entry["step"] for entry in monitor.history] == [0, 4] and monitor.last["layers"] == 2
    teacher = module.teacher[0]
    for _ in range(3):
        teacher(torch.randn(2, 5, 16))
    hooks = [hook for layer in teacher.layers for hook in layer._forward_hooks.values()]
    assert hooks, "the copy's hooks are expected to travel with it (idle), else this test checks nothing"
    assert all(not hook.__self__.recording and hook.__self__.h_res == [] for hook in hooks)
    assert all(hook.__self__.layers == [] for hook in hooks)  # not dragging other layers into the copy
