"""Imported once by the fork server that starts the two-process DDP tests' ranks (see
:class:`tests.ddp_workers.TwoGlooProcesses`): the heavy imports every rank needs, then a check that the
server is still single-threaded, as a process that forks must be. A failed check ends the server: the DDP
tests error instead of forking an unsafe process."""

from __future__ import annotations

import os
import threading

import lightning.pytorch  # noqa: F401
import torch  # noqa: F401

import examples.mnist1d  # noqa: F401
import lightning_pulse  # noqa: F401
import tests.conftest
import tests.ddp_workers  # noqa: F401

_threads = (
    len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
)
if _threads != 1 or threading.active_count() != 1:
    raise RuntimeError(
        f"the DDP fork server runs {_threads} threads after its imports; it must run one to fork"
    )
