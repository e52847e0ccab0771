"""GPU energy through NVML (``import pynvml``, from the ``nvidia-ml-py`` package).

Two meters, both *measured*:

* :class:`NvmlCounterMeter` reads ``nvmlDeviceGetTotalEnergyConsumption``: millijoules since the driver
  loaded, Volta and newer, updated every 20-100 ms. Exact over any window longer than that.
* :class:`NvmlPowerMeter` samples ``nvmlDeviceGetPowerUsage`` (milliwatts; a 1 s average on Ampere and
  newer) and integrates it with the trapezoidal rule. The fallback for GPUs without the counter.

Both check their readings. A total-energy counter that goes backwards (the driver reloaded, the GPU was
reset: the counter restarts from 0) is rebased on the new count rather than held below its old baseline;
a power reading above :data:`POWER_MARGIN` x the device's enforced power limit (or above
:data:`MAX_PLAUSIBLE_WATTS` when NVML does not give the limit) is ignored, with the last good power carried
over that interval. Each correction is a notice (:meth:`EnergyMeter.take_notices`): one warning, an event,
and the interval labelled *estimated*. :data:`MAX_IMPLAUSIBLE_IN_A_ROW` out-of-range readings in a row are a
failure of the meter.

Devices are given as NVML indices (``int``) or UUIDs (``str``, e.g. ``"GPU-8d2c..."``). CUDA indices differ
from NVML indices when ``CUDA_VISIBLE_DEVICES`` is set, so :func:`nvml_devices_for_cuda` maps through UUIDs.
A device named twice (its index and its UUID) is metered once, where NVML gives its UUID.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning_pulse.energy.meter import MEASURED, EnergyMeter, MeterError, MeterUnavailable

DeviceSelector = int | str

#: a power reading above the enforced power limit x this is not a power (NVML's all-ones "not available",
#: 0xFFFFFFFF mW = 4.29 MW, was seen); boards briefly exceed the limit, hence the margin
POWER_MARGIN = 1.5
#: the bound per device when NVML gives no enforced power limit: above any single GPU board sold so far
#: (1,200 W class accelerators)
MAX_PLAUSIBLE_WATTS = 3000.0
#: out-of-range power readings in a row that make the power meter a failed meter (it falls back)
MAX_IMPLAUSIBLE_IN_A_ROW = 3


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError as error:  # nvidia-ml-py is a dependency, but a broken install must not stop training
        raise MeterUnavailable("the nvidia-ml-py package (pynvml) is not installed") from error
    return pynvml


def nvml_devices_for_cuda(cuda_indices: Sequence[int]) -> list[DeviceSelector]:
    """NVML selectors for CUDA device indices, honouring ``CUDA_VISIBLE_DEVICES``.

    The device UUID from torch is the reliable link; without it we fall back to the visible-devices list,
    then to the index itself.
    """
    selectors: list[DeviceSelector] = []
    visible = [item.strip() for item in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    for index in cuda_indices:
        uuid = None
        try:
            import torch

            uuid = str(torch.cuda.get_device_properties(index).uuid)
        except Exception:  # older torch without `.uuid`, or no CUDA: use the fallbacks below
            uuid = None
        if uuid:
            selectors.append(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        elif index < len(visible):
            selectors.append(int(visible[index]) if visible[index].isdigit() else visible[index])
        else:
            selectors.append(int(index))
    return selectors


class _NvmlMeter(EnergyMeter):
    component = "gpu"
    method = MEASURED

    def __init__(self, devices: Sequence[DeviceSelector]) -> None:
        if not devices:
            raise ValueError("`devices` must name at least one GPU (an NVML index or a UUID).")
        self.devices = list(devices)
        self.handles: list[Any] = []
        self.device_names: list[str] = []
        self._initialised = False
        self.nvml: Any = None

    def _open(self) -> None:
        self.nvml = _pynvml()
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as error:
            raise MeterUnavailable(f"NVML could not start ({error})") from error
        self._initialised = True
        try:
            self.handles = []
            self.device_names = []
            kept: list[DeviceSelector] = []
            uuids: set[str] = set()
            for device in self.devices:
                if isinstance(device, str):
                    handle = self.nvml.nvmlDeviceGetHandleByUUID(device)
                else:
                    handle = self.nvml.nvmlDeviceGetHandleByIndex(int(device))
                uuid = self._uuid(handle)
                if uuid is not None:
                    if uuid in uuids:
                        continue  # one GPU named twice (its index and its UUID): counted once
                    uuids.add(uuid)
                kept.append(device)
                self.handles.append(handle)
                try:
                    name = self.nvml.nvmlDeviceGetName(handle)
                    self.device_names.append(name.decode() if isinstance(name, bytes) else str(name))
                except self.nvml.NVMLError:
                    self.device_names.append(str(device))
        except self.nvml.NVMLError as error:
            self.close()
            raise MeterError(f"NVML has no device {device!r} ({error})") from error
        self.devices = kept

    def _uuid(self, handle: Any) -> str | None:
        try:
            uuid = self.nvml.nvmlDeviceGetUUID(handle)
        except Exception:  # not given (older drivers, some boards): the device is kept as named
            return None
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # NVML may already be gone (GPU lost); nothing left to release
                pass

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "devices": [str(d) for d in self.devices], "names": self.device_names}


class NvmlCounterMeter(_NvmlMeter):
    """GPU energy from NVML's total-energy counter (millijoules), summed over ``devices``. *Measured*."""

    name = "nvml-counter"

    def __init__(self, devices: Sequence[DeviceSelector]) -> None:
        super().__init__(devices)
        self._last_mj: list[int] = []
        self._counted_mj: list[int] = []

    def start(self, now: float) -> None:
        self._open()
        try:
            self._last_mj = [int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self.handles]
        except self.nvml.NVMLError_NotSupported as error:
            self.close()
            raise MeterUnavailable(f"this GPU has no total-energy counter ({error})") from error
        except self.nvml.NVMLError as error:
            self.close()
            raise MeterError(f"NVMLError: {error}") from error
        self._counted_mj = [0] * len(self.handles)

    def read_joules(self, now: float) -> float:
        readings = [int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self.handles]
        for index, (raw, last) in enumerate(zip(readings, self._last_mj)):
            if raw >= last:
                self._counted_mj[index] += raw - last
            else:
                # the counter restarted (driver reload, GPU reset): it counts from 0 again, so its value is
                # the energy since the restart; what ran between the last reading and the restart is unknown
                self._counted_mj[index] += raw
                self.notice(
                    f"the energy counter of device {self.devices[index]!r} went back from {last} mJ to {raw} "
                    "mJ (driver reload or GPU reset); counting on from the new value"
                )
        self._last_mj = readings
        return sum(self._counted_mj) / 1000.0


class NvmlPowerMeter(_NvmlMeter):
    """GPU energy integrated from NVML power readings (milliwatts), summed over ``devices``. *Measured*.

    The trapezoidal rule between consecutive readings; the sampling period bounds the time resolution.
    """

    name = "nvml-power"

    def __init__(self, devices: Sequence[DeviceSelector]) -> None:
        super().__init__(devices)
        self._last_time = 0.0
        self._last_watts = 0.0
        self._joules = 0.0
        self.bounds_w: list[float] = []
        self._implausible = 0

    def _watts(self) -> float | None:
        """The summed power, or ``None`` when a device's reading is out of range (see
        :data:`POWER_MARGIN`)."""
        readings = [int(self.nvml.nvmlDeviceGetPowerUsage(h)) / 1000.0 for h in self.handles]
        for device, watts, bound in zip(self.devices, readings, self.bounds_w):
            if not 0.0 <= watts <= bound:
                self.notice(
                    f"device {device!r} read {watts:.6g} W, outside 0-{bound:.6g} W; that reading is ignored "
                    "and the last good power carried over the interval"
                )
                return None
        return sum(readings)

    def _bound(self, handle: Any) -> float:
        try:
            limit_w = int(self.nvml.nvmlDeviceGetEnforcedPowerLimit(handle)) / 1000.0
        except Exception:  # older drivers and some boards do not report it: the fixed bound
            return MAX_PLAUSIBLE_WATTS
        return POWER_MARGIN * limit_w if 0 < limit_w <= MAX_PLAUSIBLE_WATTS else MAX_PLAUSIBLE_WATTS

    def start(self, now: float) -> None:
        self._open()
        self.bounds_w = [self._bound(handle) for handle in self.handles]
        try:
            watts = self._watts()
        except self.nvml.NVMLError as error:
            self.close()
            raise MeterError(f"NVMLError: {error}") from error
        if watts is None:
            notices = self.take_notices()
            self.close()
            raise MeterError(f"no plausible first power reading ({notices[0]})")
        self._last_watts = watts
        self._last_time = now
        self._joules = 0.0
        self._implausible = 0

    def read_joules(self, now: float) -> float:
        watts = self._watts()
        if watts is None:
            self._implausible += 1
            if self._implausible >= MAX_IMPLAUSIBLE_IN_A_ROW:
                raise MeterError(f"{self._implausible} out-of-range power readings in a row")
            watts = self._last_watts
        else:
            self._implausible = 0
        elapsed = max(now - self._last_time, 0.0)
        self._joules += 0.5 * (watts + self._last_watts) * elapsed
        self._last_time, self._last_watts = now, watts
        return self._joules
