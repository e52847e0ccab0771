"""The background thread that reads the meters every ``period`` seconds into an :class:`EnergyLedger`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_pulse.energy.ledger import EnergyLedger
from lightning_pulse.energy.meter import MeterChain

THREAD_NAME = "lightning-pulse-energy-sampler"

#: how long readings wait for a meter still starting in the background (codecarbon: 1-2 s); then its start is
#: given up and its chain falls back (an estimate from the meter's own start on, not its zero point)
STARTING_GRACE_S = 60.0
#: how long :meth:`EnergySampler.settle` waits for such a start (at an epoch end, at the end) before it gives
#: it up the same way
STARTING_WAIT_S = 30.0


class EnergySampler:
    """Reads every :class:`MeterChain` and records the totals, on a daemon thread and on demand.

    Args:
        chains: one chain per metered component (may be empty on a rank that meters nothing).
        ledger: where readings go.
        period: seconds between readings of the thread.
        clock: monotonic seconds (injectable for tests).
        wall_clock: Unix seconds, for carbon-intensity and price lookups.
        warn: called once, with one line, if the thread dies of an unexpected error.

    The thread ends when :meth:`stop` is called or when a reading raises (meter failures are handled inside
    the chains, so this is a bug path); either way it leaves no thread behind. :meth:`sample` may be called
    from any thread at any time, e.g. at an epoch end, so the figures include the last instant.
    """

    def __init__(
        self,
        chains: Sequence[MeterChain],
        ledger: EnergyLedger,
        period: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        warn: Callable[[str], None] = print,
    ) -> None:
        if not period > 0:
            raise ValueError(f"`period`={period!r} must be a positive number of seconds.")
        self.chains = list(chains)
        self.ledger = ledger
        self.period = float(period)
        self.clock = clock
        self.wall_clock = wall_clock
        self.warn = warn
        self.error: BaseException | None = None
        self.samples = 0
        self.last_sample_time: float | None = None
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._started_at = 0.0
        self._waited_for_starts_s = 0.0  # in :meth:`settle`, for a start given up

    def __getstate__(self) -> dict[str, Any]:
        # pickled and deep-copied with its EnergyLogger (``ddp_spawn``, a sweep's copies): a copy is a stopped
        # sampler, its readings kept; the thread, its lock and its event stay with this one
        dropped = ("_lock", "_stop_event", "_thread")
        return {**{k: v for k, v in self.__dict__.items() if k not in dropped}, "_started": False}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._stop_event, self._thread = threading.Lock(), threading.Event(), None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, thread: bool = True) -> None:
        """Start every chain, take the first reading, and (unless ``thread=False``) start the thread."""
        with self._lock:
            now = self.clock()
            for chain in self.chains:
                chain.start(now)
            self.ledger.begin(now, self.wall_clock(), {c.component: c.read(now) for c in self.chains})
            self.last_sample_time = self._started_at = now
            self._started = True
        if thread and self.chains:
            self._stop_event.clear()
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def sample(self) -> None:
        """Read every meter now and record it."""
        with self._lock:
            if not self._started:
                return
            now = self.clock()
            self.last_sample_time = now
            if any(chain.starting for chain in self.chains):
                if now - self._started_at < STARTING_GRACE_S:
                    # no reading while a meter starts: its first real one holds the energy of the meantime,
                    # and the ledger spreads it over the phases since the last reading (a zero reading here
                    # put a short fit's whole backlog into its last interval, the fit end)
                    return
                # its zero point is no reading either
                self._give_up_starts(f"its background start did not finish within {STARTING_GRACE_S:g} s")
            totals = {chain.component: chain.read(now) for chain in self.chains}
            self.ledger.record(now, self.wall_clock(), totals)
            self.samples += 1

    def settle(self, timeout: float | None = None) -> None:
        """Let every meter still starting in the background (codecarbon) finish, so the next reading holds
        its energy; a no-op once they run. ``timeout`` (default :data:`STARTING_WAIT_S`) bounds the whole
        wait (chains sharing one codecarbon session would otherwise each wait it out); a start still running
        then is given up: the next reading falls back over the whole span since that meter's start.

        A wait that returns well before ``timeout`` with a start still running was cut short: Python 3.11's
        ``Thread.join``, once a Ctrl-C has interrupted it (at an epoch end's wait), marks the thread stopped
        and returns at once from then on, while the start goes on. The start is given up as interrupted,
        with the time really waited (all waits of this sampler), not as one that took ``timeout``."""
        timeout = STARTING_WAIT_S if timeout is None else timeout
        began = time.monotonic()
        deadline = began + timeout
        try:
            for chain in self.chains:
                chain.settle(max(0.0, deadline - time.monotonic()))
        finally:
            waited = time.monotonic() - began
            self._waited_for_starts_s += waited  # an interrupted wait too: the time the fit really waited
        if waited < timeout / 2:
            total = self._waited_for_starts_s
            self._give_up_starts(
                f"the fit was interrupted during its background start, {total:.2f} s into the wait for it"
            )
        else:
            self._give_up_starts(f"its background start did not finish within {timeout:g} s")

    def _give_up_starts(self, reason: str) -> None:
        for chain in self.chains:
            if chain.starting:
                chain.give_up_start(reason)

    def _run(self) -> None:
        try:
            while not self._stop_event.wait(self.period):
                self.sample()
        except BaseException as error:  # the thread must end quietly; the training thread keeps going
            self.error = error
            self.warn(
                f"EnergyLogger: the sampling thread stopped ({type(error).__name__}: {error}); "
                "energy is now read only at epoch ends."
            )

    def stop(self, final_sample: bool = True) -> None:
        """Stop the thread, take a last reading, and close every meter. Safe to call more than once."""
        self._stop_event.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(10.0, 3 * self.period))
        if final_sample and self._started:
            self.settle()
            try:
                self.sample()
            except Exception:  # a last reading is a nicety; closing the meters is what matters here
                pass
        with self._lock:
            self._started = False
            for chain in self.chains:
                chain.close()
