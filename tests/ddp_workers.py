"""Picklable pieces for two-process gloo tests (spawned processes import them by module path), and the
strategy that starts their ranks from a preloaded fork server (:class:`TwoGlooProcesses`)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing,
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
)

from lightning_pulse import phase_of


def run_python_in_its_own_session(call: str, hung: str, timeout: float = 240) -> tuple[int, str]:
    """Run ``call`` (Python source starting a two-rank fit) in a subprocess of its own session, with the
    repository on its path; ``(returncode, stderr)``. A run past ``timeout`` is killed with its whole process
    group (the ranks and the fork server with it) and fails the test with ``hung``: a hang fails, never
    blocks the suite."""
    import pytest

    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    command, env = [sys.executable, "-c", call], {**os.environ, "PYTHONPATH": path}
    with subprocess.Popen(
        command, cwd=root, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as ran:
        try:
            _, stderr = ran.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(ran.pid, signal.SIGKILL)
            pytest.fail(hung)
    return ran.returncode, stderr


class RankSkewedClock:
    """A fake seconds counter that runs 10x faster on rank 1: if ranks decided wall-clock phase changes
    on their own clocks, they would switch at different steps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.now += 1.0 if rank == 0 else 10.0
        return self.now


class PhaseDump(Callback):
    """Writes ``[(global_step, phase)]`` of every training batch to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.phases: list[tuple[int, str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.phases.append((trainer.global_step, phase_of(trainer).value))

    def on_train_end(self, trainer, pl_module):
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.phases))


class RankOffsetClock:
    """A simulated clock 12 h ahead on rank 1: a rank that decided on its own clock would read another hour
    of the grid series, and pause at other steps."""

    def __init__(self, start: float) -> None:
        self.now = float(start)
        self.slept: list[float] = []

    def _offset(self) -> float:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return 12 * 3600.0 if rank == 1 else 0.0

    def time(self) -> float:
        return self.now + self._offset()

    def sleep(self, seconds: float) -> None:
        self.slept.append(float(seconds))
        self.now += max(float(seconds), 0.0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SleepDump(Callback):
    """Writes ``[(global_step, seconds slept so far)]`` of every training batch to ``<directory>/rank<r>.json``."""

    def __init__(self, directory: str, clock: RankOffsetClock) -> None:
        self.directory, self.clock = directory, clock
        self.rows: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.advance(600.0)  # each step takes 10 simulated minutes
        self.rows.append((trainer.global_step, sum(self.clock.slept)))

    def on_train_end(self, trainer, pl_module):
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


class PowerSGDOnTheWrapper(Callback):
    """Registers torch's PowerSGD hook (error feedback and warm start, rank 1, compressing from its third
    step) on the DDP wrapper itself at fit start, as a user does on CPU (Lightning registers
    ``DDPStrategy(ddp_comm_hook=...)`` on CUDA only). At fit end each rank writes ``powersgd_rank<r>.json`` into
    ``directory``: the hook's step counter at each batch end (``trained``), and the elements of its error
    feedback and whether all are finite (``memory``)."""

    def __init__(self, directory: str) -> None:
        self.directory, self.trained, self.state = directory, [], None

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        trainer.strategy.model.register_comm_hook(self.state, powerSGD_hook.powerSGD_hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trained.append(self.state.iter)

    def on_train_end(self, trainer, pl_module):
        errors = list(self.state.error_dict.values())
        memory = [sum(e.numel() for e in errors), all(bool(e.isfinite().all()) for e in errors)]
        record = {"trained": self.trained, "memory": memory}
        Path(self.directory, f"powersgd_rank{trainer.global_rank}.json").write_text(json.dumps(record))

    def __getstate__(self):  # the state holds a process group: not sent back from a spawned rank
        return {**self.__dict__, "state": None}


def unreadable_signal() -> tuple[float, float]:
    """A live GreenWindow signal whose every reading fails, as a grid API that is down does."""
    raise ConnectionError("the grid API is down")


class _PreloadedSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's ``ddp_spawn`` launcher with each rank forked from a fork server that imported torch,
    Lightning and this package once (:mod:`tests.forkserver_preload`), instead of a fresh interpreter that
    imports them again (about 7 s of CPU per rank). A rank starts as a spawned one does: the launching
    process's environment, working directory and global state (seeds, RNG states) restored, its module's
    memory not shared with the other rank, and its ``atexit`` handlers run when the fit returns."""

    def launch(self, function, *args, trainer=None, **kwargs):
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)
        self._launching_state = (dict(os.environ), os.getcwd(), _GlobalStateSnapshot.capture())
        _start_fork_server()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(
        self, process_idx, trainer, function, args, kwargs, return_queue, global_states=None
    ):
        environ, cwd, global_states = self._launching_state
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        args, kwargs = _disable_module_memory_sharing((args, kwargs))
        try:
            super()._wrapping_function(
                process_idx, trainer, function, args, kwargs, return_queue, global_states
            )
        finally:
            atexit._run_exitfuncs()  # a forked rank leaves by os._exit; a spawned one ran these at exit


class TwoGlooProcesses(DDPStrategy):
    """Real DDP over gloo in two processes, as ``DDPStrategy(start_method="spawn",
    process_group_backend="gloo")``, the ranks started by :class:`_PreloadedSpawnLauncher` (seconds less per
    launch). Tests that also need a rank's whole-interpreter exit (the gloo exit abort) keep ``ddp_spawn``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(start_method="forkserver", process_group_backend="gloo", **kwargs)

    def _configure_launcher(self) -> None:
        self._launcher = _PreloadedSpawnLauncher(self, start_method="forkserver")


def _start_fork_server() -> None:
    """Start the fork server once per session, with one BLAS thread: a process that forks must not run
    other threads (numpy's OpenBLAS would start a pool at import)."""
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is not None:
        return
    forkserver.set_forkserver_preload(["tests.forkserver_preload"])
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("OPENBLAS_NUM_THREADS")
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = saved


class _ErrorRecordingLauncher(_PreloadedSpawnLauncher):
    """Writes what a rank raised to ``<directory>/rank<r>-raised.json`` (``[type name, message]``): a spawned
    rank calls no ``on_exception`` (the launching process does, with the error of the rank that failed
    first). A rank that raised waits for the other ranks' files (at most ``wait_s``) before it exits, since
    the launching process terminates the other ranks once one has exited with an error."""

    def __init__(self, strategy, directory: str, wait_s: float) -> None:
        super().__init__(strategy, start_method="forkserver")
        self.directory, self.wait_s = directory, wait_s

    def _wrapping_function(self, process_idx, trainer, *args, **kwargs):
        try:
            super()._wrapping_function(process_idx, trainer, *args, **kwargs)
        except BaseException as error:
            raised = [type(error).__name__, str(error)]
            Path(self.directory, f"rank{process_idx}-raised.json").write_text(json.dumps(raised))
            files = [Path(self.directory, f"rank{rank}-raised.json") for rank in range(trainer.world_size)]
            deadline = time.monotonic() + self.wait_s
            while not all(map(Path.is_file, files)) and time.monotonic() < deadline:
                time.sleep(0.05)  # for the other processes' files, not for a span of time
            raise


class TwoGlooProcessesRecordingErrors(TwoGlooProcesses):
    """:class:`TwoGlooProcesses` whose ranks each write what they raised to ``<directory>/rank<r>-raised.json``
    (see :class:`_ErrorRecordingLauncher`)."""

    def __init__(self, directory: str, wait_s: float = 60.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.errors_to = (directory, wait_s)

    def _configure_launcher(self) -> None:
        self._launcher = _ErrorRecordingLauncher(self, *self.errors_to)


class StepTimer(Timer):
    """Lightning's ``Timer`` (``max_time``) counting one "second" per step, rank 1's started ``skew`` seconds
    after rank 0's, as a later ``on_train_start`` of that rank: rank 0's Timer ends the fit (its
    ``should_stop`` is broadcast), while rank 1's ``time_remaining()`` still says there is time left."""

    def __init__(self, seconds: int, skew: float) -> None:
        super().__init__(duration={"seconds": seconds})
        self.skew, self._trainer = skew, None

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._trainer = trainer

    def time_elapsed(self, stage: str = "train") -> float:
        if self._trainer is None:
            return 0.0
        return float(self._trainer.global_step) - (self.skew if self._trainer.global_rank == 1 else 0.0)
