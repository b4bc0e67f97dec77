"""What a checkpoint holds the training up for: a write that a slow disk holds does not hold
the training (in the background, as a GPU or TPU writes by default, nor its commit as the
CPU's default writes); a checkpoint that falls due while the last is still being written
waits for it and says so once; and each epoch's `checkpoint_blocked_seconds` says how long
the training waited at its checkpoints. The disk is slowed through Python's audit hooks
(`sys.addaudithook`), which see every file opened: nothing of eqfit's is patched.
"""

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from helpers import (
    assert_trees_equal,
    fit_stopped_after_two_epochs,
    regression_data,
    worker_env,
)
from jax.sharding import Mesh

import eqfit


BLOCKED = "checkpoint_blocked_seconds"


class SlowDisk:
    """Files under `directory` opened as a slow disk would let them be: every opening
    recorded as `(path, mode, thread)` (the path inside `directory`), and the first `held`
    openings of files named `name` to write each wait until `release()` lets one through.
    """

    def __init__(
        self, directory: Path, name: str, held: int, fails: bool = False, seconds: float = 0.0
    ):
        self.directory, self.name, self.held = str(directory) + os.sep, name, held
        self.fails = fails  # a held opening, once let through, fails (a disk gone read-only)
        self.seconds = seconds  # how long each opening of `name` to write takes
        self.opened: list[tuple[str, str, int]] = []
        self.gate = threading.Semaphore(0)
        self.stuck = False  # a held opening was never released

    def release(self) -> None:
        self.gate.release()

    def saw(self, path: str, mode: str) -> None:
        if not path.startswith(self.directory):
            return
        self.opened.append((path[len(self.directory) :], mode, threading.get_ident()))
        if os.path.basename(path) == self.name and "w" in mode:
            time.sleep(self.seconds)
        if os.path.basename(path) == self.name and "w" in mode and self.held > 0:
            self.held -= 1
            # Released by the test; a bug that never releases it fails the test, not the suite.
            self.stuck |= not self.gate.acquire(timeout=120)
            if self.fails:
                raise OSError(errno.EROFS, "Read-only file system (the test's disk)")

    def writes(self, name: str) -> set[int]:
        """The threads that opened files named `name` to write."""
        return {
            thread
            for path, mode, thread in self.opened
            if os.path.basename(path) == name and "w" in mode
        }

    def __enter__(self) -> "SlowDisk":
        _install()
        _DISKS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _DISKS.remove(self)
        for _ in range(8):  # nothing left waiting on the gate
            self.gate.release()
        assert not self.stuck, "an opening held by the slow disk was never released"


_DISKS: list[SlowDisk] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _DISKS and isinstance(args[0], str) and isinstance(args[1], str):
        for disk in list(_DISKS):
            disk.saw(args[0], args[1])


def _install() -> None:
    """The audit hook, once a process (Python has no way to remove one): it does nothing
    while no `SlowDisk` is open.
    """
    if not getattr(sys, "_eqfit_tests_slow_disk", False):
        sys.addaudithook(_audit)
        sys._eqfit_tests_slow_disk = True  # type: ignore[attr-defined]


class WaitsReleased(logging.Handler):
    """Each log record of the `eqfit` logger that says a checkpoint waits for the write
    before it: its level kept, and the held write let through (else it would wait for ever).
    """

    def __init__(self, disk: SlowDisk):
        super().__init__(logging.DEBUG)
        self.disk = disk
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "waits for the write" in record.getMessage():
            self.records.append(record)
            self.disk.release()

    def __enter__(self) -> "WaitsReleased":
        logger = logging.getLogger("eqfit")
        self.level = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger("eqfit")
        logger.removeHandler(self)
        logger.setLevel(self.level)


def small_run(getkey):
    data = regression_data(getkey(), 100)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    kwargs = dict(
        loss=eqfit.losses.mse, key=getkey(), epochs=4, batch_size=16, optimizer=optax.adam(1e-2)
    )
    return model, data, kwargs


def checkpoints(directory):
    return sorted(p.name for p in Path(directory).glob("ckpt-*"))


def assert_resumes_from_the_one_before_the_newest(directory, policy, full, fit):
    """The newest checkpoint removed, a run resumed from the one before it ends as the
    uninterrupted one, bit for bit.
    """
    shutil.rmtree(Path(directory) / checkpoints(directory)[-1])
    resumed = fit(checkpoint=policy)
    assert_trees_equal(resumed.model, full.model)
    assert_trees_equal(resumed.opt_state, full.opt_state)
    np.testing.assert_array_equal(resumed.history.step_loss, full.history.step_loss)


# In the background (`True`, a GPU's or TPU's default) the whole write is held, the state's
# file first; as the CPU's default (`None`), whose training thread writes the state's file
# from its own buffers, the commit (the manifest, after the fsync) is.
WAYS = [pytest.param(True, "state.eqx", id="background"), pytest.param(None, "manifest.json")]


@pytest.mark.slow
@pytest.mark.parametrize("background, held", WAYS)
def test_training_goes_on_while_a_slow_disk_holds_a_checkpoints_write(
    getkey, tmp_path, background, held
):
    model, data, kwargs = small_run(getkey)
    full = eqfit.fit(model, data, **kwargs)
    policy = eqfit.Checkpoint(tmp_path, every_epochs=2, background=background)
    seen: dict[int, tuple[list[str], int]] = {}

    with SlowDisk(tmp_path, held, held=1) as disk:

        class Watch:
            def on_epoch_end(self, epoch, logs):
                seen[epoch] = (checkpoints(tmp_path), threading.get_ident())
                if epoch == 3:  # the training went past the checkpoint of epoch 2
                    disk.release()

        result = eqfit.fit(model, data, checkpoint=policy, callbacks=[Watch()], **kwargs)
        eqfit.wait_for_checkpoints()  # in the background, the last write goes on after `fit`

    # Epochs 2 and 3 ended, and were told, while the checkpoint of epoch 2 was held unwritten.
    assert seen[2][0] == [] and seen[3][0] == []
    assert checkpoints(tmp_path) == ["ckpt-000002-000000", "ckpt-000004-000000"]
    training = seen[1][1]
    assert disk.writes("manifest.json") and training not in disk.writes("manifest.json")
    state_written_by = disk.writes("state.eqx")
    assert state_written_by and (training in state_written_by) == (background is None)
    # The seconds the training waited, at the epochs with a checkpoint alone.
    blocked = result.history.throughput[BLOCKED]
    assert blocked.shape == (4,) and np.isfinite(blocked).all()
    assert (blocked[[0, 2]] == 0).all() and (blocked[[1, 3]] > 0).all()
    assert blocked.sum() < result.history.wall_time
    assert_trees_equal(result.model, full.model)

    def fit(**more):
        return eqfit.fit(model, data, **more, **kwargs)

    assert_resumes_from_the_one_before_the_newest(tmp_path, policy, full, fit)


@pytest.mark.parametrize("background, held", WAYS)
def test_a_checkpoint_due_while_the_last_is_written_waits_for_it_and_says_so_once(
    getkey, tmp_path, background, held
):
    """Each of the first writes is held until the next checkpoint says that it waits for
    it: three waits (two in the background, whose last checkpoint, the training over, is
    queued behind the write before it), said as a warning once, then at the DEBUG level.
    """
    model, data, kwargs = small_run(getkey)
    full = eqfit.fit(model, data, **kwargs)
    policy = eqfit.Checkpoint(tmp_path, every_epochs=1, background=background)
    # `None`, the default: in the background on a GPU or TPU, in the training thread on a CPU.
    in_background = background or (background is None and jax.default_backend() != "cpu")
    waited = 2 if in_background else 3
    with SlowDisk(tmp_path, held, held=waited) as disk, WaitsReleased(disk) as waits:
        result = eqfit.fit(model, data, checkpoint=policy, **kwargs)
        eqfit.wait_for_checkpoints()

    levels = [record.levelno for record in waits.records]
    assert levels == [logging.WARNING] + [logging.DEBUG] * (waited - 1)
    steps = result.history.step_loss.shape[1]
    first = waits.records[0].getMessage()
    assert f"The checkpoint at step {2 * steps} waits for the write of the one at step " in first
    assert f"{steps}, which is still going: training waits for it" in first
    assert str(tmp_path) in first and "give `Checkpoint` a longer period" in first
    blocked = result.history.throughput[BLOCKED]
    assert blocked.shape == (4,) and np.isfinite(blocked).all() and (blocked > 0).all()
    assert checkpoints(tmp_path) == ["ckpt-000003-000000", "ckpt-000004-000000"]
    assert_trees_equal(result.model, full.model)

    def fit(**more):
        return eqfit.fit(model, data, **more, **kwargs)

    assert_resumes_from_the_one_before_the_newest(tmp_path, policy, full, fit)


def test_a_run_without_checkpoints_has_no_blocked_seconds(getkey):
    model, data, kwargs = small_run(getkey)
    throughput = eqfit.fit(model, data, **kwargs).history.throughput
    assert "epoch_seconds" in throughput and BLOCKED not in throughput


@pytest.mark.slow
@pytest.mark.parametrize("background", [True, None], ids=["background", "default"])
def test_orbax_checkpoints_are_digested_and_committed_beside_the_training(
    getkey, tmp_path, background
):
    """Under `shard=`: the SHA-256 of Orbax's files (which fsyncs them) and the commit run
    in the writer's thread, and the training goes on while a slow disk holds the commit.
    """
    pytest.importorskip("orbax.checkpoint")
    data = regression_data(getkey(), 128, features=8)
    model = eqfit.models.MLP(8, "scalar", 16, 1, key=getkey())
    mesh = Mesh(np.array(jax.devices()), ("data",))
    kwargs = dict(
        loss=eqfit.losses.mse,
        key=getkey(),
        epochs=4,
        batch_size=32,
        optimizer=optax.sgd(0.05),
        mesh=mesh,
        shard=eqfit.sharding.fsdp("data", min_bytes=0),
    )
    full = eqfit.fit(model, data, **kwargs)
    policy = eqfit.Checkpoint(tmp_path, every_epochs=2, background=background)
    seen: dict[int, tuple[list[str], int]] = {}

    with SlowDisk(tmp_path, "manifest.json", held=1) as disk:

        class Watch:
            def on_epoch_end(self, epoch, logs):
                seen[epoch] = (checkpoints(tmp_path), threading.get_ident())
                if epoch == 3:
                    disk.release()

        result = eqfit.fit(model, data, checkpoint=policy, callbacks=[Watch()], **kwargs)
        # Under `shard=` `fit` returns with its last write committed, in the background too.
        assert checkpoints(tmp_path) == ["ckpt-000002-000000", "ckpt-000004-000000"]

    assert seen[2][0] == [] and seen[3][0] == []
    training = seen[1][1]
    # Each file of Orbax's was read (for its digest) by a thread that is not the training's.
    state = tmp_path / "ckpt-000004-000000" / "state"
    files = [p.relative_to(state).as_posix() for p in state.rglob("*") if p.is_file()]
    assert files  # Orbax's
    for file in files:
        assert any(
            path.endswith("/state/" + file) and mode == "r" and thread != training
            for path, mode, thread in disk.opened
        ), file
    assert training not in disk.writes("manifest.json")
    assert (result.history.throughput[BLOCKED][[1, 3]] > 0).all()
    assert_trees_equal(result.model, full.model)

    def fit(**more):
        return eqfit.fit(model, data, **more, **kwargs)

    assert_resumes_from_the_one_before_the_newest(tmp_path, policy, full, fit)


def test_fit_returns_while_its_last_checkpoint_is_written_in_the_background(
    getkey, tmp_path, capsys
):
    """In the background (a GPU's or TPU's default) `fit` returns once its last checkpoint's
    state is copied, as Orbax's asynchronous checkpoints do: the last checkpoint is queued
    behind the write in flight, the writes go on, and a `fit` that reads the directory and
    `wait_for_checkpoints` wait for them.
    """
    model, data, kwargs = small_run(getkey)
    full = eqfit.fit(model, data, **kwargs)
    policy = eqfit.Checkpoint(tmp_path, every_epochs=2, background=True)
    told: list[int] = []

    class Told:
        def on_epoch_end(self, epoch, logs):
            told.append(epoch)

    with SlowDisk(tmp_path, "state.eqx", held=1):  # epoch 2's write, held to the block's end
        result = eqfit.fit(model, data, checkpoint=policy, progress="lines", **kwargs)
        assert checkpoints(tmp_path) == []  # returned, the last queued behind the held write
    # The log's last line names the checkpoint being written.
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("training done at epoch 4/4")
    assert last.endswith(f"checkpoint: {tmp_path / 'ckpt-000004-000000'} (being written)")
    # The held write let through as the block closed: `fit` again waits for both, and
    # resumes from the last: the run is whole, no epoch is trained (none told).
    again = eqfit.fit(model, data, checkpoint=policy, callbacks=[Told()], **kwargs)
    assert told == []
    assert checkpoints(tmp_path) == ["ckpt-000002-000000", "ckpt-000004-000000"]
    eqfit.wait_for_checkpoints()
    assert_trees_equal(result.model, full.model)
    assert_trees_equal(again.model, full.model)


def test_a_run_stopped_early_names_the_checkpoint_its_last_write_makes(tmp_path, capsys):
    """A run that early stopping ends while its writes go on in the background: the host
    has queued a call past the stop (calls go ahead of the reads, where a step takes a
    while), whose checkpoint holds the state at the stop. The log's last line names the
    folder that write makes, of the step the run stopped at, and it is there once written.
    """
    model = eqfit.models.MLP(2, "scalar", 1024, 3, key=jax.random.key(0))  # steps of a while
    policy = eqfit.Checkpoint(tmp_path, background=True)
    with SlowDisk(tmp_path, "state.eqx", held=0, seconds=0.3):  # each write outlasts a call
        fit_stopped_after_two_epochs(model, checkpoint=policy, progress="lines")
        eqfit.wait_for_checkpoints(tmp_path)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("training stopped early (early_stopping) at epoch 2/10, step 6/30")
    named = Path(re.search(r"checkpoint: (\S+)", last).group(1))
    assert named == tmp_path / "ckpt-000002-000000", last
    assert checkpoints(tmp_path)[-1] == named.name


@pytest.mark.parametrize("every", [4, 2], ids=["the last", "the one before it"])
def test_a_last_write_that_fails_after_fit_returned_is_logged_and_raised_by_the_wait(
    getkey, tmp_path, caplog, every
):
    """The last write fails, or the one before it, which the last waits behind: either way
    the last is not written, the log says so, and `wait_for_checkpoints` raises the error.
    """
    model, data, kwargs = small_run(getkey)
    policy = eqfit.Checkpoint(tmp_path, every_epochs=every, background=True)
    with caplog.at_level(logging.ERROR, logger="eqfit"):
        with SlowDisk(tmp_path, "state.eqx", held=1, fails=True) as disk:
            result = eqfit.fit(model, data, checkpoint=policy, **kwargs)  # the training's whole
            disk.release()
            with pytest.raises(eqfit.CheckpointError, match="Read-only file system"):
                eqfit.wait_for_checkpoints(tmp_path)
    eqfit.wait_for_checkpoints()  # raised once
    assert checkpoints(tmp_path) == [] and result.history.step_loss.shape[0] == 4
    (record,) = [r for r in caplog.records if "failed after `fit` returned" in r.message]
    assert record.levelno == logging.ERROR and str(tmp_path) in record.message
    assert "ckpt-000004-000000 was not written" in record.message


EXITS_AT_ONCE = textwrap.dedent(
    """
    import os, sys, time
    import jax, numpy as np, optax
    import eqfit

    directory = sys.argv[1]

    def slow_last_write(event, args):  # the last state's file opened a second late
        if event == "open" and isinstance(args[0], str) and args[0].startswith(directory):
            if args[0].endswith("state.eqx") and "w" in str(args[1]):
                slow_last_write.seen += 1
                if slow_last_write.seen == 3:
                    time.sleep(1.0)

    slow_last_write.seen = 0
    sys.addaudithook(slow_last_write)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=jax.random.key(0))
    eqfit.fit(model, (x, x.sum(1)), loss=eqfit.losses.mse, optimizer=optax.adam(1e-2),
              key=jax.random.key(1), epochs=3, batch_size=16,
              checkpoint=eqfit.Checkpoint(directory, background=True))
    print("returned with", sorted(p for p in os.listdir(directory) if p.startswith("ckpt")))
    """
)


@pytest.mark.slow
def test_the_process_exit_waits_for_the_last_write_going_on(tmp_path):
    """A script that ends as `fit` returns, its last write still going: the exit waits for
    it, and the checkpoint is whole.
    """
    directory = str(tmp_path) + os.sep
    done = subprocess.run(
        [sys.executable, "-c", EXITS_AT_ONCE, directory],
        env=worker_env(Path(__file__).parent),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ckpt-000003-000000" not in done.stdout  # it returned before the last was written
    assert checkpoints(tmp_path) == ["ckpt-000002-000000", "ckpt-000003-000000"]
    manifest = json.loads((tmp_path / "ckpt-000003-000000" / "manifest.json").read_text())
    state = (tmp_path / "ckpt-000003-000000" / "state.eqx").read_bytes()
    assert manifest["crc32"] == f"{zlib.crc32(state):08x}"
