"""Model-side building blocks: Sinkhorn-Knopp, Hyper-Connections (HC) and mHC layers, gain diagnostics."""

from lightning_pulse.nn.diagnostics import (
    HyperConnectionRecorder,
    composite_gain,
    composite_mapping,
    off_diagonal_mass,
    stack_diagnostics,
)
from lightning_pulse.nn.hyper_connections import (
    RESIDUAL_KINDS,
    HyperConnection,
    HyperConnectionCoefficients,
    ManifoldHyperConnection,
    PlainResidual,
    collapse_streams,
    expand_streams,
    residual_connection,
    stream_weights,
)
from lightning_pulse.nn.sinkhorn import doubly_stochastic_error, sinkhorn_knopp

__all__ = [
    "RESIDUAL_KINDS",
    "HyperConnection",
    "HyperConnectionCoefficients",
    "HyperConnectionRecorder",
    "ManifoldHyperConnection",
    "PlainResidual",
    "collapse_streams",
    "composite_gain",
    "composite_mapping",
    "doubly_stochastic_error",
    "expand_streams",
    "off_diagonal_mass",
    "residual_connection",
    "sinkhorn_knopp",
    "stack_diagnostics",
    "stream_weights",
]
