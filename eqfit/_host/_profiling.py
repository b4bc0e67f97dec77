"""The profile's observer: traces the steps of a `Profile` with `jax.profiler`."""

import contextlib
import warnings

import jax

from .._core._policy import Profile
from .._program._state import TrainState
from ._observers import Observer


class Profiling(Observer):
    """Traces a `Profile`'s steps with `jax.profiler`, as MaxText's `profile_cleanly`
    does: calls end at the stretch's two edges, and at each the host waits for the
    device before it starts or stops the trace, so that the trace holds the work of
    those steps and of no others. The calls between go on as usual.
    """

    def __init__(self, profile: Profile, begin: int):
        # Resumed inside the stretch: what is left of it.
        self.start, self.stop = max(profile.start_step, begin), profile.stop_step
        self.profile, self.begin = profile, begin
        self.tracing = self.traced = False

    def open(self) -> None:
        if self.start == self.begin < self.stop:  # no call ends at the first edge
            self._start()

    def boundary(self, position: int) -> int | None:
        if self.traced or position >= self.stop:
            return None
        return self.stop if self.tracing else self.start

    def after_call(self, position: int, state: TrainState) -> None:
        if not self.traced and not self.tracing and self.start <= position < self.stop:
            jax.block_until_ready(state)  # the steps before the stretch are done
            self._start()
        elif self.tracing and position >= self.stop:
            jax.block_until_ready(state)  # the stretch's steps are all in the trace
            self._stop()

    def end(self, position: int, state: TrainState) -> None:
        if self.tracing:  # the run ended inside the stretch
            jax.block_until_ready(state)
            self._stop()
        elif not self.traced:
            profile = self.profile
            warnings.warn(
                f"`profile` asked for steps {profile.start_step} to {profile.stop_step - 1}, "
                f"but this run trained steps {self.begin} to {position - 1} only: no trace "
                "was written.",
                stacklevel=2,
            )

    def close(self) -> None:
        # On every way out (an error, a second Ctrl-C) the trace stops, so that the next
        # one can start; an error of its own must not hide the run's.
        if self.tracing:
            with contextlib.suppress(Exception):
                self._stop()

    def _start(self) -> None:
        try:
            jax.profiler.start_trace(str(self.profile.directory))
        except RuntimeError as e:  # one process traces one thing at a time
            raise RuntimeError(
                f"`profile` could not start its trace: {e}. Is another trace running in "
                "this process (`jax.profiler.start_trace`, `jax.profiler.trace`)?"
            ) from e
        self.tracing = True

    def _stop(self) -> None:
        self.tracing, self.traced = False, True
        jax.profiler.stop_trace()
