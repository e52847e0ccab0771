"""lightning-pulse: pulse training, energy accounting and stability for PyTorch Lightning."""

from lightning_pulse.callbacks.energy_logger import EnergyLogger
from lightning_pulse.callbacks.gradient_cache import GradientCache
from lightning_pulse.callbacks.green_window import GreenWindow, GreenWindowOptions
from lightning_pulse.callbacks.hard_sample_replay import HardSampleReplay
from lightning_pulse.callbacks.mhc_monitor import HyperConnectionMonitor
from lightning_pulse.callbacks.pulse_cycle import PulseCycle, phase_of, pulse_cycle_of
from lightning_pulse.callbacks.scheduled_prune import PruneOptions, ScheduledPrune
from lightning_pulse.callbacks.stability_guard import StabilityGuard, StabilityGuardError
from lightning_pulse.core.distillation import DistillConfig
from lightning_pulse.core.green_window import SimulatedClock
from lightning_pulse.core.stability_policy import StabilityGuardConfig
from lightning_pulse.energy.config import AccountingConfig, MeterConfig
from lightning_pulse.errors import PulseRefusal
from lightning_pulse.phase import Duration, Phase, PhaseChange, PhaseClock, parse_duration

__version__ = "0.1.0"

__all__ = [
    "AccountingConfig",
    "DistillConfig",
    "Duration",
    "EnergyLogger",
    "GradientCache",
    "GreenWindow",
    "GreenWindowOptions",
    "HardSampleReplay",
    "HyperConnectionMonitor",
    "MeterConfig",
    "Phase",
    "PhaseChange",
    "PhaseClock",
    "PruneOptions",
    "PulseCycle",
    "PulseRefusal",
    "ScheduledPrune",
    "SimulatedClock",
    "StabilityGuard",
    "StabilityGuardConfig",
    "StabilityGuardError",
    "parse_duration",
    "phase_of",
    "pulse_cycle_of",
]
