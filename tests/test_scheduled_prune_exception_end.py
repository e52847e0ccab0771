"""A fit that ends in an exception or a KeyboardInterrupt leaves the model as a fit that ends at its last step
or on ``trainer.should_stop`` does: ScheduledPrune's masks folded (with ``make_permanent``, the default) and
none of its hooks on the model. A checkpoint ``OnExceptionCheckpoint`` saves on the exception still holds the
masks, and resumes like the uninterrupted run.

Held-out sweep (many fits in one process): an unstructured trial that crashed or was interrupted at step 20
kept 6 ``*_orig``/``*_mask`` keys and 3 prune hooks; its ``state_dict()`` did not load into the plain class,
a plain Trainer then trained the same model object under the masks (0.398 of each layer kept at zero, nothing
said), and a later ``trainer.validate`` folded them as a side effect. Lightning calls no teardown or fit-end
hook after an exception.
"""

from __future__ import annotations

import signal

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import ScheduledPrune
from lightning_pulse.core.distillation import DistillConfig
from tests.conftest import trainer_kwargs
from tests.test_scheduled_prune import _LinearClassifier

HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_load_state_dict_pre_hooks")


class _FailsAt(_LinearClassifier):
    """Raises in ``training_step`` at optimizer step ``fail_at``."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.example_input_array = torch.zeros(2, 16)  # the structured trace input

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise RuntimeError("trial failed")
        return super().training_step(batch, batch_idx)


class _InterruptAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt  # a Ctrl-C: Lightning's graceful shutdown, then sys.exit(1)


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    rows = TensorDataset(
        torch.randn(640, 16, generator=generator), torch.randint(0, 4, (640,), generator=generator)
    )
    return DataLoader(rows, batch_size=32)  # 20 steps an epoch, no shuffling: a resume draws the same batches


def _prune(mode: str = "unstructured", distill: DistillConfig | None = None) -> ScheduledPrune:
    # events at steps 8, 12, ..., 32; a distillation window of 10 steps is open at step 20
    return ScheduledPrune(
        final_sparsity=0.5, mode=mode, start=4, end=32, every=4, probe_batches=0, distill=distill
    )


def _hooks(model: torch.nn.Module) -> dict[str, int]:
    return {kind: sum(len(getattr(module, kind)) for module in model.modules()) for kind in HOOKS}


@pytest.mark.parametrize(
    "ending, mode, distill",
    [
        ("exception", "unstructured", None),
        ("interrupt", "unstructured", None),
        ("exception", "unstructured", DistillConfig(steps=10)),
        ("exception", "structured", DistillConfig(steps=10)),
    ],
    ids=["exception", "interrupt", "exception-distill", "structured-exception-distill"],
)
def test_a_fit_ended_by_an_exception_leaves_the_model_folded_and_free_of_prune_hooks(
    tmp_path, ending, mode, distill, caplog
):
    pl.seed_everything(0)
    model = _FailsAt(fail_at=20 if ending == "exception" else None)
    fresh_hooks = _hooks(_FailsAt())
    prune = _prune(mode, distill)
    callbacks = [prune] + ([_InterruptAt(20)] if ending == "interrupt" else [])
    trainer = pl.Trainer(max_steps=40, callbacks=callbacks, **trainer_kwargs(default_root_dir=tmp_path))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(RuntimeError if ending == "exception" else SystemExit):
            trainer.fit(model, _data())
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after a KeyboardInterrupt
    assert trainer.global_step == 20 and [event["step"] for event in prune.events] == [8, 12, 16, 20]
    assert prune.sparsity > 0.3  # pruning was under way
    state = model.state_dict()
    assert not [key for key in state if key.endswith(("_orig", "_mask"))]
    assert _hooks(model) == fresh_hooks  # no mask hook, no distillation hook, no load-state fitter
    assert "on_exception" not in vars(trainer.strategy)  # the hook that ran after on_exception is gone
    if mode == "unstructured":
        _FailsAt().load_state_dict(state)  # the plain class takes it (before: Missing key(s) "net.0.weight")
        for layer in (model.net[0], model.net[2]):
            assert float((layer.weight == 0).float().mean()) == pytest.approx(prune.sparsity, abs=0.01)
        said = [
            r.getMessage() for r in caplog.records if "stopped on an exception or interrupt" in r.getMessage()
        ]
        assert len(said) == 1 and "at step 20" in said[0] and "2 layers were folded" in said[0]
    else:
        assert model.net[0].out_features < 32  # the cut channels stay cut

    # the same model object trained on by a plain Trainer: its pruned weights are free (before: kept at zero)
    model.fail_at = None
    pl.Trainer(max_steps=4, **trainer_kwargs(default_root_dir=tmp_path)).fit(model, _data())
    assert float((model.net[0].weight == 0).float().mean()) < 0.05


@pytest.mark.parametrize("resume_into", ["new objects", "the same objects"])
def test_a_checkpoint_saved_on_the_exception_keeps_the_masks_and_resumes_like_the_uninterrupted_run(
    tmp_path, resume_into
):
    def trainer_for(prune, extra=()):
        return pl.Trainer(
            max_steps=40,
            callbacks=[*extra, prune],
            **trainer_kwargs(default_root_dir=tmp_path, enable_checkpointing=bool(extra)),
        )

    pl.seed_everything(0)
    straight, straight_prune = _FailsAt(), _prune()
    trainer_for(straight_prune).fit(straight, _data())

    pl.seed_everything(0)
    crashed, prune = _FailsAt(fail_at=20), _prune()
    # the checkpoint callback is listed first: Lightning calls checkpoint callbacks last all the same
    saved = OnExceptionCheckpoint(dirpath=tmp_path / "on_exception")
    trainer = trainer_for(prune, [saved])
    with pytest.raises(RuntimeError, match="trial failed"):
        trainer.fit(crashed, _data())
    masked = {"net.0.weight_orig", "net.0.weight_mask", "net.2.weight_orig", "net.2.weight_mask"}
    assert not masked & set(crashed.state_dict())  # the crashed trial's model is folded
    checkpoint = torch.load(saved.ckpt_path, weights_only=False)
    assert masked <= set(checkpoint["state_dict"])  # saved before the fold, as any mid-run checkpoint
    assert checkpoint["global_step"] == 20

    if resume_into == "new objects":
        resumed, prune = _FailsAt(), _prune()
        trainer_for(prune).fit(resumed, _data(), ckpt_path=saved.ckpt_path)
    else:  # a notebook's next cell: the same Trainer, callbacks and (folded) model
        resumed, resumed.fail_at = crashed, None
        trainer.fit(resumed, _data(), ckpt_path=saved.ckpt_path)
    assert [e["step"] for e in prune.events] == [e["step"] for e in straight_prune.events]
    for name, parameter in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], parameter, rtol=0, atol=1e-6, msg=name)


class _FailsInForwardAt(_FailsAt):
    """Trains through ``self(...)`` (the forward distillation hooks), raising at optimizer step ``fail_at``;
    and raises in ``validation_step`` when ``fail_validation``."""

    fail_validation = False

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise RuntimeError("trial failed")
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        if self.fail_validation:
            raise RuntimeError("evaluation failed")
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])


def test_an_exception_says_nothing_false_of_masks_or_distillation(tmp_path, recwarn):
    """Review of sweep 39's fix: a validate raising after a clean fit warned that another callback had folded
    the masks (those of the fit, folded at its end), and an exception in the first step after an event warned
    that distillation "had no effect" (the fit was cut short, not the forward at fault)."""
    model = _FailsInForwardAt(fail_at=8)  # the event at step 8 opens a window; its step raises in training
    prune = _prune(distill=DistillConfig(weight=1.0, steps=10))
    trainer = pl.Trainer(max_steps=40, callbacks=[prune], **trainer_kwargs(default_root_dir=str(tmp_path)))
    with pytest.raises(RuntimeError, match="trial failed"):
        trainer.fit(model, _data())
    fresh, fitted = _FailsInForwardAt(), ScheduledPrune(final_sparsity=0.5, start=4, end=8, every=4)
    trainer = pl.Trainer(max_steps=12, callbacks=[fitted], **trainer_kwargs(default_root_dir=str(tmp_path)))
    trainer.fit(fresh, _data(), _data())  # a clean fit: its masks folded at its end
    fresh.fail_validation = True
    with pytest.raises(RuntimeError, match="evaluation failed"):
        trainer.validate(fresh, _data())
    said = [str(warning.message) for warning in recwarn if "ScheduledPrune" in str(warning.message)]
    assert not [text for text in said if "had no effect" in text or "another callback" in text], said
