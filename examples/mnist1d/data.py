"""A LightningDataModule that generates MNIST-1D with the ``mnist1d`` generator (no download).

Generation takes about 0.8 s for the paper's 5,000 samples on one CPU core, which is most of a short fit's
fixed cost. It is done once, in ``prepare_data`` (Lightning's place for a download), and the arrays are kept in
``data_dir`` as a real dataset is kept on disk; ``setup`` loads them in milliseconds.
"""

from __future__ import annotations

import os
import tempfile
from importlib.metadata import version
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

_ARRAYS = ("x", "y", "x_test", "y_test")


def make_mnist1d(num_samples: int = 5000, seed: int = 42) -> dict[str, np.ndarray]:
    """Generate MNIST-1D locally. ``num_samples`` counts train + test (80/20), as in the generator."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    return make_dataset(args)


def default_data_dir() -> Path:
    """``$LIGHTNING_PULSE_DATA`` if set, else ``$XDG_CACHE_HOME/lightning-pulse`` (``~/.cache/lightning-pulse``)."""
    if os.environ.get("LIGHTNING_PULSE_DATA"):
        return Path(os.environ["LIGHTNING_PULSE_DATA"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "lightning-pulse"


def mnist1d_file(data_dir: str | Path, num_samples: int, seed: int) -> Path:
    """Where the generated arrays are kept: one file per size, seed and generator version."""
    return Path(data_dir) / f"mnist1d-{version('mnist1d')}-n{num_samples}-seed{seed}.npz"


def save_mnist1d(path: Path, num_samples: int, seed: int) -> None:
    """Generate and write atomically: a concurrent reader sees the whole file or none."""
    data = make_mnist1d(num_samples, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, suffix=".npz.partial")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **{name: data[name] for name in _ARRAYS})
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def load_mnist1d(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as arrays:
        return {name: arrays[name] for name in _ARRAYS}


class MNIST1DDataModule(pl.LightningDataModule):
    """MNIST-1D: sequences of length 40, 10 classes.

    ``num_samples`` (train + test, default 5000 as in the paper, so 4000 train / 1000 test) is generated
    with the ``mnist1d`` package's own generator. ``val_fraction`` of the training split is held out for
    validation; the generator's test split is the test set.

    Args:
        num_samples: total samples to generate, from 5000 (4k train) to 125000 (100k train).
        batch_size: training and evaluation batch size.
        val_fraction: share of the training split held out for validation.
        data_seed: seed of the generator (the data), independent of the training seed.
        num_workers: DataLoader workers.
        data_dir: where the generated arrays are kept (default :func:`default_data_dir`). A folder that cannot
            be written is not an error: the data is then generated in ``setup``, every fit.
    """

    def __init__(
        self,
        num_samples: int = 5000,
        batch_size: int = 100,
        val_fraction: float = 0.1,
        data_seed: int = 42,
        num_workers: int = 0,
        data_dir: str | None = None,
    ) -> None:
        super().__init__()
        if num_samples < 100:
            raise ValueError(f"`num_samples`={num_samples} must be at least 100.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction`={val_fraction} must be in (0, 1).")
        self.save_hyperparameters()
        self.train_set = self.val_set = self.test_set = None
        folder = default_data_dir() if data_dir is None else Path(data_dir)
        self.data_file = mnist1d_file(folder, num_samples, data_seed)

    def prepare_data(self) -> None:
        """Generate the data once (on one process per node) and keep it in ``data_dir``."""
        if self.data_file.exists():
            return
        try:
            save_mnist1d(self.data_file, self.hparams.num_samples, self.hparams.data_seed)
        except OSError:  # a read-only folder: setup generates in memory instead
            pass

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.data_file.exists():
            data = load_mnist1d(self.data_file)
        else:
            data = make_mnist1d(self.hparams.num_samples, self.hparams.data_seed)
        x = torch.as_tensor(data["x"], dtype=torch.float32)
        y = torch.as_tensor(data["y"], dtype=torch.long)
        x_test = torch.as_tensor(data["x_test"], dtype=torch.float32)
        y_test = torch.as_tensor(data["y_test"], dtype=torch.long)
        n_val = int(round(len(x) * self.hparams.val_fraction))
        self.train_set = TensorDataset(x[n_val:], y[n_val:])
        self.val_set = TensorDataset(x[:n_val], y[:n_val])
        self.test_set = TensorDataset(x_test, y_test)

    def _loader(self, dataset: TensorDataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
