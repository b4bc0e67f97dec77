"""The background thread that writes a run's checkpoints, one at a time, while training
goes on; and the last write of a run, which goes on after `fit` returns (`go_on`).
"""

import logging
import os
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

    def queue(self, take: Callable[[], Any], write: Callable[[Any], Any]) -> None:
        """Starts, in the background, `take()` (a state's copy taken to the host, beside
        the write in flight), then once that write is done `write(taken)`, without waiting
        for anything here (the write skipped if the one before it failed: its error is
        raised).
        """
        before = self.thread

        def after() -> None:
            try:
                taken = take()
            finally:  # one write at a time, even where the copy failed
                if before is not None:
                    before.join()
            if self.error is None:
                write(taken)

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
    """A run's last write, going on after the run (`go_on`) into `folder`: a thread that
    is not a daemon, so that the process's exit waits for it, waits for the write and
    then runs what waited for it (`after`: the directory's lock let go).
    """

    def __init__(self, folder: Path, writer: Writer):
        self.folder, self.directory = folder, folder.parent
        self.error: BaseException | None = None
        self.reported = False  # its error raised by `wait_for_checkpoints` once
        self.then: list[Callable[[], None]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(writer,), name=f"eqfit checkpoint {folder}"
        )

    def told(self) -> BaseException | None:
        """Its error, if it failed and `wait_for_checkpoints` has not raised it yet."""
        return None if self.reported else self.error

    def _run(self, writer: Writer) -> None:
        try:
            writer.wait()
        except BaseException as e:
            # Kept without its frames, which hold the state that was written.
            e.__context__ = e.__cause__ = None
            self.error = e.with_traceback(None)
            _LOG.error(
                "A checkpoint write in %s failed after `fit` returned, and %s was not "
                "written: %s. The newest checkpoint there is the last one committed.",
                self.directory,
                self.folder.name,
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


def go_on(folder: Path, writer: Writer) -> None:
    """Lets `writer`'s writes in flight (a run's last, into `folder`) go on while `fit`
    returns: the process's exit, `waited_for` and `wait_for_checkpoints` wait for them.
    """
    going = _Going(folder.resolve(), writer)
    with _GUARD:  # the writes done and told are forgotten
        _GOING[:] = [g for g in _GOING if not g.done.is_set() or g.told() is not None]
        _GOING.append(going)
    going.thread.start()


def going(directory: Path) -> Path | None:
    """The folder of the write going on in `directory` after its run, if one is."""
    directory = directory.resolve()
    with _GUARD:
        folders = [g.folder for g in _GOING if g.directory == directory and not g.done.is_set()]
    return folders[-1] if folders else None


def after(directory: Path, then: Callable[[], None]) -> None:
    """Runs `then` once the last write going on in `directory` is done: now if none is."""
    directory = directory.resolve()
    with _GUARD:
        going = [g for g in _GOING if g.directory == directory and not g.done.is_set()]
        if going:
            going[-1].then.append(then)
            return
    then()


def waited_for(directory: Path) -> None:
    """Waits for the writes still going in `directory`, of runs that have returned (an
    error of theirs is logged, and raised by `wait_for_checkpoints`).
    """
    directory = directory.resolve()
    with _GUARD:
        going = [g for g in _GOING if g.directory == directory]
    for g in going:
        g.thread.join()


def wait_for_checkpoints(directory: str | os.PathLike[str] | None = None) -> None:
    """Waits for the checkpoints still being written after their `fit` returned.

    On a GPU or TPU (`eqfit.Checkpoint`'s `background`), `fit` returns once its last
    checkpoint's state is copied on the device, and the write goes on beside what comes
    next, as Orbax's asynchronous checkpoints do: this waits for it, as the process's exit
    does, and as a `fit` with the same directory does before it reads it.

    **Arguments:**

    - `directory`: the checkpoint directory whose writes to wait for; `None`, every one.

    **Raises:**

    [`eqfit.CheckpointError`][] (or the write's own error) if such a write failed, once;
    the `eqfit` logger has said so already.
    """
    where = None if directory is None else Path(directory).resolve()
    with _GUARD:
        waited = [g for g in _GOING if where is None or g.directory == where]
    for g in waited:
        g.thread.join()
    with _GUARD:
        errors = [e for g in waited if (e := g.told()) is not None]
        for g in waited:
            g.reported = True
        _GOING[:] = [g for g in _GOING if g not in waited]
    if errors:
        raise errors[0]
