"""PulseCycle under DDP: two CPU processes over gloo switch phases at the same steps."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest

from lightning_pulse import PulseCycle
from tests.conftest import trainer_kwargs
from tests.ddp_workers import PhaseDump, RankSkewedClock


@pytest.mark.ddp
def test_ranks_switch_wall_clock_phases_at_the_same_step(mnist1d_small, tmp_path):
    model, data = mnist1d_small()
    cycle = PulseCycle(
        burst="5s",
        replay="3s",
        maintain="2s",
        warmup=0,
        anneal=0,
        probe_batches=1,
        time_source=RankSkewedClock(),
    )
    kwargs = trainer_kwargs(devices=2, strategy="ddp_spawn")
    trainer = pl.Trainer(callbacks=[cycle, PhaseDump(str(tmp_path))], max_steps=24, **kwargs)
    trainer.fit(model, data)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0 == rank1
    # rank 0's clock ticks 1 s per step, so its 5/3/2 s budgets are 5/3/2 steps for both ranks
    assert "".join(phase[0] for _, phase in rank0) == ("b" * 5 + "r" * 3 + "m" * 2) * 2 + "b" * 4
