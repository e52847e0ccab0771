"""StabilityGuard resumed with another ``StabilityGuardConfig(loss_scale=...)`` or ``per_phase_baselines``.

The restored loss baselines held values on the checkpoint's scale, and the guard judged the new scale's
losses against them: "log" to "linear" flagged every step of a healthy run, rolled it back and stopped it
with ``StabilityGuardError`` blaming the checkpoint; "linear" to "log" was blind for a window. Baselines saved
per phase were ignored by a fit without them (another key), which warmed up again without a word. The
detector now saves its scale and key, converts what it restores, and the guard says so once.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_pulse import StabilityGuard
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from tests.conftest import trainer_kwargs

MAX_STEPS = 40
SAVED_AT = 20
SPIKE_AT = SAVED_AT + 2  # a loss 3x the plateau, gradients unchanged: a loss spike on either scale


class _Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        return loss + 2 * loss.detach() if self.trainer.global_step == SPIKE_AT else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader() -> torch.utils.data.DataLoader:
    """Random labels: a loss on a plateau near log(4), with the noise of 4 batches an epoch (in order, so
    the checkpoint at SAVED_AT, an epoch's end, resumes the same data)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _fit(
    config: StabilityGuardConfig, root: Path, resume_from: Path | None = None
) -> tuple[StabilityGuard, list[str]]:
    """The guard after a fit to MAX_STEPS (checkpoints at SAVED_AT under ``root``), and its warnings."""
    pl.seed_everything(0)
    guard = StabilityGuard(
        window=30,  # the windows at the end still hold 10 restored values
        warmup=5,
        snapshot_every=5,
        rollback_margin=2,
        skip_after_rollback=2,
        rollback_after=2,
        max_rollbacks=2,
        config=config,
    )
    callbacks: list[Callback] = [guard]
    callbacks.append(
        ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=SAVED_AT, save_top_k=-1)
    )
    trainer = pl.Trainer(
        max_steps=MAX_STEPS,
        callbacks=callbacks,
        default_root_dir=root,
        **trainer_kwargs(enable_checkpointing=True),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Classifier(), _loader(), ckpt_path=resume_from)
    assert trainer.global_step == MAX_STEPS
    return guard, [str(w.message) for w in caught if str(w.message).startswith("StabilityGuard:")]


def _windows(guard: StabilityGuard) -> dict:
    state = guard.detector.state_dict()
    return {name: state[name] for name in ("loss", "grad_norm")}


@pytest.mark.parametrize(("saved", "resumed"), [("log", "linear"), ("linear", "log"), ("log", "log")])
def test_a_run_resumed_on_another_loss_scale_judges_as_a_run_on_that_scale_throughout(
    tmp_path, saved, resumed
):
    whole, whole_warnings = _fit(StabilityGuardConfig(loss_scale=resumed), tmp_path / "whole")
    _fit(StabilityGuardConfig(loss_scale=saved), tmp_path / "saved")
    guard, said = _fit(
        StabilityGuardConfig(loss_scale=resumed),
        tmp_path / "resumed",
        tmp_path / "saved" / f"step={SAVED_AT}.ckpt",
    )
    assert not whole_warnings
    # the spike right after the resume is flagged and skipped as in the uninterrupted run, and nothing else:
    # "log" -> "linear" flagged every step, rolled back and stopped, blaming the checkpoint; "linear" ->
    # "log" judged log(loss) against linear baselines and let the spike pass
    assert whole.spikes_detected == 1 and whole.steps_skipped == 1 and whole.rollbacks == 0
    assert guard.metrics() == whole.metrics()
    # the windows hold what the uninterrupted run on the new scale holds (exp(log(x)) to rounding)
    ended, expected = _windows(guard), _windows(whole)
    assert ended.keys() == expected.keys()
    for name in ended:
        assert ended[name].keys() == expected[name].keys()
        for key, window in ended[name].items():
            assert window["stamps"] == expected[name][key]["stamps"], (name, key)
            assert window["values"] == pytest.approx(expected[name][key]["values"], rel=1e-12, abs=1e-12)
    if saved == resumed:  # a plain resume: the same windows, bit for bit, and nothing said
        assert ended == expected and not said
        return
    assert len(said) == 1
    assert f"`config.loss_scale`={resumed!r} differs from the checkpoint's {saved!r}" in said[0]
    assert f"converted to {resumed!r}" in said[0]
    assert f"`config=StabilityGuardConfig(loss_scale={saved!r})`" in said[0]


@pytest.mark.parametrize(("saved", "resumed"), [(True, False), (False, True)])
def test_a_run_resumed_with_per_phase_baselines_changed_keeps_its_baselines(tmp_path, saved, resumed):
    """Without a PulseCycle the key is "burst" with per-phase baselines and "all" without: the restored
    window used to sit under the other key, unused, while a new one warmed up (judging only 10x spikes)."""
    whole, _ = _fit(StabilityGuardConfig(per_phase_baselines=resumed), tmp_path / "whole")
    _fit(StabilityGuardConfig(per_phase_baselines=saved), tmp_path / "saved")
    guard, said = _fit(
        StabilityGuardConfig(per_phase_baselines=resumed),
        tmp_path / "resumed",
        tmp_path / "saved" / f"step={SAVED_AT}.ckpt",
    )
    # the spike two steps in is flagged as in the uninterrupted run: a new window, warming up, let it pass
    assert whole.spikes_detected == 1 and guard.metrics() == whole.metrics()
    # the new key's window holds every step's values, as if it had been used throughout
    assert _windows(guard) == _windows(whole)
    assert len(said) == 1
    assert f"`config.per_phase_baselines`={resumed} differs from the checkpoint's {saved}" in said[0]
    assert "judges from the first step" in said[0]
    assert f"`config=StabilityGuardConfig(per_phase_baselines={saved})`" in said[0]
