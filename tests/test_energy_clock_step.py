"""EnergyLogger's power timeline across a step of the wall clock (an NTP correction, a resume from suspend, a
user setting the clock): its intervals follow the monotonic clock, its timestamps stay wall-clock."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback

from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule
from lightning_pulse import PulseCycle
from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.energy.config import MeterConfig
from tests.conftest import trainer_kwargs

J_PER_KWH = 3.6e6
CLOCK_STEP_S = 3600.0


class StepTheWallClock(Callback):
    """Moves the wall clock EnergyLogger reads by ``step`` seconds once ``at_step`` optimizer steps are
    done."""

    def __init__(self, shift: list[float], step: float, at_step: int) -> None:
        self.shift, self.step, self.at_step = shift, step, at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            self.shift[0] = self.step


@pytest.mark.parametrize("step", [CLOCK_STEP_S, -CLOCK_STEP_S], ids=["forward", "backward"])
def test_a_wall_clock_step_mid_fit_leaves_the_timeline_and_phase_bands_on_the_monotonic_clock(tmp_path, step):
    # thirty-ninth pass, left open: a step forward stretched the timeline over the hour jumped (its bins
    # nearly all empty), a step back emptied it (no bins: its last reading dated before its first)
    pl.seed_everything(0)
    shift = [0.0]
    energy = EnergyLogger(
        gpu="none",
        cpu="constant",
        ram="none",
        meters=MeterConfig(sampling_period=0.05, cpu_watts=100.0),
        report_dir=str(tmp_path),
    )
    energy.account.wall_clock = lambda: time.time() + shift[0]
    cycle = PulseCycle(burst=3, replay=2, maintain=1, warmup=0.0, anneal=0.0, maintain_eval="none")
    fit = pl.Trainer(
        callbacks=[cycle, energy, StepTheWallClock(shift, step, at_step=6)],
        max_steps=12,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **trainer_kwargs(),
    )
    wall_before, monotonic_before = time.time(), time.monotonic()
    fit.fit(MNIST1DClassifier(arch="mlp"), MNIST1DDataModule(num_samples=300, batch_size=20))
    fit_s = time.monotonic() - monotonic_before

    assert shift[0] == step and fit.global_step == 12
    report = energy.report
    timeline = report["timeline"]
    starts, ends = timeline["start_wall"], timeline["end_wall"]
    # every joule of the run is on the timeline, which spans the fit's own seconds, not the step's hour
    assert sum(timeline["cpu_j"]) == pytest.approx(
        report["total"]["energy_kwh_by_component"]["cpu"] * J_PER_KWH, rel=1e-6
    )
    assert len(starts) >= 1 and 0 < ends[-1] - starts[0] <= fit_s
    # dated on the wall clock as it read at the fit's start (before the step)
    assert wall_before <= starts[0] <= wall_before + fit_s
    # the phase bands, drawn over the timeline, are on the same clock: each within the fit, in order
    segments = report["phase_segments"]
    assert [s["phase"] for s in segments[:3]] == ["burst", "replay", "maintain"]
    bands = [(s["start_wall"], s["end_wall"] if s["end_wall"] is not None else ends[-1]) for s in segments]
    assert all(wall_before <= start <= end <= wall_before + fit_s for start, end in bands)
    assert all(earlier[1] <= later[0] for earlier, later in zip(bands, bands[1:]))
