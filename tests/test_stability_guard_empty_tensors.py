"""StabilityGuard on batches holding tensors with a zero-size dimension: a detection image without boxes (its
``(0, 4)`` boxes), an empty feature part ``(B, 0)``. The bad-sample search reshaped each tensor to
``(rows, -1)``, which torch refuses for 0 elements: a recoverable NaN step crashed the fit."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pulse.callbacks.stability_guard import StabilityGuard
from lightning_pulse.core.fault_origin import nonfinite_rows, zero_filled
from tests.conftest import trainer_kwargs

BAD_IMAGE = 13  # row 5 of batch 1


def _targets(count: int) -> list[dict[str, torch.Tensor]]:
    return [
        {"boxes": torch.rand(i % 3, 4), "labels": torch.zeros(i % 3, dtype=torch.long)} for i in range(count)
    ]


def test_nonfinite_rows_read_past_tensors_with_a_zero_size_dimension():
    images = torch.zeros(8, 3, 4, 4)
    images[5, 1, 2, 2] = float("nan")
    empty_features = torch.zeros(8, 0)
    assert nonfinite_rows((images, empty_features, _targets(8)), 8) == [5]
    assert nonfinite_rows((torch.zeros(8, 3, 4, 4), torch.zeros(0, 4), torch.zeros(8, 0, 2)), 8) == []
    assert nonfinite_rows(zero_filled((images, _targets(8)))) == []


class _Detections(Dataset):
    """Images of 3 x 8 x 8, each with 0, 1 or 2 boxes; image ``BAD_IMAGE`` holds a NaN."""

    def __init__(self):
        self.images = torch.randn(32, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        self.images[BAD_IMAGE, 0, 0, 0] = float("nan")

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        boxes = torch.rand(i % 3, 4, generator=torch.Generator().manual_seed(i))
        return self.images[i], {"boxes": boxes, "labels": torch.full((i % 3,), i % 5)}


def _collate(items):
    return torch.stack([image for image, _ in items]), [target for _, target in items]


class _Detector(pl.LightningModule):
    """Two box slots an image: class logits over 5 classes and "no object", and box regression on the boxes
    the image has."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.classes, self.boxes = nn.Linear(8, 2 * 6), nn.Linear(8, 2 * 4)

    def training_step(self, batch, batch_idx):
        images, targets = batch
        features = self.backbone(images).flatten(1)
        logits, boxes = self.classes(features).view(-1, 2, 6), self.boxes(features).view(-1, 2, 4)
        wanted = torch.full((len(targets), 2), 5)
        predicted = []
        for i, target in enumerate(targets):
            wanted[i, : len(target["labels"])] = target["labels"]
            predicted.append(boxes[i, : len(target["boxes"])])
        box_loss = nn.functional.smooth_l1_loss(
            torch.cat(predicted), torch.cat([t["boxes"] for t in targets])
        )
        return nn.functional.cross_entropy(logits.reshape(-1, 6), wanted.reshape(-1)) + box_loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_nan_image_in_a_detection_batch_with_imageless_boxes_is_skipped_not_a_crash():
    pl.seed_everything(0)
    guard = StabilityGuard(warmup=2)
    trainer = pl.Trainer(max_epochs=2, callbacks=[guard], **trainer_kwargs())
    loader = DataLoader(_Detections(), batch_size=8, collate_fn=_collate)
    trainer.fit(_Detector(), loader)
    assert trainer.global_step == 8  # the fit ran to its end: 4 batches an epoch
    assert [sample["batch_idx"] for sample in guard.bad_samples] == [1, 1]
    assert guard.bad_batches == 2 and guard.rollbacks == 0
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
