"""ScheduledPrune(mode='structured') where torch-pruning cannot build its dependency graph at all: a held-out
sweep's tiny HF Mllama was refused with "it broke in model.lm_head (Linear): leave out the layers around it
with `exclude_pattern`", and `exclude_pattern='lm_head'` gave the same refusal. The error is raised in
torch-pruning's index mapping while it builds the graph of the whole model, which no pattern changes."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader

from lightning_pulse import ScheduledPrune
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

VOCAB, TOKENS = 64, 12


def _mllama() -> transformers.MllamaForConditionalGeneration:
    vision = dict(
        hidden_size=32, num_hidden_layers=2, num_global_layers=1, intermediate_size=64, attention_heads=2,
        image_size=28, patch_size=14, max_num_tiles=2, vision_output_dim=64, intermediate_layers_indices=[0],
        supported_aspect_ratios=[[1, 1], [1, 2]], num_channels=3,
    )  # fmt: skip
    text = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, cross_attention_layers=[1], max_position_embeddings=64, rope_scaling=None,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB - 1)
    return transformers.MllamaForConditionalGeneration(config)


class _Captioner(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _mllama()

    def forward(self, input_ids, pixel_values, aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask):
        return self.model(
            input_ids=input_ids, pixel_values=pixel_values, aspect_ratio_ids=aspect_ratio_ids,
            aspect_ratio_mask=aspect_ratio_mask, cross_attention_mask=cross_attention_mask, use_cache=False,
        ).logits  # fmt: skip

    def training_step(self, batch, batch_idx):
        logits = self(**batch)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        generator, count, images, tiles = torch.Generator().manual_seed(1), 8, 2, 2
        ids = torch.randint(3, VOCAB - 2, (count, TOKENS), generator=generator)
        ids[:, :2] = VOCAB - 1  # one image token per image
        rows = [
            dict(
                input_ids=ids[i],
                pixel_values=torch.randn(images, tiles, 3, 28, 28, generator=generator),
                aspect_ratio_ids=torch.tensor([1, 2]),
                aspect_ratio_mask=torch.ones(images, tiles, dtype=torch.long),
                cross_attention_mask=torch.ones(TOKENS, images, tiles, dtype=torch.long),
            )
            for i in range(count)
        ]
        return DataLoader(rows, batch_size=4)


@pytest.mark.parametrize("exclude_pattern", [None, "lm_head"])
def test_a_dependency_graph_torch_pruning_cannot_build_is_refused_naming_no_layer_and_no_pattern(
    exclude_pattern,
):
    prune = ScheduledPrune(
        final_sparsity=0.5, mode="structured", start=2, end=4, every=2, probe_batches=0,
        exclude_pattern=exclude_pattern,
    )  # fmt: skip
    trainer = pl.Trainer(callbacks=[prune], **trainer_kwargs(max_steps=4, limit_val_batches=0))
    with pytest.raises(PulseRefusal) as refusal:
        trainer.fit(_Captioner())
    message = str(refusal.value)
    assert "could not build its dependency graph of this model" in message
    assert "TypeError" in message  # torch-pruning's own error, as it was raised
    assert "it broke in" not in message and "leave out the layers around it" not in message
    assert "No `exclude_pattern` or `layer_types` changes that" in message
    assert "Use mode='unstructured'" in message
    assert trainer.global_step == 0
