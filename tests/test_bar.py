"""What `progress=True` writes: a bar in a terminal, where a worker process writes it to
pseudo-terminals of set widths and the test reads what a screen of that width would
show; and one clean line per epoch in a file or a pipe, where nobody watches a bar.
"""

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import fit_stopped_after_two_epochs, worker_env

import eqfit
from eqfit._host._progress import wrapped


# A time as eqfit's lines write it, each form exactly: `2.4ms`, `1.23s` from 0.1 s, `42.5s`
# from 10 s, `3m07s` from a minute, `2h05m` from an hour.
DURATION = r"(\d+(\.\d+)?ms|\d\.\d\ds|\d\d\.\ds|\d+m\d\ds|\d+h\d\dm)"


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


def _run_worker(outputs: list[tuple[str, str]]) -> tuple[list[str], list[dict[str, list]]]:
    """What the worker wrote to each output, and each run's values (`history.values`).

    `outputs`: where each run writes, and its `progress` (`""` for `True`): `"50"` (a
    terminal of that many columns), `"file"` or `"pipe"`.
    """
    readers, writers, files = [], [], {}
    for place, _ in outputs:
        if place == "file":
            handle = tempfile.TemporaryFile()
            files[len(readers)] = handle
            readers.append(None)
            writers.append(handle.fileno())
        else:
            reader, writer = _terminal(int(place)) if place != "pipe" else os.pipe()
            readers.append(reader)
            writers.append(writer)
    process = subprocess.Popen(
        [sys.executable, str(WORKER)]
        + [f"{fd}:{progress}" for fd, (_, progress) in zip(writers, outputs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # until the worker puts its outputs there
        pass_fds=writers,
        env=worker_env(HERE),
    )
    for i, writer in enumerate(writers):
        if i not in files:
            os.close(writer)
    # Read as it writes: a terminal holds only a few KiB that nobody read.
    written = {r: b"" for r in readers if r is not None}
    still_open = set(written)
    deadline = time.monotonic() + 120
    try:
        while still_open:
            ready, _, _ = select.select(list(still_open), [], [], 10)
            assert time.monotonic() < deadline, "the worker ran for two minutes"
            for reader in ready:
                try:
                    chunk = os.read(reader, 65536)
                except OSError:  # the slave's last holder closed it (EIO)
                    chunk = b""
                if chunk:
                    written[reader] += chunk
                else:
                    still_open.discard(reader)
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        for reader in written:
            os.close(reader)
    texts = []
    for i, reader in enumerate(readers):
        if reader is None:
            files[i].seek(0)
            texts.append(files[i].read().decode())
            files[i].close()
        else:
            texts.append(written[reader].decode())
    assert process.returncode == 0, "".join(texts)[-2000:]
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


@pytest.mark.slow
def test_a_terminal_gets_the_bar_and_a_file_or_pipe_one_line_per_epoch():
    """Every run in one worker: one process to start, one run to compile. Each writes to
    its stdout and stderr, one place for both (`> run.log 2>&1`).
    """
    terminals = [(str(width), "") for width in WIDTHS]
    forced = [("80", "lines"), ("file", "bar")]
    texts, runs = _run_worker([*terminals, ("file", ""), ("pipe", ""), *forced])
    for (columns, _), text, values in zip(terminals, texts, runs):
        _check_screen(text, {k: v[-1] for k, v in values.items()}, int(columns))
    # Nobody watches a file or a pipe, and `"lines"` asks for what they get anywhere.
    for text, values in zip(texts[3:5], runs[3:5]):
        _check_lines(text, values)
    _check_lines(texts[5].replace("\r\n", "\n"), runs[5])  # a terminal's line ends
    assert "\r" in texts[6] and "12/12" in texts[6]  # `"bar"`: the bar, in a file too


def _check_lines(text: str, values: dict[str, list[float]]) -> None:
    """`text` is the plan's line, a line for each of the 3 epochs with all its values as
    the history has them, to the digits shown, and a line saying the run is done: no
    carriage return, no escape, no blank line.
    """
    assert "\r" not in text and "\x1b" not in text, repr(text)
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    assert len(lines) == 5 and all(lines), lines
    assert lines[0].startswith("eqfit: ") and "parameters" in lines[0], lines[0]
    assert set(NAMES) <= set(values)
    for epoch, line in enumerate(lines[1:4], start=1):
        head, shown = line.split(": ", 1)
        assert head == f"epoch {epoch}/3", line
        pairs = [item.split("=") for item in shown.split(" ") if "=" in item]
        assert [name for name, _ in pairs] == list(values), line  # the history's, in order
        for name, number in pairs:
            assert number == f"{values[name][epoch - 1]:.4g}", (name, line)
    assert re.fullmatch(rf"training done at epoch 3/3, step 12/12, in {DURATION}", lines[4])


def _check_screen(text: str, values: dict[str, float], columns: int) -> None:
    assert set(NAMES) <= set(values)
    # Nothing written is wider than the terminal: no line wraps.
    segments = re.split(r"[\r\n]", ANSI.sub("", text))
    assert max(len(s) for s in segments) <= columns, (columns, max(segments, key=len))
    screen = _screen(text, columns)
    assert all(len(line) <= columns for line in screen)
    # The bar's last line: the step count (3 epochs of 4 steps), the last epoch's loss and
    # samples/s.
    bar = [line for line in screen if "|" in line and " samples/s" in line]
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


def test_progress_takes_true_false_bar_or_lines_only():
    x = np.zeros((8, 2), np.float32)
    model = eqfit.models.LinearRegression(2, key=jax.random.key(0))
    with pytest.raises((TypeError, ValueError), match="`progress`.*'bar' or 'lines'"):
        eqfit.fit(
            model,
            (x, x[:, 0]),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=jax.random.key(1),
            progress="sideways",  # type: ignore[arg-type]
        )


def test_a_log_says_where_and_why_a_run_stopped_early(tmp_path, capsys):
    """Under pytest stderr is no terminal: the lines. The last says how the run ended (and
    that its checkpoint is being written, where the writes are in the background: a GPU's
    or TPU's default).
    """
    model = eqfit.models.LinearRegression(2, key=jax.random.key(0))
    fit_stopped_after_two_epochs(model, checkpoint=tmp_path, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines[1:3]] == ["epoch 1/10", "epoch 2/10"]
    assert re.fullmatch(
        rf"training stopped early \(early_stopping\) at epoch 2/10, step 6/30, in {DURATION}; "
        rf"checkpoint: {re.escape(str(tmp_path))}/ckpt-000002-000000( \(being written\))?",
        lines[-1],
    ), lines


@pytest.mark.parametrize("members", [None, 3])
def test_a_line_inside_an_epoch_gives_the_mean_loss_of_its_steps_so_far(
    members, capsys, monkeypatch
):
    """A line written inside an epoch gives the mean loss of the epoch's steps so far, as
    the history records them, those of the calls before it in the epoch too (an
    ensemble's: the members' mean). A new configuration's first calls end after 1, 2,
    4, ... steps; with almost no interval between lines, each that ends inside an epoch
    writes one.
    """
    monkeypatch.setenv("EQFIT_LINE_SECONDS", "1e-9")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 11)).astype(np.float32)  # 40 steps an epoch
    y = (x @ rng.normal(size=(11, 1)) + 0.1 * rng.normal(size=(200, 1))).astype(np.float32)

    def make(key):
        return eqx.nn.MLP(11, 1, 13, 1, key=key)

    keys = jax.random.split(jax.random.key(0), members or 1)
    model = make(keys[0]) if members is None else eqx.filter_vmap(make)(keys)
    result = eqfit.fit(
        model,
        (x, y),
        key=jax.random.key(1),
        epochs=2,
        batch_size=5,
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(1e-2),
        ensemble=members is not None,
        progress="lines",
    )
    lines = re.findall(r"epoch (\d)/2, step (\d+)/80: loss=(\S+)", capsys.readouterr().err)
    assert lines, "no line inside an epoch"
    step_loss = result.history.step_loss.reshape(2, 40, -1)  # an ensemble's: members last
    for epoch, step, loss in lines:
        done = int(step) - 40 * (int(epoch) - 1)  # the epoch's steps so far
        assert 0 < done < 40
        expected = step_loss[int(epoch) - 1, :done].mean()
        assert float(loss) == pytest.approx(expected, rel=1e-3), (epoch, step, loss)


# A long epoch in a log: a line about every `INTERVAL` seconds between its epoch lines (an
# hour's epoch gets one a minute), by the environment's knob.
INTERVAL = 0.4
STEPS = 120000  # an epoch's: seconds, long enough for several of `INTERVAL`'s lines
STEP_LINE = re.compile(
    rf"epoch (\d)/3, step (\d+)/{3 * STEPS}: loss=\S+ \d+(\.\d+)?[kMG]? samples/s", re.ASCII
)


@pytest.mark.heavy
def test_a_long_epoch_in_a_log_writes_a_line_now_and_then_and_a_signal_is_named(tmp_path):
    """Epochs of `STEPS` steps (seconds each): between the epoch lines, one line about
    each `INTERVAL` with the step reached, each epoch line soon after its epoch's end, and
    after a SIGTERM a line naming it, the step and the checkpoint written there.
    """
    process = subprocess.Popen(
        [sys.executable, str(HERE / "early_end_worker.py"), "log", str(tmp_path), str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # a pipe: no terminal, so the lines
        text=True,
        env={**worker_env(HERE), "EQFIT_LINE_SECONDS": str(INTERVAL)},
    )
    lines: list[tuple[float, str]] = []  # stderr's, as they arrived

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        # Into the third epoch: two epoch lines and a line of the third.
        while not any(line.startswith("epoch 3/3, step") for _, line in list(lines)):
            assert process.poll() is None and time.monotonic() < deadline, lines[-5:]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        # Not `communicate`: it reads stderr too, racing the reader for the last lines.
        process.wait(timeout=60)
        assert process.stdout is not None
        out = process.stdout.read()  # two short lines: the pipe never filled
    finally:
        process.kill()
    reader.join(timeout=10)  # the pipe ends with the process
    for pipe in (process.stdout, process.stderr):
        assert pipe is not None
        pipe.close()
    assert process.returncode == 0, (out, lines[-5:])
    text = "".join(line for _, line in lines)
    assert "\r" not in text and "\n\n" not in text
    assert lines[0][1].startswith("eqfit: ")
    (signal_name, trained), *_ = re.findall(r"raised TrainingInterrupted (\w+) steps=(\d+)", out)
    assert signal_name == "SIGTERM"
    *body, (_, last) = lines[1:]
    assert re.fullmatch(
        rf"training stopped by SIGTERM at epoch 3/3, step {trained}/{3 * STEPS}, in {DURATION}; "
        rf"checkpoint: {re.escape(str(tmp_path))}/ckpt-000002-{int(trained) - 2 * STEPS:06d}\n",
        last,
    ), last
    steps: list[tuple[float, int]] = []  # (arrived, step) of each line inside an epoch
    epochs = 0
    for (arrived, line), (before, _) in zip(body, [lines[0], *body]):
        found = STEP_LINE.match(line)
        if found is None:  # an epoch's line, soon after its end (by the last lines' speed)
            epochs += 1
            # Its values, and its time: seconds long.
            assert re.fullmatch(rf"epoch {epochs}/3: loss=\S+ \({DURATION}\)\n", line), line
            assert len(steps) >= 2, "an epoch shorter than two lines' interval"
            (t1, s1), (t2, s2) = steps[-2:]
            ended = t2 + (epochs * STEPS - s2) * (t2 - t1) / (s2 - s1)
            assert arrived - ended < 1.0, (line, arrived - ended)
            continue
        steps.append((arrived, int(found.group(2))))
        # At most one line an interval, never a frame; and lines keep coming (within a
        # call or so of the interval's end, but this 2-core machine is shared: a call
        # sized for half a second may take seconds).
        assert INTERVAL * 0.8 < arrived - before < INTERVAL + 5.0, (line, arrived - before)
    assert epochs == 2 and len(steps) >= 6, body
