"""GPU energy through NVML (``import pynvml``, from the ``nvidia-ml-py`` package).

Two meters, both *measured*:

* :class:`NvmlCounterMeter` reads ``nvmlDeviceGetTotalEnergyConsumption``: millijoules since the driver
  loaded, Volta and newer, updated every 20-100 ms. Exact over any window longer than that.
* :class:`NvmlPowerMeter` samples ``nvmlDeviceGetPowerUsage`` (milliwatts; a 1 s average on Ampere and
  newer) and integrates it with the trapezoidal rule. The fallback for GPUs without the counter.

Devices are given as NVML indices (``int``) or UUIDs (``str``, e.g. ``"GPU-8d2c..."``). CUDA indices differ
from NVML indices when ``CUDA_VISIBLE_DEVICES`` is set, so :func:`nvml_devices_for_cuda` maps through UUIDs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning_pulse.energy.meter import MEASURED, EnergyMeter, MeterError, MeterUnavailable

DeviceSelector = int | str


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
            for device in self.devices:
                if isinstance(device, str):
                    handle = self.nvml.nvmlDeviceGetHandleByUUID(device)
                else:
                    handle = self.nvml.nvmlDeviceGetHandleByIndex(int(device))
                self.handles.append(handle)
                try:
                    name = self.nvml.nvmlDeviceGetName(handle)
                    self.device_names.append(name.decode() if isinstance(name, bytes) else str(name))
                except self.nvml.NVMLError:
                    self.device_names.append(str(device))
        except self.nvml.NVMLError as error:
            self.close()
            raise MeterError(f"NVML has no device {device!r} ({error})") from error

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
        self._baseline_mj: list[int] = []

    def start(self, now: float) -> None:
        self._open()
        try:
            self._baseline_mj = [int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self.handles]
        except self.nvml.NVMLError_NotSupported as error:
            self.close()
            raise MeterUnavailable(f"this GPU has no total-energy counter ({error})") from error
        except self.nvml.NVMLError as error:
            self.close()
            raise MeterError(f"NVMLError: {error}") from error

    def read_joules(self, now: float) -> float:
        total_mj = 0
        for handle, baseline in zip(self.handles, self._baseline_mj):
            total_mj += int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle)) - baseline
        return total_mj / 1000.0


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

    def _watts(self) -> float:
        return sum(int(self.nvml.nvmlDeviceGetPowerUsage(h)) for h in self.handles) / 1000.0

    def start(self, now: float) -> None:
        self._open()
        try:
            self._last_watts = self._watts()
        except self.nvml.NVMLError as error:
            self.close()
            raise MeterError(f"NVMLError: {error}") from error
        self._last_time = now
        self._joules = 0.0

    def read_joules(self, now: float) -> float:
        watts = self._watts()
        elapsed = max(now - self._last_time, 0.0)
        self._joules += 0.5 * (watts + self._last_watts) * elapsed
        self._last_time, self._last_watts = now, watts
        return self._joules
