"""Held-out modules for studies: ordinary LightningModules written as a user would, not for this library.

A ResNet, a MobileNet, HF Llama, T5, ViT and DistilBERT from small configs (nothing downloaded), a VAE, a DDPM, a
mixture of experts and a GRU, on sklearn digits, the standard library's source as text, or generated data. They
came from the sixth pass's held-out sweeps; :mod:`benchmarks.studies.replay_rule` trains them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


# ------------------------------------------------------------------------------------------ data
def digits_tensors(size=8):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    return x[perm], y[perm]


class DigitsDM(pl.LightningDataModule):
    def __init__(self, size=8, flat=False, batch_size=32):
        super().__init__()
        self.size, self.flat, self.batch_size = size, flat, batch_size

    def setup(self, stage=None):
        x, y = digits_tensors(self.size)
        if self.flat:
            x = x.flatten(1)
        self.train_set = TensorDataset(x[:1437], y[:1437])
        self.val_set = TensorDataset(x[1437:], y[1437:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    test_dataloader = val_dataloader


def stdlib_codes(max_chars=60_000):
    import os

    root = os.path.dirname(os.__file__)
    text = ""
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="ignore") as f:
                text += f.read()
        if len(text) >= max_chars:
            break
    codes = torch.tensor([min(ord(c), 127) for c in text[:max_chars]], dtype=torch.long)
    return codes


class DictWindows(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class TextDM(pl.LightningDataModule):
    """task: lm | classify | seq2seq"""

    def __init__(self, task="lm", seq_len=32, batch_size=32, max_chars=60_000):
        super().__init__()
        self.task, self.seq_len, self.batch_size, self.max_chars = task, seq_len, batch_size, max_chars

    def setup(self, stage=None):
        codes = stdlib_codes(self.max_chars)
        L = self.seq_len
        w = codes[: len(codes) // L * L].view(-1, L)
        items = []
        g = torch.Generator().manual_seed(0)
        for row in w:
            if self.task == "lm":
                items.append(
                    {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()}
                )
            elif self.task == "classify":
                lab = (row[L // 2 :] == ord("(")).any().long()
                items.append({"input_ids": row, "attention_mask": torch.ones_like(row), "labels": lab})
            else:  # seq2seq: source is first half, target is second half with a random-length -100 tail
                src, tgt = row[: L // 2], row[L // 2 :].clone()
                n = int(torch.randint(L // 4, L // 2 + 1, (1,), generator=g))
                tgt[n:] = -100
                items.append({"input_ids": src, "attention_mask": torch.ones_like(src), "labels": tgt})
        split = int(0.9 * len(items))
        self.train_set, self.val_set = DictWindows(items[:split]), DictWindows(items[split:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    test_dataloader = val_dataloader


# ---------------------------------------------------------------------------------------- modules
class Base(pl.LightningModule):
    lr = 3e-3

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=self.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss


class HFLM(Base):
    def __init__(self, kind="llama"):
        super().__init__()
        import transformers as T

        if kind == "llama":
            cfg = T.LlamaConfig(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
            self.model = T.LlamaForCausalLM(cfg)
        self.kind = kind

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss(self, batch):
        return self.model(**batch).loss


class HFT5(Base):
    def __init__(self):
        super().__init__()
        import transformers as T

        cfg = T.T5Config(
            vocab_size=128,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            dropout_rate=0.0,
        )
        self.model = T.T5ForConditionalGeneration(cfg)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).logits

    def _loss(self, batch):
        return self.model(**batch).loss


class HFViT(Base):
    def __init__(self):
        super().__init__()
        import transformers as T

        cfg = T.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=1,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            num_labels=10,
        )
        self.model = T.ViTForImageClassification(cfg)

    def forward(self, x):
        return self.model(pixel_values=x).logits

    def _loss(self, batch):
        x, y = batch
        return self.model(pixel_values=x, labels=y).loss


class HFDistilBert(Base):
    def __init__(self):
        super().__init__()
        import transformers as T

        cfg = T.DistilBertConfig(
            vocab_size=128,
            dim=64,
            hidden_dim=128,
            n_layers=2,
            n_heads=4,
            max_position_embeddings=64,
            num_labels=2,
        )
        self.model = T.DistilBertForSequenceClassification(cfg)

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss(self, batch):
        return self.model(**batch).loss


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.short is None else self.short(x)))


class ResNet(Base):
    lr = 1e-2

    def __init__(self, width=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = ResBlock(width, width, 1)
        self.layer2 = ResBlock(width, 2 * width, 2)
        self.layer3 = ResBlock(2 * width, 4 * width, 2)
        self.fc = nn.Linear(4 * width, 10)

    def forward(self, x):
        h = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)


def dw_sep(cin, cout, stride):
    return nn.Sequential(
        nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
        nn.BatchNorm2d(cin),
        nn.ReLU6(),
        nn.Conv2d(cin, cout, 1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class MobileNet(Base):
    lr = 1e-2

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, 1, 1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU6(),
            dw_sep(16, 32, 1),
            dw_sep(32, 64, 2),
            dw_sep(64, 64, 1),
            dw_sep(64, 128, 2),
        )
        self.classifier = nn.Linear(128, 10)

    def forward(self, x):
        return self.classifier(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)


class VAE(Base):
    def __init__(self, z=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.mu, self.logvar = nn.Linear(64, z), nn.Linear(64, z)
        self.dec = nn.Sequential(
            nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)
        )

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        zz = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(zz), mu, logvar

    def _loss(self, batch):
        x, _ = batch
        recon, mu, logvar = self(x)
        rec = F.binary_cross_entropy_with_logits(recon, x, reduction="sum") / x.size(0)
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / x.size(0)
        return rec + kl


class Diffusion(Base):
    T = 100

    def __init__(self):
        super().__init__()
        betas = torch.linspace(1e-4, 0.02, self.T)
        self.register_buffer("abar", torch.cumprod(1 - betas, 0))
        self.temb = nn.Embedding(self.T, 32)
        self.net = nn.Sequential(
            nn.Linear(64 + 32, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU(), nn.Linear(256, 64)
        )

    def forward(self, xt, t):
        return self.net(torch.cat([xt, self.temb(t)], 1))

    def _loss(self, batch):
        x0, _ = batch
        x0 = x0 * 2 - 1
        t = torch.randint(0, self.T, (x0.size(0),), device=x0.device)
        eps = torch.randn_like(x0)
        a = self.abar[t].unsqueeze(1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * eps
        return F.mse_loss(self(xt, t), eps)


class MoE(Base):
    def __init__(self, n_exp=4, k=2, aux_w=0.01):
        super().__init__()
        self.k, self.aux_w, self.n_exp = k, aux_w, n_exp
        self.inp = nn.Linear(64, 64)
        self.gate = nn.Linear(64, n_exp)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(n_exp)]
        )
        self.head = nn.Linear(64, 10)
        self.last_aux = None

    def forward(self, x):
        h = F.relu(self.inp(x))
        probs = self.gate(h).softmax(-1)
        topv, topi = probs.topk(self.k, -1)
        topv = topv / topv.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            w = (topv * (topi == e)).sum(-1, keepdim=True)
            out = out + w * expert(h)
        frac = F.one_hot(topi[:, 0], self.n_exp).float().mean(0)
        self.last_aux = self.n_exp * (frac * probs.mean(0)).sum()
        return self.head(h + out)

    def _loss(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y) + self.aux_w * self.last_aux


# --- GRU on variable-length sequences
class VarSeqs(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            L = int(torch.randint(5, 31, (1,), generator=g))
            x = torch.randn(L, 4, generator=g)
            y = int((x[:, 0].sum() > 0).item()) + 2 * int((x[:, 1].cumsum(0)[-1] > 0).item())
            self.items.append((x, y))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_collate(batch):
    xs, ys = zip(*batch)
    lengths = torch.tensor([len(x) for x in xs])
    return nn.utils.rnn.pad_sequence(xs, batch_first=True), lengths, torch.tensor(ys)


class VarSeqDM(pl.LightningDataModule):
    def __init__(self, batch_size=32):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage=None):
        self.train_set, self.val_set = VarSeqs(1400, 0), VarSeqs(320, 1)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, collate_fn=pad_collate)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size, collate_fn=pad_collate)

    test_dataloader = val_dataloader


class GRUClassifier(Base):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 64, batch_first=True)
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(h[-1])

    def _loss(self, batch):
        x, lengths, y = batch
        return F.cross_entropy(self(x, lengths), y)


MODULES = {
    "llama": (lambda: HFLM("llama"), lambda: TextDM("lm"), 3),
    "t5": (HFT5, lambda: TextDM("seq2seq"), 3),
    "vit": (HFViT, lambda: DigitsDM(size=16), 4),
    "distilbert": (HFDistilBert, lambda: TextDM("classify"), 3),
    "resnet": (ResNet, lambda: DigitsDM(size=16), 4),
    "mobilenet": (MobileNet, lambda: DigitsDM(size=16), 4),
    "vae": (VAE, lambda: DigitsDM(flat=True), 4),
    "diffusion": (Diffusion, lambda: DigitsDM(flat=True), 4),
    "moe": (MoE, lambda: DigitsDM(flat=True), 4),
    "gru": (GRUClassifier, VarSeqDM, 4),
}
