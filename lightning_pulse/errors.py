"""The one exception a lightning-pulse callback raises when it refuses a run at fit start."""

from __future__ import annotations

from lightning.pytorch.utilities.exceptions import MisconfigurationException


class PulseRefusal(MisconfigurationException):
    """A callback cannot handle this model, strategy or run, and says so before the first step.

    The message names the callback, the reason and the way out, e.g. ``"PulseCycle: epoch-based phase
    durations need a dataloader with a length; give the durations in steps or seconds instead."``. The
    ``lightning-pulse`` command prints it as one line (exit code 2) instead of a traceback.
    """
