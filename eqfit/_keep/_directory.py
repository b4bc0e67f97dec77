"""The checkpoint directory's own: its lock, a check that it takes files, and the error of
a checkpoint that could not be written.
"""

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any


class CheckpointError(OSError):
    """A checkpoint could not be written (or its directory used). `result` holds the
    training result so far, when there is one.
    """

    result: Any = None


def lock(directory: Path) -> Any:
    """An exclusive lock on `directory` (through a `.lock` file in it), naming its holder;
    refused with the holder's name if another run has it.
    """
    import fcntl

    path = directory / ".lock"
    try:
        handle = open(path, "a+")  # noqa: SIM115 (held until `close`)
    except OSError as e:
        raise CheckpointError(f"Cannot open the lock file {path}: {e.strerror}.") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise CheckpointError(
            f"The checkpoint directory {directory} is in use by another run ({holder}). "
            "Wait for it to end, or give another directory."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n")
    handle.flush()
    return handle


def check_writable(directory: Path) -> None:
    """Writes and removes a file, so that a directory that cannot take checkpoints is
    found before training rather than at its first checkpoint.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"Cannot write to the checkpoint directory {directory} ({e.strerror}); training "
            "has not started. Give a directory this process can write to."
        ) from None
