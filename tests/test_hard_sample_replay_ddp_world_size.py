"""HardSampleReplay(mode='steps') resumed on another number of processes: each process plans its own share of
the data, and the checkpoint counted rank 0's. From an epoch's end the rest of the run is planned again for
this fit's processes; inside an epoch the fit is refused at its start, naming both numbers and the ways out.
Two gloo processes, a tiny MLP on 128 random samples (one process: 16 batches of 8 an epoch, two: 8 each)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pulse import HardSampleReplay
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs
from tests.ddp_workers import TwoGlooProcesses, TwoGlooProcessesRecordingErrors

EPOCHS = 4


class _Mlp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(128, 16, generator=generator), torch.randint(0, 4, (128,), generator=generator)
        )
        return DataLoader(data, batch_size=8)


class _Record(pl.Callback):
    """Per rank, the epochs that trained a batch and the last global step; checkpoints at ``save_at`` steps
    (a batch's end) and at the end of the epochs in ``save_epochs``."""

    def __init__(self, directory: Path, save_at=(), save_epochs=()) -> None:
        self.directory, self.save_at, self.save_epochs, self.epochs = directory, save_at, save_epochs, set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.epochs.add(trainer.current_epoch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.save_at:
            trainer.save_checkpoint(self.directory / f"step{trainer.global_step}.ckpt")

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch in self.save_epochs:
            trainer.save_checkpoint(self.directory / f"epoch{trainer.current_epoch}.ckpt")

    def on_train_end(self, trainer, pl_module):
        record = {"epochs": sorted(self.epochs), "step": trainer.global_step}
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(
    directory: Path,
    ckpt: Path | None = None,
    devices: int = 1,
    strategy=None,
    max_steps: int = -1,
    every_epoch: bool = False,
    **save,
) -> pl.Trainer:
    directory.mkdir(exist_ok=True)
    pl.seed_everything(0)
    more = {} if strategy is None else {"devices": devices, "strategy": strategy}
    saver = ModelCheckpoint(
        dirpath=directory, filename="ep{epoch}", save_top_k=-1, save_on_train_epoch_end=True
    )
    if every_epoch:
        more["enable_checkpointing"] = True
    trainer = pl.Trainer(
        callbacks=[HardSampleReplay(), _Record(directory, **save)] + [saver] * every_epoch,
        max_epochs=EPOCHS if max_steps == -1 else -1,
        max_steps=max_steps,
        **trainer_kwargs(**more),
    )
    trainer.fit(_Mlp(), ckpt_path=ckpt)
    return trainer


def _records(directory: Path, ranks: int) -> list[dict]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _stream(checkpoint: Path) -> dict:
    states = torch.load(checkpoint, weights_only=False)["callbacks"]
    return next(state for key, state in states.items() if key.startswith("HardSampleReplay"))["stream"]


@pytest.mark.ddp
def test_a_steps_plan_resumed_on_another_number_of_processes_plans_again_at_an_epoch_end_and_refuses_inside_one(
    tmp_path,
):
    # before: the checkpoint's counts of one process's 128-sample share were read in a 64-sample share, so the
    # 1 -> 2 resume from epoch 0's end planned one epoch away (epochs 1 and 2 trained, 3 never, at step 16),
    # and 2 -> 1 inside an epoch trained 20 samples of it twice; nothing said either time
    one = tmp_path / "one"
    _fit(one, save_at=(3,), save_epochs=(0,))  # half of each epoch's batches: 8 steps an epoch
    assert _records(one, 1)[0] == {"epochs": [0, 1, 2, 3], "step": 32}

    # 1 -> 2 from epoch 0's end: epochs 1 to 3 planned for two 64-sample shares, 4 steps each
    two = tmp_path / "two"
    _fit(two, one / "epoch0.ckpt", 2, TwoGlooProcesses(), save_at=(10,), save_epochs=(1,))
    assert _records(two, 2) == [{"epochs": [1, 2, 3], "step": 20}] * 2

    # 1 -> 2 inside epoch 0 (step 3): refused on both ranks before a step
    refused = tmp_path / "refused"
    refused.mkdir()
    with pytest.raises(Exception, match="HardSampleReplay"):
        _fit(refused, one / "step3.ckpt", 2, TwoGlooProcessesRecordingErrors(str(refused)))
    for rank in (0, 1):
        kind, message = json.loads((refused / f"rank{rank}-raised.json").read_text())
        assert kind == "PulseRefusal"
        assert "made on 1 process(es) and this fit runs on 2" in message
        assert "saved at step 3, inside epoch 0" in message
        assert "Resume on 1 process(es)" in message and "mode='batch'" in message
    assert not (refused / "rank0.json").exists()  # no batch trained

    # 2 -> 1 inside epoch 1 (step 10 of 8..12): refused; from epoch 1's end: epochs 2 and 3 at 8 steps each
    with pytest.raises(PulseRefusal, match=r"made on 2 process\(es\) and this fit runs on 1"):
        _fit(tmp_path / "back_inside", two / "step10.ckpt")
    _fit(tmp_path / "back", two / "epoch1.ckpt")
    assert _records(tmp_path / "back", 1)[0] == {"epochs": [2, 3], "step": 12 + 16}
    assert _stream(one / "epoch0.ckpt")["world_size"] == 1
    assert _stream(two / "epoch1.ckpt")["world_size"] == 2


@pytest.mark.ddp
def test_a_max_steps_run_resumed_on_another_number_of_processes_from_an_epoch_end_is_refused(tmp_path):
    # under max_steps Lightning goes on from an epoch-end checkpoint inside that epoch, by its batch count: 2 -> 1
    # from epoch 1's end (4 of this fit's 8 planned batches) re-entered epoch 1 for 4 batches and planned epoch 2
    # again (25 of 64 samples trained twice); 1 -> 2 from epoch 0's end trained a batch in epoch 0 again and
    # cut epoch 1 to 1 of its 4 batches; both said the plan was remade from the next epoch on
    one = tmp_path / "one"
    _fit(one, max_steps=48, every_epoch=True)
    assert _records(one, 1)[0] == {"epochs": [0, 1, 2], "step": 24}
    two = tmp_path / "two"
    _fit(two, devices=2, strategy=TwoGlooProcesses(), max_steps=48, every_epoch=True)

    refused = tmp_path / "refused"
    refused.mkdir()
    with pytest.raises(Exception, match="HardSampleReplay"):
        _fit(refused, one / "epepoch=0.ckpt", 2, TwoGlooProcessesRecordingErrors(str(refused)), max_steps=48)
    for rank in (0, 1):
        kind, message = json.loads((refused / f"rank{rank}-raised.json").read_text())
        assert kind == "PulseRefusal" and "made on 1 process(es) and this fit runs on 2" in message
        assert "max_steps" in message
    assert not (refused / "rank0.json").exists()

    with pytest.raises(PulseRefusal, match=r"made on 2 process\(es\) and this fit runs on 1") as back:
        _fit(tmp_path / "back", two / "epepoch=1.ckpt", max_steps=48)
    assert "max_steps" in str(back.value)
    assert not (tmp_path / "back" / "rank0.json").exists()

    # on the saved number of processes it goes on as before
    _fit(tmp_path / "same", one / "epepoch=0.ckpt", max_steps=48)
    assert _records(tmp_path / "same", 1)[0] == {"epochs": [1, 2], "step": 24}


def test_a_checkpoint_saved_before_the_number_of_processes_was_recorded_resumes_as_before(tmp_path):
    # taken as saved on this fit's number of processes: the same run as from the checkpoint with the field
    _fit(tmp_path, save_at=(3,), save_epochs=(0,))
    for name in ("step3", "epoch0"):
        checkpoint = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
        key = next(key for key in checkpoint["callbacks"] if key.startswith("HardSampleReplay"))
        del checkpoint["callbacks"][key]["stream"]["world_size"]
        torch.save(checkpoint, tmp_path / f"{name}-old.ckpt")
        finals = []
        for path in (tmp_path / f"{name}.ckpt", tmp_path / f"{name}-old.ckpt"):
            trainer = _fit(tmp_path / f"{path.stem}-resumed", path)
            model = trainer.lightning_module
            finals.append(
                (trainer.global_step, torch.cat([p.detach().flatten() for p in model.parameters()]))
            )
        assert finals[0][0] == finals[1][0] == 32
        assert torch.equal(finals[0][1], finals[1][1])


def test_the_start_line_of_a_plan_remade_for_another_number_of_processes_says_its_scores_were_kept(
    tmp_path, caplog
):
    # one process standing in for two: the checkpoint's stream says it was saved on 2 (a 2 -> 1 resume)
    _fit(tmp_path, save_epochs=(0,))
    checkpoint = torch.load(tmp_path / "epoch0.ckpt", weights_only=False)
    key = next(key for key in checkpoint["callbacks"] if key.startswith("HardSampleReplay"))
    checkpoint["callbacks"][key]["stream"]["world_size"] = 2
    torch.save(checkpoint, tmp_path / "two.ckpt")
    with caplog.at_level(logging.INFO):
        trainer = _fit(tmp_path / "resumed", tmp_path / "two.ckpt")
    line = next(r.getMessage() for r in caplog.records if "remade from epoch" in r.getMessage())
    # before: "joined this run at step 8, with no state of its own from before", its scores restored
    assert "with no state of its own" not in line
    assert "planned this run again from step 8 on, with the sample scores it restored" in line
    assert "made on 2 process(es), remade from epoch 1 on for 1" in line
    replay = next(c for c in trainer.callbacks if isinstance(c, HardSampleReplay))
    assert torch.isfinite(torch.as_tensor(replay.selector.table.scores)).sum() > 0
