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

from lightning_pulse import PulseCycle, StabilityGuard
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from tests.conftest import trainer_kwargs
from tests.test_stability_guard_mid_incident_resume import MAX_STEPS as INCIDENT_STEPS
from tests.test_stability_guard_mid_incident_resume import _GoesBad, _Regressor
from tests.test_stability_guard_mid_incident_resume import _loader as _incident_loader

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
    config: StabilityGuardConfig, root: Path, resume_from: Path | None = None, cycle: bool = False
) -> tuple[StabilityGuard, list[str]]:
    """The guard after a fit to MAX_STEPS (checkpoints at SAVED_AT under ``root``, an epoch's end), next
    to a PulseCycle if ``cycle``, and its warnings."""
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
    if cycle:  # phases of 8, 4 and 2 steps: the checkpoint at SAVED_AT holds a window for each
        callbacks.append(PulseCycle(burst=8, replay=4, maintain=2, warmup=0, anneal=0, maintain_eval="none"))
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


@pytest.mark.parametrize(
    ("saved", "resumed", "cycle"), [(True, False, False), (False, True, False), (True, False, True)]
)
def test_a_run_resumed_with_per_phase_baselines_changed_keeps_its_baselines(tmp_path, saved, resumed, cycle):
    """Without a PulseCycle the key is "burst" with per-phase baselines and "all" without: the restored
    window used to sit under the other key, unused, while a new one warmed up (judging only 10x spikes).
    With one, the phases' windows given up for "all" leave it the pooled window of every phase."""
    whole, _ = _fit(StabilityGuardConfig(per_phase_baselines=resumed), tmp_path / "whole", cycle=cycle)
    saved_guard, _ = _fit(StabilityGuardConfig(per_phase_baselines=saved), tmp_path / "saved", cycle=cycle)
    guard, said = _fit(
        StabilityGuardConfig(per_phase_baselines=resumed),
        tmp_path / "resumed",
        tmp_path / "saved" / f"step={SAVED_AT}.ckpt",
        cycle=cycle,
    )
    if cycle:  # the checkpoint's windows of the replay and maintain phases are merged, not lost
        assert {"replay", "maintain"} <= saved_guard.detector.state_dict()["loss"].keys()
    # the spike two steps in is flagged as in the uninterrupted run: a new window, warming up, let it pass
    assert whole.spikes_detected == 1 and guard.metrics() == whole.metrics()
    # the new key's window holds every step's values, as if it had been used throughout
    assert _windows(guard) == _windows(whole)
    assert len(said) == 1
    assert f"`config.per_phase_baselines`={resumed} differs from the checkpoint's {saved}" in said[0]
    assert "judges from the first step" in said[0]
    # a run without a PulseCycle had no pulse phases to merge: the message says it merged them only if one ran
    merged = "its pulse phases' baselines merged, where its run had a PulseCycle"
    assert (merged in said[0]) == (not resumed)
    assert f"`config=StabilityGuardConfig(per_phase_baselines={saved})`" in said[0]


class _LossWindows(Callback):
    """The guard's loss windows after each step (after the guard's batch end: after a rollback)."""

    def __init__(self) -> None:
        self.after: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        guard = next(callback for callback in trainer.callbacks if isinstance(callback, StabilityGuard))
        self.after[trainer.global_step] = guard.detector.state_dict()["loss"]


def _mid_incident_fit(
    loss_scale: str, root: Path, resume_from: Path | None = None
) -> tuple[StabilityGuard, _LossWindows]:
    """The mid-incident test's fit (the model goes bad after step 13, rolled back 15 -> 10) on
    ``loss_scale``, a checkpoint every step under ``root`` unless it resumes."""
    pl.seed_everything(0)
    guard = StabilityGuard(
        window=10,
        warmup=5,
        snapshot_every=5,
        rollback_margin=2,
        skip_after_rollback=2,
        config=StabilityGuardConfig(loss_scale=loss_scale),
    )
    windows = _LossWindows()
    callbacks: list[Callback] = [guard, _GoesBad(), windows]
    if resume_from is None:
        callbacks.append(
            ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    trainer = pl.Trainer(
        max_steps=INCIDENT_STEPS,
        callbacks=callbacks,
        default_root_dir=root,
        **trainer_kwargs(enable_checkpointing=resume_from is None),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the conversion is said: tested above
        trainer.fit(_Regressor(), _incident_loader(), ckpt_path=resume_from)
    return guard, windows


def test_a_rollback_after_a_resume_on_another_loss_scale_converts_the_snapshot_it_restores(tmp_path):
    """A checkpoint saved mid-incident on "log" carries the snapshots a rollback returns to, each with the
    detector's windows on "log". Resumed on "linear", the rollback restored them as they were: log values in a
    linear detector (off by about 1.1 from the uninterrupted linear run's), blind until they turned over."""
    whole, whole_windows = _mid_incident_fit("linear", tmp_path / "whole")
    _mid_incident_fit("log", tmp_path / "saved")
    for resume_at in (14, 15):  # the rollback comes in the resumed fit's second step, or its first
        checkpoint = tmp_path / "saved" / f"step={resume_at}.ckpt"
        guard, windows = _mid_incident_fit("linear", tmp_path / f"resumed{resume_at}", checkpoint)
        assert [(e["step"], e["to_step"]) for e in guard.events if e["event"] == "rollback"] == [(15, 10)]
        assert guard.metrics() == whole.metrics()
        # after every step, the rollback's first, the windows hold what the uninterrupted linear run's hold
        assert min(windows.after) == resume_at + 1 and 16 in windows.after
        for step, ended in windows.after.items():
            expected = whole_windows.after[step]
            assert ended.keys() == expected.keys(), (resume_at, step)
            for key, window in ended.items():
                assert window["stamps"] == expected[key]["stamps"], (resume_at, step, key)
                assert window["values"] == pytest.approx(expected[key]["values"], rel=1e-12, abs=1e-12), (
                    resume_at,
                    step,
                    key,
                )
