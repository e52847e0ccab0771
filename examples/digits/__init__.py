"""scikit-learn's bundled 8x8 digits (1797 images, no download)."""

from examples.digits.data import DigitsDataModule
from examples.digits.model import DigitsClassifier

__all__ = ["DigitsClassifier", "DigitsDataModule"]
