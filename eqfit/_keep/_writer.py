"""The background thread that writes a run's checkpoints, one at a time, while training
goes on; and the last write of a run, which goes on after `fit` returns (`go_on`).
"""

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


_LOG = logging.getLogger("eqfit")


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

    def queue(self, write: Callable[[], Any]) -> None:
        """Starts `write()` in the background once the write in flight is done, without
        waiting for it here (nothing if that write fails: its error is raised).
        """
        before = self.thread

        def after() -> None:
            if before is not None:
                before.join()
            if self.error is None:
                write()

        self.thread = threading.Thread(target=self._run, args=(after,), daemon=True)
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


class _Going:
    """A run's last write, going on after the run (`go_on`): a thread that is not a
    daemon, so that the process's exit waits for it, waits for the write and then runs
    what waited for it (`after`: the directory's lock let go).
    """

    def __init__(self, directory: Path, writer: Writer):
        self.directory = directory
        self.error: BaseException | None = None
        self.reported = False  # its error raised by `wait_for_checkpoints` once
        self.then: list[Callable[[], None]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(writer,), name=f"eqfit checkpoint {directory}"
        )

    def told(self) -> BaseException | None:
        """Its error, if it failed and `wait_for_checkpoints` has not raised it yet."""
        return None if self.reported else self.error

    def _run(self, writer: Writer) -> None:
        try:
            writer.wait()
        except BaseException as e:
            self.error = e
            _LOG.error(
                "The last checkpoint of a run in %s failed as it was written after `fit` "
                "returned (the newest checkpoint there is the one before it): %s",
                self.directory,
                e,
            )
        finally:
            with _GUARD:
                self.done.set()
                then, self.then = self.then, []
            for f in then:
                f()


_GUARD = threading.Lock()
_GOING: list[_Going] = []  # every run's last write in this process, newest last


def go_on(directory: Path, writer: Writer) -> None:
    """Lets `writer`'s write in flight (a run's last) go on while `fit` returns: the
    process's exit, `waited_for(directory)` and `wait_for_checkpoints` wait for it.
    """
    going = _Going(directory.resolve(), writer)
    with _GUARD:  # the writes done and told are forgotten
        _GOING[:] = [g for g in _GOING if not g.done.is_set() or g.told() is not None]
        _GOING.append(going)
    going.thread.start()


def after(directory: Path, then: Callable[[], None]) -> None:
    """Runs `then` once the last write going on in `directory` is done: now if none is."""
    directory = directory.resolve()
    with _GUARD:
        going = [g for g in _GOING if g.directory == directory and not g.done.is_set()]
        if going:
            going[-1].then.append(then)
            return
    then()


def waited_for(directory: Path) -> BaseException | None:
    """Waits for the writes still going in `directory` (of runs that have returned), and
    returns the error of the newest, if it failed.
    """
    directory = directory.resolve()
    with _GUARD:
        going = [g for g in _GOING if g.directory == directory]
    for g in going:
        g.thread.join()
    return going[-1].error if going else None


def wait_for_checkpoints() -> None:
    """Waits for every checkpoint still being written.

    On a GPU or TPU (`eqfit.Checkpoint`'s `background`), `fit` returns once its last
    checkpoint's state is copied on the device, and the write goes on beside what comes
    next, as Orbax's asynchronous checkpoints do: this waits for it, as the process's exit
    does, and as a `fit` with the same directory does before it reads it.

    **Raises:**

    [`eqfit.CheckpointError`][] (or the write's own error) if a write that went on after
    its `fit` returned failed, once; the `eqfit` logger has said so already.
    """
    with _GUARD:
        going = list(_GOING)
    for g in going:
        g.thread.join()
    with _GUARD:
        errors = [e for g in going if (e := g.told()) is not None]
        for g in going:
            g.reported = True
        _GOING[:] = [g for g in _GOING if g not in going]
    if errors:
        raise errors[0]
