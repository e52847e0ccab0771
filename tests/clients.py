"""Client models: ordinary LightningModules written the way users write them, not for lightning-pulse.

Each is small enough to fit in seconds on one CPU core, and each carries one trait that the bundled examples
do not: a Hugging Face model computing its own loss from a dict batch, ``nn.MultiheadAttention`` inside
``nn.TransformerEncoder``, hidden state carried across batches, a module applied twice (shared weights),
manual optimization, a per-step OneCycleLR. Weights are built from configs; data is generated or local.

``CLIENTS`` maps a name to ``make() -> (module, datamodule)``.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from examples.charlm.data import encode, load_stdlib_text

SEQ_LEN = 32


# ---------------------------------------------------------------------------------------------- models
class BatchNormMLP(pl.LightningModule):
    """An MLP with BatchNorm on 10 features and 3 classes: StochasticWeightAveraging adds an epoch that
    recomputes its statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


# ---------------------------------------------------------------------------------------------- data
class _DictWindows(Dataset):
    """Token windows as HF-style dict samples: ``input_ids``, ``attention_mask`` and ``labels``."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[index]
        label = ids if self.labels is None else self.labels[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": label}


class TextWindowsDataModule(pl.LightningDataModule):
    """Windows of stdlib source as dict batches; ``task="lm"`` labels are the inputs (HF shifts them),
    ``task="classify"`` labels say whether the window contains a ``(`` in its second half."""

    def __init__(self, task: str = "lm", max_chars: int = 60_000, batch_size: int = 16) -> None:
        super().__init__()
        self.task, self.max_chars, self.batch_size = task, max_chars, batch_size

    def setup(self, stage: str | None = None) -> None:
        codes = encode(load_stdlib_text(self.max_chars))
        windows = codes[: len(codes) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
        labels = None
        if self.task == "classify":
            labels = (windows[:, SEQ_LEN // 2 :] == ord("(")).any(dim=1).long()
        split = int(0.9 * len(windows))
        self.train_set = _DictWindows(windows[:split], None if labels is None else labels[:split])
        self.val_set = _DictWindows(windows[split:], None if labels is None else labels[split:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    test_dataloader = val_dataloader  # the benchmarks' test pass reuses the held-out windows


class _ContiguousStreams(Sampler[list[int]]):
    """Batch ``k`` holds window ``k`` of each of ``batch_size`` parallel streams, so row ``i`` of every batch
    continues row ``i`` of the previous one (the truncated-BPTT layout a stateful RNN needs)."""

    def __init__(self, num_windows: int, batch_size: int) -> None:
        self.batch_size = batch_size
        self.steps = num_windows // batch_size

    def __iter__(self):
        for step in range(self.steps):
            yield [stream * self.steps + step for stream in range(self.batch_size)]

    def __len__(self) -> int:
        return self.steps


class StreamDataModule(pl.LightningDataModule):
    """Next-character prediction over contiguous streams: ``(x, y)`` of shape ``(B, T)``."""

    def __init__(self, max_chars: int = 60_000, batch_size: int = 8) -> None:
        super().__init__()
        self.max_chars, self.batch_size = max_chars, batch_size

    def setup(self, stage: str | None = None) -> None:
        codes = encode(load_stdlib_text(self.max_chars))
        count = (len(codes) - 1) // SEQ_LEN
        x = codes[: count * SEQ_LEN].view(count, SEQ_LEN)
        y = codes[1 : count * SEQ_LEN + 1].view(count, SEQ_LEN)
        split = int(0.9 * count)
        self.train_set, self.val_set = (
            TensorDataset(x[:split], y[:split]),
            TensorDataset(x[split:], y[split:]),
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_sampler=_ContiguousStreams(len(self.train_set), self.batch_size)
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_sampler=_ContiguousStreams(len(self.val_set), self.batch_size))


def _digits(batch_size: int = 64):
    from examples.digits import DigitsDataModule

    return DigitsDataModule(batch_size=batch_size)


# -------------------------------------------------------------------------------------------- models
class HFCausalLM(pl.LightningModule):
    """The common wrapper: ``self.model`` is a Hugging Face GPT-2 that computes its own loss. No ``forward``."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=128,
            n_positions=SEQ_LEN,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(config)  # lm_head is tied to the token embedding
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class HFSequenceClassifier(pl.LightningModule):
    """A Hugging Face BERT sequence classifier fine-tuned on dict batches; the loss comes from the model."""

    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ_LEN,
            num_labels=2,
        )
        self.model = BertForSequenceClassification(config)
        self.lr = lr

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.log("val_loss", out.loss)
        self.log("val_acc", (out.logits.argmax(-1) == batch["labels"]).float().mean())

    def test_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.log("test_loss", out.loss)
        self.log("test_acc", (out.logits.argmax(-1) == batch["labels"]).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _DigitsClassifier(pl.LightningModule):
    """The steps every digits client writes the same way: cross-entropy, accuracy, Adam."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class EncoderClassifier(_DigitsClassifier):
    """``nn.TransformerEncoder`` over the 8 rows of a digit image, with a learned positional table."""

    def __init__(self, d_model: int = 32, lr: float = 3e-3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d_model)
        self.positions = nn.Parameter(torch.zeros(1, 8, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(d_model, 10)
        self.lr = lr

    def forward(self, x):
        tokens = self.embed(x.squeeze(1)) + self.positions  # (B, 8 rows, d_model)
        return self.head(self.encoder(tokens).mean(dim=1))


class StatefulLSTM(pl.LightningModule):
    """A character LSTM whose hidden state carries from one batch to the next (truncated BPTT)."""

    def __init__(self, hidden: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 32)
        self.lstm = nn.LSTM(32, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, 128)
        self.lr = lr
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None

    def _step(self, x, y):
        hidden, state = self.lstm(self.embed(x), self.state)
        self.state = tuple(s.detach() for s in state)
        return nn.functional.cross_entropy(self.out(hidden).flatten(0, 1), y.flatten())

    def on_train_epoch_start(self) -> None:
        self.state = None

    def on_validation_epoch_start(self) -> None:
        self._train_state, self.state = self.state, None

    def on_validation_epoch_end(self) -> None:
        self.state = self._train_state

    def training_step(self, batch, batch_idx):
        loss = self._step(*batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._step(*batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class SharedConvCNN(_DigitsClassifier):
    """A digits CNN that applies one conv twice (a shared module) and ties two linear layers' weights."""

    def __init__(self, channels: int = 16, lr: float = 3e-3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.shared = nn.Conv2d(channels, channels, 3, padding=1)  # applied twice
        self.encode = nn.Linear(channels * 16, 32)
        self.mix_a = nn.Linear(32, 32)
        self.mix_b = nn.Linear(32, 32)
        self.mix_b.weight = self.mix_a.weight  # tied: one Parameter, two owners
        self.head = nn.Linear(32, 10)
        self.lr = lr

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = torch.relu(self.shared(h))
        h = torch.relu(self.shared(h))
        h = nn.functional.max_pool2d(h, 2).flatten(1)
        h = torch.relu(self.encode(h))
        h = torch.relu(self.mix_a(h))
        return self.head(torch.relu(self.mix_b(h)))


class ManualOptimizationMLP(_DigitsClassifier):
    """A digits MLP trained with ``automatic_optimization = False``."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        loss = nn.functional.cross_entropy(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)


class OneCycleMLP(ManualOptimizationMLP):
    """A digits MLP with OneCycleLR stepped every optimizer step, planned from ``estimated_stepping_batches``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.automatic_optimization = True

    training_step = _DigitsClassifier.training_step

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------ held-out sweep (issue 19), each one trait
class LBFGSMLP(OneCycleMLP):
    """A digits MLP trained with ``torch.optim.LBFGS`` (Lightning evaluates its closure several times a step)."""

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


class _LossModule(pl.LightningModule):
    """Trains and validates on ``self.loss(batch)`` with Adam at 3e-3."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


class _RandomSequences(Dataset):
    """``count`` token sequences of random lengths in ``[shortest, longest]``, tokens in ``[low, high]``."""

    def __init__(self, count: int, seed: int, lengths: tuple[int, int], tokens: tuple[int, int]) -> None:
        generator = torch.Generator().manual_seed(seed)
        sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=generator).tolist()
        self.items = [torch.randint(tokens[0], tokens[1] + 1, (size,), generator=generator) for size in sizes]

    def __len__(self) -> int:
        return len(self.items)


class _ReverseTask(_RandomSequences):
    """Token sequences of 3-9 tokens in 2..11; the target is the sequence reversed."""

    def __init__(self, count: int, seed: int) -> None:
        super().__init__(count, seed, lengths=(3, 9), tokens=(2, 11))

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def _pad_reverse(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(source, decoder input, target)``, padded to the batch's longest sequence (0; -100 in the target)."""
    pad = nn.utils.rnn.pad_sequence
    targets = [sequence.flip(0) for sequence in sequences]
    decoder_in = [torch.cat([torch.tensor([1]), target[:-1]]) for target in targets]
    return (
        pad(sequences, batch_first=True),
        pad(decoder_in, batch_first=True),
        pad(targets, batch_first=True, padding_value=-100),
    )


class ReverseDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ReverseTask(1500, 1), self.batch_size, shuffle=True, collate_fn=_pad_reverse)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_ReverseTask(300, 2), 64, collate_fn=_pad_reverse)


class Seq2SeqTransformer(_LossModule):
    """``nn.TransformerEncoder`` + ``nn.TransformerDecoder`` with teacher forcing, padding masks and a token loss
    that ignores padding (``ignore_index=-100``): its gradient norm grows several-fold while the loss falls."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, width, padding_idx=0)
        self.position = nn.Parameter(torch.randn(16, width) * 0.02)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(width, 4, 64, 0.0, batch_first=True), 1
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(width, 4, 64, 0.0, batch_first=True), 1
        )
        self.head = nn.Linear(width, 12)

    def loss(self, batch) -> torch.Tensor:
        source, decoder_in, target = batch
        memory = self.encoder(
            self.embed(source) + self.position[: source.size(1)], src_key_padding_mask=source == 0
        )
        causal = torch.ones(decoder_in.size(1), decoder_in.size(1), dtype=torch.bool).triu(1)
        hidden = self.decoder(
            self.embed(decoder_in) + self.position[: decoder_in.size(1)],
            memory,
            tgt_mask=causal,
            tgt_key_padding_mask=decoder_in == 0,
            memory_key_padding_mask=source == 0,
        )
        return nn.functional.cross_entropy(
            self.head(hidden).reshape(-1, 12), target.reshape(-1), ignore_index=-100
        )


class _TokenSequences(_RandomSequences):
    """Sequences of 3-19 tokens in 1..29; the label says whether most tokens are above 15."""

    def __init__(self, count: int, seed: int) -> None:
        super().__init__(count, seed, lengths=(3, 19), tokens=(1, 29))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        tokens = self.items[index]
        return tokens, int((tokens > 15).sum() > len(tokens) / 2)


def _pad_to_longest(items: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sequences = [tokens for tokens, _ in items]
    lengths = torch.tensor([len(tokens) for tokens in sequences])
    return (
        nn.utils.rnn.pad_sequence(sequences, batch_first=True),
        lengths,
        torch.tensor([y for _, y in items]),
    )


class PaddedSequencesDataModule(pl.LightningDataModule):
    """Each batch padded to its own longest sequence, as ``pad_sequence`` in a collate function does."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_TokenSequences(1500, 1), 32, shuffle=True, collate_fn=_pad_to_longest)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_TokenSequences(300, 2), 64, collate_fn=_pad_to_longest)


class PackedBiLSTM(_LossModule):
    """``nn.Embedding(padding_idx=0)``, ``pack_padded_sequence`` and a bidirectional LSTM classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 32, batch_first=True, bidirectional=True)
        self.head = nn.Linear(64, 2)

    def loss(self, batch) -> torch.Tensor:
        tokens, lengths, labels = batch
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embed(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        _, (hidden, _) = self.lstm(packed)
        return nn.functional.cross_entropy(self.head(torch.cat([hidden[0], hidden[1]], dim=1)), labels)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``B @ A``, with LoRA's init (A small, B zero)."""

    def __init__(self, inputs: int, outputs: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(inputs, outputs).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, inputs) * 0.01)
        self.B = nn.Parameter(torch.zeros(outputs, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t()


class LoRAClassifier(pl.LightningModule):
    """Three LoRA layers on frozen base weights; only the adapters train."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            LoRALinear(16, 64), nn.ReLU(), LoRALinear(64, 64), nn.ReLU(), LoRALinear(64, 5)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=3e-3)


def linear_rule_data(count: int = 2000, seed: int = 1) -> TensorDataset:
    """Gaussian inputs labelled by the argmax of a fixed random linear map (16 -> 5)."""
    rule = torch.randn(16, 5, generator=torch.Generator().manual_seed(9))
    x = torch.randn(count, 16, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ rule).argmax(dim=1))


CLIENTS: dict[str, Callable[[], tuple[pl.LightningModule, pl.LightningDataModule]]] = {
    "hf-gpt2": lambda: (HFCausalLM(), TextWindowsDataModule("lm")),
    "hf-bert": lambda: (HFSequenceClassifier(), TextWindowsDataModule("classify")),
    "transformer-encoder": lambda: (EncoderClassifier(), _digits()),
    "stateful-lstm": lambda: (StatefulLSTM(), StreamDataModule()),
    "shared-conv-cnn": lambda: (SharedConvCNN(), _digits()),
    "manual-optimization": lambda: (ManualOptimizationMLP(), _digits()),
    "onecycle-per-step": lambda: (OneCycleMLP(), _digits()),
}
