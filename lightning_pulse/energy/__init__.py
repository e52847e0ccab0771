"""Energy meters (NVML, RAPL, codecarbon, constant), carbon-intensity and price series, the ledger that
attributes energy to phases, the account that runs them for a fit (:class:`EnergyAccount`, what
:class:`~lightning_pulse.EnergyLogger` adapts), its configs, the report, and the comparison of two runs' reports."""

from lightning_pulse.energy.account import EnergyAccount
from lightning_pulse.energy.carbon import Rate, TimeSeries, carbon_intensity_from, price_from
from lightning_pulse.energy.codecarbon_meter import (
    CodecarbonMeter,
    CodecarbonSession,
    country_carbon_intensity,
)
from lightning_pulse.energy.compare import compare_runs, load_run, write_comparison
from lightning_pulse.energy.config import AccountingConfig, MeterConfig
from lightning_pulse.energy.constant import ConstantPowerMeter
from lightning_pulse.energy.ledger import EnergyLedger, predict_run
from lightning_pulse.energy.meter import (
    ESTIMATED,
    MEASURED,
    NONE,
    EnergyMeter,
    MeterChain,
    MeterError,
    MeterUnavailable,
)
from lightning_pulse.energy.nvml import NvmlCounterMeter, NvmlPowerMeter
from lightning_pulse.energy.rapl import RaplMeter
from lightning_pulse.energy.report import render_report, write_report
from lightning_pulse.energy.sampler import EnergySampler

__all__ = [
    "ESTIMATED",
    "MEASURED",
    "NONE",
    "AccountingConfig",
    "CodecarbonMeter",
    "CodecarbonSession",
    "ConstantPowerMeter",
    "EnergyAccount",
    "EnergyLedger",
    "EnergyMeter",
    "EnergySampler",
    "MeterChain",
    "MeterConfig",
    "MeterError",
    "MeterUnavailable",
    "NvmlCounterMeter",
    "NvmlPowerMeter",
    "RaplMeter",
    "Rate",
    "TimeSeries",
    "carbon_intensity_from",
    "compare_runs",
    "country_carbon_intensity",
    "load_run",
    "predict_run",
    "price_from",
    "render_report",
    "write_comparison",
    "write_report",
]
