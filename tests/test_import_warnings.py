"""Importing lightning_pulse under warnings-as-errors, as a user's test suite does (pytest's
``filterwarnings = ["error"]``): the project's own pytest config ignores every DeprecationWarning, so only a
fresh interpreter with the filter shows one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

IMPORT_EVERY_MODULE = """
import importlib, pkgutil
import lightning_pulse
for module in pkgutil.walk_packages(lightning_pulse.__path__, "lightning_pulse."):
    importlib.import_module(module.name)
print(lightning_pulse.__file__)
"""


def test_importing_lightning_pulse_and_its_modules_raises_no_deprecation_warning():
    """Fortieth pass: `import lightning_pulse` raised 67 DeprecationWarnings (torch's "`torch.jit.script` is
    deprecated", from importing `torch.distributed.optim` for one isinstance check), so under
    `-W error::DeprecationWarning` it failed, where torch, Lightning and codecarbon import. Every module of
    the package, `lightning_pulse.nn`, `.energy`, `.cli` and `.core.*` included, imports cleanly now."""
    run = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", IMPORT_EVERY_MODULE],
        cwd=ROOT,  # this checkout's package, as the tests import it
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(ROOT / "lightning_pulse" / "__init__.py")
