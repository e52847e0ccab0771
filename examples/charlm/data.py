"""Character data from the Python standard library's source, found through ``sysconfig``."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB_SIZE = 128  # 7-bit ASCII; anything else maps to 0


def load_stdlib_text(max_chars: int = 1_000_000) -> str:
    """The first ``max_chars`` characters of the stdlib's ``*.py`` files, in sorted path order.

    Sorting makes the corpus identical on every machine with the same Python version. Test suites are left
    out so the text is ordinary library code.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:-1] or path.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        pieces.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(pieces)[:max_chars]


def encode(text: str) -> torch.Tensor:
    codes = torch.tensor(list(text.encode("ascii", errors="replace")), dtype=torch.long)
    codes[codes >= VOCAB_SIZE] = 0
    return codes


class CharLMDataModule(pl.LightningDataModule):
    """Non-overlapping windows of ``seq_len + 1`` characters: inputs ``(B, T)``, next-char targets ``(B, T)``.

    The last ``val_fraction`` of the corpus is the validation (and test) split, so no window leaks.

    Args:
        max_chars: characters of stdlib source to use.
        seq_len: context length ``T``.
        batch_size: batch size ``B``.
        val_fraction: tail share of the corpus held out.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        max_chars: int = 400_000,
        seq_len: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"`seq_len`={seq_len} must be at least 2.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction`={val_fraction} must be in (0, 1).")
        self.save_hyperparameters()
        self.train_set = self.val_set = None

    def _windows(self, codes: torch.Tensor) -> TensorDataset:
        span = self.hparams.seq_len + 1
        count = len(codes) // span
        windows = codes[: count * span].view(count, span)
        return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        codes = encode(load_stdlib_text(self.hparams.max_chars))
        split = int(len(codes) * (1 - self.hparams.val_fraction))
        self.train_set = self._windows(codes[:split])
        self.val_set = self._windows(codes[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers
        )

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
