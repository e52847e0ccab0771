"""A LightningDataModule over scikit-learn's bundled digits."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class DigitsDataModule(pl.LightningDataModule):
    """8x8 digit images as ``(B, 1, 8, 8)`` floats in [0, 1], labels ``(B,)``.

    A fixed, seeded split: ``test_fraction`` for test, ``val_fraction`` of the rest for validation.

    Args:
        batch_size: batch size.
        val_fraction: share of the non-test data held out for validation.
        test_fraction: share of all data held out for test.
        split_seed: seed of the split.
    """

    def __init__(
        self, batch_size: int = 64, val_fraction: float = 0.1, test_fraction: float = 0.2, split_seed: int = 0
    ) -> None:
        super().__init__()
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0 < value < 1:
                raise ValueError(f"`{name}`={value} must be in (0, 1).")
        self.save_hyperparameters()
        self.train_set = self.val_set = self.test_set = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.as_tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.hparams.split_seed))
        x, y = x[order], y[order]
        n_test = int(len(x) * self.hparams.test_fraction)
        n_val = int((len(x) - n_test) * self.hparams.val_fraction)
        self.test_set = TensorDataset(x[:n_test], y[:n_test])
        self.val_set = TensorDataset(x[n_test : n_test + n_val], y[n_test : n_test + n_val])
        self.train_set = TensorDataset(x[n_test + n_val :], y[n_test + n_val :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)
