"""HardSampleReplay on vision layouts a sweep found silently wrong or refused late: SimCLR's ``(2B,)`` per-row
NT-Xent losses given to ``OutputKeyScorer`` (folded into the wrong samples), torchvision's detection collate
``tuple(zip(*batch))`` in batch mode (refused only at a short batch, or a TypeError at the first cut), and a
detection loss whose box term runs over the boxes joined across images (left out of every score)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import HardSampleReplay
from lightning_pulse.core.per_sample_loss import OutputKeyScorer
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

B = 8


# ---------------------------------------------------------------- SimCLR: (2B,) rows given to OutputKeyScorer
class _TwoViews(Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(6, generator=generator)
        return x + 0.1 * torch.randn(6, generator=generator), x + 0.1 * torch.randn(6, generator=generator)


class _SimCLR(pl.LightningModule):
    def __init__(self, per_row: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.per_row = nn.Linear(6, 4), per_row

    def training_step(self, batch, batch_idx):
        view1, view2 = batch
        count = view1.shape[0]
        z = F.normalize(self.encoder(torch.cat([view1, view2])), dim=1)
        similarity = (z @ z.t() / 0.5).masked_fill(torch.eye(2 * count, dtype=torch.bool), float("-inf"))
        targets = torch.cat([torch.arange(count, 2 * count), torch.arange(count)])
        rows = F.cross_entropy(similarity, targets, reduction="none")  # (2B,): [view1; view2]
        per_sample = rows if self.per_row else rows.view(2, count).mean(0)
        return {"loss": rows.mean(), "per_sample_loss": per_sample.detach()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_TwoViews(), batch_size=B)


def test_output_key_scorer_refuses_simclr_rows_of_two_views_naming_the_b_shape_and_the_reduction(tmp_path):
    # sweep: the (2B,) rows were cut into B runs of 2 consecutive rows, each sample scored by two other
    # samples' rows (rank correlation -0.04 with its own loss), with no word
    replay = HardSampleReplay(mode="batch", score_half_life=None, scorer=OutputKeyScorer("per_sample_loss"))
    trainer = pl.Trainer(max_steps=3, callbacks=[replay], **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_SimCLR(per_row=True))
    message = str(refusal.value)
    assert trainer.global_step == 0
    assert message.startswith("HardSampleReplay") and "OutputKeyScorer" in message
    assert "16 rows" in message and "(8,)" in message and "view(2, 8).mean(0)" in message


def test_simclr_rows_reduced_per_sample_train_and_score_with_output_key_scorer(tmp_path):
    replay = HardSampleReplay(mode="batch", score_half_life=None, scorer=OutputKeyScorer("per_sample_loss"))
    trainer = pl.Trainer(max_steps=4, callbacks=[replay], **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(_SimCLR(per_row=False))
    assert trainer.global_step == 4
    assert sum(score == score for score in replay.table.scores.tolist()) == 32


def test_the_simclr_capture_refusal_gives_the_shape_a_scorer_returns(tmp_path):
    trainer = pl.Trainer(
        max_steps=3, callbacks=[HardSampleReplay(mode="batch")], **trainer_kwargs(default_root_dir=tmp_path)
    )
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_SimCLR(per_row=False))
    assert "OutputKeyScorer" in str(refusal.value) and "view(2, 8).mean(0)" in str(refusal.value)


# ------------------------------------------------------- torchvision's detection collate in batch mode
class _Detection(Dataset):
    """Images ``(3, 16, 16)`` with 0 to 3 boxes each."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(count, 3, 16, 16, generator=generator)
        self.boxes = [
            torch.rand(int(torch.randint(0, 4, (1,), generator=generator)), 4, generator=generator)
            for _ in range(count)
        ]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        boxes = self.boxes[index]
        return self.images[index], {"boxes": boxes, "labels": torch.zeros(len(boxes), dtype=torch.long)}


class _DetectionModule(pl.LightningModule):
    """A class score per image slot (``Q`` slots) and a box per image box, as a DETR-like head predicts."""

    def __init__(self, count: int = 48, collate=None, box_term: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.count, self.collate, self.box_term = count, collate, box_term
        self.backbone, self.cls, self.box = (
            nn.Linear(3 * 16 * 16, 16),
            nn.Linear(16, 3 * 4),
            nn.Linear(16, 3 * 4),
        )

    def training_step(self, batch, batch_idx):
        images, targets = batch
        features = torch.relu(self.backbone(torch.stack(list(images)).flatten(1)))
        logits = self.cls(features).view(-1, 3, 4)  # (B, Q, classes)
        slots = torch.full((len(targets), 3), 3)  # class 3: no object
        for k, target in enumerate(targets):
            slots[k, : len(target["boxes"])] = target["labels"]
        loss = F.cross_entropy(logits.reshape(-1, 4), slots.reshape(-1))
        if self.box_term:  # boxes joined across images: N rows, N changes from batch to batch
            boxes = self.box(features).view(-1, 3, 4)
            predicted = torch.cat([boxes[k, : len(t["boxes"])] for k, t in enumerate(targets)])
            loss = loss + F.smooth_l1_loss(predicted, torch.cat([t["boxes"] for t in targets]))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        collate = self.collate or (lambda items: tuple(zip(*items)))
        return DataLoader(_Detection(self.count), batch_size=B, shuffle=True, collate_fn=collate)


def test_batch_mode_refuses_a_detection_collate_of_tuples_at_the_first_full_batch(tmp_path):
    # sweep: at 96 samples (no short batch) the first cut raised a TypeError after 12 steps; at 100 the
    # refusal came at the short last batch. (3, H, W) images made the batch look like one of 3 rows.
    replay = HardSampleReplay(mode="batch", score_half_life=None)
    trainer = pl.Trainer(max_epochs=3, callbacks=[replay], **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.raises(
        PulseRefusal, match=r"its part batch\[0\] is a tuple of 8 per-sample items"
    ) as refusal:
        trainer.fit(_DetectionModule(count=48, box_term=False))
    assert trainer.global_step == 0 and "mode='steps'" in str(refusal.value)


def _list_collate(items):
    return torch.stack([image for image, _ in items]), [target for _, target in items]


@pytest.mark.parametrize("mode", ["batch", "steps"])
def test_a_box_term_over_the_boxes_joined_across_images_is_refused_at_the_first_step_naming_a_scorer(
    tmp_path, mode
):
    # sweep: each image's score was the class term alone, the box term left out as a penalty with no word,
    # unless the batch's box count happened to be a multiple of B (then that step went unscored)
    replay = HardSampleReplay(mode=mode, score_half_life=None)
    trainer = pl.Trainer(max_epochs=2, callbacks=[replay], **trainer_kwargs(default_root_dir=tmp_path))
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_DetectionModule(count=48, collate=_list_collate))
    message = str(refusal.value)
    assert trainer.global_step == 0
    assert "smooth_l1_loss" in message and "set `scorer=`" in message and "OutputKeyScorer" in message


def test_a_detection_loss_with_the_class_term_alone_scores_each_image(tmp_path):
    # the check above does not refuse the class term over B x Q slots, which splits into the images
    replay = HardSampleReplay(mode="batch", score_half_life=None)
    trainer = pl.Trainer(max_epochs=2, callbacks=[replay], **trainer_kwargs(default_root_dir=tmp_path))
    trainer.fit(_DetectionModule(count=48, collate=_list_collate, box_term=False))
    assert trainer.global_step > 6
    assert sum(score == score for score in replay.table.scores.tolist()) == 48
