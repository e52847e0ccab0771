"""The one exception a lightning-pulse callback raises when it refuses a run at fit start, and the
strategy check that several callbacks share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.exceptions import MisconfigurationException

if TYPE_CHECKING:
    import lightning.pytorch as pl


class PulseRefusal(MisconfigurationException):
    """A callback cannot handle this model, strategy or run, and says so before the first step.

    The message names the callback, the reason and the way out, e.g. ``"PulseCycle: epoch-based phase
    durations need a dataloader with a length; give the durations in steps or seconds instead."``. The
    ``lightning-pulse`` command prints it as one line (exit code 2) instead of a traceback.
    """


def sharded_strategy_name(trainer: pl.Trainer) -> str | None:
    """The name of the trainer's strategy when it shards parameters or gradients (FSDP, DeepSpeed, model
    parallel), else ``None``. Under those a rank holds a shard, so per-rank norms, masks and ``requires_grad``
    flags are not the model's."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    for sharded in (FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy):
        if isinstance(strategy, sharded):
            return type(strategy).__name__
    return None


def refuse_sharded_strategy(trainer: pl.Trainer, callback: str, reason: str) -> None:
    """Raise :class:`PulseRefusal` naming ``callback``, the strategy and ``reason`` under a sharded strategy."""
    name = sharded_strategy_name(trainer)
    if name is not None:
        raise PulseRefusal(
            f"{callback} does not support {name}: {reason}. Train with strategy='ddp' (or one device), "
            f"or remove {callback} from the callbacks."
        )
