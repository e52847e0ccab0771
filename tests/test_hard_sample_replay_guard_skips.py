"""HardSampleReplay next to StabilityGuard: a step whose update the guard drops is not scored, and a sample
whose loss is not finite is held out of the selection instead of counting as never scored (which always
trains).

A real fit: an autoencoder on 640 sklearn digits, two of them corrupted (x50, or a NaN pixel). Every batch
holding one spikes and the guard skips it. Before the fix the skipped steps' losses became the two samples'
scores (about 80 against a median of 0.02), so top-k put them into every replay window that held them and the
guard skipped a replay step in five; their NaN scores, in the NaN variant, read as never scored and were
always kept.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from lightning_pulse import HardSampleReplay, PulseCycle, StabilityGuard
from lightning_pulse.core.replay import UNTOUCHED, HardSampleSelector, ReplayConfig
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.core.selection import select_topk
from tests.conftest import trainer_kwargs

BAD = (5, 300)


def _digits(nan: bool) -> torch.Tensor:
    x = torch.tensor(load_digits().data[:640], dtype=torch.float32) / 16.0
    if nan:
        x[list(BAD), 3] = math.nan
    else:
        x[list(BAD)] *= 50
    return x


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i


class _AutoEncoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64))
        self.seen: list[tuple[str, bool]] = []  # (phase, the batch holds a corrupted sample)

    def training_step(self, batch, batch_idx):
        cycle = next(c for c in self.trainer.callbacks if isinstance(c, PulseCycle))
        self.seen.append((str(cycle.phase), any(int(i) in BAD for i in batch[1])))
        return F.mse_loss(self.net(batch[0]), batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2e-3)


def _fit(nan: bool, accumulate: int = 1, guard: bool = True):
    torch.manual_seed(0)
    model, replay = _AutoEncoder(), HardSampleReplay(rule="topk")
    callbacks = [PulseCycle(burst=10, replay=15, maintain=0, warmup=0, anneal=0), replay]
    stability = StabilityGuard(warmup=10, window=40) if guard else None
    callbacks += [stability] if guard else []
    kwargs = trainer_kwargs(
        max_steps=100 // accumulate, callbacks=callbacks, accumulate_grad_batches=accumulate
    )
    trainer = pl.Trainer(**kwargs)
    loader = torch.utils.data.DataLoader(_Indexed(_digits(nan)), batch_size=32, shuffle=True, drop_last=True)
    trainer.fit(model, loader)
    return model, replay, stability


@pytest.mark.parametrize("nan", [False, True], ids=["spike", "nan"])
def test_samples_of_steps_the_guard_skips_are_held_out_not_replayed(nan):
    model, replay, guard = _fit(nan)
    assert guard.steps_skipped > 0  # the corrupted samples' batches were skipped in the burst phases
    replayed = [bad for phase, bad in model.seen if phase == "replay"]
    assert len(replayed) > 30
    # before the fix: the corrupted samples ranked hardest (or, NaN, unscored) and trained in every window
    assert sum(replayed) == 0
    scores = replay.table.scores
    assert all(np.isneginf(scores[i]) for i in BAD)  # held out, not scored from the skipped steps
    assert np.isfinite(np.delete(scores, list(BAD))).sum() > 500  # the others scored as before
    assert replay.metrics()["table_held_out"] >= len(BAD)


def test_under_accumulation_a_window_the_guard_skips_is_held_out_whole():
    model, replay, guard = _fit(nan=False, accumulate=2)
    assert guard.steps_skipped > 0
    assert sum(bad for phase, bad in model.seen if phase == "replay") == 0
    assert all(np.isneginf(replay.table.scores[i]) for i in BAD)
    assert replay.selector._unsettled <= 1  # only a window still open at the fit's end may wait


def _selector(n: int = 8) -> HardSampleSelector:
    return HardSampleSelector(SampleScoreTable(n), ReplayConfig("topk", 0.5, 0.5, 0))


def _record(selector, indices, losses, step, **kwargs):
    roles = np.full(len(indices), UNTOUCHED)
    return selector.record(
        torch.tensor(indices), torch.tensor(losses), roles, step, False, len(indices), **kwargs
    )


def test_a_non_finite_loss_holds_the_sample_out_of_top_k_and_an_unsplit_step_holds_none():
    selector = _selector()
    _record(selector, [0, 1, 2, 3], [1.0, math.nan, 2.0, math.inf], step=0)
    _record(selector, [4, 5], [math.nan, math.nan], step=1, scored=False)  # a loss that did not split
    selector.apply()
    scores = selector.table.effective_array(np.arange(6), 2)
    assert np.isneginf(scores[[1, 3]]).all() and np.isnan(scores[[4, 5]]).all()
    assert selector.table.held_out == 2
    # top-k of four among 0..3 takes the finite ones first; the held-out ones only fill what is left
    assert select_topk(scores[:4], 2).positions.tolist() == [0, 2]
    assert math.isfinite(selector.table.quantile_score(0.5, 2)) and math.isfinite(
        selector.table.mean_score(2)
    )
    _record(selector, [1], [0.5], step=3)  # measured finite again: the hold ends
    selector.apply()
    assert selector.table.scores[1] == 0.5 and selector.table.held_out == 1


def test_a_hold_ends_after_a_half_life():
    table = SampleScoreTable(3, half_life=10)
    table.update(np.array([0, 1]), np.array([1.0, 2.0]), step=0)
    table.hold_out(np.array([1]), 0)
    assert np.isneginf(table.effective_array(np.array([1]), 9)).all()
    assert np.isnan(table.effective_array(np.array([1]), 10)).all()  # read as never scored: trains once more


def test_an_accumulation_window_waits_for_its_verdict_and_is_saved():
    selector = _selector()
    _record(selector, [0, 1], [1.0, 2.0], step=0, undone=None)  # micro-batches of one window
    _record(selector, [2, 3], [3.0, 4.0], step=0, undone=None)
    selector.current_threshold(5)  # applies what is settled: nothing of the open window
    assert selector.table.seen == 0
    _record(selector, [4, 5], [5.0, 6.0], step=0, undone=True)  # the window's last micro-batch: skipped
    _record(selector, [6], [7.0], step=1)
    state = selector.state_dict()
    assert state["unapplied"]["undone"] == [True, True, True, False]
    restored = _selector()
    restored.load_state_dict(state)  # a resume keeps the verdicts of the steps it had not applied
    for candidate in (selector, restored):
        candidate.apply()
        assert np.isneginf(candidate.table.scores[:6]).all() and candidate.table.scores[6] == 7.0
    older = dict(
        state, unapplied={k: v for k, v in state["unapplied"].items() if k not in ("undone", "scored")}
    )
    before = _selector()
    before.load_state_dict(older)  # a checkpoint of an earlier version: no verdicts, every step applied
    before.apply()
    assert before.table.scores.tolist()[:7] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_without_the_guard_a_clean_fit_holds_nothing_out():
    torch.manual_seed(0)
    x = torch.tensor(load_digits().data[:640], dtype=torch.float32) / 16.0
    model, replay = _AutoEncoder(), HardSampleReplay(rule="topk")
    trainer = pl.Trainer(**trainer_kwargs(max_steps=60, callbacks=[PulseCycle(burst=10, replay=15), replay]))
    trainer.fit(model, torch.utils.data.DataLoader(_Indexed(x), batch_size=32, shuffle=True, drop_last=True))
    assert replay.metrics()["table_held_out"] == 0
    assert replay.selector._unsettled == 0
