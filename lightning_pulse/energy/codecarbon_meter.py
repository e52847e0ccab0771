"""CPU and RAM energy *estimated* by codecarbon's offline tracker, and country carbon intensities.

One :class:`CodecarbonSession` runs one ``codecarbon.OfflineEmissionsTracker`` (no network calls) and two
meters read from it: :class:`CodecarbonMeter` for ``"cpu"`` (TDP x load model when RAPL is not readable)
and for ``"ram"`` (codecarbon's memory-power estimate). The session reads the tracker through its public
output-handler interface: each :meth:`CodecarbonSession.read` calls ``tracker.flush()``, which measures
and hands the cumulative figures to our handler. codecarbon swallows its own exceptions inside ``flush``;
a flush that delivers nothing is therefore treated as a failure.

Readings never carry an impossible power: the start's totals are dated at codecarbon's own start-up
measurement (not the moment our start returned), a total implying more than
:data:`PLAUSIBLE_FACTOR` x codecarbon's own model power is cut to that model power (a notice: one warning, an
event), and an extrapolation that ran ahead of the measured total is taken back at :data:`PAYBACK_SHARE` of the
power, not by holding the total flat (0 W).

codecarbon's logging is quieted (level ``ERROR``) while the session runs and restored afterwards.

A background start holds :data:`FORK_GATE` (see :class:`ForkGate`): a process forked meanwhile (a DataLoader's
workers) would inherit the pipes of the subprocesses codecarbon's start runs, and hang it. A start that does
not finish is given up (:meth:`CodecarbonSession.abandon_start`); its thread stops its own tracker if it ends.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any

from lightning_pulse.energy.constant import codecarbon_default_cpu_watts
from lightning_pulse.energy.meter import ESTIMATED, EnergyMeter, MeterError

CODECARBON_LOGGER = "codecarbon"
START_THREAD_NAME = "lightning-pulse-codecarbon-start"
TRACKING_MODES = ("machine", "process")
_KWH_TO_J = 3.6e6
#: an interval whose codecarbon energy implies more than this many times codecarbon's own model power (the mean
#: of the powers it measured) is not a power: in machine mode its CPU model draws 10-100% of the TDP, so the
#: mean is at least a tenth of any power it gives, and its RAM model is one constant
PLAUSIBLE_FACTOR = 10.0
#: the least RAM model power (W) a bound is based on: codecarbon's smallest RAM (two 5 W DIMMs); the CPU's is
#: its generic CPU (:func:`plausible_floor_watts`), so a near-idle start does not make ordinary load look
#: implausible
PLAUSIBLE_RAM_FLOOR_W = 10.0
#: while an extrapolation that ran ahead of codecarbon's measured total (its power fell) is taken back, the
#: figure grows at this share of codecarbon's power instead of standing still
PAYBACK_SHARE = 0.5
#: the longest a fork on another thread (a DataLoader starting its workers) waits for a codecarbon start in
#: flight; a start that takes longer is not waited for again (a first start takes 1.5-3 s)
FORK_WAIT_S = 10.0
#: codecarbon measures again at a flush at least this long (s) after its last measurement
#: (``_measure_power_and_energy_if_stale``'s 50 ms), with a margin
REMEASURE_S = 0.06
#: how often a background start in ``"process"`` mode whose CPU reads exactly 0 W measures again (each
#: :data:`REMEASURE_S` later) before it takes 0 W as the process's power: a process idle but for codecarbon
#: (its training thread waiting for the start at an epoch end) saw no 10 ms tick of CPU time in 6 of 16 such
#: windows, so 5 tries (0.3 s) still read 0 W about once in 130 starts, 10 tries once in 20,000
REMEASURE_TRIES = 10


class ForkGate:
    """Holds ``os.fork()`` on other threads while codecarbon starts on a thread of its own.

    codecarbon's start runs subprocesses (``uname -p`` through ``platform.platform()``, ``lscpu``, ``file``,
    cpuinfo's probe; ``nvidia-smi`` and ``rocm-smi`` at its import). A process forked while one of them is
    being spawned inherits the write end of the spawn's pipes (``O_CLOEXEC`` closes them at an ``exec``, and
    a forked worker does not exec): the start then reads its pipe until that process exits, for a
    persistent DataLoader worker the whole fit. Caching ``platform``'s answers beforehand covers one of these
    only, so a fork waits here for the start instead, at most :data:`FORK_WAIT_S`, through an
    ``os.register_at_fork`` hook (registered once per process, at the first background start; subprocess
    spawns do not run such hooks). A fork with no start in flight costs one set lookup.
    """

    def __init__(self) -> None:
        self._reset()
        self._registered = False

    def _reset(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._starters: set[threading.Thread] = set()

    def enter(self, starter: threading.Thread) -> None:
        """``starter`` (not started yet) holds forks from now until :meth:`leave`."""
        with self._changed:
            if not self._registered and hasattr(os, "register_at_fork"):
                # its own fork hook takes the lock `ThreadPoolExecutor.submit` needs (codecarbon's CPU probe):
                # imported first, so that ours, registered after it, runs before it
                import concurrent.futures.thread  # noqa: F401

                os.register_at_fork(before=self._wait, after_in_child=self._reset)
                self._registered = True
            self._starters.add(starter)

    def leave(self, starter: threading.Thread | None) -> None:
        with self._changed:
            self._starters.discard(starter)  # type: ignore[arg-type]
            self._changed.notify_all()

    def _wait(self) -> None:
        if not self._starters:
            return
        current = threading.current_thread()
        deadline = time.monotonic() + FORK_WAIT_S
        with self._changed:
            while self._starters and current not in self._starters:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._starters.clear()  # stuck: the next fork does not wait for it again
                    break
                self._changed.wait(remaining)


#: the process's one gate: forks are process-wide
FORK_GATE = ForkGate()


@functools.cache
def plausible_floor_watts() -> tuple[float, float]:
    """The least model power (W) of CPU and RAM a plausibility bound is based on: codecarbon's generic CPU
    (85 W TDP x 0.5) and :data:`PLAUSIBLE_RAM_FLOOR_W`. Read at the first bound, not at import: it imports
    codecarbon."""
    return codecarbon_default_cpu_watts()[0], PLAUSIBLE_RAM_FLOOR_W


def country_carbon_intensity(country_iso_code: str) -> float:
    """Grid carbon intensity of a country in gCO2eq/kWh from codecarbon's offline energy-mix data.

    Raises:
        ValueError: if codecarbon has no data for ``country_iso_code`` (codecarbon itself would silently
            use the world average; we refuse instead).
    """
    from codecarbon.core.emissions import Emissions
    from codecarbon.core.units import Energy
    from codecarbon.external.geography import GeoMetadata
    from codecarbon.input import DataSource

    code = validate_country(country_iso_code)
    data_source = DataSource()
    with quiet_codecarbon():
        kg = Emissions(data_source).get_country_emissions(
            Energy.from_energy(kWh=1.0), GeoMetadata(country_iso_code=code)
        )
    return float(kg) * 1000.0


def validate_country(country_iso_code: Any, field: str = "country_iso_code") -> str:
    """Upper-cased ISO 3166-1 alpha-3 code known to codecarbon's offline data, else ValueError."""
    from codecarbon.input import DataSource

    if not isinstance(country_iso_code, str) or len(country_iso_code.strip()) != 3:
        raise ValueError(
            f"`{field}`={country_iso_code!r} must be a 3-letter ISO 3166-1 code such as 'DEU' or 'BRA'."
        )
    code = country_iso_code.strip().upper()
    if code not in DataSource().get_global_energy_mix_data():
        raise ValueError(
            f"`{field}`={country_iso_code!r} is not in codecarbon's offline energy-mix data "
            "(global_energy_mix.json); use a 3-letter ISO code such as 'DEU', 'FRA', 'GBR', 'USA' or 'BRA'."
        )
    return code


class quiet_codecarbon:
    """Set codecarbon's logger to ERROR inside the block (it logs every measurement at INFO otherwise)."""

    def __enter__(self) -> quiet_codecarbon:
        self._logger = logging.getLogger(CODECARBON_LOGGER)
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.setLevel(self._level)


def _receiver_class() -> type:
    from codecarbon.output_methods.base_output import BaseOutput

    class _LatestReading(BaseOutput):
        """codecarbon output handler that keeps the latest cumulative figures."""

        def __init__(self) -> None:
            self.count = 0
            self.cpu_kwh = 0.0
            self.ram_kwh = 0.0
            self.cpu_watts = 0.0
            self.ram_watts = 0.0

        def out(self, total: Any, delta: Any) -> None:
            self.cpu_kwh = float(total.cpu_energy)
            self.ram_kwh = float(total.ram_energy)
            self.cpu_watts = float(total.cpu_power)
            self.ram_watts = float(total.ram_power)
            self.count += 1

        def live_out(self, total: Any, delta: Any) -> None:
            pass

    return _LatestReading


class CodecarbonSession:
    """One running ``OfflineEmissionsTracker`` shared by the CPU and RAM meters.

    Args:
        country_iso_code: passed to the tracker (its own emissions figure is not used).
        tracking_mode: ``"machine"`` (the whole node, codecarbon's default; right when one process per node
            meters) or ``"process"``: the CPU as its TDP times this process's CPU time (a share of the cores),
            but RAM not as a share: codecarbon 3 prices the process's memory as a machine holding that much,
            with a floor of two DIMMs (10 W on x86 for any process up to 16 GB, 3 W on ARM;
            ``codecarbon.external.ram.RAM._calculate_ram_power``), a constant power times wall time. On a
            CPU-only fit that is most of the energy (82-96% in a held-out sweep), so two runs' energy then
            compares about as their wall times do, waits for other processes included.
        measure_power_secs: codecarbon's own periodic measurement; ours are driven by ``flush``, so this
            is long to keep codecarbon's timer thread idle.
        min_flush_interval: readings closer than this (seconds) to the last flush are extrapolated.
        background: start the tracker on a thread of its own and return at once (what EnergyLogger does:
            codecarbon's first start in a process detects the hardware, 1.5-3 s, which must not hold up
            training). Until it has started, readings are the zero point; its first reading then holds the
            energy from the request on, the gap before codecarbon's own start at its first measured power.
            A start that fails shows at the next reading, as a failure of the meter there.
    """

    def __init__(
        self,
        country_iso_code: str | None = None,
        tracking_mode: str = "machine",
        measure_power_secs: float = 3600.0,
        min_flush_interval: float = 0.5,
        background: bool = False,
    ) -> None:
        if tracking_mode not in TRACKING_MODES:
            raise ValueError(f"`tracking_mode`={tracking_mode!r} is not one of {list(TRACKING_MODES)}.")
        self.country_iso_code = country_iso_code
        self.tracking_mode = tracking_mode
        self.measure_power_secs = measure_power_secs
        self.tracker: Any = None
        self.receiver: Any = None
        self.error: str | None = None
        self._users = 0
        self._lock = threading.RLock()  # re-entered by a foreground start under `acquire`
        self.min_flush_interval = float(min_flush_interval)
        self._last_now: float | None = None
        self._last_value = (0.0, 0.0)
        self._flush_now: float | None = None
        self._flushed = (0.0, 0.0)
        self._raw_flushed: tuple[float, float] | None = None  # codecarbon's own totals at the latest flush
        self._watts: tuple[float, float] | None = None  # the power of the latest flush interval
        self._start_watts = (0.0, 0.0)  # codecarbon's own power at the latest measuring flush
        self._quiet: quiet_codecarbon | None = None
        self.hardware: dict[str, Any] = {}
        self.background = bool(background)
        self._starter: threading.Thread | None = None
        self._abandoned = False  # a background start given up: its thread stops its own tracker if it ends
        self._gap_kwh = (0.0, 0.0)  # (cpu, ram) before codecarbon's own start, of a background start
        self._dropped_kwh = (0.0, 0.0)  # (cpu, ram) cut from implausible intervals, off every later total
        self._notices: dict[str, list[str]] = {"cpu": [], "ram": []}
        self._metered = {"cpu": 0, "ram": 0}  # live meters per component: the ones that take notices

    def acquire(self, now: float, component: str | None = None) -> None:
        """Start the tracker on first use (on a thread of its own when ``background``). Raises
        :class:`MeterError` if a start in the foreground produces no reading. ``component``: the meter's
        (``"cpu"`` or ``"ram"``), so that corrections are announced to a meter that reads them."""
        with self._lock:
            if self.error is not None:
                raise MeterError(self.error)
            if self.tracker is None and self._starter is None:
                if self.background:
                    self._starter = threading.Thread(
                        target=self._start_quietly,
                        args=((time.perf_counter(), now),),
                        name=START_THREAD_NAME,
                        daemon=True,
                    )
                    FORK_GATE.enter(self._starter)  # before it runs: a fork right after must wait too
                    self._starter.start()
                else:
                    self._start(None)
            self._users += 1
            if component is not None:
                self._metered[component] += 1

    @property
    def starting(self) -> bool:
        """Whether the tracker is still starting in the background (readings are the zero point meanwhile)."""
        return self.tracker is None and self._starter is not None and self.error is None

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait for a background start to finish; whether the tracker runs."""
        starter = self._starter
        if starter is not None and starter is not threading.current_thread():
            starter.join(timeout)
        return self.tracker is not None

    def abandon_start(self, reason: str) -> None:
        """Give up a background start still running: readings raise :class:`MeterError` from now on (the
        meters' chains fall back), forks no longer wait for it, and its thread, if the start ever ends,
        stops the tracker it built rather than publish it."""
        with self._lock:
            if not self.starting:
                return
            self._abandoned = True
            self.error = reason  # word for word the chain's: the meters sharing it warn once
            starter = self._starter
        FORK_GATE.leave(starter)

    def release(self, component: str | None = None) -> None:
        with self._lock:
            self._users = max(self._users - 1, 0)
            if component is not None:
                self._metered[component] = max(self._metered[component] - 1, 0)
            if self._users:
                return
        # a tracker still starting is stopped once it runs, never left behind: by us, or by its own thread
        if not self._abandoned and not self.wait_started(timeout=60.0):
            self.abandon_start("it did not finish within 60 s of the meters' release")
        with self._lock:
            if self._users == 0:
                self._stop()

    def read(self, now: float) -> tuple[float, float]:
        """Cumulative ``(cpu_kwh, ram_kwh)`` since start, at monotonic time ``now``.

        One ``flush`` per sampling instant (the CPU and RAM meters share it). codecarbon's estimate is power
        x time, but it only adds to its totals when it measures, at most every 50 ms: between two of its
        measurements (a reading less than ``min_flush_interval`` after the last flush, or a flush that
        measured nothing) the last measured totals are carried forward to ``now`` with the latest power. So
        every interval gets its energy, and a run shorter than codecarbon's measuring period does not end
        with none. A carried figure that ran ahead of a later measurement is not taken back (totals are
        cumulative); the figure then grows at :data:`PAYBACK_SHARE` of the power until the measurement
        catches up, so no interval reads 0 W while codecarbon draws power.
        """
        with self._lock:
            if self.error is not None:
                raise MeterError(self.error)
            if self.tracker is None:
                if self._starter is not None:  # still starting in the background: the zero point
                    return self._last_value
                raise MeterError("codecarbon tracker is not running")
            if self._last_now is not None and abs(now - self._last_now) <= 1e-3:
                return self._last_value
            # carried forward without a flush only with the power of an interval of ours; before there is
            # one, a flush (more accurate than codecarbon's start-up power) is worth its cost
            if (
                self._watts is not None
                and self._flush_now is not None
                and 0 <= now - self._flush_now < self.min_flush_interval
            ):
                value = self._extrapolated(now)
            else:
                value = self._flush(now)
            value = self._behind_the_figure_given(value, now)
            self._last_now, self._last_value = now, value
            return value

    def take_notices(self, component: str) -> list[str]:
        """The corrections made for ``component`` since the last call (see :meth:`EnergyMeter.take_notices`)."""
        with self._lock:
            notices, self._notices[component] = self._notices[component], []
            return notices

    def _flush(self, now: float) -> tuple[float, float]:
        before = self.receiver.count
        self.tracker.flush()
        if self.receiver.count == before:
            self.error = "codecarbon's tracker raised inside flush() and returned no measurement"
            raise MeterError(self.error)
        raw = (self.receiver.cpu_kwh, self.receiver.ram_kwh)
        if self._flush_now is not None and raw == self._raw_flushed:
            # codecarbon measured nothing (`_measure_power_and_energy_if_stale`): no new interval; the next
            # measuring flush covers the whole span. Compared on codecarbon's own totals: ours, less a cut
            # excess, round differently from one flush to the next
            return self._extrapolated(now)
        gap, dropped = self._gap_kwh, self._dropped_kwh
        value = (raw[0] + gap[0] - dropped[0], raw[1] + gap[1] - dropped[1])
        model_watts = (self.receiver.cpu_watts, self.receiver.ram_watts)
        if self._flush_now is not None and now > self._flush_now:
            seconds = now - self._flush_now
            value = self._plausible(value, model_watts, seconds)
            self._watts = (
                max(value[0] - self._flushed[0], 0.0) * _KWH_TO_J / seconds,
                max(value[1] - self._flushed[1], 0.0) * _KWH_TO_J / seconds,
            )
        self._start_watts = model_watts
        self._flushed, self._flush_now, self._raw_flushed = value, now, raw
        return value

    def _plausible(
        self, value: tuple[float, float], model_watts: tuple[float, float], seconds: float
    ) -> tuple[float, float]:
        """``value``, with a component whose rise over the ``seconds`` since the last flush implies more than
        :data:`PLAUSIBLE_FACTOR` x codecarbon's model power counted at that model power instead (codecarbon's
        own timer firing late, a clock jump): the excess is dropped from this and every later total, with a
        notice (one warning, an event) to the first cut component a meter reads (codecarbon may meter RAM
        only, beside RAPL's CPU); a cut of components no meter reads is not announced."""
        kept, found = list(value), []
        metered = [component for component in ("cpu", "ram") if self._metered[component]]
        for index, component in enumerate(("cpu", "ram")):
            watts = (value[index] - self._flushed[index]) * _KWH_TO_J / seconds
            bound = PLAUSIBLE_FACTOR * max(model_watts[index], plausible_floor_watts()[index])
            if watts > bound:
                kept[index] = self._flushed[index] + model_watts[index] * seconds / _KWH_TO_J
                if component in metered or not metered:  # no meter recorded: the session is read directly
                    found.append(
                        (
                            component,
                            f"{component} {watts:.4g} W over {seconds:.3g} s (above {bound:.4g} W, "
                            f"{PLAUSIBLE_FACTOR:g}x codecarbon's model {model_watts[index]:.3g} W)",
                        )
                    )
        dropped = self._dropped_kwh
        self._dropped_kwh = (dropped[0] + value[0] - kept[0], dropped[1] + value[1] - kept[1])
        if found:
            self._notices[found[0][0]].append(
                f"codecarbon's totals implied {' and '.join(text for _, text in found)}, not a power; counted "
                "at the model's power, the excess dropped"
            )
        return kept[0], kept[1]

    def _behind_the_figure_given(self, value: tuple[float, float], now: float) -> tuple[float, float]:
        """``value``, unless a carried figure ran ahead of it (codecarbon's power fell within the carry): then
        the figure given so far, grown at :data:`PAYBACK_SHARE` of the power until the total catches up.
        Holding it flat instead made every interval up to then read 0 W."""
        last = self._last_value
        if self._last_now is None or (value[0] >= last[0] and value[1] >= last[1]):
            return (max(value[0], last[0]), max(value[1], last[1]))
        watts = self._watts if self._watts is not None else self._start_watts
        seconds = max(now - self._last_now, 0.0)
        return (
            value[0] if value[0] >= last[0] else last[0] + PAYBACK_SHARE * watts[0] * seconds / _KWH_TO_J,
            value[1] if value[1] >= last[1] else last[1] + PAYBACK_SHARE * watts[1] * seconds / _KWH_TO_J,
        )

    def _extrapolated(self, now: float) -> tuple[float, float]:
        """The last flushed totals carried forward to ``now`` with the power of the latest interval, or
        before there is one, the average power codecarbon reported at its latest measurement."""
        watts = self._watts if self._watts is not None else self._start_watts
        if self._flush_now is None:
            return self._flushed
        elapsed_h = max(now - self._flush_now, 0.0) / 3600.0
        return (
            self._flushed[0] + watts[0] * elapsed_h / 1000.0,
            self._flushed[1] + watts[1] * elapsed_h / 1000.0,
        )

    def _start_quietly(self, requested: tuple[float, float]) -> None:
        try:
            self._start(requested)
        except MeterError:  # kept in `self.error`: the next reading raises it, and the chain falls back there
            pass
        finally:
            FORK_GATE.leave(threading.current_thread())

    def _start(self, requested: tuple[float, float] | None) -> None:
        """Build, start and flush the tracker; publish it under the lock only once it measures.
        ``requested``: a background start's request, as ``(time.perf_counter(), the caller's now)``: the gap
        before codecarbon's own start is counted, and the start's flush is the first of ours, dated at
        codecarbon's measurement in it (not when the start returned: a start thread that lost the CPU
        in between once divided the next reading's energy by a few milliseconds, ~100x the power)."""
        from codecarbon import OfflineEmissionsTracker

        quiet = quiet_codecarbon().__enter__()
        receiver = _receiver_class()()
        tracker: Any = None
        error: str | None = None
        origin = time.perf_counter()
        cpu_watts = 0.0
        try:
            tracker = OfflineEmissionsTracker(
                country_iso_code=self.country_iso_code,
                measure_power_secs=self.measure_power_secs,
                api_call_interval=-1,
                output_handlers=[receiver],
                output_methods=[],  # no CSV, API, logger or Prometheus output: codecarbon 3's non-deprecated way
                log_level="error",
                allow_multiple_runs=True,
                tracking_mode=self.tracking_mode,
            )
            tracker.start()  # codecarbon counts from the end of its hardware detection, inside start()
            origin = time.perf_counter()
            tracker.flush()
            cpu_watts = receiver.cpu_watts
            if (
                requested is not None
                and self.tracking_mode == "process"
                and receiver.count
                and cpu_watts == 0.0
            ):
                cpu_watts = self._remeasured_cpu_watts(tracker, receiver, origin)
        except Exception as caught:
            error = f"codecarbon could not start ({type(caught).__name__}: {caught})"
        if error is None and receiver.count == 0:
            error = "codecarbon's tracker raised inside start()/flush() and returned no measurement"
        hardware: dict[str, Any] = {}
        if error is None:
            try:
                hardware = dict(tracker.get_detected_hardware())
            except Exception:  # only descriptive; never worth failing for
                hardware = {}
        with self._lock:
            abandoned = self._abandoned  # the meters fell back without it: stopped below, unpublished
            if not abandoned:
                self._publish(tracker, receiver, quiet, hardware, error, requested, origin, cpu_watts)
        if abandoned:
            _stop_tracker(tracker)
            quiet.__exit__(None, None, None)
            return
        if error is not None:
            raise MeterError(error)

    def _publish(
        self,
        tracker: Any,
        receiver: Any,
        quiet: quiet_codecarbon,
        hardware: dict[str, Any],
        error: str | None,
        requested: tuple[float, float] | None,
        origin: float,
        cpu_watts: float,
    ) -> None:
        """Under the lock: the started tracker becomes the session's (a failed one is stopped). ``cpu_watts``:
        the CPU power the start-up gap is counted at (codecarbon's, or :meth:`_remeasured_cpu_watts`)."""
        self.tracker, self.receiver, self._quiet, self.hardware = tracker, receiver, quiet, hardware
        if error is None and requested is not None:
            mono, now = requested
            hours = max(origin - mono, 0.0) / 3600.0
            gap = self._gap_kwh = (cpu_watts * hours / 1000.0, receiver.ram_watts * hours / 1000.0)
            # the start's flush, in the caller's clock at codecarbon's latest measurement (its totals
            # hold the energy up to then; start() ends with one): later readings carry forward from it,
            # so a span in which codecarbon measures nothing new still gets its energy
            measured = _measured_time(tracker, origin)
            self._flushed = (receiver.cpu_kwh + gap[0], receiver.ram_kwh + gap[1])
            self._raw_flushed = (receiver.cpu_kwh, receiver.ram_kwh)
            self._flush_now = now + (measured - mono)
            self._start_watts = (cpu_watts, receiver.ram_watts)
        if error is not None:
            self.error = error
            self._stop()

    def _remeasured_cpu_watts(self, tracker: Any, receiver: Any, origin: float) -> float:
        """On the start thread, before the tracker is published (the meter still starting: no reading covers
        the backlog meanwhile): the CPU power of a ``"process"``-mode start that read exactly 0 W, measured
        again over :data:`REMEASURE_S` windows, at most :data:`REMEASURE_TRIES` times while it reads 0 W.
        codecarbon's start-up window is a millisecond or two, below the 10 ms tick of the process CPU times
        it reads, so its 0 W is no power: the start-up gap, counted at it, lost a working process's CPU
        energy (a fit shorter than the start-up reported 0 kWh CPU). A process that really is idle still reads
        0 W. The power of the latest window, not codecarbon's running mean (which averages the 0 W in)."""
        watts, since = 0.0, _measured_time(tracker, origin)
        for _ in range(REMEASURE_TRIES):
            if self._abandoned:
                break
            kwh = receiver.cpu_kwh
            time.sleep(REMEASURE_S)
            tracker.flush()  # codecarbon measures: over 50 ms since its latest measurement
            measured = _measured_time(tracker, time.perf_counter())
            if measured > since:
                watts = max(receiver.cpu_kwh - kwh, 0.0) * _KWH_TO_J / (measured - since)
            since = measured
            if watts > 0.0:
                break
        return watts

    def _stop(self) -> None:
        tracker, self.tracker = self.tracker, None
        self._starter = None
        _stop_tracker(tracker)
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None


def _measured_time(tracker: Any, default: float) -> float:
    """codecarbon's latest measurement in ``time.perf_counter()`` (``default`` where it does not say)."""
    measured = getattr(tracker, "_last_measured_time", None)
    if not isinstance(measured, float) or not default - 1.0 <= measured <= time.perf_counter():
        return default
    return measured


def _stop_tracker(tracker: Any) -> None:
    if tracker is not None:
        try:
            tracker.stop()
        except Exception:  # stopping must not raise; its timers are cancelled before anything can fail
            pass
        _join_timers(tracker)


def _join_timers(tracker: Any) -> None:
    """Wait for the tracker's ``threading.Timer`` threads to end, so none is left behind.

    codecarbon's periodic scheduler re-arms a new Timer from inside a firing one; a Timer firing while
    ``stop()`` runs can re-arm after it. We find the Timers whose scheduler belongs to this tracker,
    cancel them and join them, until none is left.
    """
    for _ in range(5):
        timers = []
        for thread in threading.enumerate():
            scheduler = getattr(getattr(thread, "function", None), "__self__", None)
            owner = getattr(getattr(scheduler, "function", None), "__self__", None)
            if isinstance(thread, threading.Timer) and owner is tracker:
                timers.append(thread)
        if not timers:
            return
        for thread in timers:
            thread.cancel()
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)


class CodecarbonMeter(EnergyMeter):
    """CPU or RAM energy from a :class:`CodecarbonSession`. *Estimated*.

    Args:
        component: ``"cpu"`` or ``"ram"``.
        session: the shared tracker session.
    """

    method = ESTIMATED
    name = "codecarbon"

    def __init__(self, component: str, session: CodecarbonSession) -> None:
        if component not in ("cpu", "ram"):
            raise ValueError(f"`component`={component!r} must be 'cpu' or 'ram' for codecarbon.")
        self.component = component
        self.session = session
        self._baseline_kwh = 0.0
        self._acquired = False

    def start(self, now: float) -> None:
        self.session.acquire(now, self.component)
        self._acquired = True
        self._baseline_kwh = self._kwh(now)

    def _kwh(self, now: float) -> float:
        cpu_kwh, ram_kwh = self.session.read(now)
        return cpu_kwh if self.component == "cpu" else ram_kwh

    def read_joules(self, now: float) -> float:
        return (self._kwh(now) - self._baseline_kwh) * _KWH_TO_J

    def take_notices(self) -> list[str]:
        return super().take_notices() + self.session.take_notices(self.component)

    @property
    def starting(self) -> bool:
        return self.session.starting

    def settle(self, timeout: float) -> None:
        self.session.wait_started(timeout)

    def give_up_start(self, reason: str) -> None:
        self.session.abandon_start(reason)

    def close(self) -> None:
        if self._acquired:
            self._acquired = False
            self.session.release(self.component)

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "tracking_mode": self.session.tracking_mode}
        hardware = self.session.hardware
        if self.component == "cpu" and hardware.get("cpu_model"):
            described["cpu_model"] = hardware["cpu_model"]
        if self.component == "ram" and hardware.get("ram_total_size"):
            described["ram_total_gb"] = hardware["ram_total_size"]
        return described
