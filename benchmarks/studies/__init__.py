"""Finished studies: their scripts, plans and results, kept as the record (see ``README.md`` here)."""

from pathlib import Path

#: Where the studies write: ``benchmarks/studies/results/``.
RESULTS_DIR = Path(__file__).parent / "results"
