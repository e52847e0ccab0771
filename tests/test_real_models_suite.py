"""The full suite as shipped (``examples/mnist1d/pulse.yaml``'s callbacks) on every client model.

Each client either trains with the suite, healthy (no rollback or skip on a healthy run, energy reported per
phase), or is refused before its first step with a PulseRefusal that names the callback.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml

from benchmarks.harness import instantiate_callbacks
from lightning_pulse import PulseCycle, PulseRefusal, StabilityGuard
from tests.clients import CLIENTS
from tests.conftest import trainer_kwargs

pytest.importorskip("transformers")

SUITE = Path(__file__).resolve().parents[1] / "examples" / "mnist1d" / "pulse.yaml"
REFUSED = {
    # its custom batch sampler hides the dataset indices the replay scores are keyed by
    "stateful-lstm": "HardSampleReplay",
    # both read gradients in on_before_optimizer_step of Lightning's own optimization loop
    "manual-optimization": "GradientCache",
}


def _suite():
    specs = yaml.safe_load(SUITE.read_text())["trainer"]["callbacks"]
    for spec in specs:
        if spec["class_path"].endswith("PulseCycle"):  # the shipped rhythm, scaled to a 150-step run
            spec["init_args"].update(burst=30, replay=30, maintain=4)
    return instantiate_callbacks(specs)


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_the_shipped_suite_trains_each_client_or_refuses_it_before_the_first_step(name, tmp_path):
    pl.seed_everything(0, verbose=False)
    module, data = CLIENTS[name]()
    callbacks = _suite()
    # max_epochs too: bounded by max_steps alone, a schedule built from estimated_stepping_batches is refused
    # (tests/test_step_saving_replay.py::test_a_run_bounded_by_max_steps_alone_is_refused_when_its_lr_schedule_read_the_unplanned_length)
    trainer = pl.Trainer(
        max_epochs=100,
        max_steps=150,
        limit_val_batches=2,
        callbacks=callbacks,
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    if name in REFUSED:
        with pytest.raises(PulseRefusal, match=f"^{REFUSED[name]}"):
            trainer.fit(module, data)
        assert trainer.global_step == 0
        return
    trainer.fit(module, data)
    # the shipped HardSampleReplay saves steps: the 150 plain steps' data in the planned, fewer steps
    assert trainer.global_step == trainer.max_steps < 150
    for config in trainer.lr_scheduler_configs:  # a schedule planned for the run ends with it
        assert getattr(config.scheduler, "total_steps", trainer.max_steps) == trainer.max_steps
    cycle = next(c for c in callbacks if isinstance(c, PulseCycle))
    assert cycle.clock.steps_by_phase["replay"] > 0
    guard = next(c for c in callbacks if isinstance(c, StabilityGuard))
    # a healthy run: the switch into a replay phase (harder samples, higher loss) is not a spike
    assert guard.rollbacks == 0 and guard.steps_skipped == 0, guard.events
    assert list(tmp_path.rglob("energy_report.json"))
