"""Ready callbacks for experiment logs: `fit(..., callbacks=[...])`.

A callback is any object with `on_epoch_end(epoch, logs) -> bool | None` (epochs counted
from 1), called on the host after each epoch; it may also have `on_train_end(logs)`,
called once training ends, with the last epoch's values. One whose class says
`stops_training = False` (these do) never stops training, so the device need not wait
for it: the next epoch is queued before it sees the last.
"""

import csv
import os
from pathlib import Path
from typing import Any


class CSVLogger:
    """Writes each epoch's values to a CSV file as training goes: a row per epoch, a
    column per value, the first one `epoch`. The file is flushed after each row, so it
    can be read while training runs.

    **Arguments:**

    - `path`: the file.
    - `append`: add rows to an existing file (continuing a run) rather than start anew.
    - `separator`: the column separator.
    """

    stops_training: bool = False

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False, separator: str = ","):
        self.path: Path = Path(path)
        self.append: bool = append
        self.separator: str = separator
        self._file: Any = None
        self._writer: Any = None
        self._columns: list[str] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """Writes epoch `epoch`'s row."""
        if self._file is None:
            exists = self.append and self.path.exists() and self.path.stat().st_size > 0
            self._file = open(self.path, "a" if self.append else "w", newline="")  # noqa: SIM115
            self._writer = csv.writer(self._file, delimiter=self.separator)
            self._columns = ["epoch", *logs]
            if not exists:
                self._writer.writerow(self._columns)
        self._writer.writerow([epoch, *(logs.get(name) for name in self._columns[1:])])
        self._file.flush()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Closes the file."""
        del logs
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoard:
    """Writes each epoch's values as TensorBoard scalars, one per name, at the epoch's
    number. Needs tensorboardX: `pip install "eqfit[tensorboard]"` (imported only when
    the first epoch is written).

    **Arguments:**

    - `logdir`: the directory for the event files (`tensorboard --logdir` it).
    """

    stops_training: bool = False

    def __init__(self, logdir: str | os.PathLike[str]):
        self.logdir: Path = Path(logdir)
        self._writer: Any = None

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        """Writes epoch `epoch`'s values."""
        if self._writer is None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as e:
                hint = 'pip install "eqfit[tensorboard]"'
                raise ImportError(f"eqfit.callbacks.TensorBoard needs tensorboardX: {hint}") from e
            self._writer = SummaryWriter(str(self.logdir))
        for name, value in logs.items():
            self._writer.add_scalar(name, value, epoch)
        self._writer.flush()

    def on_train_end(self, logs: dict[str, float] | None = None) -> None:
        """Closes the event file."""
        del logs
        if self._writer is not None:
            self._writer.close()
            self._writer = None
