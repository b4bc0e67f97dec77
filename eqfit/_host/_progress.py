"""What `fit(..., progress=True)` shows a person as the run goes: a live bar where one
is watched (a terminal, a notebook), and one line per epoch everywhere else (a log file,
a pipe, a batch job's output), where a bar's frames would pile up as leftovers.

Both are observers (`_observers.Observer`) that `_train.observers_for` makes; they
write the same epoch lines, with the same figures.
"""

import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from .._program._options import Options
from .._program._schedule import Schedule
from .._program._state import TrainState
from .._step._record import THROUGHPUT_FIGURES
from .._step._statistics import ENTRY
from ._observers import Observer, Progress


# The bar redraws about this often: its calls last at most this long.
SECONDS_PER_BAR_CALL = 0.2
# Where no bar is drawn, an epoch longer than this writes a line about this often between
# its epoch lines (the step reached, the running loss, samples per second): a log shows the
# run alive and its speed, and 1,000 such lines are a day's run. The environment variable
# `LINE_SECONDS_VARIABLE` sets another interval.
SECONDS_PER_LINE = 60.0
LINE_SECONDS_VARIABLE = "EQFIT_LINE_SECONDS"
# An epoch this long or longer has its time on its line.
SHOWN_EPOCH_SECONDS = 1.0

# The epoch's values that its line leaves out: the throughput figures, which are in
# `history.throughput` (the bar and the lines show samples per second their own way).
_FIGURES = THROUGHPUT_FIGURES


def progress_kind(
    progress: bool | Literal["bar", "lines"], stream: Any
) -> Literal["bar", "lines"] | None:
    """What `fit`'s `progress` draws on `stream`: `True` is a bar where a person watches
    `stream` as it is drawn (`watched`) and lines elsewhere, as Keras's `verbose="auto"`;
    `"bar"` and `"lines"` are themselves; `False` is nothing (`None`).
    """
    if progress is False:
        return None
    if progress is True:
        return "bar" if watched(stream) else "lines"
    return progress


def watched(stream: Any) -> bool:
    """Whether `stream` is drawn for a person as it is written: a terminal, or a Jupyter
    kernel's output (where `tqdm.auto` draws its widget). Not a file or a pipe.
    """
    isatty = getattr(stream, "isatty", None)
    try:
        if callable(isatty) and isatty():
            return True
    except ValueError:  # a closed file
        return False
    return type(stream).__module__.split(".")[0] == "ipykernel"


def seconds_per_line() -> float:
    """The interval between a long epoch's lines: `SECONDS_PER_LINE`, or the environment's
    `LINE_SECONDS_VARIABLE` where it is set.
    """
    given = os.environ.get(LINE_SECONDS_VARIABLE)
    if given is None:
        return SECONDS_PER_LINE
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:
        raise ValueError(
            f"The environment variable {LINE_SECONDS_VARIABLE} must be a number of seconds "
            f"above 0 (between a long epoch's lines in a log), got {given!r}."
        )
    return seconds


def per_second(rate: float) -> str:
    """`rate` to three figures, thousands by a prefix: `879k`, `1.23M`, `512`, `0.25`."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        shown = f"{rate / scale:.3g}"
        if float(shown) >= 1:
            return shown + prefix
    return f"{rate:.3g}"


def duration(seconds: float) -> str:
    """`seconds` as a person reads a time: `4.2ms`, `0.35s`, `1.23s`, `42.5s`, `3m07s`,
    `2h05m`.
    """
    if seconds < 0.0995:  # a short run: `0.00s` would say it took no time
        return f"{seconds * 1e3:.2g}ms"
    if seconds < 9.995:
        return f"{seconds:.2f}s"
    if seconds < 59.95:
        return f"{seconds:.1f}s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class EpochLines:
    """Makes the line of each epoch that ends: its values (`history.values`' row) and,
    from the first epoch of the run that took `SHOWN_EPOCH_SECONDS` or more on, its
    time (so that a run's epochs about a second long all show it, or none).
    """

    def __init__(self, epochs: int):
        self.epochs = epochs
        self.timed = False

    def __call__(self, epoch: int, logs: dict[str, float]) -> str:
        # An array value's entries (a confusion matrix's) are left out: the history has it.
        shown = " ".join(
            f"{k}={v:.4g}" for k, v in logs.items() if k not in _FIGURES and not ENTRY.search(k)
        )
        line = f"epoch {epoch}/{self.epochs}: {shown}"
        seconds = logs.get("epoch_seconds")  # none for an epoch begun before a resume
        self.timed = self.timed or (seconds is not None and seconds >= SHOWN_EPOCH_SECONDS)
        if self.timed and seconds is not None:
            line += f" ({duration(seconds)})"
        return line


def early_stops(options: Options) -> tuple[str, str]:
    """What may stop a run with these options before its last epoch, in words (for
    `Lines`' last line): what the program decides, and what the host does.
    """
    program = ["early_stopping"] * (options.early_stopping is not None)
    program += ["a non-finite loss, on_nan='stop'"] * (options.step.on_nan == "stop")
    host = ["a callback"] * bool(options.callbacks) + ["the data ran out"]
    return " or ".join(program), " or ".join(host)


# The bar's line, fullest first: the first that leaves the bar `MIN_BAR_CELLS` cells
# on the terminal's line is drawn (the last where none does). tqdm shrinks only the
# bar to fit, and cuts what is still too long at the line's end, so each drops what
# the line can best spare: the percentage, the times, the epoch (which the epochs'
# lines name too). tqdm writes `{desc}` as "epoch 3/10: " and `{postfix}` as
# ", loss=..., 879k samples/s".
BAR_FORMATS = (
    "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
    "{desc}|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
    "{desc}|{bar}| {n_fmt}/{total_fmt}{postfix}",
    "|{bar}| {n_fmt}/{total_fmt}{postfix}",
)
MIN_BAR_CELLS = 10


class Bar(Observer):
    """The tqdm bar, and a line for each epoch that ends. It starts when the first call
    is queued (after compilation, so its rate is the training's).

    The bar names the epoch the last step was in, and shows that epoch's mean loss so far
    (at its end, `history.loss`'s value) and the samples per second of the last calls;
    it keeps to the terminal's line, whatever its width. When an epoch ends, a line
    above the bar gives all its values (its row of `history.values`), broken between
    values to the terminal's width.
    """

    seconds_per_call = SECONDS_PER_BAR_CALL

    def __init__(self, schedule: Schedule, begin: int, summary: str | None = None):
        self.schedule, self.begin = schedule, begin
        self.summary = summary  # the plan's line, printed above the bar
        self.made: Any = None
        self.shown = begin
        self.epoch_line = EpochLines(schedule.epochs)

    def after_call(self, position: int, state: TrainState) -> None:
        if self.made is None:
            from tqdm.auto import tqdm

            schedule = self.schedule
            # No tqdm rate: a step's rate means little, and tqdm's is of the last
            # redraw alone. The postfix shows samples per second over the last calls.
            self.made = tqdm(
                total=None if schedule.learning else schedule.total - schedule.begin,
                initial=self.begin - schedule.begin,
                unit="step",
                dynamic_ncols=True,
                bar_format=BAR_FORMATS[0],
            )
            if self.summary is not None:
                self._write(self.summary)

    def learned(self, schedule: Schedule) -> None:
        self.schedule = schedule
        if self.made is not None:
            self.made.total = schedule.total - schedule.begin
            self._fit_line()
            self.made.refresh()

    def on_progress(self, progress: Progress) -> bool:
        if self.made is None or progress.position <= self.shown:
            return False
        epochs = self.schedule.epochs
        for epoch, logs in progress.ended:
            self._write(self.epoch_line(epoch, logs))
        epoch = min(progress.epoch, epochs)
        self.made.set_description(f"epoch {epoch}/{epochs}", refresh=False)
        postfix = f"loss={progress.epoch_loss:.4g}"
        if progress.samples_per_second is not None:
            postfix += f", {per_second(progress.samples_per_second)} samples/s"
        self.made.set_postfix_str(postfix, refresh=False)
        self._fit_line()
        self.made.update(progress.position - self.shown)
        self.shown = progress.position
        return False

    def close(self) -> None:
        if self.made is not None:
            self._fit_line()  # its last line, with the run's time
            self.made.close()

    def _write(self, line: str) -> None:
        """Prints `line` above the bar, broken to the terminal's width."""
        self.made.write(wrapped(line, self._width()), file=sys.stderr)

    def _width(self) -> int | None:
        """The columns tqdm draws in now (one less than the terminal's: it leaves the
        last free); `None` where the bar is not in a terminal (a file, a notebook).
        """
        width = self.made.format_dict["ncols"]
        return width if isinstance(width, int) and width > 0 else None

    def _fit_line(self) -> None:
        """Sets the fullest of `BAR_FORMATS` that fits the line with the bar's values."""
        made, width = self.made, self._width()
        chosen = BAR_FORMATS[0]
        if width is not None:
            meter = made.format_dict
            for chosen in BAR_FORMATS:
                text = chosen.replace("{bar}", "")  # the line without its bar
                rest = made.format_meter(**{**meter, "bar_format": text, "ncols": None})
                if len(rest) + MIN_BAR_CELLS <= width:
                    break
        made.bar_format = chosen


def wrapped(line: str, width: int | None) -> str:
    """`line` broken at its spaces into lines of at most `width` characters (all of it on
    one line where `width` is `None`), each after the first indented by two spaces. A
    word longer than a line is not cut: it has a line of its own.
    """
    if width is None:
        return line
    lines = textwrap.wrap(
        line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
    )
    return "\n".join(lines)


def validation_line(step: int, logs: dict[str, float]) -> str:
    """A validation's line (`validation_every`): its step and its values."""
    return f"step {step}: " + " ".join(
        f"{name}={value:.4g}" for name, value in logs.items() if not ENTRY.search(name)
    )


class Lines(Observer):
    """The run as a log shows it, where no bar is drawn: the plan's line once the run
    starts, a line for each epoch as it ends (the bar's epoch line, unbroken), and for
    each validation (`validation_every`) before it, a line
    about every `seconds_per_line()` inside a longer epoch, and a line saying how the
    run ended. Each line is whole and flushed as it is written, so that `tail -f` shows
    it: no carriage return, no frame, no blank line.

    **Arguments:**

    - `stream`: where the lines go (`sys.stderr`, where a bar would be drawn).
    - `newest`: the newest checkpoint's folder (`None`: none), for the last line; `None`
        where the run writes none.
    - `stops`: what may stop the run before its last epoch, in words: what the program
        decides (`early_stopping`, a non-finite loss), and what the host does (a callback,
        the data's end).
    """

    def __init__(
        self,
        schedule: Schedule,
        begin: int,
        summary: str | None,
        stream: Any,
        newest: Callable[[], Path | None] | None = None,
        stops: tuple[str, str] = ("", ""),
    ):
        self.schedule, self.summary, self.stream = schedule, summary, stream
        self.newest, self.stops = newest, stops
        self.interval = seconds_per_line()
        self.epoch_line = EpochLines(schedule.epochs)
        self.position = begin
        self.epoch = 0  # the epoch the last step read was in; 0: none read
        self.stopped = False  # the program stopped the run
        self.began: float | None = None  # when the first call was queued
        self.written = 0.0  # when the last line was written

    def after_call(self, position: int, state: TrainState) -> None:
        if self.began is None:
            self.began = self.written = time.monotonic()
            if self.summary is not None:
                self._write(self.summary)

    def on_progress(self, progress: Progress) -> bool:
        schedule = self.schedule
        validated = list(progress.validated)  # `validation_every`'s, each before its epoch's
        for epoch, logs in progress.ended:
            while validated and validated[0][0] <= epoch * schedule.steps_per_epoch:
                self._write(validation_line(*validated.pop(0)))
            self._write(self.epoch_line(epoch, logs))
        for step, logs in validated:
            self._write(validation_line(step, logs))
        self.position, self.stopped = progress.position, progress.stopped
        self.epoch = min(progress.epoch, schedule.epochs)
        inside = schedule.learning or not schedule.is_epoch_end(progress.position)
        if inside and time.monotonic() - self.written >= self.interval:
            line = f"{self._where()}: loss={progress.epoch_loss:.4g}"
            if progress.samples_per_second is not None:
                line += f" {per_second(progress.samples_per_second)} samples/s"
            self._write(line)
        return False

    def finished(self) -> None:
        # Called inside `fit`'s `except` clause where it raises: the error tells how.
        error = sys.exc_info()[1]
        schedule = self.schedule
        if isinstance(error, KeyboardInterrupt):  # `TrainingInterrupted`: with its signal
            how = f"stopped by {getattr(error, 'signal', 'SIGINT')}"
        elif error is not None:
            how = f"ended by {type(error).__name__}"
        elif not schedule.learning and self.position >= schedule.total:
            how = "done"
        else:
            why = self.stops[0] if self.stopped else self.stops[1]
            how = f"stopped early ({why})" if why else "stopped early"
        line = f"training {how} at {self._where()}"
        if self.began is not None:
            line += f", in {duration(time.monotonic() - self.began)}"
        newest = None if self.newest is None else self.newest()
        if newest is not None:  # in the background, the last may still be written
            line += f"; checkpoint: {newest}" + ("" if newest.exists() else " (being written)")
        self._write(line)

    def _where(self) -> str:
        """The epoch and step the run reached: `epoch 3/10, step 1200/5000`."""
        schedule = self.schedule
        epoch = self.epoch or schedule.first_epoch + 1
        if schedule.learning:  # the epoch's length, and so the run's, is not known yet
            return f"epoch {epoch}/{schedule.epochs}, step {self.position}"
        return f"epoch {epoch}/{schedule.epochs}, step {self.position}/{schedule.total}"

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
        self.written = time.monotonic()
