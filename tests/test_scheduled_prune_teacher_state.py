"""ScheduledPrune(distill=...) keeps its distillation teacher in a checkpoint as tensors, not pickled.

A held-out sweep found the teacher stored as ``torch.save(whole LightningModule)`` bytes inside the callback
state: a module with a lambda attribute crashed the fit at the first checkpoint inside a window (step 15/48),
the nested bytes were unpickled with ``weights_only=False`` past the user's ``weights_only=True`` (a payload
ran), and a checkpoint saved from ``__main__`` did not resume from another script. ``load_pruned`` read every
file with ``weights_only=False`` too.
"""

from __future__ import annotations

import io
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.callbacks.scheduled_prune import DistillConfig
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs


def _data(samples: int = 128, batch_size: int = 16) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 3, 8, 8, generator=generator)
    y = x.mean(dim=(2, 3)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _fit(
    module, prune: ScheduledPrune, steps: int, root, ckpt_path=None, data=None, precision=None, **kwargs
):
    checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(
        max_steps=steps,
        precision=precision,
        callbacks=[prune, checkpoints],
        default_root_dir=root,
        **trainer_kwargs(enable_checkpointing=True),
    )
    trainer.fit(module, data or _data(), ckpt_path=ckpt_path, **kwargs)
    return trainer


def _in_window(root, steps: int) -> str:
    """The first checkpoint saved inside a distillation window whose event cut or masked since."""
    for step in range(1, steps + 1):
        path = os.path.join(root, f"step={step}.ckpt")
        if os.path.exists(path) and torch.load(path, weights_only=True)["callbacks"]["ScheduledPrune"].get(
            "teacher"
        ):
            return path
    raise AssertionError("no checkpoint inside a distillation window")


def _only_plain_values(value) -> bool:
    if isinstance(value, dict):
        return all(_only_plain_values(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(_only_plain_values(item) for item in value)
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def test_a_module_pickle_cannot_take_checkpoints_inside_a_window_and_resumes_like_the_uninterrupted_run(
    tmp_path,
):
    class LocalNet(pl.LightningModule):  # a local class and a lambda: neither pickles
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(192, 32), nn.ReLU(), nn.Linear(32, 3))
            self.post = lambda logits: logits

        def forward(self, x):
            return self.post(self.net(x))

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    def prune():
        return ScheduledPrune(
            final_sparsity=0.5, start=4, end=16, every=4, probe_batches=0, distill=DistillConfig(steps=3)
        )

    full_prune, steps = prune(), 20
    full = LocalNet()
    _fit(full, full_prune, steps, tmp_path / "full")  # crashed at step 5: "Can't pickle local object"

    path = _in_window(tmp_path / "full", steps)
    teacher = torch.load(path, weights_only=True)["callbacks"]["ScheduledPrune"]["teacher"]
    assert "module" not in teacher and _only_plain_values(teacher)
    assert set(teacher["teacher_state"]) >= {"net.1.weight", "net.3.weight"}

    resumed_prune, resumed = prune(), LocalNet()
    _fit(resumed, resumed_prune, steps, tmp_path / "resumed", ckpt_path=path, weights_only=True)
    assert [event["step"] for event in resumed_prune.events] == [event["step"] for event in full_prune.events]
    assert [e["distill_calls"] for e in resumed_prune.events] == [
        e["distill_calls"] for e in full_prune.events
    ]
    for (name, value), other in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(value, other, atol=1e-6), name


class _DepthwiseNet(pl.LightningModule):
    """A depthwise convolution: its widths live in ``groups`` too, which its shapes alone do not tell."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 3),
        )
        self.example_input_array = torch.randn(2, 3, 8, 8)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("precision", [None, "bf16-true"])
def test_a_structured_teacher_resumes_with_its_pre_event_widths_and_matches_the_uninterrupted_run(
    tmp_path, precision
):
    """Under ``bf16-true`` (a review): the teacher, rebuilt in a copy of the model as Lightning restores it,
    kept float32 weights while the model's became bfloat16, and the first step crashed."""

    def prune():
        return ScheduledPrune(
            final_sparsity=0.5,
            mode="structured",
            start=3,
            end=12,
            every=3,
            probe_batches=0,
            distill=DistillConfig(steps=2),
        )

    full_prune, steps, data = prune(), 14, _data(160, 32)  # 5 batches an epoch: resumed at an epoch's end
    full = _DepthwiseNet()
    _fit(full, full_prune, steps, tmp_path / "full", data=data, precision=precision)
    # events at steps 6, 9 and 12; step 10 is inside the window of the second: its teacher is cut once
    path = str(tmp_path / "full" / "step=10.ckpt")
    checkpoint = torch.load(path, weights_only=True)
    teacher = checkpoint["callbacks"]["ScheduledPrune"]["teacher"]["teacher_state"]
    assert checkpoint["callbacks"]["ScheduledPrune"]["teacher"]["event_step"] == 9
    assert 16 > teacher["net.3.weight"].shape[0] > checkpoint["state_dict"]["net.3.weight"].shape[0]

    resumed_prune, resumed = prune(), _DepthwiseNet()
    _fit(resumed, resumed_prune, steps, tmp_path / "resumed", ckpt_path=path, data=data, precision=precision)
    assert [e["distill_calls"] for e in resumed_prune.events] == [
        e["distill_calls"] for e in full_prune.events
    ]
    assert resumed.state_dict().keys() == full.state_dict().keys()
    for (name, value), other in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert value.shape == other.shape and torch.allclose(value.float(), other.float(), atol=1e-6), name


class _Payload:
    """What a shared checkpoint could hold: unpickling it makes a folder."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker, 0o755, True))


class _Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(192, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _distilled(tmp_path) -> str:
    prune = ScheduledPrune(
        final_sparsity=0.5, start=2, end=8, every=2, probe_batches=0, distill=DistillConfig()
    )
    _fit(_Mlp(), prune, 6, tmp_path / "run")
    return _in_window(tmp_path / "run", 6)


def test_a_pickled_teacher_is_never_unpickled_and_the_resume_is_refused_naming_the_way_out(tmp_path):
    path = _distilled(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    marker = str(tmp_path / "payload_ran")
    buffer = io.BytesIO()
    torch.save(_Payload(marker), buffer)
    teacher = checkpoint["callbacks"]["ScheduledPrune"]["teacher"]
    del teacher["teacher_state"]
    teacher["module"] = buffer.getvalue()  # as earlier versions stored it: opaque to torch's safe loader
    torch.save(checkpoint, path)
    torch.load(path, weights_only=True)  # the file passes torch's safe loader

    prune = ScheduledPrune(
        final_sparsity=0.5, start=2, end=8, every=2, probe_batches=0, distill=DistillConfig()
    )
    with pytest.raises(
        PulseRefusal, match=r"ScheduledPrune: .*pickled module.*Resume from a checkpoint saved"
    ):
        _fit(_Mlp(), prune, 8, tmp_path / "resumed", ckpt_path=path, weights_only=True)
    assert not os.path.exists(marker)  # it ran before the refusal came


def test_load_pruned_reads_a_file_with_torchs_safe_loader(tmp_path):
    path = _distilled(tmp_path)
    ScheduledPrune.load_pruned(_Mlp(), path)  # a lightning-pulse checkpoint passes it
    checkpoint = torch.load(path, weights_only=True)
    marker = str(tmp_path / "payload_ran")
    checkpoint["note"] = _Payload(marker)
    torch.save(checkpoint, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        ScheduledPrune.load_pruned(_Mlp(), path)
    assert not os.path.exists(marker)


class _NonFiniteAt(_DepthwiseNet):
    """Returns a NaN loss at steps 20-22: StabilityGuard rolls back, past the last window's end."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in (20, 21, 22) else loss


def test_a_guard_rollback_into_a_window_since_closed_takes_its_teacher_back(tmp_path):
    """A review: the teacher rebuilt from the cut student (a depthwise convolution's widths are not in its
    shapes) refused the run mid-training at the rollback; the last window's teacher is kept until the next."""
    from lightning_pulse import PulseCycle, StabilityGuard

    pl.seed_everything(0)
    guard = StabilityGuard(
        warmup=5, window=10, snapshot_every=4, rollback_after=3, rollback_margin=2, skip_after_rollback=1
    )
    prune = ScheduledPrune(
        final_sparsity=0.5, mode="structured", start=5, end=17, probe_batches=0, distill=DistillConfig()
    )
    cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0, anneal=0, probe_batches=1)
    trainer = pl.Trainer(
        max_steps=30, callbacks=[cycle, guard, prune], **trainer_kwargs(default_root_dir=tmp_path)
    )
    trainer.fit(_NonFiniteAt(), _data(512, 32))
    assert trainer.global_step == 30
    rollbacks = [event for event in guard.events if event["event"] == "rollback"]
    assert rollbacks and all(prune.events[-1]["step"] <= event["to_step"] for event in rollbacks)
