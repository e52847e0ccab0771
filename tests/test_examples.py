from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from examples.charlm import CharLMDataModule, CharTransformerLM
from tests.conftest import trainer_kwargs


def test_charlm_cosine_schedule_warms_up_then_decays_to_floor():
    model = CharTransformerLM(d_model=16, n_layers=1, seq_len=16, lr=1e-2, scheduler="cosine")
    lrs = []

    class RecordLearningRate(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = pl.Trainer(
        **trainer_kwargs(max_steps=40, limit_val_batches=0, callbacks=[RecordLearningRate()])
    )
    trainer.fit(model, CharLMDataModule(seq_len=16, batch_size=4, max_chars=20000))
    assert lrs[0] < lrs[2] <= 1e-2 + 1e-12
    assert max(lrs) == pytest.approx(1e-2)
    assert lrs[-1] < 0.2e-2 and lrs[-1] >= 0.1e-2 - 1e-12


def test_charlm_rejects_unknown_scheduler():
    with pytest.raises(ValueError, match="scheduler"):
        CharTransformerLM(scheduler="step")


def _mnist1d_tensors(data):
    return [tensor for dataset in (data.train_set, data.val_set, data.test_set) for tensor in dataset.tensors]


def test_mnist1d_is_generated_once_and_loaded_bit_for_bit(tmp_path):
    from examples.mnist1d import MNIST1DDataModule
    from examples.mnist1d.data import make_mnist1d

    first = MNIST1DDataModule(num_samples=300, data_dir=str(tmp_path))
    first.prepare_data()
    assert first.data_file.exists() and first.data_file.parent == tmp_path
    written = first.data_file.stat().st_mtime_ns
    second = MNIST1DDataModule(num_samples=300, data_dir=str(tmp_path))
    second.prepare_data()  # finds the file: nothing is generated or written again
    assert second.data_file.stat().st_mtime_ns == written
    second.setup("fit")
    generated = make_mnist1d(300)
    x, y = torch.as_tensor(generated["x"], dtype=torch.float32), torch.as_tensor(generated["y"])
    assert torch.equal(second.train_set.tensors[0], x[24:]) and torch.equal(second.val_set.tensors[1], y[:24])
    assert torch.equal(second.test_set.tensors[0], torch.as_tensor(generated["x_test"], dtype=torch.float32))
    # another size or seed is another dataset, in its own file
    assert MNIST1DDataModule(num_samples=400, data_dir=str(tmp_path)).data_file != first.data_file
    assert (
        MNIST1DDataModule(num_samples=300, data_seed=1, data_dir=str(tmp_path)).data_file != first.data_file
    )


def test_mnist1d_without_a_writable_folder_generates_in_setup(tmp_path):
    from examples.mnist1d import MNIST1DDataModule

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    unwritable = MNIST1DDataModule(num_samples=300, data_dir=str(blocker / "data"))
    unwritable.prepare_data()  # cannot write there: not an error
    assert not unwritable.data_file.exists()
    unwritable.setup("fit")
    cached = MNIST1DDataModule(num_samples=300, data_dir=str(tmp_path))
    cached.prepare_data()
    cached.setup("fit")
    assert all(torch.equal(a, b) for a, b in zip(_mnist1d_tensors(unwritable), _mnist1d_tensors(cached)))
