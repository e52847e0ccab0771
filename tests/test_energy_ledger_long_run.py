"""A long run of tiny epochs and phases: the ledger's caches stay small and its figures stay those it gave."""

from __future__ import annotations

import pytest

from lightning_pulse.energy import ledger as ledger_module
from lightning_pulse.energy.carbon import Rate
from lightning_pulse.energy.ledger import (
    NUMBERED,
    Bucket,
    EnergyLedger,
    grouped_figures,
    recent_buckets,
)
from lightning_pulse.energy.meter import ESTIMATED, MEASURED


class _SortingLedger(EnergyLedger):
    """The ledger before the fix, as the reference for its figures: each new numbered bucket sorted every
    cycle and epoch key (``recent_buckets``) and rebuilt the lookup cache per dropped key."""

    def _bucket(self, key: str) -> Bucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket()
            if key.startswith(NUMBERED):
                for dropped in set(self.buckets) - set(recent_buckets(self.buckets)):
                    del self.buckets[dropped]
                    self._bucket_lists = {k: v for k, v in self._bucket_lists.items() if dropped not in k}
        return bucket


def _reading(joules: float) -> dict:
    return {"gpu": (joules, MEASURED), "cpu": (joules / 2, ESTIMATED), "ram": (0.0, ESTIMATED)}


def _run(ledger: EnergyLedger, cycles: int, start: int = 0, read_every: int = 5) -> float:
    """``cycles`` PulseCycle cycles of 1-batch phases from cycle ``start``, epochs of 2 batches, each ending
    with a validation, and a reading every ``read_every`` phases; returns the time reached."""
    t = 3.0 * start
    if not ledger.started:
        ledger.begin(t, 1000.0 + t, _reading(0.0))
    phase_count = 3 * start
    for cycle in range(start, start + cycles):
        for phase in ("burst", "replay", "maintain"):
            epoch = phase_count // 2
            ledger.mark(t, 1000.0 + t, stage="train", phase=phase, cycle=cycle, epoch=epoch)
            keys = ledger.current_keys()
            ledger.count_batch(keys, samples=8, tokens=None, stall_s=0.01, loop_s=0.1)
            ledger.count_step(keys, 1)
            t += 0.7
            if phase_count % 2 == 1:  # the epoch's end
                ledger.mark(t, 1000.0 + t, stage="validation")
            t += 0.3
            phase_count += 1
            if phase_count % read_every == 0:
                ledger.record(t, 1000.0 + t, _reading(10.0 * t))
    return t


@pytest.fixture
def small_cap(monkeypatch):
    # the cap of 1,000 cycles and epochs, made 40 so that a short loop drops many buckets of each
    monkeypatch.setattr(ledger_module, "RECENT_RECORDS", 40)
    return 40


def test_the_ledgers_caches_stay_bounded_over_many_cycles_and_epochs(small_cap):
    # held-out sweep: the label cache gained an entry per label and was never pruned (7,503 entries after
    # 5,000 steps of 2-batch epochs and 1-step phases, for 2,007 kept buckets)
    ledger = EnergyLedger()
    t = _run(ledger, 400)
    sizes = {
        "labels": len(ledger._label_keys),
        "lists": len(ledger._bucket_lists),
        "buckets": len(ledger.buckets),
    }
    _run(ledger, 1600, start=400)  # five times as long: no cache grows with it
    later = {
        "labels": len(ledger._label_keys),
        "lists": len(ledger._bucket_lists),
        "buckets": len(ledger.buckets),
    }
    assert later["buckets"] == sizes["buckets"] <= 2 * small_cap + 10  # totals, stages, phases and the caps
    assert later["labels"] <= 3 * small_cap and later["lists"] <= 3 * small_cap
    assert t > 0 and all(len(numbered) == small_cap for numbered in ledger._numbered.values())


def test_the_figures_equal_those_of_the_sorting_ledger_on_a_run_that_drops_buckets(small_cap):
    rates = {"intensity": Rate("constant", "gCO2eq/kWh", constant=400.0)}
    rates["price"] = Rate("constant", "EUR/kWh", constant=0.3)
    fixed, sorting = EnergyLedger(**rates), _SortingLedger(**rates)
    for ledger in (fixed, sorting):
        # readings 50 cycles apart: each spreads over labels whose buckets were dropped since the last one
        end = _run(ledger, 3 * small_cap + 7, read_every=150)
        ledger.record(end + 1.0, 1001.0 + end, _reading(10.0 * end + 5.0))
    fixed_snapshot = fixed.snapshot(end + 2.0, timeline=False)["buckets"]
    sorting_snapshot = sorting.snapshot(end + 2.0, timeline=False)["buckets"]
    assert fixed_snapshot == sorting_snapshot  # every bucket, every field: the same floats
    groups = grouped_figures(fixed_snapshot, True, True)
    assert groups == grouped_figures(sorting_snapshot, True, True)
    assert len(groups["cycles"]) == len(groups["epochs"]) == small_cap  # buckets were dropped
    assert list(groups["cycles"])[0] == str(2 * small_cap + 7)  # the latest kept
    assert groups["epochs"]["170"]["steps"] == 2 and groups["cycles"]["100"]["steps"] == 3
    assert groups["total"]["steps"] == 3 * (3 * small_cap + 7) and groups["total"]["co2_kg"] > 0


def _part(first_wall: float, bins: int, joules: float) -> dict:
    walls = [first_wall + i for i in range(bins + 1)]
    return {
        "start_wall": walls[:-1],
        "end_wall": walls[1:],
        **{f"{c}_j": [joules] * bins for c in ("gpu", "cpu", "ram")},
    }


def test_a_run_resumed_again_and_again_keeps_a_timeline_as_small_as_an_uninterrupted_runs():
    # held-out sweep: each resume appended up to 400 bins to the carried snapshot (1,030-1,157 bins after 7
    # resumes; EnergyLogger's state 13 KB -> 82 KB, energy_report.json 40 KB -> 412 KB after 11)
    merged: dict | None = None
    for part in range(8):  # each part 400 bins of 1 s, an hour apart
        snapshot = {"buckets": {}, "timeline": _part(3600.0 * part, 400, 1.0), "phase_segments": []}
        merged = ledger_module.merge_snapshots(merged, snapshot)
    timeline = merged["timeline"]
    assert len(timeline["start_wall"]) <= ledger_module.MAX_TIMELINE_BINS
    assert {len(values) for values in timeline.values()} == {len(timeline["start_wall"])}
    assert sum(timeline["gpu_j"]) == pytest.approx(8 * 400.0)  # every joule kept
    # merged bins stay within their part: none reaches across the hour between two parts
    spans = [end - start for start, end in zip(timeline["start_wall"], timeline["end_wall"])]
    assert max(spans) < 3600.0
    assert timeline["start_wall"] == sorted(timeline["start_wall"])


def test_a_timeline_of_more_parts_than_bins_is_coarsened_across_them():
    parts = [_part(10.0 * i, 1, 2.0) for i in range(12)]
    joined = {name: [value for part in parts for value in part[name]] for name in parts[0]}
    coarse = ledger_module.coarsened_timeline(joined, max_bins=5)
    assert len(coarse["start_wall"]) <= 5 and sum(coarse["cpu_j"]) == pytest.approx(24.0)
    assert coarse["start_wall"][0] == 0.0 and coarse["end_wall"][-1] == 111.0
