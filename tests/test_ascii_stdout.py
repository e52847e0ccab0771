"""A stdout that cannot encode every character (a Latin-1 or ASCII locale, ``PYTHONIOENCODING``): what
lightning_pulse shows in the progress bar and what its CLI prints is plain ASCII. Lightning's TQDM bar (its
default without ``rich``) writes to ``sys.stdout``, whose error handler is ``strict``: one character it
cannot encode raises ``UnicodeEncodeError`` and kills the fit."""

from __future__ import annotations

import io
import json
import shutil
import sys

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_pulse import EnergyLogger, PulseCycle
from lightning_pulse.cli import main
from lightning_pulse.energy.config import MeterConfig
from lightning_pulse.energy.report import JSON_NAME
from tests.conftest import trainer_kwargs


def ascii_stdout(monkeypatch) -> io.BytesIO:
    """``sys.stdout`` as one with an ASCII encoding and Python's default ``strict`` errors; the bytes
    written."""
    written = io.BytesIO()
    stream = io.TextIOWrapper(written, encoding="ascii", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", stream)
    return written


def test_a_fit_shows_its_progress_bar_on_an_ascii_stdout(mnist1d_small, tmp_path, monkeypatch):
    """Fortieth pass: EnergyLogger's figure before any reading was `—` (U+2014; Latin-1 lacks it too), and
    PulseCycle's label `replay·c0` (U+00B7): the fit died at its first step, or at the first cycle's."""
    model, data = mnist1d_small(arch="mlp")
    energy = EnergyLogger(cpu="none", ram="none", gpu="none")  # nothing metered: no figure, all along
    cycle = PulseCycle(burst=3, replay=2, maintain=0, warmup=0.0, anneal=0.0)
    written = ascii_stdout(monkeypatch)
    bar = TQDMProgressBar(refresh_rate=1)
    trainer = pl.Trainer(
        callbacks=[bar, cycle, energy],
        max_steps=6,
        **trainer_kwargs(enable_progress_bar=True, default_root_dir=tmp_path),
    )
    trainer.fit(model, data)
    assert trainer.global_step == 6
    shown = written.getvalue().decode("ascii")
    assert "phase=burst c0" in shown and "phase=replay c0" in shown and "kWh=n/a" in shown


def test_compare_prints_on_an_ascii_stdout(mnist1d_small, tmp_path, monkeypatch):
    """Fortieth pass: `lightning-pulse compare` printed `—` (U+2014) for a missing value (here CO2 and cost:
    no carbon intensity, no price) and died with a traceback, exit status 1, under an ASCII stdout."""
    energy = EnergyLogger(cpu="constant", ram="none", gpu="none", meters=MeterConfig(cpu_watts=20.0))
    trainer = pl.Trainer(callbacks=[energy], max_steps=3, **trainer_kwargs(default_root_dir=tmp_path / "a"))
    trainer.fit(*mnist1d_small(arch="mlp"))
    assert json.loads(energy.report_paths[0].read_text())["total"]["co2_kg"] is None
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    written = ascii_stdout(monkeypatch)
    assert main(["compare", str(tmp_path / "a" / JSON_NAME), str(tmp_path / "b" / JSON_NAME)]) == 0
    printed = written.getvalue().decode("ascii")
    assert "| energy (kWh) |" in printed and "| n/a |" in printed
