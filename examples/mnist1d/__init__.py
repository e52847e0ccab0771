"""MNIST-1D (Greydanus 2020), generated locally by the ``mnist1d`` package; never downloaded."""

from examples.mnist1d.data import MNIST1DDataModule
from examples.mnist1d.models import MNIST1DClassifier

__all__ = ["MNIST1DClassifier", "MNIST1DDataModule"]
