"""Long runs: checkpoint policies (by steps, by time, the best kept), checkpoints inside an
epoch that resume bit for bit on every kind of data and placement, and the errors a policy
or a signal set can make. The signals themselves, SIGKILL and two processes are in the
heavy tests at the end.
"""

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, Recorder, worker_env

import eqfit


HERE = Path(__file__).parent
ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs
OVERSHOOTS = optax.sgd(0.2)
N, BATCH = 200, 16  # 13 steps an epoch: 12 of 16 samples, then one of 8


def arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32) + np.sin(x[:, 0])
    return x, y


class Batches:
    """A loader: the same batches every pass (with `len`, or without)."""

    def __init__(self, with_len):
        self.x, self.y = arrays()
        self.with_len = with_len

    def __iter__(self):
        for start in range(0, N, BATCH):
            yield self.x[start : start + BATCH], self.y[start : start + BATCH]

    def __len__(self):
        if not self.with_len:
            raise TypeError("no len")
        return -(-N // BATCH)


class Unsized:
    """A re-iterable loader that does not say its length."""

    def __init__(self):
        self.batches = Batches(True)

    def __iter__(self):
        return iter(self.batches)


def data_of(kind, tmp_path):
    x, y = arrays()
    if kind == "arrays":
        return x, y
    if kind == "memmap":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "y.npy", y)
        return np.load(tmp_path / "x.npy", mmap_mode="r"), np.load(
            tmp_path / "y.npy", mmap_mode="r"
        )
    if kind == "loader":
        return Batches(True)
    return Unsized()


def train(data, epochs=4, optimizer=ADAM, model=None, **kwargs):
    x, y = arrays()
    if model is None:
        model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(1))
    return eqfit.fit(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=optimizer,
        key=jax.random.key(2),
        epochs=epochs,
        batch_size=BATCH,
        validation_data=(x[:40], y[:40]),
        **kwargs,
    )


def folders(directory):
    return sorted(p.name for p in Path(directory).glob("ckpt-*"))


def position(name, steps_per_epoch):
    _, epoch, step = name.split("-")
    return int(epoch) * steps_per_epoch + int(step)


def assert_same_run(a, b):
    assert_trees_equal(a.model, b.model)
    assert_trees_equal(a.opt_state, b.opt_state)
    np.testing.assert_array_equal(a.history.step_loss, b.history.step_loss)
    for name in ("loss", "val_loss"):
        np.testing.assert_array_equal(a.history[name], b.history[name])


def resume_from(tmp_path, name, **kwargs):
    """A run resumed from the checkpoint `name` of `tmp_path / "all"`, alone in a new
    directory.
    """
    alone = tmp_path / name
    shutil.copytree(tmp_path / "all" / name, alone / name)
    return train(**kwargs, checkpoint=eqfit.Checkpoint(alone, every_steps=5))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, progress, background",
    [
        ("arrays", False, None),
        pytest.param("arrays", True, None, marks=pytest.mark.heavy),
        ("memmap", False, None),
        pytest.param("loader", True, None, marks=pytest.mark.heavy),
        ("unsized", False, None),
        ("arrays", True, True),  # the default here is the training thread (a CPU)
        ("unsized", False, True),
    ],
)
def test_a_checkpoint_inside_an_epoch_resumes_bit_for_bit(tmp_path, kind, progress, background):
    whole = train(data_of(kind, tmp_path), progress=progress)
    policy = eqfit.Checkpoint(
        tmp_path / "all", every_epochs=None, every_steps=5, keep=100, background=background
    )
    checkpointed = train(data_of(kind, tmp_path), progress=progress, checkpoint=policy)
    eqfit.wait_for_checkpoints()  # in the background, the last write goes on after `fit`
    assert_same_run(checkpointed, whole)  # checkpoints change nothing
    names = folders(tmp_path / "all")
    positions = [position(n, 13) for n in names]
    # Every 5 steps, and at the run's end (52). A loader without `len` writes none while
    # its first epoch teaches its length (here read whole, ahead, by the first call's end).
    expected = [*range(5, 52, 5), 52]
    if kind == "unsized":
        assert set(expected[2:]) <= set(positions) <= set(expected)
    else:
        assert positions == expected
    inside = [n for n, p in zip(names, positions) if p % 13 and p > 13]
    assert inside
    for name in (inside[0], inside[-1]):  # in epoch 2, and in the last
        resumed = resume_from(tmp_path, name, data=data_of(kind, tmp_path), progress=progress)
        assert_same_run(resumed, whole)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [
        "arrays",
        "unsized",
        *(pytest.param(k, marks=pytest.mark.heavy) for k in ("memmap", "loader")),
    ],
)
def test_a_finished_run_resumed_with_more_epochs_equals_the_longer_run(tmp_path, kind):
    # The commonest resume: a run trained for longer once it ended. Validations every 5
    # steps too, which the state keeps a row each of, as it keeps each epoch's record.
    every = {"validation_every": 5} if kind != "unsized" else {}
    longer = train(data_of(kind, tmp_path), epochs=4, **every)
    directory = tmp_path / "run"
    shorter = train(data_of(kind, tmp_path), epochs=2, checkpoint=directory, **every)
    assert shorter.history.epochs == 2
    told = Recorder()
    grown = train(
        data_of(kind, tmp_path), epochs=4, checkpoint=directory, callbacks=[told], **every
    )
    assert [n for what, n, _ in told.told if what == "epoch"] == [
        3,
        4,
    ]  # continued, not anew (from 1)
    assert_same_run(grown, longer)
    assert grown.history.epochs == 4
    np.testing.assert_array_equal(grown.history.batch_sizes, longer.history.batch_sizes)
    for name, values in longer.history.validations.items():
        np.testing.assert_array_equal(grown.history.validations[name], values)
    # The checkpoints it wrote are of the longer run: resumed, it has nothing to do.
    assert position(folders(directory)[-1], 13) == 52
    assert_same_run(train(data_of(kind, tmp_path), epochs=4, checkpoint=directory, **every), longer)


def test_a_run_resumed_with_fewer_epochs_or_more_changed_is_refused(tmp_path):
    x, y = arrays()
    train((x, y), epochs=3, checkpoint=tmp_path)
    with pytest.raises(
        ValueError, match=r"What differs: epochs: checkpoint \[0, 3\], now \[0, 2\]"
    ):
        train((x, y), epochs=2, checkpoint=tmp_path)
    with pytest.raises(ValueError, match=r"epochs: .*; shuffle: .*more `epochs` continues"):
        train((x, y), epochs=5, checkpoint=tmp_path, shuffle=False)


@pytest.mark.heavy  # several devices: CI runs it, the README's command leaves it out
@pytest.mark.parametrize("place", ["devices", "mesh"])
def test_a_checkpoint_inside_an_epoch_resumes_on_several_devices(tmp_path, place):
    x, y = arrays()
    if place == "devices":
        where = {"devices": 2}
    else:
        where = {"mesh": jax.sharding.Mesh(np.array(jax.devices()), ("batch",))}
    whole = train((x, y), epochs=3, **where)
    policy = eqfit.Checkpoint(tmp_path / "all", every_epochs=None, every_steps=6, keep=100)
    assert_same_run(train((x, y), epochs=3, checkpoint=policy, **where), whole)
    resumed = resume_from(tmp_path, "ckpt-000001-000005", data=(x, y), epochs=3, **where)
    assert_same_run(resumed, whole)


@pytest.mark.heavy  # Orbax's writes take a while
def test_a_checkpoint_inside_an_epoch_resumes_under_shard(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    x, y = arrays()
    where = {
        "mesh": jax.sharding.Mesh(np.array(jax.devices()), ("batch",)),
        "shard": eqfit.sharding.fsdp("batch", min_bytes=0),
    }
    whole = train((x, y), epochs=2, **where)
    policy = eqfit.Checkpoint(tmp_path / "all", every_epochs=None, every_steps=6, keep=100)
    assert_same_run(train((x, y), epochs=2, checkpoint=policy, **where), whole)
    assert (tmp_path / "all" / "ckpt-000001-000005" / "state").is_dir()  # Orbax's format
    resumed = resume_from(tmp_path, "ckpt-000001-000005", data=(x, y), epochs=2, **where)
    assert_same_run(resumed, whole)


@pytest.mark.slow
@pytest.mark.parametrize("how", [pytest.param("shard", marks=pytest.mark.heavy), "ensemble"])
def test_a_sharded_or_ensembled_run_grows_as_the_longer_run(tmp_path, how):
    # Orbax's checkpoints read straight into the layout of the state, and an ensemble's
    # record has its members first: the rows of the epochs added go after theirs alike.
    x, y = arrays()
    if how == "shard":
        pytest.importorskip("orbax.checkpoint")
        where = {
            "mesh": jax.sharding.Mesh(np.array(jax.devices()), ("batch",)),
            "shard": eqfit.sharding.fsdp("batch", min_bytes=0),
        }
    else:
        keys = jax.random.split(jax.random.key(1), 2)
        members = eqx.filter_vmap(lambda k: eqfit.models.MLP(3, "scalar", 8, 1, key=k))(keys)
        where = {"ensemble": True, "devices": 2, "model": members}
    longer = train((x, y), epochs=3, **where)
    train((x, y), epochs=1, checkpoint=tmp_path, **where)
    told = Recorder()
    grown = train((x, y), epochs=3, checkpoint=tmp_path, callbacks=[told], **where)
    assert [n for what, n, _ in told.told if what == "epoch"] == [2, 3]
    assert_same_run(grown, longer)


@pytest.mark.parametrize("background", [None, True])
def test_keep_best_keeps_the_best_epoch_beside_the_newest(tmp_path, background):
    x, y = arrays()
    # A rate that overshoots: the validation loss does not fall every epoch.
    policy = eqfit.Checkpoint(tmp_path, keep=1, keep_best="val_loss", background=background)
    result = train((x, y), epochs=8, checkpoint=policy, optimizer=OVERSHOOTS)
    eqfit.wait_for_checkpoints()
    losses = result.history.val_loss
    best = int(np.argmin(losses)) + 1
    expected = {f"ckpt-{best:06d}-000000", "ckpt-000008-000000"}
    assert set(folders(tmp_path)) == expected
    manifest = json.loads((tmp_path / f"ckpt-{best:06d}-000000" / "manifest.json").read_text())
    assert manifest["monitor"] == {"name": "val_loss", "value": float(losses[best - 1])}


def test_keep_best_with_mode_max_and_a_step_policy(tmp_path):
    x, y = arrays()
    policy = eqfit.Checkpoint(
        tmp_path, every_epochs=None, every_steps=4, keep=2, keep_best="val_loss", mode="max"
    )
    result = train((x, y), epochs=5, checkpoint=policy)
    worst = int(np.argmax(result.history.val_loss)) + 1
    names = folders(tmp_path)
    assert f"ckpt-{worst:06d}-000000" in names
    newest = sorted(names, key=lambda n: position(n, 13))[-2:]
    assert position(newest[-1], 13) == 65 and len(set(names) - set(newest)) <= 1


def test_every_seconds_writes_inside_epochs(tmp_path):
    x, y = arrays()
    # Calls grow 1, 2, 4, ... steps at first (where no run of the configuration, of any
    # epochs, has shown its speed: none, once the cache is cleared); a period shorter
    # than any of them makes a checkpoint at the end of each.
    eqfit.clear_cache()
    policy = eqfit.Checkpoint(tmp_path, every_epochs=None, every_seconds=1e-6, keep=100)
    result = train((x, y), epochs=2, checkpoint=policy, progress=True)
    positions = [position(n, 13) for n in folders(tmp_path)]
    assert positions[-1] == 26 and len(positions) >= 3
    assert any(p % 13 for p in positions)
    resumed = train((x, y), epochs=2, checkpoint=policy, progress=True)
    assert_same_run(resumed, result)  # the run was over: resumed, it trains nothing more


class SeesCheckpoints:
    """A callback that notes, at each epoch's end, whether its checkpoint is there."""

    def __init__(self, directory):
        self.directory, self.seen = directory, []

    def on_epoch_end(self, epoch, logs):
        self.seen.append((self.directory / f"ckpt-{epoch:06d}-000000").is_dir())


@pytest.mark.parametrize("background", [None, False, True])
def test_background_says_which_thread_writes(tmp_path, monkeypatch, background):
    """With `False` a checkpoint is written and committed in the training thread before
    training goes past its step, so the callback of its epoch sees it; by default on the
    CPU backend the training thread writes the state's file and a thread commits it
    (waits for the disk, renames it); with `True` a background thread does all of it.
    Every one is committed before `fit` returns; in the background, but the last, whose
    write `wait_for_checkpoints` waits for.
    """
    from eqfit._keep._checkpoint import Checkpoints

    writes, commits = [], []

    def noted(method, threads):
        def call(self, *args, **kwargs):
            threads.append(threading.current_thread() is threading.main_thread())
            return method(self, *args, **kwargs)

        return call

    monkeypatch.setattr(Checkpoints, "_write_state", noted(Checkpoints._write_state, writes))
    monkeypatch.setattr(Checkpoints, "_commit", noted(Checkpoints._commit, commits))
    x, y = arrays()
    directory = tmp_path / "run"
    policy = eqfit.Checkpoint(directory, keep=100, background=background)
    sees = SeesCheckpoints(directory)
    result = train((x, y), epochs=4, checkpoint=policy, callbacks=[sees])
    eqfit.wait_for_checkpoints()
    assert_same_run(result, train((x, y), epochs=4))
    assert folders(directory) == [f"ckpt-{e:06d}-000000" for e in range(1, 5)]
    assert len(writes) == len(commits) == 4
    if background:
        assert not any(writes) and not any(commits)
    elif background is None:
        assert all(writes) and not any(commits)
    else:
        assert all(writes) and all(commits) and sees.seen == [True] * 4


class MovesTheDirectory:
    """A callback that moves the checkpoint directory away after the first epoch, so
    that every later write fails.
    """

    def __init__(self, directory):
        self.directory = directory

    def on_epoch_end(self, epoch, logs):
        if epoch == 1:
            self.directory.rename(self.directory.with_name("moved"))


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_write_raises_with_the_result_in_either_thread(tmp_path, background):
    x, y = arrays()
    directory = tmp_path / "run"
    policy = eqfit.Checkpoint(directory, background=background)
    with pytest.raises(eqfit.CheckpointError, match=r"Cannot write the checkpoint") as caught:
        train((x, y), epochs=6, checkpoint=policy, callbacks=[MovesTheDirectory(directory)])
    result = caught.value.result
    assert result is not None and 1 <= result.history.epochs < 6


def test_checkpoint_every_is_a_policy_of_epochs(tmp_path):
    x, y = arrays()
    train((x, y), epochs=4, checkpoint=tmp_path, checkpoint_every=2)
    assert folders(tmp_path) == ["ckpt-000002-000000", "ckpt-000004-000000"]


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ({"every_epochs": None}, ValueError, "no policy"),
        ({"every_steps": 0}, ValueError, "`every_steps` must be a whole number of 1 or more"),
        ({"every_epochs": -1}, ValueError, "`every_epochs` must be"),
        ({"every_seconds": 0.0}, ValueError, "`every_seconds` must be a number of seconds"),
        ({"every_seconds": float("nan")}, ValueError, "`every_seconds`"),
        ({"keep": 0}, ValueError, "`keep` must be a whole number of 1 or more"),
    ],
)
def test_a_bad_policy_is_refused_naming_its_argument(tmp_path, arguments, error, match):
    with pytest.raises(error, match=match):
        eqfit.Checkpoint(tmp_path, **arguments)


@pytest.mark.parametrize("arguments", [{"mode": "lowest"}, {"keep_best": 3}, {"background": "yes"}])
def test_a_policy_of_the_wrong_type_is_refused_naming_its_argument(tmp_path, arguments):
    # Under the suite's runtime type checks (jaxtyping's hook) the annotation refuses it
    # first; without them, the policy's own check, with its message.
    (name,) = arguments
    with pytest.raises((ValueError, TypeError), match=name):
        eqfit.Checkpoint(tmp_path, **arguments)


def test_bad_checkpoint_and_signal_arguments_are_refused_before_training(tmp_path):
    x, y = arrays()
    unknown = eqfit.Checkpoint(tmp_path, keep_best="val_accuracy")
    with pytest.raises(ValueError, match=r"`keep_best` is 'val_accuracy', which this run"):
        train((x, y), checkpoint=unknown)
    no_validation = eqfit.Checkpoint(tmp_path, keep_best="val_loss")
    with pytest.raises(ValueError, match="Give `validation_data` or `validation_split`"):
        eqfit.fit(
            eqfit.models.LinearRegression(3, key=jax.random.key(0)),
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=ADAM,
            key=jax.random.key(0),
            checkpoint=no_validation,
        )
    with pytest.raises(ValueError, match="`checkpoint_every` with a `Checkpoint`"):
        train((x, y), checkpoint=eqfit.Checkpoint(tmp_path), checkpoint_every=3)
    with pytest.raises(ValueError, match="`signals` holds 'SIGNOPE', which is not a signal"):
        train((x, y), signals=("SIGNOPE",))
    with pytest.raises(ValueError, match="`signals` holds SIGKILL, which no process can catch"):
        train((x, y), signals=("SIGKILL",))
    with pytest.raises(TypeError, match="argument `checkpoint` has the wrong type"):
        train((x, y), checkpoint=3)
    assert folders(tmp_path) == []  # nothing trained, nothing written


# The signals, in processes of their own.


def start(directory, *extra):
    return subprocess.Popen(
        [sys.executable, str(HERE / "checkpoint_worker.py"), str(directory), *extra],
        env=worker_env(HERE),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(process, text, timeout=120):
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        if line.startswith(text):
            return line
        assert time.monotonic() < deadline, f"no {text!r} in time"
    pytest.fail(f"the worker ended without {text!r}: {process.stderr.read()[-3000:]}")


@pytest.mark.heavy
@pytest.mark.parametrize(
    "name, mode, where",
    [
        ("SIGTERM", "compiled", ""),
        ("SIGTERM", "progress", ""),
        ("SIGUSR1", "compiled", ""),
        ("SIGUSR1", "progress", ""),
        ("SIGTERM", "compiled", "background"),
        ("SIGTERM", "compiled", "inthread"),
    ],
)
def test_a_preemption_signal_checkpoints_the_step_reached_and_stops_soon(
    tmp_path, name, mode, where
):
    """An epoch of a million steps: the signal is answered within a call (half a second)
    and the checkpoint's write, not at the epoch's end; the checkpoint is at the step the
    result reached, and a rerun of the same script resumes from it. Written as the CPU's
    default, in the background, or wholly in the training thread.
    """
    with start(tmp_path, mode, "long", *([where] if where else [])) as process:
        wait_for(process, "starting")
        time.sleep(4)  # compiled, and training
        process.send_signal(getattr(signal, name))
        sent = time.monotonic()
        out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err[-3000:]
    answered = float(out.split("answered at ")[1].split()[0]) - sent
    assert 0 < answered < 2.5, answered  # a call and the write
    words = out.split("interrupted after ")[1].split()
    steps, by = int(words[2]), words[5]
    assert by == name and 0 < steps < 10**6
    (newest,) = folders(tmp_path)[-1:]
    assert newest == f"ckpt-000000-{steps:06d}"


@pytest.mark.heavy
def test_signals_switched_off_leave_sigterm_to_kill(tmp_path):
    with start(tmp_path, "compiled", "long", "nosignals") as process:
        wait_for(process, "starting")
        time.sleep(4)
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM


@pytest.mark.heavy
def test_sigkill_at_random_points_of_a_run_checkpointed_every_few_steps(tmp_path):
    """Killed at random moments (during writes too), or stopped by SIGTERM (which
    checkpoints the step reached, between the every-7-steps ones), rerun each time, two
    rounds with each way of writing: the CPU's default (the state's file in the training
    thread, its commit in a thread), wholly in the training thread (`background=False`),
    and in the background. The run that finishes at last equals the uninterrupted one
    bit for bit.
    """
    from shared_problem import checkpoint_problem

    rng = np.random.default_rng(0)
    kills = terms = 0
    for round in range(6):
        name = "SIGTERM" if round % 2 else "SIGKILL"
        # SIGKILL in rounds 0, 2 and 4: one in each way of writing, as SIGTERM
        where = [[], [], ["inthread"], ["inthread"], ["background"], ["background"]][round]
        # 200 epochs, about 25 s of steps and writes here: six rounds of at most 4 s each
        # never reach the end (with 40, a fast machine finished before the second kill).
        with start(tmp_path, "compiled", "steps", "7", "epochs", "200", *where) as process:
            wait_for(process, "starting")
            time.sleep(float(rng.uniform(1.5, 4.0)))
            if process.poll() is not None:  # the run finished first (its pipes close here)
                break
            process.send_signal(getattr(signal, name))
            out, err = process.communicate(timeout=30)
        if name == "SIGKILL":
            kills += 1
        elif process.returncode == 3:  # else it finished before the signal came
            assert "by SIGTERM" in out, err[-3000:]
            terms += 1
    assert kills >= 2 and terms >= 1
    with start(tmp_path, "compiled", "steps", "7", "epochs", "200") as process:
        out, err = process.communicate(timeout=300)
    assert "finished" in out, err[-3000:]
    model, data, kwargs = checkpoint_problem(epochs=200)
    resumed = eqfit.fit(model, data, checkpoint=eqfit.Checkpoint(tmp_path, every_steps=7), **kwargs)
    reference = eqfit.fit(model, data, **kwargs)
    assert_trees_equal(resumed.model, reference.model)
    assert_trees_equal(resumed.opt_state, reference.opt_state)
    np.testing.assert_array_equal(resumed.history.step_loss, reference.history.step_loss)
    np.testing.assert_array_equal(resumed.history.val_loss, reference.history.val_loss)
