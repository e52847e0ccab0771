"""CPU and RAM energy *estimated* by codecarbon's offline tracker, and country carbon intensities.

One :class:`CodecarbonSession` runs one ``codecarbon.OfflineEmissionsTracker`` (no network calls) and two
meters read from it: :class:`CodecarbonMeter` for ``"cpu"`` (TDP x load model when RAPL is not readable)
and for ``"ram"`` (codecarbon's memory-power estimate). The session reads the tracker through its public
output-handler interface: each :meth:`CodecarbonSession.read` calls ``tracker.flush()``, which measures
and hands the cumulative figures to our handler. codecarbon swallows its own exceptions inside ``flush``;
a flush that delivers nothing is therefore treated as a failure.

codecarbon's logging is quieted (level ``ERROR``) while the session runs and restored afterwards.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from lightning_pulse.energy.meter import ESTIMATED, EnergyMeter, MeterError

CODECARBON_LOGGER = "codecarbon"
START_THREAD_NAME = "lightning-pulse-codecarbon-start"
TRACKING_MODES = ("machine", "process")
_KWH_TO_J = 3.6e6


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
            meters) or ``"process"`` (this process's share of CPU load and memory).
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
        self._watts: tuple[float, float] | None = None  # the power of the latest flush interval
        self._start_watts = (0.0, 0.0)  # codecarbon's own power at the latest measuring flush
        self._quiet: quiet_codecarbon | None = None
        self.hardware: dict[str, Any] = {}
        self.background = bool(background)
        self._starter: threading.Thread | None = None
        self._gap_kwh = (0.0, 0.0)  # (cpu, ram) before codecarbon's own start, of a background start

    def acquire(self, now: float) -> None:
        """Start the tracker on first use (on a thread of its own when ``background``). Raises
        :class:`MeterError` if a start in the foreground produces no reading."""
        with self._lock:
            if self.error is not None:
                raise MeterError(self.error)
            if self.tracker is None and self._starter is None:
                if self.background:
                    self._starter = threading.Thread(
                        target=self._start_quietly,
                        args=((time.monotonic(), now),),
                        name=START_THREAD_NAME,
                        daemon=True,
                    )
                    self._starter.start()
                else:
                    self._start(None)
            self._users += 1

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

    def release(self) -> None:
        with self._lock:
            self._users = max(self._users - 1, 0)
            if self._users:
                return
        self.wait_started(timeout=60.0)  # a tracker still starting is stopped once it runs, never left behind
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
        with none.
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
                before = self.receiver.count
                self.tracker.flush()
                if self.receiver.count == before:
                    self.error = "codecarbon's tracker raised inside flush() and returned no measurement"
                    raise MeterError(self.error)
                gap = self._gap_kwh
                value = (self.receiver.cpu_kwh + gap[0], self.receiver.ram_kwh + gap[1])
                if self._flush_now is not None and value == self._flushed:
                    # codecarbon measured nothing (`_measure_power_and_energy_if_stale`): no new interval;
                    # the next measuring flush covers the whole span
                    value = self._extrapolated(now)
                else:
                    if self._flush_now is not None and now > self._flush_now:
                        hours = (now - self._flush_now) / 3600.0
                        self._watts = (
                            max(value[0] - self._flushed[0], 0.0) * 1000.0 / hours,
                            max(value[1] - self._flushed[1], 0.0) * 1000.0 / hours,
                        )
                    self._start_watts = (self.receiver.cpu_watts, self.receiver.ram_watts)
                    self._flushed, self._flush_now = value, now
            # an extrapolation is never taken back: a later, lower measurement is held at the figure given
            value = (max(value[0], self._last_value[0]), max(value[1], self._last_value[1]))
            self._last_now, self._last_value = now, value
            return value

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

    def _start(self, requested: tuple[float, float] | None) -> None:
        """Build, start and flush the tracker; publish it under the lock only once it measures.
        ``requested``: a background start's request, as ``(time.monotonic(), the caller's now)``: the gap
        before codecarbon's own start is counted, and the start's flush is the first of ours."""
        from codecarbon import OfflineEmissionsTracker

        quiet = quiet_codecarbon().__enter__()
        receiver = _receiver_class()()
        tracker: Any = None
        error: str | None = None
        origin = time.monotonic()
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
            origin = time.monotonic()
            tracker.flush()
            flushed = time.monotonic()
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
            self.tracker, self.receiver, self._quiet, self.hardware = tracker, receiver, quiet, hardware
            if error is None and requested is not None:
                mono, now = requested
                hours = max(origin - mono, 0.0) / 3600.0
                gap = self._gap_kwh = (
                    receiver.cpu_watts * hours / 1000.0,
                    receiver.ram_watts * hours / 1000.0,
                )
                # the start's flush, in the caller's clock: later readings carry forward from it, so a span
                # in which codecarbon measures nothing new still gets its energy
                self._flushed = (receiver.cpu_kwh + gap[0], receiver.ram_kwh + gap[1])
                self._flush_now = now + (flushed - mono)
                self._start_watts = (receiver.cpu_watts, receiver.ram_watts)
            if error is not None:
                self.error = error
                self._stop()
        if error is not None:
            raise MeterError(error)

    def _stop(self) -> None:
        tracker, self.tracker = self.tracker, None
        self._starter = None
        if tracker is not None:
            try:
                tracker.stop()
            except Exception:  # stopping must not raise; its timers are cancelled before anything can fail
                pass
            _join_timers(tracker)
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None


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
        self.session.acquire(now)
        self._acquired = True
        self._baseline_kwh = self._kwh(now)

    def _kwh(self, now: float) -> float:
        cpu_kwh, ram_kwh = self.session.read(now)
        return cpu_kwh if self.component == "cpu" else ram_kwh

    def read_joules(self, now: float) -> float:
        return (self._kwh(now) - self._baseline_kwh) * _KWH_TO_J

    @property
    def starting(self) -> bool:
        return self.session.starting

    def settle(self, timeout: float) -> None:
        self.session.wait_started(timeout)

    def close(self) -> None:
        if self._acquired:
            self._acquired = False
            self.session.release()

    def describe(self) -> dict[str, Any]:
        described = {**super().describe(), "tracking_mode": self.session.tracking_mode}
        hardware = self.session.hardware
        if self.component == "cpu" and hardware.get("cpu_model"):
            described["cpu_model"] = hardware["cpu_model"]
        if self.component == "ram" and hardware.get("ram_total_size"):
            described["ram_total_gb"] = hardware["ram_total_size"]
        return described
