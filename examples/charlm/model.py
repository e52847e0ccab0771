"""A small pre-norm transformer language model over characters. An ordinary LightningModule."""

from __future__ import annotations

import math
from functools import partial

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from examples.charlm.data import VOCAB_SIZE
from lightning_pulse.nn import (
    RESIDUAL_KINDS,
    HyperConnection,
    ManifoldHyperConnection,
    collapse_streams,
    expand_streams,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"`d_model`={dim} must be divisible by `n_heads`={heads}.")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        batch, time, dim = x.shape
        q, k, v = self.qkv(x).view(batch, time, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, time, dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, mult * dim), nn.GELU(), nn.Linear(mult * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PreNorm(nn.Module):
    """``F(LayerNorm(x))``: the branch a residual connection wraps."""

    def __init__(self, dim: int, branch: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branch(self.norm(x))


class Residual(nn.Module):
    """The plain residual connection ``x + F(x)``."""

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


SCHEDULERS = ("none", "cosine")


class CharTransformerLM(pl.LightningModule):
    """Next-character prediction with a pre-norm transformer.

    ``forward`` maps tokens ``(B, T)`` to logits ``(B, T, V)``; the loss is the token-mean cross-entropy over
    the flattened ``(B*T, V)`` logits.

    Args:
        d_model: residual width ``C``.
        n_layers: transformer blocks (each has an attention and a feed-forward residual branch).
        n_heads: attention heads.
        seq_len: maximum context (positional embedding size).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        residual: how branches join the residual stream. ``"plain"``: ``x + F(x)``; ``"hc"``: unconstrained
            Hyper-Connections over ``n_streams`` streams; ``"mhc"``: manifold-constrained Hyper-Connections
            (doubly stochastic stream mixing). For ``"hc"``/``"mhc"`` the embedding is expanded into the streams
            before the first block and the streams are averaged after the last (``lightning_pulse.nn``).
        n_streams: residual streams for ``"hc"`` / ``"mhc"`` (ignored for ``"plain"``).
        sinkhorn_iters: Sinkhorn-Knopp iterations of ``"mhc"`` (the paper's 20 by default).
        scheduler: ``"none"`` (constant learning rate) or ``"cosine"`` (linear warm-up over the first 5% of
            optimizer steps, then cosine decay to 10% of ``lr``), stepped per optimizer step over
            ``trainer.estimated_stepping_batches``.
    """

    def __init__(
        self,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        residual: str = "plain",
        n_streams: int = 4,
        sinkhorn_iters: int = 20,
        scheduler: str = "none",
    ) -> None:
        super().__init__()
        if scheduler not in SCHEDULERS:
            raise ValueError(f"`scheduler`={scheduler!r} is not one of {list(SCHEDULERS)}.")
        if residual not in RESIDUAL_KINDS:
            raise ValueError(f"`residual`={residual!r} is not one of {list(RESIDUAL_KINDS)}.")
        if isinstance(n_streams, bool) or not isinstance(n_streams, int) or n_streams < 1:
            raise ValueError(f"`n_streams`={n_streams!r} must be a positive int.")
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.position = nn.Parameter(torch.zeros(1, seq_len, d_model))
        if residual == "plain":
            wrap = Residual
        elif residual == "hc":
            wrap = partial(HyperConnection, dim=d_model, n_streams=n_streams)
        else:
            wrap = partial(
                ManifoldHyperConnection, dim=d_model, n_streams=n_streams, sinkhorn_iters=sinkhorn_iters
            )
        blocks: list[nn.Module] = []
        for _ in range(n_layers):
            blocks.append(wrap(PreNorm(d_model, CausalSelfAttention(d_model, n_heads))))
            blocks.append(wrap(PreNorm(d_model, FeedForward(d_model))))
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[:, : tokens.shape[1]]
        if self.hparams.residual == "plain":
            return self.head(self.norm(self.blocks(x)))
        streams = self.blocks(expand_streams(x, self.hparams.n_streams))  # (B, T, n, C)
        return self.head(self.norm(collapse_streams(streams)))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_bpc", loss / math.log(2))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("test_loss", loss)
        self.log("test_bpc", loss / math.log(2))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        if self.hparams.scheduler == "none":
            return optimizer
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        warmup_steps = max(1, round(0.05 * total_steps))

        def warmup_then_cosine(step: int) -> float:
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            # past the planned total (a callback changed the epoch length) the floor holds, never a restart
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
