"""Batch mode and a vision-language model's image patches joined across the batch (Qwen2-VL's
``pixel_values``, ``(sum of patches, D)``, next to ``image_grid_thw``); steps mode on its own and an attribute
such a model computes anew at every forward (``rope_deltas``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pulse import HardSampleReplay
from lightning_pulse.core.replay import HardSampleSelector, ReplayConfig
from lightning_pulse.core.replay_batch import ReplayBatchLifecycle
from lightning_pulse.core.sample_scores import SampleScoreTable
from lightning_pulse.core.selection import concatenated_parts, joined_rows, joined_rows_refusal
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

transformers = pytest.importorskip("transformers")

IMAGE, VISION_START, VISION_END = 120, 121, 122
PATCH = 3 * 2 * 2 * 2  # channels * temporal patch * patch * patch


def _vlm(kind: str) -> nn.Module:
    """A tiny Qwen2-VL (or Qwen2.5-VL) from a config: 2 text layers of width 64, a 1-block vision tower."""
    torch.manual_seed(0)
    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    vision = dict(depth=1, hidden_size=64, num_heads=2, patch_size=2, spatial_merge_size=2)
    vision.update(temporal_patch_size=2, in_channels=3)
    if kind == "qwen2_vl":
        vision.update(embed_dim=32, mlp_ratio=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision.update(intermediate_size=64, out_hidden_size=64, fullatt_block_indexes=[0], window_size=8)
        config_class = transformers.Qwen2_5_VLConfig
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    ids = dict(image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    config = config_class(text_config=text, vision_config=vision, video_token_id=123, **ids)
    return model_class(config)


class _Samples(Dataset):
    """Image-and-text samples: 16 or 8 patches each (a ``(1, h, 4)`` grid); ``text_only``: every fourth has no
    image, so the grid holds a row per image, not per sample."""

    def __init__(self, size: int, text_only: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(size):
            label = i % 7
            text = torch.randint(1, 100, (6 + i % 5,), generator=generator)
            text[-1] = 100 + label  # the answer token follows the image's class
            item: dict[str, torch.Tensor] = {"ids": text}
            if not (text_only and i % 4 == 3):
                grid = torch.tensor([[1, 4 if i % 3 else 2, 4]])
                patches = int(grid.prod())
                item["pixel_values"] = torch.randn(patches, PATCH, generator=generator) * 0.1 + label
                item["grid"] = grid
                image = [
                    torch.tensor([VISION_START]),
                    torch.full((patches // 4,), IMAGE),
                    torch.tensor([VISION_END]),
                ]
                item["ids"] = torch.cat([*image, text])
            self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What Qwen2-VL's processor makes: padded tokens, every image's patches joined into one tensor."""
    length = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["ids"])], mask[row, : len(sample["ids"])] = sample["ids"], 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100).masked_fill(ids == IMAGE, -100),
        "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.cat([s["pixel_values"] for s in samples if "grid" in s]),
        "image_grid_thw": torch.cat([s["grid"] for s in samples if "grid" in s]),
    }


class _VisionLanguage(pl.LightningModule):
    """Trains the model on its own loss; ``clear_rope_deltas``: sets the model's ``rope_deltas`` (computed
    anew at every training forward, kept for generation) to ``None`` at the end of each ``training_step``."""

    def __init__(self, kind: str = "qwen2_vl", clear_rope_deltas: bool = False) -> None:
        super().__init__()
        self.model = _vlm(kind)
        self.clear_rope_deltas = clear_rope_deltas

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        if self.clear_rope_deltas:
            self.model.model.rope_deltas = None
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(module: pl.LightningModule, replay: HardSampleReplay, text_only: bool = False) -> pl.Trainer:
    pl.seed_everything(0)
    loader = DataLoader(_Samples(32, text_only), batch_size=8, shuffle=True, collate_fn=_collate)
    trainer = pl.Trainer(callbacks=[replay], max_epochs=3, **trainer_kwargs())
    trainer.fit(module, loader)
    return trainer


@pytest.mark.parametrize(
    ("kind", "text_only", "split"),
    [
        ("qwen2_vl", False, r"the sum of the row products of batch\['image_grid_thw'\]"),
        ("qwen2_5_vl", False, r"the sum of the row products of batch\['image_grid_thw'\]"),
        (
            "qwen2_vl",
            True,
            r"whose first dimension is not the batch's 8 samples and changes from batch to batch",
        ),
    ],
)
def test_patches_joined_across_the_batch_are_refused_in_batch_mode_at_the_second_batch(
    kind, text_only, split
):
    # held-out sweep: the first cut step cut input_ids, labels and image_grid_thw to 4 samples and kept the
    # 112 patch rows whole; the vision tower failed on the sizes (112 against 64) mid-run. Images of several
    # sizes give 16 or 8 patches; with text-only samples the grid holds a row per image, not per sample
    replay = HardSampleReplay(mode="batch")
    with pytest.raises(PulseRefusal, match=r"batch\['pixel_values'\].*" + split) as refusal:
        _fit(_VisionLanguage(kind), replay, text_only)
    assert replay.batches.recorded_steps == 1  # refused at the second batch, before any cut
    assert "Use mode='steps'" in str(refusal.value)


def test_steps_mode_alone_names_clearing_a_recomputed_attribute_and_not_batch_mode_for_joined_patches():
    # held-out sweep: steps mode on its own refused Qwen2-VL at its cut second batch for `rope_deltas`, which
    # the model computes anew at every training forward, and named `mode='batch'`, which crashed on the
    # joined patches. The check cannot tell a recomputed attribute from carried state before the cut batch
    # trains (a read inside TorchScript is not seen), so it still refuses, naming the ways out that train
    with pytest.raises(
        PulseRefusal, match=r"`model\.model\.rope_deltas` \(tensor of shape \(8, 1\)\)"
    ) as refusal:
        _fit(_VisionLanguage(), HardSampleReplay())
    message = str(refusal.value)
    assert "clear it at the end of `training_step` (`self.model.model.rope_deltas = None`)" in message
    assert "or `mode='batch'`" not in message
    assert "not `mode='batch'`, which would keep batch['pixel_values'] (joined: the sum of" in message
    # the way out named trains the whole fit and selects
    replay = HardSampleReplay()
    trainer = _fit(_VisionLanguage(clear_rope_deltas=True), replay)
    assert trainer.current_epoch == 3 and replay.state_check.done and replay.state_check.found == {}
    assert replay.metrics()["replay_fraction"] == pytest.approx(0.5)


# ---------------------------------------------------------------- the rules, without a Trainer
def test_a_grid_per_sample_splits_the_rows_joined_next_to_it_and_padded_or_constant_tensors_do_not_match():
    grid = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4], [1, 4, 4]])  # 16 + 8 + 16 + 16 patches
    batch = {"ids": torch.zeros(4, 12, dtype=torch.long), "pixel_values": torch.randn(56, 24), "grid": grid}
    assert concatenated_parts(batch, 4) == {
        ("batch['pixel_values']", "the sum of the row products of batch['grid']"): 56
    }
    # (N, F) rows next to a (B,) count per sample
    nodes = {
        "x": torch.randn(11, 3),
        "num_nodes": torch.tensor([3, 2, 4, 2]),
        "y": torch.tensor([1, 0, 1, 1]),
    }
    assert concatenated_parts(nodes, 4) == {("batch['x']", "the sum of batch['num_nodes']"): 11}
    # a shared (L, L) mask sized by the padding, next to lengths that sum to L; a grid of more columns than
    # a size has (token ids); a float grid; a negative one
    lengths = torch.tensor([3, 3, 3, 3])
    assert concatenated_parts({"ids": torch.ones(4, 12), "mask": torch.ones(12, 12), "len": lengths}, 4) == {}
    wide = torch.ones(4, 5, dtype=torch.long)
    wide[:, -1] = 5  # row products 5: they would sum to the 20 rows
    assert concatenated_parts({"pixel_values": torch.randn(20, 24), "ids": wide}, 4) == {}
    assert concatenated_parts({"pixel_values": torch.randn(56, 24), "grid": grid.float()}, 4) == {}
    assert concatenated_parts({"pixel_values": torch.randn(56, 24), "grid": -grid}, 4) == {}


def test_joined_rows_are_refused_only_when_their_first_dimension_changes_from_batch_to_batch():
    codebook, before = torch.randn(16, 4), {"x": torch.randn(8, 3), "pixel_values": torch.randn(96, 24)}
    now = {"x": torch.randn(8, 3), "pixel_values": torch.randn(80, 24)}
    for batch in (before, now):
        batch.update(
            codebook=codebook, weights=torch.ones(1, 10), mask=torch.ones(5, 5), ids=torch.ones(8, 5)
        )
    assert joined_rows(before, 8) == {"batch['pixel_values']": (96, 24), "batch['codebook']": (16, 4)}
    reason = joined_rows_refusal(joined_rows(before, 8), joined_rows(now, 8), 8)
    assert reason is not None and "batch['pixel_values'] of shape (80, 24) (before: (96, 24))" in reason
    assert "codebook" not in reason and "mode='steps'" in reason
    assert joined_rows_refusal(joined_rows(before, 8), joined_rows(before, 8), 8) is None


def _step(batches: ReplayBatchLifecycle, selector: HardSampleSelector, model: nn.Module, batch, step, active):
    indices = torch.arange(8 * step, 8 * step + 8) % 24
    started = batches.start_batch(selector, batch, indices, step, step, active)
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    batches.close_capture()
    batches.finish_batch(model, batch, outputs=loss)
    return started


def _hf_style(step: int, layout: str) -> dict[str, torch.Tensor]:
    """Batches of 8 as HF text and image models take them, with a (K, D) codebook and a shared (L, L) mask of
    a length that changes; ``x``, ``y`` feed the test's loss."""
    generator = torch.Generator().manual_seed(step)
    length = 6 + 3 * step
    batch = {"x": torch.randn(8, 4, generator=generator), "y": torch.randint(0, 3, (8,), generator=generator)}
    batch["input_ids"] = torch.randint(0, 50, (8, length), generator=generator)
    batch["attention_mask"] = torch.ones(8, length, dtype=torch.long)
    batch["labels"] = batch["input_ids"].masked_fill(torch.rand(8, length, generator=generator) < 0.2, -100)
    if layout == "llava":
        batch["pixel_values"] = torch.randn(8, 1, 3, 6, 6, generator=generator)
    elif layout == "bert":
        batch["token_type_ids"] = torch.zeros(8, length, dtype=torch.long)
        batch["causal"] = torch.ones(length, length, dtype=torch.bool)
    batch["codebook"] = torch.ones(16, 4)
    return batch


@pytest.mark.parametrize("layout", ["gpt2", "bert", "llava"])
def test_batches_of_hf_text_and_image_models_and_per_batch_constants_are_cut_in_batch_mode(layout):
    torch.manual_seed(0)
    model, batches = nn.Linear(4, 3), ReplayBatchLifecycle("batch")
    selector = HardSampleSelector(SampleScoreTable(24), ReplayConfig("topk", replay_fraction=0.5))
    batches.start_fit()
    try:
        for step in range(3):  # the first two batches are checked, the third scores the rest
            _step(batches, selector, model, _hf_style(step, layout), step, active=False)
        selector.apply()
        light = _hf_style(3, layout)
        _step(batches, selector, model, light, 3, active=True)
        assert light["input_ids"].shape[0] == light["x"].shape[0] == 4  # cut by sample
        assert light["codebook"].shape == (16, 4)  # the constants kept whole
    finally:
        batches.release()


class _KeepsItsLogits(pl.LightningModule):
    """Keeps its (B, C) logits on itself, replaced every step: steps mode alone refuses it at the cut second
    batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 3)

    def training_step(self, batch, batch_idx):
        out = self.net(batch["x"])
        self.last_logits = out.detach()
        return torch.nn.functional.cross_entropy(out, batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _with_joined_targets(samples):
    # YOLO-style targets: one row per box, (image index, class, box), joined across the batch
    counts = torch.tensor([sample["boxes"] for sample in samples])
    image = torch.repeat_interleave(torch.arange(len(samples)), counts)
    return {
        "x": torch.stack([sample["x"] for sample in samples]),
        "y": torch.tensor([sample["y"] for sample in samples]),
        "targets": torch.cat([image[:, None].float(), torch.rand(len(image), 5)], 1),
    }


def test_the_carried_state_refusal_names_batch_mode_only_on_condition_for_joined_rows_it_cannot_split():
    # a review of this pass: with joined rows nothing splits (YOLO targets; Qwen2-VL with text-only samples),
    # steps mode's refusal named `mode='batch'` as a way out, which refuses such batches at the second batch
    generator = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=generator), "y": i % 3, "boxes": i % 4} for i in range(64)]
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, collate_fn=_with_joined_targets)
    pl.seed_everything(0)
    trainer = pl.Trainer(callbacks=[HardSampleReplay()], **trainer_kwargs(max_epochs=3))
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_KeepsItsLogits(), loader)
    message = str(refusal.value)
    assert "`last_logits`" in message
    assert "or `mode='batch'` if batch['targets']" in message and "keeps its first dimension" in message
