"""Shared fixtures: small real workloads that train in seconds on one CPU core."""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping

import pytest
import torch
from lightning.pytorch.loggers import Logger

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def generated_data_in_a_scratch_folder(tmp_path_factory):
    """Generated datasets (MNIST-1D) are kept in a folder of this session, not in the user's cache; DDP
    workers inherit the variable."""
    import os

    if "LIGHTNING_PULSE_DATA" in os.environ:
        yield
        return
    os.environ["LIGHTNING_PULSE_DATA"] = str(tmp_path_factory.mktemp("generated-data"))
    yield
    os.environ.pop("LIGHTNING_PULSE_DATA", None)


_USERS_MASTER_PORT = os.environ.get("MASTER_PORT")


@pytest.fixture(autouse=True)
def a_fresh_master_port_for_each_test():
    """Lightning's spawn launcher writes the port it picked into ``MASTER_PORT`` of this process, where every
    later DDP fit (and child interpreter) of the session would find it: two pytest-xdist workers, each keeping
    its first port, could hold the same one, or find theirs taken meanwhile by another run's connections. Each
    test starts without it (unless the user set one), so a fit picks a port that is free at its launch."""
    if _USERS_MASTER_PORT is None:
        os.environ.pop("MASTER_PORT", None)
    yield


@pytest.fixture(autouse=True)
def nothing_written_into_the_working_directory():
    """A test writes its files (reports, checkpoints, logs) under ``tmp_path``: a report left in the working
    directory (a Trainer without ``default_root_dir``) would land in the user's checkout."""
    before = set(os.listdir())
    yield
    written = sorted(set(os.listdir()) - before)
    # under pytest-xdist the workers share the directory: a file another worker's test wrote (and removed)
    # meanwhile is seen here too, named so that its writer can be found
    shared = " (or a test on another pytest-xdist worker)" if os.environ.get("PYTEST_XDIST_WORKER") else ""
    assert not written, f"the test{shared} wrote {written} into the working directory; give it tmp_path"


def trainer_kwargs(**overrides):
    """Trainer arguments for fast, quiet test runs."""
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


def stop_after_epochs(epochs: int):
    """A callback that stops the fit after ``epochs`` epochs of a longer planned run, so that every schedule
    still spans the planned run (the first part of an interrupted run, for resume tests)."""
    from lightning.pytorch.callbacks import Callback

    class StopAfterEpochs(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch + 1 >= epochs:
                trainer.should_stop = True

    return StopAfterEpochs()


@pytest.fixture
def mnist1d_small():
    """A fresh (model, datamodule) pair on 1000 generated MNIST-1D samples (720 train: 12 batches of 64)."""
    from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule

    def make(**model_kwargs):
        return MNIST1DClassifier(**{"arch": "cnn", **model_kwargs}), MNIST1DDataModule(
            num_samples=1000, batch_size=64
        )

    return make


class RecordingLogger(Logger):
    """A logger that keeps every ``log_metrics`` call in memory, as ``(step, metrics)`` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    @property
    def metrics(self) -> list[dict[str, float]]:
        return [metrics for _, metrics in self.rows]

    def logged(self, key: str) -> list[tuple[int | None, float]]:
        return [(step, metrics[key]) for step, metrics in self.rows if key in metrics]


class StandInTrainer:
    """A Trainer whose strategy cannot run here (FSDP is GPU-only in Lightning, DeepSpeed is not installed,
    model parallel needs a device mesh): an uninitialised strategy object stands in, for the checks at setup
    that read only the strategy's type. A fake only for absent hardware, only for refusal paths."""

    def __init__(self, strategy_class: type) -> None:
        self.strategy = strategy_class.__new__(strategy_class)


class AttributeStoredMapping(MutableMapping):
    """A mapping of one's own that keeps its entries in an attribute (``copy.copy`` shares it): a batch type
    the library must keep by reference, never copy into."""

    def __init__(self, entries: dict):
        self._entries = entries

    def __getitem__(self, key):
        return self._entries[key]

    def __setitem__(self, key, value):
        self._entries[key] = value

    def __delitem__(self, key):
        del self._entries[key]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def fast_tokenizer():
    """A Hugging Face fast tokenizer built here (a ``tokenizers`` WordLevel model over ``w0`` ... ``w19``, no
    download): its ``BatchEncoding`` keeps the encodings that ``word_ids()`` and ``n_sequences`` read."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(20)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")
