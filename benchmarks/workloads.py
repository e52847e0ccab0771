"""Named workloads for benchmarks: a fresh (LightningModule, LightningDataModule) pair per run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl


@dataclass(frozen=True)
class Workload:
    """A benchmark workload.

    Attributes:
        build: ``build(**overrides) -> (module, datamodule)``; overrides go to the module or datamodule
            constructor by prefix: ``model__lr=...``, ``data__batch_size=...``.
        metric: the validation metric that decides "same accuracy".
        mode: ``"max"`` if larger is better, ``"min"`` otherwise.
        test_metric: the metric reported from ``Trainer.test``.
    """

    build: Callable[..., tuple[pl.LightningModule, pl.LightningDataModule]]
    metric: str
    mode: str
    test_metric: str


def _split(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    model, data = {}, {}
    for key, value in overrides.items():
        prefix, _, name = key.partition("__")
        if prefix == "model":
            model[name] = value
        elif prefix == "data":
            data[name] = value
        else:
            raise ValueError(f"Workload override {key!r} must start with 'model__' or 'data__'.")
    return model, data


def _mnist1d(arch: str) -> Callable[..., tuple[pl.LightningModule, pl.LightningDataModule]]:
    def build(**overrides: Any):
        from examples.mnist1d import MNIST1DClassifier, MNIST1DDataModule

        model, data = _split(overrides)
        return MNIST1DClassifier(arch=arch, **model), MNIST1DDataModule(**data)

    return build


def _digits(**overrides: Any):
    from examples.digits import DigitsClassifier, DigitsDataModule

    model, data = _split(overrides)
    return DigitsClassifier(**model), DigitsDataModule(**data)


def _charlm(**overrides: Any):
    from examples.charlm import CharLMDataModule, CharTransformerLM

    model, data = _split(overrides)
    data_module = CharLMDataModule(**data)
    model.setdefault("seq_len", data_module.hparams.seq_len)
    return CharTransformerLM(**model), data_module


def _client(name: str) -> Callable[..., tuple[pl.LightningModule, pl.LightningDataModule]]:
    """A client model of the test matrix (``tests/clients.py``): written as users write them, not for us."""

    def build(**overrides: Any):
        from tests.clients import CLIENTS

        if overrides:
            raise ValueError(f"Client workload {name!r} takes no overrides, got {sorted(overrides)}.")
        return CLIENTS[name]()

    return build


WORKLOADS: dict[str, Workload] = {
    "mnist1d-cnn": Workload(_mnist1d("cnn"), "val_acc", "max", "test_acc"),
    "mnist1d-mlp": Workload(_mnist1d("mlp"), "val_acc", "max", "test_acc"),
    "digits": Workload(_digits, "val_acc", "max", "test_acc"),
    "charlm": Workload(_charlm, "val_loss", "min", "test_loss"),
    "hf-gpt2": Workload(_client("hf-gpt2"), "val_loss", "min", "test_loss"),
    "hf-bert": Workload(_client("hf-bert"), "val_acc", "max", "test_acc"),
}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"Unknown workload {name!r}; known: {sorted(WORKLOADS)}.")
    return WORKLOADS[name]
