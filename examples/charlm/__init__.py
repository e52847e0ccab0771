"""A character-level language model on the Python standard library's own source (no download)."""

from examples.charlm.data import CharLMDataModule, load_stdlib_text
from examples.charlm.model import CharTransformerLM

__all__ = ["CharLMDataModule", "CharTransformerLM", "load_stdlib_text"]
