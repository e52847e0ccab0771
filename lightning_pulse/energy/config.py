"""The rarely turned knobs of :class:`~lightning_pulse.EnergyLogger`, as two small validated dataclasses.

LightningCLI nests them under the callback's ``init_args``::

    init_args:
      country_iso_code: DEU
      meters: {sampling_period: 0.5, codecarbon_tracking_mode: process}
      accounting: {progress_bar: false}
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_pulse.energy.codecarbon_meter import TRACKING_MODES
from lightning_pulse.energy.rapl import DEFAULT_POWERCAP_ROOT
from lightning_pulse.errors import FLOAT_RANGE, plain_fields, too_large_for_float


class _EnergyLoggerConfig:
    """Validates a config dataclass at construction; an error names EnergyLogger, whose arguments these are."""

    def __post_init__(self) -> None:
        plain_fields(self)  # np.float32(0.5) as 0.5, as the callbacks' own arguments
        try:
            self._validate()
        except ValueError as error:
            raise ValueError(prefixed(str(error))) from None
        except OverflowError:  # an integer beyond the float range: name it, not Python's bare message
            nested = "meters" if isinstance(self, MeterConfig) else "accounting"
            field = next((name for name, value in vars(self).items() if too_large_for_float(value)), None)
            if field is None:
                raise
            raise ValueError(
                prefixed(f"`{nested}.{field}` is an integer beyond the range of a float ({FLOAT_RANGE}).")
            ) from None

    def _validate(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class MeterConfig(_EnergyLoggerConfig):
    """How the meters are read.

    Args:
        sampling_period: seconds between meter readings on the background thread.
        gpu_devices: NVML indices or GPU UUIDs to meter instead of the rank's own CUDA device: the node's
            devices (NVML names a GPU alike in every process), metered on local rank 0 of each node only.
        cpu_watts: a constant CPU power in watts: what ``cpu="constant"`` counts, and the last CPU fallback
            of ``cpu="auto"`` / ``"codecarbon"`` (without it, codecarbon's power for a generic CPU is).
        rapl_root: the powercap sysfs directory.
        codecarbon_tracking_mode: codecarbon's ``"machine"`` (the whole node) or ``"process"`` (the CPU as
            its TDP times this process's CPU time, a share of the cores; RAM as a machine holding this process's
            memory, with codecarbon 3's floor of two DIMMs: 10 W on x86 for any process up to 16 GB; codecarbon
            2 prices the gigabytes the process holds: either way a power set by memory size times wall time, not
            a share of the node's memory, and most of a CPU-only fit's energy).

    Raises:
        ValueError: on a bad value, naming the field, the value and what is allowed.
    """

    sampling_period: float = 1.0
    gpu_devices: Sequence[int | str] | None = None
    cpu_watts: float | None = None
    rapl_root: str = DEFAULT_POWERCAP_ROOT
    codecarbon_tracking_mode: str = "machine"

    def _validate(self) -> None:
        period = self.sampling_period
        if not _is_number(period) or period <= 0:
            raise ValueError(f"`meters.sampling_period`={period!r} must be a positive number of seconds.")
        object.__setattr__(self, "sampling_period", float(period))
        devices = self.gpu_devices
        if devices is not None:
            # the type before any iteration: a float gave Python's bare "'float' object is not iterable"
            listed = isinstance(devices, Iterable) and not isinstance(devices, (str, bytes))
            entries = tuple(devices) if listed else ()
            if not listed or not all(
                (isinstance(d, int) and not isinstance(d, bool) and d >= 0) or (isinstance(d, str) and d)
                for d in entries
            ):
                raise ValueError(
                    f"`meters.gpu_devices`={devices!r} must be a list of NVML indices (int >= 0) or GPU UUIDs."
                )
            object.__setattr__(self, "gpu_devices", entries)
        if self.cpu_watts is not None:
            if not _is_number(self.cpu_watts) or self.cpu_watts < 0:
                raise ValueError(
                    f"`meters.cpu_watts`={self.cpu_watts!r} must be a finite number of watts >= 0."
                )
            object.__setattr__(self, "cpu_watts", float(self.cpu_watts))
        if self.codecarbon_tracking_mode not in TRACKING_MODES:
            raise ValueError(
                f"`meters.codecarbon_tracking_mode`={self.codecarbon_tracking_mode!r} is not one of "
                f"{list(TRACKING_MODES)}."
            )
        object.__setattr__(self, "rapl_root", str(self.rapl_root))


@dataclass(frozen=True)
class AccountingConfig(_EnergyLoggerConfig):
    """How figures are dated, counted and shown.

    Args:
        carbon_intensity_start: read a carbon-intensity CSV series as if the run had started at this UTC
            time (e.g. ``"2020-06-01 12:00:00"``), inside the series; by default the run's own dates, or the
            same time of year when the run starts outside the series.
        price_start: the same, for a price series.
        sample_counter: ``batch -> int`` replacing the default sample count.
        token_counter: ``batch -> int | None`` replacing the default token count.
        log_every_n_steps: step-level logging interval; default the Trainer's.
        progress_bar: show the total kWh in the progress bar.
        baseline: a baseline run's ``energy_report.json``, or a log directory holding one (for instance the
            plain run's): the report then compares this run against it (wall time, kWh, CO2, cost, final
            metrics and the ratios this/baseline), as ``lightning-pulse compare BASELINE THIS`` does.

    Raises:
        ValueError: on a bad value, naming the field, the value and what is allowed.
    """

    carbon_intensity_start: str | None = None
    price_start: str | None = None
    sample_counter: Callable[[Any], int] | None = None
    token_counter: Callable[[Any], int | None] | None = None
    log_every_n_steps: int | None = None
    progress_bar: bool = True
    baseline: str | None = None

    def _validate(self) -> None:
        if self.baseline is not None:
            from lightning_pulse.energy.compare import load_run

            if not isinstance(self.baseline, (str, os.PathLike)):
                raise ValueError(f"`accounting.baseline`={self.baseline!r} must be a path or None.")
            try:  # its errors name the field, the value and what is allowed
                load_run(self.baseline, field="accounting.baseline")
            except OSError as error:
                raise ValueError(str(error)) from None
            object.__setattr__(self, "baseline", os.fspath(self.baseline))
        steps = self.log_every_n_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"`accounting.log_every_n_steps`={steps!r} must be a positive int or None.")
        for field in ("sample_counter", "token_counter"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise ValueError(
                    f"`accounting.{field}`={value!r} must be a callable taking a batch, or None."
                )
        if not isinstance(self.progress_bar, bool):
            raise ValueError(f"`accounting.progress_bar`={self.progress_bar!r} must be True or False.")
        from lightning_pulse.energy.carbon import parse_series_start

        for field in ("carbon_intensity_start", "price_start"):
            parse_series_start(getattr(self, field), f"accounting.{field}")  # a timestamp, or refused now


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def prefixed(message: str) -> str:
    """``message`` as the first line a user reads: it names the callback (``"EnergyLogger: ..."``)."""
    return message if message.startswith("EnergyLogger: ") else f"EnergyLogger: {message}"


@contextmanager
def naming_energy_logger() -> Iterator[None]:
    """A ``ValueError`` raised in the block (EnergyLogger's construction) comes out :func:`prefixed`: the
    first line a user reads names the callback (the CLI prints it)."""
    try:
        yield
    except ValueError as error:
        raise ValueError(prefixed(str(error))) from None


def checked_configs(
    meters: MeterConfig | Mapping[str, Any] | None, accounting: AccountingConfig | Mapping[str, Any] | None
) -> tuple[MeterConfig, AccountingConfig]:
    """The two nested configs of ``EnergyLogger``: an instance, a mapping of its fields (as YAML gives it), or
    ``None`` for the defaults."""
    resolved = []
    for field, value, kind in (("meters", meters, MeterConfig), ("accounting", accounting, AccountingConfig)):
        if isinstance(value, Mapping):
            value = kind(**value)
        if value is not None and not isinstance(value, kind):
            raise ValueError(
                f"`{field}`={value!r} must be a {kind.__name__}, a mapping of its fields, or None."
            )
        resolved.append(value or kind())
    return resolved[0], resolved[1]


#: EnergyLogger's default `currency`, which labels nothing without a price
DEFAULT_CURRENCY = "EUR"


def unread_meter_options(gpu: str, cpu: str, ram: str, meters: MeterConfig) -> list[tuple[str, str]]:
    """The ``meters`` fields set away from their defaults that no chosen meter reads, each with why: a meter
    option next to a meter that is off would pass silently, and the figures would not be what the YAML says."""
    defaults = MeterConfig()
    codecarbon = cpu in ("auto", "codecarbon") or ram == "codecarbon"
    reasons = {
        "gpu_devices": None if gpu != "none" else "`gpu`='none' meters no GPU",
        "cpu_watts": None if cpu != "none" else "`cpu`='none' meters no CPU",
        "rapl_root": None if cpu == "auto" else f"RAPL is read by `cpu`='auto' only, and `cpu`={cpu!r}",
        "codecarbon_tracking_mode": None
        if codecarbon
        else f"codecarbon runs for `cpu`='auto'/'codecarbon' or `ram`='codecarbon', and `cpu`={cpu!r}, `ram`={ram!r}",
    }
    return [
        (field, reason)
        for field, reason in reasons.items()
        if reason is not None and getattr(meters, field) != getattr(defaults, field)
    ]


def checked_arguments(
    gpu: str,
    cpu: str,
    ram: str,
    currency: str,
    report_dir: str | Path | None,
    country_iso_code: str | None,
    meters: MeterConfig,
    price_per_kwh: Any,
) -> str | None:
    """Validate ``EnergyLogger``'s top-level arguments (each error names the field, the value and what is
    allowed); returns the country code as codecarbon knows it."""
    from lightning_pulse.energy.account import MODES

    for field, value in (("gpu", gpu), ("cpu", cpu), ("ram", ram)):
        if value not in MODES[field]:
            raise ValueError(f"`{field}`={value!r} is not one of {list(MODES[field])}.")
    if cpu == "constant" and meters.cpu_watts is None:
        raise ValueError("`cpu`='constant' needs `meters.cpu_watts`, the constant CPU power in watts.")
    unread = unread_meter_options(gpu, cpu, ram, meters)
    if unread:
        field, reason = unread[0]
        raise ValueError(f"`meters.{field}`={getattr(meters, field)!r} is not read: {reason}; drop it.")
    if not isinstance(currency, str) or not currency.strip():
        raise ValueError(f"`currency`={currency!r} must be a non-empty string such as 'EUR'.")
    if price_per_kwh is None and currency.strip() != DEFAULT_CURRENCY:
        raise ValueError(
            f"`currency`={currency!r} labels the price, and `price_per_kwh` is None (no cost is reported); set "
            "`price_per_kwh`, or drop `currency`."
        )
    if report_dir is not None and (not isinstance(report_dir, (str, Path)) or not str(report_dir).strip()):
        raise ValueError(
            f"`report_dir`={report_dir!r} must be a directory path, or None for the run's own folder."
        )
    if country_iso_code is None:
        return None
    from lightning_pulse.energy.codecarbon_meter import validate_country

    return validate_country(country_iso_code)
