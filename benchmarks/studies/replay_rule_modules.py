"""The replay-rule study's modules: :mod:`benchmarks.studies.heldout_modules` with val_acc logged, plus MLP tasks.

Every classifier logs val_loss and val_acc; regressors log val_loss (MSE on standardised targets).
Datasets are fixed across seeds (fixed generators); the run seed changes init, shuffling and selection draws.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.studies import heldout_modules as M


# ------------------------------------------------------------------ val_acc wrappers (no change to training)
class AccMixin:
    def _val_logits_loss(self, batch):  # -> (logits, labels, loss)
        x, y = batch
        logits = self(x)
        return logits, y, F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        logits, y, loss = self._val_logits_loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())


class ResNetA(AccMixin, M.ResNet):
    pass


class MobileNetA(AccMixin, M.MobileNet):
    pass


class ViTA(AccMixin, M.HFViT):
    def _val_logits_loss(self, batch):
        x, y = batch
        out = self.model(pixel_values=x, labels=y)
        return out.logits, y, out.loss


class DistilBertA(AccMixin, M.HFDistilBert):
    def _val_logits_loss(self, batch):
        out = self.model(**batch)
        return out.logits, batch["labels"], out.loss


class GRUA(AccMixin, M.GRUClassifier):
    def _val_logits_loss(self, batch):
        x, lengths, y = batch
        logits = self(x, lengths)
        return logits, y, F.cross_entropy(logits, y)


# ------------------------------------------------------------------ MLP classifier / regressor
class MLPClassifier(AccMixin, M.Base):
    lr = 3e-3

    def __init__(self, d_in=64, n_classes=10, hidden=128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x):
        return self.net(x)

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x), y)


class MLPRegressor(M.Base):
    lr = 3e-3

    def __init__(self, d_in=10, hidden=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def _loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)


# ------------------------------------------------------------------ data
class CountingTensorDataset(TensorDataset):
    """TensorDataset that counts how often each index is loaded (num_workers=0, so in this process)."""

    def __init__(self, *tensors):
        super().__init__(*tensors)
        self.counts = torch.zeros(len(tensors[0]), dtype=torch.long)

    def __getitem__(self, i):
        self.counts[i] += 1
        return super().__getitem__(i)


class TensorDM(pl.LightningDataModule):
    """build() -> (xtr, ytr, xva, yva, special) where special is a bool mask over the training samples
    (flipped label / outlier target / minority class) or None; used only for the load-share diagnostic."""

    def __init__(self, build, batch_size=32):
        super().__init__()
        self.build, self.batch_size = build, batch_size

    def setup(self, stage=None):
        if getattr(self, "train_set", None) is not None:
            return
        xtr, ytr, xva, yva, self.special = self.build()
        self.train_set, self.val_set = CountingTensorDataset(xtr, ytr), TensorDataset(xva, yva)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


def digits_flat():
    x, y = M.digits_tensors(8)
    x = x.flatten(1)
    return x[:1437], y[:1437], x[1437:], y[1437:], None


def digits_noisy(rate=0.2):
    """20% of TRAINING labels replaced by a different class (fixed generator); val labels clean."""
    xtr, ytr, xva, yva, _ = digits_flat()
    g = torch.Generator().manual_seed(1234)
    n = len(ytr)
    flip = torch.randperm(n, generator=g)[: int(round(rate * n))]
    ytr = ytr.clone()
    ytr[flip] = (ytr[flip] + torch.randint(1, 10, (len(flip),), generator=g)) % 10  # always a wrong class
    special = torch.zeros(n, dtype=torch.bool)
    special[flip] = True
    return xtr, ytr, xva, yva, special


def _long_tail_subset(labels, rho, seed):
    """Indices keeping a share ``rho**(k/9)`` of class ``k`` (class 0: all, class 9: ``rho``), fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    keep = []
    for k in range(10):
        idx = (labels == k).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        keep.append(idx[: max(1, int(round(len(idx) * rho ** (k / 9))))])
    return torch.cat(keep).sort().values


def digits_longtail(rho=0.1):
    """Class k keeps a share rho**(k/9) of its training samples (class 0: all, class 9: 10%); val balanced."""
    xtr, ytr, xva, yva, _ = digits_flat()
    keep = _long_tail_subset(ytr, rho, 4321)
    return xtr[keep], ytr[keep], xva, yva, ytr[keep] >= 5  # special = the 5 rarest classes


def digits_longtail_iid(rho=0.1):
    """Same long-tail training set; the VALIDATION set is subsampled to the same class proportions
    (so a shift of the predicted prior toward rare classes is no longer rewarded by a balanced val set)."""
    xtr, ytr, xva, yva, special = digits_longtail(rho)
    keep = _long_tail_subset(yva, rho, 5678)
    return xtr, ytr, xva[keep], yva[keep], special


def friedman(outliers=0.0):
    """sklearn make_friedman1 (10 features, 5 informative, noise 1.0); targets standardised on train.
    outliers>0: that share of TRAINING targets gets N(0, 5^2) added (in standardised units); val clean."""
    from sklearn.datasets import make_friedman1

    X, y = make_friedman1(n_samples=1900, n_features=10, noise=1.0, random_state=0)
    X, y = torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    X = (X - 0.5) / 0.29
    mu, sd = y[:1500].mean(), y[:1500].std()
    y = (y - mu) / sd
    xtr, ytr, xva, yva = X[:1500], y[:1500].clone(), X[1500:], y[1500:]
    special = None
    if outliers > 0:
        g = torch.Generator().manual_seed(99)
        idx = torch.randperm(1500, generator=g)[: int(outliers * 1500)]
        ytr[idx] += 5.0 * torch.randn(len(idx), generator=g)
        special = torch.zeros(1500, dtype=torch.bool)
        special[idx] = True
    return xtr, ytr, xva, yva, special


# name: (model factory, datamodule factory, epochs, kind)
MODULES = {
    "resnet": (ResNetA, lambda: M.DigitsDM(size=16), 4, "image cls, CNN+BN"),
    "mobilenet": (MobileNetA, lambda: M.DigitsDM(size=16), 4, "image cls, depthwise CNN+BN"),
    "vit": (ViTA, lambda: M.DigitsDM(size=16), 4, "image cls, HF ViT"),
    "distilbert": (DistilBertA, lambda: M.TextDM("classify"), 3, "text binary cls (21% pos), HF"),
    "gru": (GRUA, M.VarSeqDM, 4, "sequence cls, 4 classes, GRU"),
    "mlp_digits": (MLPClassifier, lambda: TensorDM(digits_flat), 4, "tabular cls, clean"),
    "mlp_noisy": (MLPClassifier, lambda: TensorDM(digits_noisy), 4, "tabular cls, 20% train labels flipped"),
    "mlp_longtail": (MLPClassifier, lambda: TensorDM(digits_longtail), 10, "tabular cls, long-tail 10:1"),
    "mlp_longtail_iid": (
        MLPClassifier,
        lambda: TensorDM(digits_longtail_iid),
        10,
        "tabular cls, long-tail 10:1, val long-tail too",
    ),
    "reg_clean": (MLPRegressor, lambda: TensorDM(friedman), 4, "regression, Friedman1, Gaussian noise"),
    "reg_outlier": (
        MLPRegressor,
        lambda: TensorDM(lambda: friedman(0.1)),
        4,
        "regression, 10% train outliers",
    ),
}


# extra held-out modules from models.py, unchanged (val_loss only; MoE also gets val_acc)
class MoEA(AccMixin, M.MoE):
    pass


MODULES.update(
    {
        "moe": (MoEA, lambda: M.DigitsDM(flat=True), 4, "tabular cls, top-2 MoE"),
        "llama": (lambda: M.HFLM("llama"), lambda: M.TextDM("lm"), 3, "char LM, HF Llama (token loss)"),
        "t5": (M.HFT5, lambda: M.TextDM("seq2seq"), 3, "char seq2seq, HF T5 (token loss)"),
        "vae": (M.VAE, lambda: M.DigitsDM(flat=True), 4, "generative, VAE (stochastic loss)"),
        "diffusion": (M.Diffusion, lambda: M.DigitsDM(flat=True), 4, "generative, DDPM eps-MSE (random t)"),
    }
)
