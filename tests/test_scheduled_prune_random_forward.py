"""ScheduledPrune(mode="structured") on the models of a held-out sweep that it refused wrongly: Hugging Face
ViTMAE, which draws a random patch mask inside its forward (in eval mode too), and Hugging Face DETR, whose
batch holds a list of per-image target dicts next to the image tensors."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_pulse import ScheduledPrune
from lightning_pulse.core import pruning
from lightning_pulse.errors import PulseRefusal
from tests.conftest import trainer_kwargs

STEPS = 12


def _prune(**kwargs) -> ScheduledPrune:
    return ScheduledPrune(
        **{"final_sparsity": 0.5, "mode": "structured", "start": 0.1, "end": 0.6, "every": 3, **kwargs}
    )


def _fit(module: pl.LightningModule, data: DataLoader, prune: ScheduledPrune) -> pl.Trainer:
    trainer = pl.Trainer(**trainer_kwargs(max_steps=STEPS, callbacks=[prune]))
    trainer.fit(module, data)
    return trainer


# ------------------------------------------------------------------------- a random draw inside forward
class _TinyViTMAE(pl.LightningModule):
    """Hugging Face ViTMAE from a config: its forward masks a random 75% of the patches, from torch's global
    generator, whatever the mode."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTMAEConfig, ViTMAEForPreTraining

        config = ViTMAEConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=4,
            num_channels=1,
            decoder_hidden_size=32,
            decoder_num_hidden_layers=1,
            decoder_num_attention_heads=2,
            decoder_intermediate_size=64,
            mask_ratio=0.75,
        )
        self.model = ViTMAEForPreTraining(config)

    def forward(self, **batch):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _images() -> DataLoader:
    pixels = torch.rand(64, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    return DataLoader([{"pixel_values": image} for image in pixels], batch_size=8)


def test_a_random_mask_drawn_in_forward_is_cut_and_trains_and_its_refusal_offers_a_working_pattern():
    module = _TinyViTMAE().eval()
    image = next(iter(_images()))["pixel_values"]
    with (
        torch.no_grad()
    ):  # two eval forwards of the uncut model differ: the check must compare like with like
        assert not torch.equal(module(pixel_values=image).logits, module(pixel_values=image).logits)
    pl.seed_everything(0)
    prune = _prune(exclude_pattern="attention")
    # held-out sweep: refused, as a cut that "does not follow this model's channel structure"
    assert _fit(_TinyViTMAE(), _images(), prune).global_step == STEPS
    assert prune.events[-1]["layer_sparsity"] == {
        "model.vit.layers.0.mlp.fc1": 0.5,
        "model.decoder.decoder_layers.0.mlp.fc1": 0.5,
    }
    # without the pattern the head reshape breaks, and the refusal names the pattern that passes the check
    with pytest.raises(PulseRefusal, match=r"`exclude_pattern`='attention' the trial cut passes"):
        _fit(_TinyViTMAE(), _images(), _prune())


def test_the_value_check_leaves_the_runs_random_state_as_it_was():
    module, example = _TinyViTMAE(), pruning.small_example(next(iter(_images())))
    generator_state = torch.random.get_rng_state()  # after the loader drew its seed
    pruner = pruning.Pruner("structured", None, "attention")
    assert pruning.check_structured(module, pruner, [0.25, 0.5], example) is None
    assert torch.equal(torch.random.get_rng_state(), generator_state)


class _PrivateNoiseMLP(pl.LightningModule):
    """Adds noise from a generator of its own in forward: no state of torch's global generators repeats it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
        self.noise = torch.Generator().manual_seed(0)

    def forward(self, x):
        return self.net(x + torch.randn(x.shape, generator=self.noise))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_forward_that_differs_at_the_same_random_state_is_refused_as_not_deterministic_not_as_a_bad_cut():
    generator = torch.Generator().manual_seed(0)
    data = DataLoader(
        list(zip(torch.randn(64, 8, generator=generator), torch.randint(0, 2, (64,), generator=generator))),
        batch_size=8,
    )
    with pytest.raises(PulseRefusal) as refusal:
        _fit(_PrivateNoiseMLP(), data, _prune())
    assert "its forward is not deterministic" in str(refusal.value)
    assert "channel structure" not in str(refusal.value)


# ------------------------------------------------------------------------------ a list of per-sample targets
def _detr_config():
    from transformers import DetrConfig, ResNetConfig

    backbone = ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        out_features=["stage2"],
    )
    return DetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        num_queries=6,
        num_labels=3,
        dropout=0.0,
    )


class _TinyDetr(pl.LightningModule):
    """Hugging Face DETR from a config; its forward takes the whole batch, targets included, by name."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import DetrForObjectDetection

        self.model = DetrForObjectDetection(_detr_config())

    def forward(self, **inputs):
        output = self.model(**inputs)  # the loss too: the model must run on the targets of the trace example
        return output.logits, output.pred_boxes

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _detection_samples(count: int = 48) -> list[dict]:
    """Images with 1 to 3 boxes each (the usual dataset of a detection model: a target dict per image)."""
    generator, samples = torch.Generator().manual_seed(0), []
    for index in range(count):
        boxes = int(torch.randint(1, 4, (1,), generator=generator))
        target = {
            "class_labels": torch.randint(0, 3, (boxes,), generator=generator),
            "boxes": 0.25 + 0.5 * torch.rand(boxes, 4, generator=generator),
            "image_id": torch.tensor(index),
        }
        samples.append({"pixel_values": torch.randn(3, 32, 32, generator=generator), "labels": target})
    return samples


def _detection_collate(samples: list[dict]) -> dict:
    return {
        "pixel_values": torch.stack([sample["pixel_values"] for sample in samples]),
        "pixel_mask": torch.ones(len(samples), 32, 32, dtype=torch.long),
        "labels": [sample["labels"] for sample in samples],
    }


def _detection_batches() -> DataLoader:
    return DataLoader(_detection_samples(), batch_size=8, collate_fn=_detection_collate)


def test_the_trace_example_of_a_detection_batch_keeps_two_images_with_their_whole_targets():
    batch = next(iter(_detection_batches()))
    example = pruning.small_example(batch)
    assert example["pixel_values"].shape == (2, 3, 32, 32) and example["pixel_mask"].shape == (2, 32, 32)
    # held-out sweep: the list kept its 8 dicts, and each dict's boxes were cut to 2 rows
    assert [int(target["image_id"]) for target in example["labels"]] == [0, 1]
    for kept, whole in zip(example["labels"], batch["labels"]):
        assert torch.equal(kept["boxes"], whole["boxes"]) and torch.equal(
            kept["class_labels"], whole["class_labels"]
        )
    with torch.no_grad():
        assert torch.isfinite(_TinyDetr().model(**example).loss)


def test_a_detr_forward_taking_the_whole_batch_with_its_target_list_is_cut_and_trains():
    pl.seed_everything(0)
    module, prune = _TinyDetr(), _prune(exclude_pattern="attn|input_projection|backbone")
    # held-out sweep: refused, "the model does not run on the example it is traced with"
    assert _fit(module, _detection_batches(), prune).global_step == STEPS
    cut = prune.events[-1]["layer_sparsity"]
    assert (
        cut["model.model.encoder.layers.0.mlp.fc1"] == 0.5
        and cut["model.model.decoder.layers.0.mlp.fc1"] == 0.5
    )
    assert module.model.model.encoder.layers[0].mlp.fc1.out_features == 32


class _TinyDetrReturningItsLoss(_TinyDetr):
    def forward(self, **inputs):
        return self.model(**inputs)  # the whole output: the loss (its box matching) included


def test_a_dependency_search_held_up_by_a_loss_in_the_output_is_refused_naming_the_loss(monkeypatch):
    # torch-pruning's search through DETR's loss did not end within 200 s, with the attention left out or not;
    # without the loss it takes a second (the test above)
    monkeypatch.setattr(pruning, "STRUCTURED_CHECK_SECONDS", 2.0)
    with pytest.raises(PulseRefusal) as refusal:
        _fit(_TinyDetrReturningItsLoss(), _detection_batches(), _prune())
    assert "did not finish within 2 s" in str(refusal.value)
    assert "output holds its loss (`loss`)" in str(refusal.value) and "training_step" in str(refusal.value)
    # the attention left out is checked by a second search, which does not end either: not offered
    assert "usual cause" not in str(refusal.value) and "self_attn" not in str(refusal.value)


def test_the_trace_example_of_a_defaultdict_batch_is_cut_to_two_samples_as_a_dict():
    # a review: cutting with the replay's batch cutter rebuilt mappings by their type, and a defaultdict takes
    # no items: the trace example of such a batch raised TypeError at setup, where it was cut before
    from collections import defaultdict

    from lightning_pulse.core.pruning import small_example

    batch = defaultdict(list, {"x": torch.randn(8, 3), "y": torch.arange(8)})
    example = small_example(batch)
    assert type(example) is dict and example["x"].shape == (2, 3) and example["y"].tolist() == [0, 1]


def test_a_prune_event_leaves_the_runs_random_stream_alone_when_the_forward_draws():
    # a review: the event's dependency trace ran the model's forward outside a forked random state, so a
    # model drawing in forward (a random mask, as ViTMAE's) had the run's stream moved at every event
    from lightning_pulse.core import pruning

    class DrawsInForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)) * (torch.rand(x.shape[0], 32) > -1))

    for train in (True, False):
        torch.manual_seed(0)
        model, example = DrawsInForward().train(train), torch.randn(2, 8)
        before = torch.get_rng_state()
        pruning.Pruner(mode="structured").prune(model, 0.5, (), example)
        assert model.a.out_features == 16 and torch.equal(torch.get_rng_state(), before)
