"""Ctrl-C and the preemption signals, deferred to the end of the call in flight: a
handler only sets flags; the driver stops there and the checkpoints observer writes.
"""

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Interrupt:
    """Defers Ctrl-C (SIGINT) and the preemption signals (`signals`) to the end of the
    call of the program in flight, where `fit` checkpoints and stops.

    Use `deferred()` as a context manager around training; `requested` turns true when a
    signal came, and `signal` names the first. A second one raises `KeyboardInterrupt`
    at once (the driver waits for the device on a lock, which a signal interrupts, so
    Python's handler runs). A handler only sets flags: nothing is written inside it.
    Outside the main thread it does nothing.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = ()) -> None:
        self.signals = (signal.SIGINT, *(s for s in signals if s != signal.SIGINT))
        self.requested = False
        self.signal: str | None = None  # the name of the first signal that came
        self._holding = False  # inside `held()`
        self._pending = False  # a second signal came while held
        self.ended = False  # training is over: further signals are let be
        # Set by the driver where every process has agreed to stop (at a call's end):
        # what the observers go by, so that all processes checkpoint at one step.
        self.stopping = False

    def request(self, name: str) -> None:
        """Asks training to stop as if signal `name` had come (another process's, say)."""
        if not self.requested:
            self.requested, self.signal = True, name

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A second signal inside the block is raised as it ends: a call of the program
        is dispatched (its state donated) and its new state taken as one step.
        """
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator["Interrupt"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handler(signum: int, frame: Any) -> None:
            if self.ended:  # the result is being made: it is on its way out already
                return
            if self.requested:
                if self._holding:
                    self._pending = True
                    return
                raise KeyboardInterrupt
            self.request(signal.Signals(signum).name)

        previous = {s: signal.signal(s, handler) for s in self.signals}
        try:
            yield self
        finally:
            for s, handler_before in previous.items():
                signal.signal(s, handler_before)
