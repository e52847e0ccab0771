"""The energy ledger: attributes metered energy to phases, cycles, epochs and stages, and sums it up.

Plain Python + numpy, no Lightning, no threads of its own (it is thread-safe: the sampler thread records
readings while the training thread marks labels and counts batches).

How attribution works. The training thread marks *labels* (phase, cycle, epoch, stage) with a monotonic
time stamp whenever one changes; it does nothing per step but count. The sampler records cumulative joules
per component every period; the energy of each sampling interval is split over the labels that were in
force during it, in proportion to their time in the interval (constant power within an interval). Each
label adds to the buckets ``total``, ``stage/<stage>``, and, inside the training loop (stage ``train`` or
``validation``), ``phase/<phase>``, ``cycle/<n>`` and ``epoch/<n>``. CO2 and cost of each piece use the mean
intensity and price over the piece's wall-clock time.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from lightning_pulse.energy.carbon import Rate
from lightning_pulse.energy.meter import (
    COMPONENTS,
    ESTIMATED,
    MEASURED,
    METHOD_FLAGS,
    NONE,
    PARTIAL,
    method_from_flags,
)
from lightning_pulse.records import RECENT_RECORDS, append_recent

J_PER_KWH = 3.6e6
#: the most bins a run's energy timeline holds (a resumed run's parts together too: coarsened_timeline)
MAX_TIMELINE_BINS = 400
STAGES = ("train", "validation", "other")
#: the stages of the training loop: only a label in one of them adds to ``phase/``, ``cycle/`` and ``epoch/``
#: buckets, so the phases sum to exactly these stages (less the sanity check, a validation in no phase)
IN_LOOP_STAGES = ("train", "validation")
#: the stage of the instrumentation's own start-up (the wait for codecarbon's background start): its
#: time and energy go to the bucket :data:`STARTUP_KEY` only, outside the run's total, stages and phases
STARTUP_STAGE = "meter_startup"
STARTUP_KEY = "meter_startup"

_COUNTING = (MEASURED, ESTIMATED)
#: the relative difference between two sums of the same joules, added in another order, that is rounding
_ROUNDING = 1e-9

# how each field combines over DDP ranks (over resumed runs every field adds up)
SUM_FIELDS = (
    *("gpu_j", "cpu_j", "ram_j", "co2_kg", "cost", "samples", "tokens", "batches", "token_batches"),
    *("co2_uncounted_j", "cost_uncounted_j"),
)
MAX_FIELDS = ("seconds", "steps")
MEAN_FIELDS = ("stall_s", "loop_s")
OR_FIELDS = ("gpu_flags", "cpu_flags", "ram_flags")


@dataclass
class Bucket:
    """Raw sums of one bucket (e.g. ``phase/burst``): seconds, joules per component, counts, CO2, cost, and
    the joules that no carbon intensity (``co2_uncounted_j``) or price (``cost_uncounted_j``) counted: a part
    of the run without one, before a resume that gave it (its CO2 or cost is then partial)."""

    seconds: float = 0.0
    gpu_j: float = 0.0
    cpu_j: float = 0.0
    ram_j: float = 0.0
    gpu_flags: int = 0
    cpu_flags: int = 0
    ram_flags: int = 0
    co2_kg: float = 0.0
    cost: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    batches: float = 0.0
    token_batches: float = 0.0
    steps: float = 0.0
    stall_s: float = 0.0
    loop_s: float = 0.0
    co2_uncounted_j: float = 0.0
    cost_uncounted_j: float = 0.0

    def add(self, other: Bucket) -> None:
        for item in fields(self):
            if item.name in OR_FIELDS:
                setattr(self, item.name, int(getattr(self, item.name)) | int(getattr(other, item.name)))
            else:
                setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))

    def to_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in BUCKET_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Bucket:
        names = {item.name for item in fields(cls)}
        bucket = cls(**{k: v for k, v in data.items() if k in names})
        for name in OR_FIELDS:
            setattr(bucket, name, int(getattr(bucket, name)))
        return bucket

    @property
    def joules(self) -> float:
        return self.gpu_j + self.cpu_j + self.ram_j


BUCKET_FIELDS = tuple(item.name for item in fields(Bucket))
_JOULE_FIELD = {component: f"{component}_j" for component in COMPONENTS}
_FLAG_FIELD = {component: f"{component}_flags" for component in COMPONENTS}


@dataclass(frozen=True)
class Label:
    """What the run is doing: ``phase``/``cycle``/``epoch`` count only in the training loop's stages
    (:data:`IN_LOOP_STAGES`), where they are set; elsewhere they are ``None`` or not yet in force."""

    phase: str | None = None
    cycle: int | None = None
    epoch: int | None = None
    stage: str = "other"

    def keys(self) -> tuple[str, ...]:
        if self.stage == STARTUP_STAGE:
            return (STARTUP_KEY,)
        keys = ["total", f"stage/{self.stage}"]
        if self.stage not in IN_LOOP_STAGES:
            # a phase marked before the training stage starts is outside the loop: PulseCycle, listed
            # first, announces its first phase in its `on_train_start`, before EnergyLogger's marks the stage
            # `train`; that moment (1% of a short run on a busy machine) was in a phase but in no loop stage
            return tuple(keys)
        if self.phase is not None:
            keys.append(f"phase/{self.phase}")
        if self.cycle is not None:
            keys.append(f"cycle/{self.cycle}")
        if self.epoch is not None:
            keys.append(f"epoch/{self.epoch}")
        return tuple(keys)


_UNCHANGED: Any = object()


def _banded(label: Label) -> tuple[str | None, int | None]:
    """The phase band (the report's ``phase_segments``) ``label`` is in: none during the meter start-up."""
    return (None, None) if label.stage == STARTUP_STAGE else (label.phase, label.cycle)


class _Tally:
    """Counts of consecutive batches with the same label, kept as plain numbers until flushed."""

    __slots__ = ("keys", "samples", "batches", "tokens", "token_batches", "stall_s", "loop_s", "steps")

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.samples = self.batches = self.tokens = self.token_batches = self.steps = 0
        self.stall_s = self.loop_s = 0.0


class EnergyLedger:
    """Buckets of energy, time, counts, CO2 and cost for one process.

    Args:
        intensity: carbon intensity, or ``None`` (then CO2 is not computed).
        price: electricity price, or ``None``.
        max_points: the power timeline is thinned to at most this many readings (cumulative energy is kept,
            so thinning never loses energy, only time resolution).
    """

    def __init__(
        self, intensity: Rate | None = None, price: Rate | None = None, max_points: int = 4000
    ) -> None:
        self.intensity = intensity
        self.price = price
        self.max_points = max(int(max_points), 16)
        self.lock = threading.RLock()
        self.buckets: dict[str, Bucket] = {}
        self.label = Label()
        self._label_since: float | None = None
        self._segments: list[tuple[float, Label]] = []
        self._last_time: float | None = None
        self._last_wall: float | None = None
        self.totals_j = {component: 0.0 for component in COMPONENTS}
        # the meter start-up's share of them: the timeline leaves it out, as the report's total does
        self._startup_j = {component: 0.0 for component in COMPONENTS}
        self.methods = {component: NONE for component in COMPONENTS}
        self.timeline_wall: list[float] = []
        self.timeline_j: list[tuple[float, float, float]] = []
        self.phase_segments: list[dict[str, Any]] = []
        self.first_wall: float | None = None
        # (monotonic, wall) at the first reading or label change: the timeline and the phase bands are dated
        # from it on the monotonic clock, so that a step of the wall clock (an NTP correction, a resume from
        # suspend, a user setting the clock) neither stretches nor empties them
        self._timeline_anchor: tuple[float, float] | None = None
        self.last_power_w = 0.0
        self.metered = False  # whether any reading so far came from a meter (measured or estimated)
        self.readings = 0  # readings recorded after the zero point of `begin`
        self._run_seconds = 0.0
        # (run J, time, average power W, run s, readings so far that counted only part of the energy) of the
        # latest reading, replaced whole under `lock`: one attribute read gives a consistent tuple, so the
        # per-step read-outs take no lock
        self._latest: tuple[float, float | None, float, float, int] = (0.0, None, 0.0, 0.0, 0)
        self._partial_readings = 0
        self._keys: tuple[str, ...] = ()
        self._keys_of: Label | None = None
        # caches of the buckets' lookups, emptied whenever a numbered bucket is dropped (:meth:`_bucket`)
        self._bucket_lists: dict[tuple[str, ...], list[Bucket]] = {}
        self._label_keys: dict[Label, tuple[str, ...]] = {}  # under `lock` (current_keys() is not)
        # per prefix of NUMBERED, a heap of ``(number, key)`` of the kept numbered buckets: the oldest is
        # dropped without sorting every key (a run of tiny epochs opens one every few steps)
        self._numbered: dict[str, list[tuple[int, str]]] = {prefix: [] for prefix in NUMBERED}
        self._tally = _Tally(())

    # an EnergyLogger is pickled by ``ddp_spawn`` and copied by sweeps, also after a fit: the figures go with
    # it, the lock is made anew
    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ time and labels
    def begin(self, now: float, wall: float, totals: Mapping[str, tuple[float, str]] | None = None) -> None:
        """Start the clock at the first reading (cumulative ``totals`` become the zero point)."""
        with self.lock:
            self._label_since = now
            self._segments = [(now, self.label)]
            self._last_time, self._last_wall = now, wall
            self.first_wall = wall
            for component, (joules, method) in (totals or {}).items():
                self.totals_j[component] = float(joules)
                self.methods[component] = method
                self.metered = self.metered or method in _COUNTING
            # a zero point: the run has counted nothing
            self._latest = (0.0, now, self.last_power_w, 0.0, self._partial_readings)
            self._append_timeline(self.timeline_time(now, wall))

    @property
    def last_reading_time(self) -> float | None:
        """Monotonic time of the latest reading (``None`` before the first)."""
        return self._last_time

    @property
    def started(self) -> bool:
        return self._last_time is not None

    def mark(
        self,
        now: float,
        wall: float,
        phase: str | None = _UNCHANGED,
        cycle: int | None = _UNCHANGED,
        epoch: int | None = _UNCHANGED,
        stage: str = _UNCHANGED,
    ) -> None:
        """Change the label from ``now`` on (only the given fields change)."""
        with self.lock:
            old = self.label
            new = Label(
                phase=old.phase if phase is _UNCHANGED else (None if phase is None else str(phase)),
                cycle=old.cycle if cycle is _UNCHANGED else (None if cycle is None else int(cycle)),
                epoch=old.epoch if epoch is _UNCHANGED else (None if epoch is None else int(epoch)),
                stage=old.stage if stage is _UNCHANGED else str(stage),
            )
            if new == old:
                return
            self.flush_counts()
            self.settle_time(now)
            self.label = new
            if self.started:
                self._segments.append((now, new))
            # the meter start-up is in no phase's band, as in no phase's figures
            shown, before = _banded(new), _banded(old)
            if shown != before:
                dated = self.timeline_time(now, wall)
                if self.phase_segments and self.phase_segments[-1]["end_wall"] is None:
                    self.phase_segments[-1]["end_wall"] = dated
                if shown[0] is not None:
                    segment = {"phase": shown[0], "cycle": shown[1], "start_wall": dated, "end_wall": None}
                    append_recent(self.phase_segments, segment)

    def settle_time(self, now: float) -> None:
        """Credit the time since the last label change to the current label's buckets."""
        with self.lock:
            if self._label_since is None:
                return
            elapsed = max(now - self._label_since, 0.0)
            for bucket in self._buckets_of(self.label.keys()):
                bucket.seconds += elapsed
            self._label_since = now

    # ------------------------------------------------------------------ counts from the training thread
    def current_keys(self) -> tuple[str, ...]:
        """The bucket keys of the current label (cached: this is called on every batch)."""
        label = self.label
        if self._keys_of is not label:
            self._keys, self._keys_of = label.keys(), label
        return self._keys

    def count_batch(
        self,
        keys: tuple[str, ...],
        samples: int,
        tokens: int | None,
        stall_s: float | None = None,
        loop_s: float | None = None,
    ) -> None:
        """One training batch: its samples, its tokens (``None``: unknown) and, when known, the loop
        iteration that led to it (``loop_s`` seconds of the training loop, of which ``stall_s`` waited for
        this batch).

        Counts are tallied in plain numbers and reach the buckets at the next label change or read-out, so a
        batch costs a few additions. Call from the training thread only.
        """
        tally = self._tally
        if tally.keys is not keys:
            tally = self._switch_tally(keys)
        tally.samples += samples
        tally.batches += 1
        if tokens is not None:
            tally.tokens += tokens
            tally.token_batches += 1
        if loop_s is not None and stall_s is not None:
            tally.stall_s += stall_s if stall_s > 0 else 0.0
            tally.loop_s += loop_s if loop_s > 0 else 0.0

    def count_step(self, keys: tuple[str, ...], steps: int = 1) -> None:
        """Optimizer steps finished in a batch labelled ``keys``. Training thread only."""
        tally = self._tally
        if tally.keys is not keys:
            tally = self._switch_tally(keys)
        tally.steps += steps

    def flush_counts(self) -> None:
        """Move the tallied counts into the buckets."""
        with self.lock:
            tally = self._tally
            if tally.keys:
                for bucket in self._buckets_of(tally.keys):
                    bucket.samples += tally.samples
                    bucket.batches += tally.batches
                    bucket.tokens += tally.tokens
                    bucket.token_batches += tally.token_batches
                    bucket.stall_s += tally.stall_s
                    bucket.loop_s += tally.loop_s
                    bucket.steps += tally.steps
            self._tally = _Tally(tally.keys)

    def add_counts(
        self,
        keys: Sequence[str],
        batches: int,
        samples: int,
        tokens: int = 0,
        token_batches: int = 0,
        stall_s: float = 0.0,
        loop_s: float = 0.0,
        steps: int = 0,
    ) -> None:
        """Counts of many batches at once, tallied by the caller (``EnergyLogger`` keeps them in plain ints
        between label changes): ``token_batches`` of the ``batches`` told their tokens."""
        with self.lock:
            for bucket in self._buckets_of(keys):
                bucket.batches += batches
                bucket.samples += samples
                bucket.tokens += tokens
                bucket.token_batches += token_batches
                bucket.stall_s += stall_s
                bucket.loop_s += loop_s
                bucket.steps += steps

    def _switch_tally(self, keys: tuple[str, ...]) -> _Tally:
        self.flush_counts()
        self._tally = _Tally(tuple(keys) if not isinstance(keys, tuple) else keys)
        return self._tally

    def add_tokens(self, keys: Sequence[str], tokens: int) -> None:
        """Tokens of batches already counted (token counts that were read from the device later)."""
        with self.lock:
            for bucket in self._buckets_of(keys):
                bucket.tokens += tokens

    def _buckets_of(self, keys: Sequence[str]) -> list[Bucket]:
        # per-batch calls reuse the bucket objects of a label instead of looking up each key
        keys = tuple(keys)
        buckets = self._bucket_lists.get(keys)
        if buckets is None:
            buckets = self._bucket_lists[keys] = [self._bucket(key) for key in keys]
        return buckets

    # ------------------------------------------------------------------ readings from the sampler
    def record(self, now: float, wall: float, totals: Mapping[str, tuple[float, str]]) -> None:
        """A reading: cumulative joules and method per component at monotonic ``now``."""
        with self.lock:
            if self._last_time is None:
                self.begin(now, wall, totals)
                return
            t0, wall0 = self._last_time, self._last_wall
            assert wall0 is not None
            span = now - t0
            deltas: dict[str, float] = {}
            flags = 0
            for component, (joules, method) in totals.items():
                flags |= METHOD_FLAGS[method]
                deltas[component] = max(float(joules) - self.totals_j[component], 0.0)
                self.totals_j[component] = max(float(joules), self.totals_j[component])
                self.methods[component] = method
                self.metered = self.metered or method in _COUNTING
            startup_s = 0.0
            if span > 0:
                pieces = self._pieces(t0, now)
                for start, end, label in pieces:
                    share = (end - start) / span
                    if label.stage == STARTUP_STAGE:
                        startup_s += end - start
                        for component, delta in deltas.items():
                            self._startup_j[component] += delta * share
                    piece_wall0 = wall0 + (start - t0) / span * (wall - wall0)
                    piece_wall1 = wall0 + (end - t0) / span * (wall - wall0)
                    self._credit(label, deltas, totals, share, piece_wall0, piece_wall1)
            else:
                # two readings at the same instant: nothing to spread over, give it to the current label
                self._credit(self.label, deltas, totals, 1.0, wall, wall)
                if self.label.stage == STARTUP_STAGE:
                    for component, delta in deltas.items():
                        self._startup_j[component] += delta
            if span > 0:
                self.last_power_w = sum(deltas.values()) / span
                self._run_seconds += span - startup_s
            self._segments = [(now, self.label)]
            self._last_time, self._last_wall = now, wall
            self.readings += 1
            total = self.buckets.get("total")
            run_joules = total.joules if total is not None else 0.0
            if method_from_flags(flags) not in _COUNTING:  # a lost component: the interval is partial
                self._partial_readings += 1
            self._latest = (run_joules, now, self.last_power_w, self._run_seconds, self._partial_readings)
            self._append_timeline(self.timeline_time(now, wall))

    def _pieces(self, t0: float, t1: float) -> list[tuple[float, float, Label]]:
        pieces = []
        segments = self._segments
        for index, (start, label) in enumerate(segments):
            end = segments[index + 1][0] if index + 1 < len(segments) else t1
            lo, hi = max(start, t0), min(end, t1)
            if hi > lo:
                pieces.append((lo, hi, label))
        if not pieces:
            pieces.append((t0, t1, self.label))
        return pieces

    def _credit(
        self,
        label: Label,
        deltas: Mapping[str, float],
        totals: Mapping[str, tuple[float, str]],
        share: float,
        wall0: float,
        wall1: float,
    ) -> None:
        # runs for every label piece of every reading (the sampling thread): names and buckets are looked
        # up once, not per bucket
        pieces = [
            (
                _JOULE_FIELD[component],
                _FLAG_FIELD[component],
                delta * share,
                METHOD_FLAGS[totals[component][1]],
            )
            for component, delta in deltas.items()
        ]
        joules = sum(piece[2] for piece in pieces)
        kwh = joules / J_PER_KWH
        co2 = kwh * self.intensity.mean(wall0, wall1) / 1000.0 if self.intensity is not None and kwh else 0.0
        cost = kwh * self.price.mean(wall0, wall1) if self.price is not None and kwh else 0.0
        # kept, so that a resume which adds the rate reports the CO2 or cost as partial, not as the run's
        co2_uncounted = joules if self.intensity is None else 0.0
        cost_uncounted = joules if self.price is None else 0.0
        keys = self._label_keys.get(label)
        if keys is None:
            keys = self._label_keys[label] = label.keys()
        for bucket in self._buckets_of(keys):
            for joule_field, flag_field, value, flag in pieces:
                setattr(bucket, joule_field, getattr(bucket, joule_field) + value)
                setattr(bucket, flag_field, getattr(bucket, flag_field) | flag)
            bucket.co2_kg += co2
            bucket.cost += cost
            bucket.co2_uncounted_j += co2_uncounted
            bucket.cost_uncounted_j += cost_uncounted

    def timeline_time(self, now: float, wall: float) -> float:
        """Where monotonic ``now`` (read with ``wall``) lies on the timeline: Unix seconds, the wall clock at
        the ledger's first reading or label change plus the monotonic time since. CO2 and cost read the
        rates at ``wall`` itself; only the timeline and the phase bands are kept on this clock."""
        with self.lock:
            if self._timeline_anchor is None:
                self._timeline_anchor = (now, wall)
            anchor_now, anchor_wall = self._timeline_anchor
            return anchor_wall + (now - anchor_now)

    def _append_timeline(self, wall: float) -> None:
        self.timeline_wall.append(wall)
        # without the meter start-up's energy: the timeline sums to the report's total, as every figure does
        run_j = tuple(self.totals_j[c] - self._startup_j[c] for c in COMPONENTS)
        self.timeline_j.append(run_j)  # type: ignore[arg-type]
        if len(self.timeline_wall) > self.max_points:
            # keep the first and last reading, drop every other one in between
            keep = list(range(0, len(self.timeline_wall) - 1, 2)) + [len(self.timeline_wall) - 1]
            self.timeline_wall = [self.timeline_wall[i] for i in keep]
            self.timeline_j = [self.timeline_j[i] for i in keep]

    def _bucket(self, key: str) -> Bucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket()
            if key.startswith(NUMBERED):
                prefix = key[: key.index("/") + 1]
                numbered = self._numbered[prefix]
                heapq.heappush(numbered, (int(key[len(prefix) :]), key))
                if len(numbered) > RECENT_RECORDS:  # the lowest number, as recent_buckets drops
                    del self.buckets[heapq.heappop(numbered)[1]]  # its figures stay in the totals and phases
                    # the caches may hold the dropped bucket, and gain an entry per label: rebuilt on demand
                    # from the labels in use, so they stay as small as the latest few cycles' labels
                    self._bucket_lists.clear()
                    self._label_keys.clear()
        return bucket

    # ------------------------------------------------------------------ read-out
    @property
    def run_reading(self) -> tuple[float, float]:
        """``(joules, seconds)`` of the run at the latest reading: the ``total`` bucket's energy (what the
        report's total says), so without the meter start-up's (:data:`STARTUP_KEY`) or a meter's zero point,
        and the time the readings cover without the start-up's."""
        joules, _, _, seconds, _ = self._latest
        return joules, seconds

    @property
    def run_reading_gaps(self) -> tuple[float, float, int]:
        """:attr:`run_reading` and how many readings so far counted only part of the energy (a component's
        meters lost: partial, or nothing counted: none). The count unchanged between two read-outs: every
        reading between them counted all of it, so their difference is a measured or estimated figure."""
        joules, _, _, seconds, partial = self._latest
        return joules, seconds, partial

    @property
    def counted(self) -> bool:
        """Whether a meter has counted energy over some time: a reading past the zero point of :meth:`begin`
        (none comes while a meter is still starting in the background; see ``EnergySampler.sample``)."""
        return self.metered and self.readings > 0

    def estimate_joules(self, now: float, horizon: float = 10.0) -> float:
        """The run's energy at the last reading (:attr:`run_reading`) plus the latest average power times the
        time since (at most ``horizon`` seconds): a smooth figure between readings, at no metering cost and
        without the lock (it is read at every optimizer step)."""
        total, last_time, power, _, _ = self._latest
        if last_time is None:
            return total
        return total + power * min(max(now - last_time, 0.0), horizon)

    def snapshot(
        self,
        now: float,
        edges: np.ndarray | None = None,
        max_bins: int = MAX_TIMELINE_BINS,
        timeline: bool = True,
        keys: Callable[[str], bool] | None = None,
    ) -> dict[str, Any]:
        """A JSON-able copy: buckets, the timeline as energy per time bin, phase segments.

        Args:
            now: monotonic time; the current label's time is credited up to it.
            edges: wall-clock bin edges for the timeline (DDP ranks use rank 0's); default: evenly spaced
                over this ledger's readings.
            max_bins: the most timeline bins.
            timeline: ``False`` leaves the timeline and phase segments out (figures only, cheaper).
            keys: only the buckets whose key passes this test (default: all; a run's epoch and cycle
                buckets grow with its length, and a per-epoch read-out needs three or four of them).
        """
        with self.lock:
            self.flush_counts()
            self.settle_time(now)
            snapshot: dict[str, Any] = {
                "buckets": {
                    key: bucket.to_dict() for key, bucket in self.buckets.items() if keys is None or keys(key)
                }
            }
            if timeline:
                if edges is None:
                    edges = timeline_edges(self.timeline_wall, max_bins)
                snapshot["timeline"] = bin_timeline(self.timeline_wall, self.timeline_j, edges)
                snapshot["phase_segments"] = [dict(segment) for segment in self.phase_segments]
            return snapshot


# ---------------------------------------------------------------------- timeline
def timeline_edges(walls: Sequence[float], max_bins: int = MAX_TIMELINE_BINS) -> np.ndarray:
    """Evenly spaced wall-clock bin edges covering the readings (no bins for fewer than 2 readings)."""
    if len(walls) < 2 or walls[-1] <= walls[0]:
        return np.zeros(0)
    bins = max(1, min(len(walls) - 1, max_bins))
    return np.linspace(walls[0], walls[-1], bins + 1)


def bin_timeline(
    walls: Sequence[float], cumulative: Sequence[Sequence[float]], edges: np.ndarray
) -> dict[str, list]:
    """Energy per component in each ``[edges[i], edges[i+1])``, from cumulative readings (interpolated)."""
    edges = np.asarray(edges, dtype=np.float64)
    out: dict[str, list] = {"start_wall": edges[:-1].tolist(), "end_wall": edges[1:].tolist()}
    values = np.asarray(cumulative, dtype=np.float64).reshape(-1, len(COMPONENTS))
    for index, component in enumerate(COMPONENTS):
        if len(edges) < 2 or len(walls) == 0:
            out[f"{component}_j"] = []
            continue
        at_edges = np.interp(edges, np.asarray(walls, dtype=np.float64), values[:, index])
        out[f"{component}_j"] = np.diff(at_edges).tolist()
    return out


# ---------------------------------------------------------------------- combining
def flatten_buckets(buckets: Mapping[str, Mapping[str, float]], keys: Sequence[str]) -> np.ndarray:
    """``(len(keys), len(BUCKET_FIELDS))`` array; a key this rank has not seen is all zeros."""
    array = np.zeros((len(keys), len(BUCKET_FIELDS)), dtype=np.float64)
    for row, key in enumerate(keys):
        bucket = buckets.get(key)
        if bucket is not None:
            array[row] = [float(bucket.get(name, 0.0)) for name in BUCKET_FIELDS]
    return array


def combine_ranks(stacked: np.ndarray, keys: Sequence[str]) -> dict[str, dict[str, float]]:
    """Buckets of all ranks, from ``(world, len(keys), len(BUCKET_FIELDS))`` gathered arrays.

    Energy, CO2, cost and counts add up; seconds and steps are the same wall clock and loop on every rank
    (max); stall and loop time are averaged; method flags are or-ed.
    """
    stacked = np.asarray(stacked, dtype=np.float64)
    combined: dict[str, dict[str, float]] = {}
    for row, key in enumerate(keys):
        bucket: dict[str, float] = {}
        for column, name in enumerate(BUCKET_FIELDS):
            values = stacked[:, row, column]
            if name in SUM_FIELDS:
                bucket[name] = float(values.sum())
            elif name in MAX_FIELDS:
                bucket[name] = float(values.max())
            elif name in MEAN_FIELDS:
                bucket[name] = float(values.mean())
            else:
                flags = 0
                for value in values:
                    flags |= int(value)
                bucket[name] = flags
        combined[key] = bucket
    return combined


#: the bucket keys numbered by cycle or epoch: a run's latest RECENT_RECORDS of each are kept
NUMBERED = ("cycle/", "epoch/")


def recent_buckets(buckets: Mapping[str, Any]) -> dict[str, Any]:
    """``buckets`` without the oldest ``cycle/<n>`` and ``epoch/<n>`` beyond the latest :data:`RECENT_RECORDS`
    of each: a run of a million steps holds thousands of cycles, and its checkpoint and report would grow with
    them. The totals, stages and phases keep every joule."""
    dropped: set[str] = set()
    for prefix in NUMBERED:
        numbered = sorted((k for k in buckets if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :]))
        dropped.update(numbered[: max(len(numbered) - RECENT_RECORDS, 0)])
    return {key: value for key, value in buckets.items() if key not in dropped}


def merge_snapshots(earlier: Mapping[str, Any] | None, later: Mapping[str, Any]) -> dict[str, Any]:
    """One snapshot for a run made of consecutive parts (a resumed run): everything adds up."""
    if not earlier:
        return dict(later)  # snapshots are fresh copies already
    buckets: dict[str, Bucket] = {
        key: Bucket.from_dict(value) for key, value in earlier.get("buckets", {}).items()
    }
    for key, value in later.get("buckets", {}).items():
        buckets.setdefault(key, Bucket()).add(Bucket.from_dict(value))
    timeline = {name: list(earlier.get("timeline", {}).get(name, [])) for name in _TIMELINE_KEYS}
    for name in _TIMELINE_KEYS:
        timeline[name] += list(later.get("timeline", {}).get(name, []))
    timeline = coarsened_timeline(timeline)  # each part brings up to MAX_TIMELINE_BINS
    merged = {key: _copy(value) for key, value in later.items() if key != "buckets"}
    merged["buckets"] = recent_buckets({key: bucket.to_dict() for key, bucket in buckets.items()})
    if "timeline" in later:
        merged.update(
            timeline=timeline,
            phase_segments=(list(earlier.get("phase_segments", [])) + list(later.get("phase_segments", [])))[
                -RECENT_RECORDS:
            ],
            events=list(earlier.get("events", [])) + list(later.get("events", [])),
        )
    return merged


_TIMELINE_KEYS = ("start_wall", "end_wall", *(f"{c}_j" for c in COMPONENTS))


def coarsened_timeline(timeline: Mapping[str, list], max_bins: int = MAX_TIMELINE_BINS) -> dict[str, list]:
    """``timeline`` (bins of :func:`bin_timeline`, consecutive parts of a resumed run one after another) in at
    most ``max_bins`` bins: runs of adjacent bins merged into one, its energy their sum, so that a run resumed
    again and again keeps a timeline (and a checkpoint and report) as small as an uninterrupted run's, every
    joule kept. A merged bin does not reach across the time between two parts (where nothing ran) while
    there are fewer parts than ``max_bins``."""
    starts, ends = list(timeline.get("start_wall", [])), list(timeline.get("end_wall", []))
    count = len(starts)
    if count <= max_bins:
        return {name: list(timeline.get(name, [])) for name in _TIMELINE_KEYS}
    parts = [0] + [i for i in range(1, count) if starts[i] > ends[i - 1]]  # the first bin of each part
    if len(parts) >= max_bins:
        parts = [0]
    size = math.ceil(count / max_bins)
    while True:  # bins of `size` within each part; a part's last group may be shorter
        groups = [
            (start, min(start + size, stop))
            for first, stop in zip(parts, [*parts[1:], count])
            for start in range(first, stop, size)
        ]
        if len(groups) <= max_bins:
            break
        size += 1
    merged: dict[str, list] = {
        "start_wall": [starts[a] for a, _ in groups],
        "end_wall": [ends[b - 1] for _, b in groups],
    }
    for name in _TIMELINE_KEYS[2:]:
        values = list(timeline.get(name, []))
        merged[name] = [sum(values[a:b]) for a, b in groups] if values else []
    return merged


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# ---------------------------------------------------------------------- figures
def figures(bucket: Mapping[str, float], has_intensity: bool, has_price: bool) -> dict[str, Any]:
    """Reportable figures of a raw bucket, each with its method (``measured``/``estimated``/``partial``/
    ``none``). A figure no meter counted is ``None`` (null in the JSON), never 0; the average power of a
    partial figure is ``None`` too (its energy misses an unknown part of its time)."""
    b = Bucket.from_dict(bucket)
    joules = b.joules
    methods = {c: method_from_flags(getattr(b, f"{c}_flags")) for c in COMPONENTS}
    flags = 0
    for c in COMPONENTS:
        flags |= getattr(b, f"{c}_flags")
    method = method_from_flags(flags)
    kwh = joules / J_PER_KWH
    tokens_known = b.batches > 0 and b.token_batches == b.batches
    co2_method, co2_kwh = _rated(ESTIMATED, b.co2_uncounted_j, joules, has_intensity and method != NONE)
    cost_method, _ = _rated(method, b.cost_uncounted_j, joules, has_price)
    return {
        "duration_s": b.seconds,
        "energy_kwh": kwh if method != NONE else None,
        "energy_kwh_by_component": {
            c: getattr(b, f"{c}_j") / J_PER_KWH if methods[c] != NONE else None for c in COMPONENTS
        },
        "energy_method": method,
        "methods": methods,
        "avg_power_w": joules / b.seconds if b.seconds > 0 and method in _COUNTING else None,
        "co2_kg": b.co2_kg if co2_method != NONE else None,
        "co2_method": co2_method,
        "g_co2_per_kwh": b.co2_kg * 1000.0 / co2_kwh if co2_method != NONE and co2_kwh > 0 else None,
        "cost": b.cost if cost_method != NONE else None,
        "cost_method": cost_method,
        "samples": int(b.samples),
        "tokens": int(b.tokens) if tokens_known else None,
        "steps": int(b.steps),
        "energy_per_sample_j": joules / b.samples if b.samples > 0 and method != NONE else None,
        "energy_per_token_j": joules / b.tokens if tokens_known and b.tokens > 0 and method != NONE else None,
        "per_sample_method": method if b.samples > 0 else NONE,
        "stall_s": b.stall_s,
        "loop_s": b.loop_s,
        "stall_share": b.stall_s / b.loop_s if b.loop_s > 0 else None,
    }


def counted_part(uncounted_j: float, joules: float) -> float:
    """The joules of a bucket that a rate counted, of its ``joules`` of which ``uncounted_j`` it did not: 0
    when (up to rounding) none, all of them when (up to rounding) every joule was counted."""
    if uncounted_j <= _ROUNDING * joules:
        return joules
    counted = joules - uncounted_j
    return counted if counted > _ROUNDING * joules else 0.0


def _rated(method: str, uncounted_j: float, joules: float, has_rate: bool) -> tuple[str, float]:
    """The method of a bucket's CO2 or cost (``method`` when a rate counted all of its energy, partial when
    part of it, none when none or no rate is set now) and the kWh it counted."""
    if not has_rate:
        return NONE, 0.0
    counted = counted_part(uncounted_j, joules)
    if counted < joules:
        return (PARTIAL, counted / J_PER_KWH) if counted > 0 and method != NONE else (NONE, 0.0)
    return method, joules / J_PER_KWH


def grouped_figures(
    buckets: Mapping[str, Mapping[str, float]], has_intensity: bool, has_price: bool
) -> dict[str, Any]:
    """``{"total": ..., "phases": {...}, "cycles": {...}, "epochs": {...}, "stages": {...}}``."""
    groups: dict[str, Any] = {"phases": {}, "cycles": {}, "epochs": {}, "stages": {}}
    names = {"phase": "phases", "cycle": "cycles", "epoch": "epochs", "stage": "stages"}
    total = buckets.get("total", {})
    for key, bucket in buckets.items():
        kind, _, name = key.partition("/")
        if kind in names:
            groups[names[kind]][name] = figures(bucket, has_intensity, has_price)
    for group in ("cycles", "epochs"):
        groups[group] = dict(sorted(groups[group].items(), key=lambda item: int(item[0])))
    order = {"burst": 0, "replay": 1, "maintain": 2}
    groups["phases"] = dict(sorted(groups["phases"].items(), key=lambda item: order.get(item[0], 9)))
    groups["stages"] = dict(sorted(groups["stages"].items(), key=lambda item: STAGES.index(item[0])))
    groups["total"] = figures(total, has_intensity, has_price)
    return groups


def predict_run(
    epoch_bucket: Mapping[str, float],
    total_steps: float,
    intensity_known: bool,
    price_known: bool,
    epoch: int = 0,
    steps_done: float | None = None,
    total_batches: float | None = None,
) -> dict[str, Any] | None:
    """carbontracker-style forecast from an epoch (the first one with energy): scale its energy and time per
    batch to ``total_batches`` (the run's batches, all ranks together, as the bucket counts them), or, without
    it, per step to ``total_steps``. Per step is wrong where later steps cover more batches: under a
    ``GradientAccumulationScheduler`` raising the accumulation from 1 to 5 it forecast 40% of a run's energy.

    Returns ``None`` when the epoch made no optimizer step, its meters have read no energy yet (an epoch
    shorter than their first reading: the caller tries the next epoch rather than forecast 0 kWh), the run has
    no finite length, or the run ends with this epoch (``steps_done``: the run's steps so far; default the
    epoch's own).
    """
    b = Bucket.from_dict(epoch_bucket)
    done = b.steps if steps_done is None else steps_done
    if b.steps <= 0 or b.joules <= 0 or not math.isfinite(total_steps) or total_steps <= done:
        return None  # nothing to forecast from, or nothing left to forecast
    if total_batches is not None and math.isfinite(total_batches) and b.batches > 0:
        scale = total_batches / b.batches
    else:
        scale = total_steps / b.steps
    kwh = b.joules / J_PER_KWH * scale
    return {
        "basis": f"epoch {epoch}: {int(b.steps)} optimizer steps, {b.seconds:.1f} s, {b.joules / J_PER_KWH:.6g} kWh",
        "total_steps": float(total_steps),
        "energy_kwh": kwh,
        "duration_s": b.seconds * scale,
        # an epoch with energy no rate counted (a rate given on a resume) forecasts no CO2 or cost
        "co2_kg": b.co2_kg * scale if intensity_known and not b.co2_uncounted_j else None,
        "cost": b.cost * scale if price_known and not b.cost_uncounted_j else None,
    }
