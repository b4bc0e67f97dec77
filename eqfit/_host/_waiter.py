"""Waiting for the device from a thread of its own, so that the main thread waits on a
lock that a signal interrupts; and, at exit, for calls still running when `fit` raised.
"""

import atexit
import math
import queue
import threading
import time
from typing import Any

# Imported before `_wait_for_pending` is registered, so that it runs before JAX's own
# exit handlers (they run last first).
import jax  # noqa: F401


class Stamp:
    """When an array became ready (`time.perf_counter()`), as `_Waiter` saw it."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.at = math.nan
        # Done before the thread got to it: it finished at some time before `at`, which
        # is when the thread was done with the array asked before it.
        self.done_before = False

    def set(self) -> None:
        self.at = time.perf_counter()
        self.ready.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the array (at most `timeout` seconds); returns whether it is ready."""
        return self.ready.wait(timeout)


class _Waiter:
    """Waits for device arrays in a thread of its own, in the order asked. The main
    thread then waits on a lock, which a signal interrupts, so that a second Ctrl-C gets
    through at once; a blocking wait for the device in the main thread would hold it
    until the device is done. Since the thread waits on each call's report from when the
    call is queued, it also tells when the device finished each call (`stamp`), however
    late the host reads the report: within the thread's wake-up, which one thread keeps
    in order (a call done before the thread got to it is stamped then).
    """

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[tuple[Any, Stamp]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def wait(self, array: Any, timeout: float | None = None) -> bool:
        """Waits for `array` (at most `timeout` seconds); returns whether it is ready."""
        if array.is_ready():
            return True
        return self.stamp(array).wait(timeout)

    def stamp(self, array: Any) -> Stamp:
        """When `array` becomes ready: at once, or once the thread has waited for the
        arrays asked before it, and for it.
        """
        stamp = Stamp()
        if array.is_ready():
            stamp.set()
            return stamp
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, daemon=True)
                self.thread.start()
        self.requests.put((array, stamp))
        return stamp

    def _serve(self) -> None:
        while True:
            array, stamp = self.requests.get()
            stamp.done_before = array.is_ready()
            try:
                array.block_until_ready()
            except Exception:  # the main thread reads the array and meets the error
                pass
            stamp.set()


WAITER = _Waiter()


def wait_for(array: Any) -> bool:
    """Waits for `array`, the last call's: whether it is ready. A further Ctrl-C stops the
    wait; then Python waits for it at exit (`_PENDING`), so that the process never exits
    with the device still running (XLA aborts it).
    """
    try:
        return WAITER.wait(array)
    except KeyboardInterrupt:
        _PENDING.append(array)
        raise


# Arrays of calls still running when `fit` raised: waited for before Python exits. JAX is
# imported first, so this runs before JAX's own exit handlers (they run last first).
_PENDING: list[Any] = []


@atexit.register
def _wait_for_pending() -> None:
    for array in _PENDING:
        try:
            array.block_until_ready()
        except Exception:
            pass
