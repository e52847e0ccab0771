"""ScheduledPrune(mode='structured') and the forward hooks a model's author registered: the fit-start trial
cut runs them (a held-out sweep found it ran a copy without them, so a pre-hook gating a layer's inputs with a
fixed width-48 tensor passed the check and the first event's cut broke the next forward mid-run). A hook that
breaks under the cut refuses the run at fit start, naming the hooked module and a checked ``exclude_pattern``;
a hook that follows the widths keeps working; hooks of callbacks stay out of the check's copy. Also: a layer
whose weight a parametrization computes is named when it keeps every channel group from being cut."""

from __future__ import annotations

import re
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import pruning, user_hooks
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

STEPS = 30


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(256, 16, generator=generator)
        labels = (inputs[:, :4].sum(dim=1) > 0).long() + (inputs[:, 4] > 0).long()
        return DataLoader(TensorDataset(inputs, labels), batch_size=32, shuffle=False)


class _CountedCalls:
    """A hook object holding what cannot be copied (a lock): the check's copies share it."""

    def __init__(self) -> None:
        self.lock, self.calls = threading.Lock(), 0

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        with self.lock:
            self.calls += 1


class _Mlp(pl.LightningModule):
    """Three Linear layers, 48 wide in the middle; ``hook`` registers the author's hooks on them."""

    def __init__(self, hook: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 3))
        gate = (torch.arange(48) % 4 != 0).float()  # a fixed gate over 48 features
        if hook == "gate before net.2":
            self.net[2].register_forward_pre_hook(lambda module, args: (args[0] * gate,))
        elif hook == "gate after net.0":
            self.net[0].register_forward_hook(lambda module, args, output: output * gate)
        elif hook == "width-agnostic":
            # a root pre-hook rewriting the inputs and a layer hook that reads the widths it gets
            self.register_forward_pre_hook(
                lambda module, args, kwargs: ((args[0] * 2.0,), kwargs), with_kwargs=True
            )
            self.net[2].register_forward_pre_hook(self.halve_the_negatives)
            self.net[0].register_forward_hook(_CountedCalls())

    def halve_the_negatives(self, module: nn.Module, args: tuple) -> tuple:
        # per element: whatever the width, a kept channel's value is what it was
        return (torch.where(args[0] < 0, 0.5 * args[0], args[0]),)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch, batch_index):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class _StepCounter(pl.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


def _prune(**kwargs) -> ScheduledPrune:
    settings = {"final_sparsity": 0.5, "mode": "structured", "start": 4, "end": 16, "every": 2}
    return ScheduledPrune(**{**settings, "probe_batches": 0, **kwargs})


def _fit(module: pl.LightningModule, prune: ScheduledPrune, *others: pl.Callback) -> _StepCounter:
    counter = _StepCounter()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[prune, *others, counter]))
    trainer.fit(module, _Data())
    return counter


def _widths(module: _Mlp) -> list[int]:
    return [layer.out_features for layer in module.net if isinstance(layer, nn.Linear)]


@pytest.mark.parametrize(
    ("hook", "hooked", "kind"),
    [("gate before net.2", "net.2", "forward pre-hook"), ("gate after net.0", "net.0", "forward hook")],
)
def test_a_user_hook_that_breaks_under_the_cut_refuses_the_run_at_fit_start_naming_it(hook, hooked, kind):
    module, prune = _Mlp(hook), _prune()
    counter = _StepCounter()
    # before: the trial cut ran without the hook and passed; the first event's cut broke the next forward
    # (RuntimeError: The size of tensor a (34) must match the size of tensor b (48))
    with pytest.raises(PulseRefusal) as refused:
        _fit(module, prune, counter)
    message = str(refused.value)
    assert f"the {kind} " in message and f"on `{hooked}`" in message and "in a hook you registered" in message
    assert "with `exclude_pattern`='^net\\\\.0$' the trial cut passes" in message
    assert counter.steps == 0 and not prune.events and _widths(module) == [48, 48, 3]


def test_the_exclude_pattern_the_refusal_offers_lets_the_run_cut_the_other_layers():
    module = _Mlp("gate before net.2")
    with pytest.raises(PulseRefusal) as refused:
        _fit(module, _prune())
    offered = re.search(r"`exclude_pattern`='([^']+)'", str(refused.value)).group(1).replace("\\\\", "\\")
    module, prune = _Mlp("gate before net.2"), _prune(exclude_pattern=offered)
    assert _fit(module, prune).steps == STEPS
    widths = _widths(module)
    assert widths[0] == 48 and widths[1] < 48 and widths[2] == 3  # net.0 (feeding the gate) is left whole
    assert prune.events and prune.events[-1]["sparsity"] > 0


def test_hooks_that_follow_the_widths_keep_working_and_the_model_is_cut():
    module, prune = _Mlp("width-agnostic"), _prune()
    assert _fit(module, prune).steps == STEPS
    assert _widths(module)[:2] == [24, 24] and prune.events
    (counter,) = [hook for hook in module.net[0]._forward_hooks.values() if isinstance(hook, _CountedCalls)]
    assert counter.calls >= STEPS
    # the hooks still run on the cut model
    seen = []
    module.net[2].register_forward_pre_hook(lambda layer, args: seen.append(args[0].shape[-1]))
    module(torch.randn(2, 16))
    assert seen == [24]


class _ActivationLog(pl.Callback):
    """Another callback's hook on the model, registered before ScheduledPrune checks it: it records only the
    trainer's module's activations, and must not run on (or be dragged into) the check's copy."""

    def __init__(self) -> None:
        self.calls, self.on_other_modules, self.module = 0, 0, None

    def setup(self, trainer, pl_module, stage) -> None:
        self.module = pl_module
        pl_module.net[2].register_forward_pre_hook(self.record)

    def record(self, layer: nn.Module, args: tuple) -> None:
        self.calls += 1
        self.on_other_modules += layer is not self.module.net[2]


def test_hooks_of_callbacks_stay_out_of_the_checks_copy():
    log = _ActivationLog()
    assert _fit(_Mlp(), _prune(), log).steps == STEPS
    assert log.calls >= STEPS and log.on_other_modules == 0


class _RecordsActivations(_Mlp):
    """Keeps an activation for its loss (an activation penalty) through a hook, as a bound method and as a
    closure over the module."""

    def __init__(self) -> None:
        super().__init__()
        self.acts: list[torch.Tensor] = []
        self.seen: list[tuple[int, ...]] = []
        self.net[1].register_forward_hook(self.record)
        self.net[3].register_forward_hook(lambda module, args, output: self.seen.append(tuple(output.shape)))

    def record(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.acts.append(output)

    def training_step(self, batch, batch_index):
        self.acts.clear()
        self.seen.clear()
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1]) + 1e-3 * self.acts[0].pow(2).mean()
        assert self.seen == [(32, 48)] or self.seen == [(32, self.net[2].out_features)]  # the batch's own
        return loss


def test_a_model_that_records_activations_for_its_loss_trains_and_its_list_is_untouched():
    """A review: the check's copies ran the model's hooks and wrote into the real module's lists (the first
    step's loss read an activation of the check), and a kept activation with its graph made the next copy
    fail ("Only Tensors created explicitly by the user ... support the deepcopy protocol"): a healthy model
    was refused."""
    module = _RecordsActivations()
    module.acts.append(torch.ones(1, requires_grad=True) * 2)  # an activation with its graph, at fit start
    prune = _prune()
    assert _fit(module, prune).steps == STEPS
    assert prune.events and _widths(module)[:2] == [24, 24]


def test_which_hooks_count_as_the_users():
    module = _Mlp()
    assert user_hooks.is_user_hook(lambda *args: None)
    log = _ActivationLog()

    def counting(module, args, output):  # a hook a callback defines inside its own method
        log.calls += 1

    assert not user_hooks.is_user_hook(counting)
    assert user_hooks.is_user_hook(module.halve_the_negatives)  # a method of the model itself
    assert not user_hooks.is_user_hook(_ActivationLog().record)  # a Lightning callback's, whoever wrote it
    assert not user_hooks.is_user_hook(pruning.Pruner("structured").prune)  # this library's
    module.net[2].register_forward_pre_hook(module.halve_the_negatives)
    copied = pruning.copy_without_hooks(module, keep_user_hooks=True)
    (hook,) = copied.net[2]._forward_pre_hooks.values()
    assert hook.__self__ is copied  # bound to the copy, which it reads
    assert not pruning.copy_without_hooks(module).net[2]._forward_pre_hooks


class _LowRank(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        u, s, v = torch.linalg.svd(weight, full_matrices=False)
        return u[:, : self.rank] @ torch.diag(s[: self.rank]) @ v[: self.rank]


def test_a_parametrized_layer_that_keeps_every_group_from_being_cut_is_named():
    module = _Mlp()
    parametrize.register_parametrization(module.net[2], "weight", _LowRank(8))
    # before: only "no channel group of the selected layers can be cut safely", not which layer blocks them
    with pytest.raises(
        PulseRefusal,
        match=r"can be cut safely: net\.2 is left out \(the weight is computed by a "
        r"parametrization.*remove_parametrizations",
    ):
        _fit(module, _prune())


class _KeepsCounts(_Mlp):
    """A forward hook counting its calls in a buffer (as a hook-kept running statistic is) and in a number."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("hook_calls", torch.zeros((), dtype=torch.long))
        self.calls = 0
        self.net[1].register_forward_hook(self._count)

    def _count(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.hook_calls += 1
        self.calls += 1


def test_the_events_and_the_replays_traces_leave_what_the_users_hooks_keep_as_it_was(tmp_path):
    """A held-out sweep: each event's trace of the live model ran the author's hooks and kept what they wrote
    (21 calls counted for 16 steps, one more per event), while the fit-start check gave it back; the replay of
    a checkpoint's cuts traces the module it loads into as well."""
    module, prune = _KeepsCounts(), _prune()
    counter = _StepCounter()
    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=STEPS, callbacks=[prune, counter], default_root_dir=tmp_path)
    )
    trainer.fit(module, _Data())
    assert len(prune.events) >= 3 and _widths(module)[:2] == [24, 24]
    assert module.calls == int(module.hook_calls) == counter.steps == STEPS
    trainer.save_checkpoint(tmp_path / "cut.ckpt")
    fresh = pruning.load_pruned(_KeepsCounts(), tmp_path / "cut.ckpt")
    assert _widths(fresh) == _widths(module) and fresh.calls == 0
