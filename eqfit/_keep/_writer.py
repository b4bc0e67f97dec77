"""The background thread that writes a run's checkpoints, one at a time, while training
goes on.
"""

import threading
from collections.abc import Callable
from typing import Any


class Writer:
    """Writes checkpoints in a background thread, one at a time: `submit` waits for the
    write before it, and `wait` for the last. An error of a write is raised by the next
    `check`, `submit` or `wait`, in the training thread. A process killed during a write leaves
    the newest committed checkpoint whole: a checkpoint is renamed into place only once
    written and fsynced.
    """

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, write: Callable[[], Any]) -> None:
        """Starts `write()` in the background, once the write before it is done."""
        self.wait()
        self.thread = threading.Thread(target=self._run, args=(write,), daemon=True)
        self.thread.start()

    def _run(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except BaseException as e:  # raised in the training thread by `wait`
            self.error = e

    def busy(self) -> bool:
        """Whether a write is still going."""
        return self.thread is not None and self.thread.is_alive()

    def check(self) -> None:
        """Raises the error of the write in flight if it has failed already."""
        if self.thread is not None and not self.busy():
            self.wait()

    def wait(self) -> None:
        """Waits for the write in flight; raises its error, if it had one."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error
