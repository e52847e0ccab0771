"""CPU energy from Intel/AMD RAPL counters, read through Linux powercap sysfs.

Layout read (the kernel's ``intel-rapl`` powercap driver, also used for AMD packages)::

    /sys/class/powercap/intel-rapl:0/name                 "package-0"
    /sys/class/powercap/intel-rapl:0/energy_uj            cumulative microjoules, wraps around
    /sys/class/powercap/intel-rapl:0/max_energy_range_uj  the value at which it wraps
    /sys/class/powercap/intel-rapl:0:0/...                sub-zones (core, uncore, dram): not summed

Only the top-level ``package-*`` zones are summed: sub-zones are parts of their package, and ``psys``
(platform) overlaps the packages. Since Linux 5.10 ``energy_uj`` is readable by root only (CVE-2020-8694);
an unreadable counter raises :class:`~lightning_pulse.energy.meter.MeterError` so the chain falls back.

A counter can also restart from about 0 without wrapping: after a suspend/resume, a CPU hotplug, a VM migrated
to another host. Read as a wrap, that adds up to ``max_energy_range_uj`` (262 kJ on Intel servers) in one
interval. A lower reading whose wrap would mean more than :data:`MAX_PLAUSIBLE_PACKAGE_WATTS` for its package
over the seconds since the last reading is taken as such a reset: its value is the energy since the reset (as
NVML's counter reset, :class:`~lightning_pulse.energy.nvml.NvmlCounterMeter`), with a notice (one warning, an
event, and the interval labelled *estimated*).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_pulse.energy.meter import MEASURED, EnergyMeter, MeterError, MeterUnavailable

DEFAULT_POWERCAP_ROOT = "/sys/class/powercap"
_TOP_LEVEL_ZONE = re.compile(r"^intel-rapl:\d+$")
#: the most one package can draw: twice the largest server CPU package's TDP so far (500 W). A real wrap
#: counts the package's real energy over the interval, below this; a reset read as a wrap counts most of
#: the whole range
MAX_PLAUSIBLE_PACKAGE_WATTS = 1000.0
#: seconds added to every interval the bound allows energy for: RAPL publishes its counter in steps about
#: every 1 ms, so two readings 0.2 ms apart can see a whole step (up to 1 ms of the package's energy), and a
#: reading's timestamp is taken before its file is read, where the sampling thread may wait for the GIL (5 ms
#: a switch). 10 ms covers both (10 J at 1000 W); a VM move's jump lands anywhere in the counter's range
#: (262 kJ on Intel servers), a counter that went back reads as a wrap of nearly all of it
COUNTER_SLACK_SECONDS = 0.01


@dataclass
class RaplZone:
    """One package counter: where it is, its wrap value, and the last value read."""

    path: Path
    name: str
    max_range_uj: int
    last_uj: int
    total_uj: int = 0

    def energy_file(self) -> Path:
        return self.path / "energy_uj"


def counter_delta(previous_uj: int, current_uj: int, max_range_uj: int) -> int:
    """Microjoules between two readings of a counter that wraps to 0 after ``max_range_uj``.

    A reading below the previous one means the counter wrapped once (unless it was reset, see
    :func:`plausible_delta`); reading at least once per wrap period
    (about an hour at 60 W for a 2^32 uJ range, minutes for a busy server) keeps this exact.
    """
    if current_uj >= previous_uj:
        return current_uj - previous_uj
    return current_uj + max_range_uj - previous_uj


def plausible_delta(previous_uj: int, current_uj: int, max_range_uj: int, seconds: float) -> int | None:
    """Microjoules between two readings, or ``None`` where no reading of the counter explains them: read as
    a step forward (or one wrap), they would mean more than :data:`MAX_PLAUSIBLE_PACKAGE_WATTS` over the
    ``seconds`` since plus :data:`COUNTER_SLACK_SECONDS` (a counter step between readings under 1 ms apart
    is no jump). A counter reset (suspend/resume, CPU hotplug) restarts from 0: its new value is the
    energy since, where that value is itself plausible; a jump (a VM moved to a host whose counter reads
    otherwise, a counter that went back a few microjoules) explains nothing."""
    bound = MAX_PLAUSIBLE_PACKAGE_WATTS * 1e6 * (seconds + COUNTER_SLACK_SECONDS)
    delta = counter_delta(previous_uj, current_uj, max_range_uj)
    if delta <= bound:
        return delta
    if current_uj < previous_uj and current_uj <= bound:  # restarted from 0 since the last reading
        return current_uj
    return None


def find_package_zones(root: str | Path = DEFAULT_POWERCAP_ROOT) -> list[Path]:
    """Top-level RAPL zones named ``package-*`` under ``root``, in index order."""
    root = Path(root)
    if not root.is_dir():
        raise MeterUnavailable(f"no powercap directory at {root}")
    zones = []
    for path in sorted(root.iterdir(), key=lambda p: p.name):
        if not _TOP_LEVEL_ZONE.match(path.name):
            continue
        try:
            name = (path / "name").read_text().strip()
        except OSError:
            continue
        if name.startswith("package"):
            zones.append(path)
    if not zones:
        raise MeterUnavailable(f"no RAPL package zone under {root}")
    return zones


def _read_int(path: Path) -> int:
    try:
        text = path.read_text()
    except PermissionError as error:
        raise MeterError(f"permission denied reading {path} (RAPL needs root since Linux 5.10)") from error
    except OSError as error:
        raise MeterError(f"cannot read {path}: {error}") from error
    try:
        return int(text.strip())
    except ValueError as error:
        raise MeterError(f"{path} holds {text.strip()!r}, not an integer") from error


class RaplMeter(EnergyMeter):
    """CPU package energy from RAPL, *measured*, with counter wrap-around and counter resets handled.

    Args:
        root: the powercap directory (a temporary tree in tests).
    """

    component = "cpu"
    method = MEASURED
    name = "rapl"

    def __init__(self, root: str | Path = DEFAULT_POWERCAP_ROOT) -> None:
        self.root = Path(root)
        self.zones: list[RaplZone] = []
        self._last_time = 0.0

    def start(self, now: float) -> None:
        self.zones = []
        for path in find_package_zones(self.root):
            name = (path / "name").read_text().strip()
            max_range = _read_int(path / "max_energy_range_uj")
            if max_range <= 0:
                raise MeterError(f"{path / 'max_energy_range_uj'} is {max_range}, expected a positive range")
            self.zones.append(RaplZone(path, name, max_range, _read_int(path / "energy_uj")))
        self._last_time = now

    def read_joules(self, now: float) -> float:
        seconds = max(now - self._last_time, 0.0)
        for zone in self.zones:
            current = _read_int(zone.energy_file())
            if current > zone.max_range_uj:
                raise MeterError(f"{zone.energy_file()} reads {current}, above its range {zone.max_range_uj}")
            delta = plausible_delta(zone.last_uj, current, zone.max_range_uj, seconds)
            if delta is None or delta != counter_delta(zone.last_uj, current, zone.max_range_uj):
                # a reset counts from its new value; a jump counts nothing for the interval (unknown)
                wrap_w = counter_delta(zone.last_uj, current, zone.max_range_uj) / 1e6 / max(seconds, 1e-9)
                what = "a reset (suspend/resume, CPU hotplug): counting on from the new value"
                if delta is None:
                    what = "a jump no reading explains (a VM moved to another host?): nothing counted for it"
                self.notice(
                    f"the counter of {zone.name} went from {zone.last_uj} uJ to {current} uJ in "
                    f"{seconds:.3g} s, which as a step or a wrap would mean {wrap_w:.3g} W (above "
                    f"{MAX_PLAUSIBLE_PACKAGE_WATTS:g} W a package): {what}"
                )
            zone.total_uj += delta or 0
            zone.last_uj = current
        self._last_time = now
        return sum(zone.total_uj for zone in self.zones) / 1e6

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "zones": [zone.name for zone in self.zones], "root": str(self.root)}
