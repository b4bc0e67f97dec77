"""The bar in a terminal: a worker process writes it to pseudo-terminals of set widths,
and the test reads what a screen of that width would show.
"""

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from helpers import worker_env

from eqfit._observers import wrapped


HERE = Path(__file__).parent
WORKER = HERE / "bar_worker.py"
WIDTHS = (50, 80, 120)  # 50: the bar drops all it can spare
# What the worker's runs record: the loss, its aux value, two metrics, the validation's
# forms of these, and the norms.
TRAINING = ("loss", "max_err", "mae", "bias")
NAMES = (*TRAINING, *(f"val_{n}" for n in TRAINING), "grad_norm", "update_norm")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal(columns: int) -> tuple[int, int]:
    """A pseudo-terminal `columns` wide: its (master, slave) descriptors."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, slave


def _run_worker(widths: tuple[int, ...]) -> tuple[list[str], list[dict[str, float]]]:
    """What the worker wrote to a terminal of each width, and each run's last values."""
    terminals = [_terminal(w) for w in widths]
    slaves = [s for _, s in terminals]
    process = subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, slaves)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # until the worker puts a terminal there
        pass_fds=slaves,
        env=worker_env(HERE),
    )
    for slave in slaves:
        os.close(slave)
    # Read as it writes: a terminal holds only a few KiB that nobody read.
    written = {m: b"" for m, _ in terminals}
    open_masters = set(written)
    deadline = time.monotonic() + 120
    try:
        while open_masters:
            ready, _, _ = select.select(list(open_masters), [], [], 10)
            assert time.monotonic() < deadline, "the worker ran for two minutes"
            for master in ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the slave's last holder closed it (EIO)
                    chunk = b""
                if chunk:
                    written[master] += chunk
                else:
                    open_masters.discard(master)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        for master in written:
            os.close(master)
    assert process.returncode == 0, b"".join(written.values()).decode()[-2000:]
    texts = [written[m].decode() for m, _ in terminals]
    return texts, json.loads(out)


def _screen(text: str, columns: int) -> list[str]:
    """The lines a terminal `columns` wide holds after `text`: carriage returns and
    cursor-up escapes move the cursor, other escapes are dropped, and text past the
    last column wraps to the next line (as a terminal does).
    """
    lines, row, column = [[]], 0, 0
    for token in re.split(f"({ANSI.pattern}|\r|\n)", text):
        if token == "\r":
            column = 0
        elif token == "\n":
            row, column = row + 1, 0
        elif token.startswith("\x1b["):
            if token.endswith("A"):
                row = max(0, row - int(token[2:-1] or 1))
        else:
            for char in token:
                if column == columns:
                    row, column = row + 1, 0
                while len(lines) <= row:
                    lines.append([])
                line = lines[row]
                line.extend(" " * (column + 1 - len(line)))
                line[column] = char
                column += 1
        while len(lines) <= row:
            lines.append([])
    return ["".join(line).rstrip() for line in lines]


def test_the_bar_fits_its_terminal_and_shows_every_value():
    """The runs at every width in one worker: one process to start, one run to compile."""
    texts, runs = _run_worker(WIDTHS)
    for columns, text, values in zip(WIDTHS, texts, runs):
        _check_screen(text, values, columns)


def _check_screen(text: str, values: dict[str, float], columns: int) -> None:
    assert set(NAMES) <= set(values)
    # Nothing written is wider than the terminal: no line wraps.
    segments = re.split(r"[\r\n]", ANSI.sub("", text))
    assert max(len(s) for s in segments) <= columns, (columns, max(segments, key=len))
    screen = _screen(text, columns)
    assert all(len(line) <= columns for line in screen)
    # The bar's last line: the step count (3 epochs of 4 steps), the last epoch's loss and
    # samples/s.
    bar = [line for line in screen if "|" in line and "samples/s=" in line]
    assert bar, screen
    assert "12/12" in bar[-1] and f"loss={values['loss']:.4g}," in bar[-1], bar[-1]
    # Each epoch's line, broken to the width, names its epoch and holds all its values,
    # each whole on one line and the same number as the history's.
    for epoch in (1, 2, 3):
        assert sum(line.startswith(f"epoch {epoch}/3: loss=") for line in screen) == 1, screen
    last = screen.index(next(line for line in screen if line.startswith("epoch 3/3: loss=")))
    lines = [screen[last]]
    for line in screen[last + 1 :]:
        if not line.startswith("  "):  # its continuation lines are indented
            break
        lines.append(line)
    for name in NAMES:
        shown = [f" {name}={values[name]:.4g} " in f" {line} " for line in lines]
        assert sum(shown) == 1, (columns, name, lines)
    assert "samples/s" not in "".join(lines)  # the bar's figure, not one of the history's


def test_an_epochs_line_breaks_between_values():
    items = [f"value_{i}={i / 7:.4g}" for i in range(20)]
    line = " ".join(["epoch 1/2:", *items])
    for width in (20, 40, 80):
        lines = wrapped(line, width).split("\n")
        assert all(len(line) <= width for line in lines)
        assert all(line.startswith("  ") for line in lines[1:])
        assert " ".join(lines).split() == ["epoch", "1/2:", *items]
    # A value wider than the line has a line of its own, whole.
    assert wrapped(f"epoch 1/2: {'x' * 30} y=1", 20) == f"epoch 1/2:\n  {'x' * 30}\n  y=1"
    assert wrapped(line, None) == line  # not in a terminal
