"""Checkpoints that never lose the newest good state, exact resume after SIGKILL or Ctrl-C,
Ctrl-C on every path, and refusing what cannot be written or read.
"""

import contextlib
import hashlib
import itertools
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, regression_data, worker_env
from shared_problem import checkpoint_problem

import eqfit


HERE = Path(__file__).parent
ADAM = optax.adam(1e-2)


def worker(directory, mode, *extra):
    env = worker_env(HERE)
    return subprocess.Popen(
        [sys.executable, str(HERE / "checkpoint_worker.py"), str(directory), mode, *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def checkpoints(directory):
    return sorted(p.name for p in Path(directory).glob("ckpt-*"))


def wait_for(process, text, timeout=120):
    """Reads the worker's lines until one starts with `text`."""
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        if line.startswith(text):
            return line
        assert time.monotonic() < deadline, f"no {text!r} in time"
    pytest.fail(f"the worker ended without {text!r}: {process.stderr.read()[-3000:]}")


@pytest.fixture(scope="module")
def uninterrupted():
    model, data, kwargs = checkpoint_problem()
    return eqfit.fit(model, data, **kwargs)


@pytest.mark.heavy
def test_resume_after_sigkill_is_bitwise_equal(tmp_path, uninterrupted):
    with worker(tmp_path, "compiled") as process:
        wait_for(process, "epoch 3")
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
    killed_at = checkpoints(tmp_path)[-1]
    assert killed_at < "ckpt-000200", "the run finished before it was killed"
    model, data, kwargs = checkpoint_problem()
    resumed = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(resumed.model, uninterrupted.model)
    assert_trees_equal(resumed.opt_state, uninterrupted.opt_state)
    np.testing.assert_array_equal(resumed.history.val_loss, uninterrupted.history.val_loss)
    np.testing.assert_array_equal(resumed.history.step_loss, uninterrupted.history.step_loss)
    assert checkpoints(tmp_path) == ["ckpt-000199-000000", "ckpt-000200-000000"]  # the last 2


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["compiled", "progress"])
@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_ctrl_c_stops_at_the_step_reached_with_the_result(
    tmp_path, uninterrupted, mode, with_checkpoint
):
    directory = tmp_path if with_checkpoint else "-"
    with worker(directory, mode) as process:
        wait_for(process, "epoch 2")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err[-3000:]
    words = out.split("interrupted after ")[1].split()
    epochs, steps, by = int(words[0]), int(words[2]), words[5]
    assert 2 <= epochs < 200 and by == "SIGINT"  # the result so far
    if with_checkpoint:  # written at the very step it stopped at, inside an epoch or not
        per_epoch = uninterrupted.history.step_loss.shape[1]
        epoch, step = divmod(steps, per_epoch)
        assert checkpoints(tmp_path)[-1] == f"ckpt-{epoch:06d}-{step:06d}"
        model, data, kwargs = checkpoint_problem()
        resumed = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
        assert_trees_equal(resumed.model, uninterrupted.model)
        np.testing.assert_array_equal(resumed.history.step_loss, uninterrupted.history.step_loss)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["compiled", "progress"])
@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_a_second_ctrl_c_stops_at_once(tmp_path, mode, with_checkpoint):
    """Epochs of minutes: the first Ctrl-C would wait for the epoch's end; the second
    stops at once, with the training so far, and the process exits cleanly.
    """
    with worker(tmp_path if with_checkpoint else "-", mode, "long") as process:
        wait_for(process, "starting")
        time.sleep(3)  # compiled, and training
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)  # a person's second press: two at once merge into one signal
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        process.communicate(timeout=60)
        assert time.monotonic() - sent < 2.0
    assert process.returncode == 3, process.returncode  # `TrainingInterrupted`, no abort


@pytest.mark.heavy
def test_a_directory_in_use_is_refused_naming_its_holder(tmp_path):
    with worker(tmp_path, "compiled") as process:
        wait_for(process, "epoch 2")
        model, data, kwargs = checkpoint_problem()
        with pytest.raises(
            eqfit.CheckpointError, match=rf"in use by another run \(pid {process.pid}"
        ):
            eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
        process.kill()


@pytest.mark.heavy
@pytest.mark.parametrize("where", ["default", "background"])
def test_a_full_disk_is_an_error_naming_the_directory_and_bytes(tmp_path, where):
    flags = ["background"] if where == "background" else []
    with worker(tmp_path, "compiled", "limit", str(2**14), *flags) as process:
        out, err = process.communicate(timeout=120)
    assert process.returncode == 4, err[-3000:]
    assert f"The checkpoint directory {tmp_path} has no room for a checkpoint of" in out
    # What it had trained goes with the error: written in the training thread (the
    # default on a CPU), the first write failed at its step; in the background, while
    # training went on, and stopped it at the end of the call after it.
    epochs = ["(result: 1 epochs)"] + (["(result: 2 epochs)"] if flags else [])
    assert any(e in out for e in epochs), out[-3000:]
    assert not list(tmp_path.glob(".tmp-*"))  # and no litter


@pytest.mark.heavy
def test_a_read_only_directory_is_refused_before_training():
    parent = Path(tempfile.mkdtemp())
    try:
        parent.chmod(0o755)
        directory = parent / "read-only"
        directory.mkdir(mode=0o555)
        directory.chmod(0o555)
        started = time.monotonic()
        with worker(directory, "compiled", "nobody") as process:
            out, err = process.communicate(timeout=120)
        assert process.returncode == 4, err[-3000:]
        assert f"Cannot write to the checkpoint directory {directory}" in out
        assert "training has not started" in out and "epoch 1" not in out
        assert time.monotonic() - started < 60
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def small_run(getkey):
    data = regression_data(getkey(), 100)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    kwargs = dict(loss=eqfit.losses.mse, key=getkey(), epochs=4, batch_size=16, optimizer=ADAM)
    return model, data, kwargs


def without_sequence(folder):
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["sequence"]
    (folder / "manifest.json").write_text(json.dumps(manifest))


def flip_a_byte(folder):
    """One bit of the state changed, its length kept: only the checksum can tell."""
    data = bytearray((folder / "state.eqx").read_bytes())
    data[len(data) // 2] ^= 1
    (folder / "state.eqx").write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated state": lambda folder: (folder / "state.eqx").write_bytes(b"\0" * 10),
    "a byte flipped": flip_a_byte,
    "no state": lambda folder: (folder / "state.eqx").unlink(),
    "manifest not JSON": lambda folder: (folder / "manifest.json").write_text("{"),
    "manifest []": lambda folder: (folder / "manifest.json").write_text("[]"),
    "manifest null": lambda folder: (folder / "manifest.json").write_text("null"),
    "manifest without sequence": without_sequence,
    "no manifest": lambda folder: (folder / "manifest.json").unlink(),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "newest, older",
    [  # each corruption of the newest in the quick suite; with an older one broken too, whole
        (n, o) if n is None or o is None else pytest.param(n, o, marks=pytest.mark.heavy)
        for n, o in itertools.product([None, *CORRUPTIONS], [None, "truncated state"])
    ],
)
def test_no_corruption_loses_a_good_checkpoint(getkey, tmp_path, newest, older):
    """The newest good checkpoint is the one resumed from, whatever is broken around it; a
    broken one is skipped with a warning and never counted among the two kept.
    """
    model, data, kwargs = small_run(getkey)
    full = eqfit.fit(model, data, **kwargs)
    eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    assert checkpoints(tmp_path) == ["ckpt-000003-000000", "ckpt-000004-000000"]
    for name, corruption in (("ckpt-000004-000000", newest), ("ckpt-000003-000000", older)):
        if corruption is not None:
            CORRUPTIONS[corruption](tmp_path / name)
    broken = [c for c in (newest, older) if c is not None]
    warns = pytest.warns(UserWarning, match=r"Skipping checkpoint")
    with warns if broken else contextlib.nullcontext():
        resumed = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(resumed.model, full.model)
    assert_trees_equal(resumed.opt_state, full.opt_state)
    # Broken folders are left for a person to look at, but a later run trained over them
    # and wrote good ones in their place; only an older one the run never reached stays.
    stays = older is not None and newest is None
    with pytest.warns(UserWarning, match=r"ckpt-000003") if stays else contextlib.nullcontext():
        again = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(again.model, full.model)


@pytest.mark.slow
@pytest.mark.parametrize("background", [None, True, False])
def test_a_state_of_arrays_larger_than_the_writes_pieces_is_written_whole(
    getkey, tmp_path, background
):
    """Arrays of 700 x 700 floats (1.9 MiB, not a whole number of the write's pieces):
    the file holds them whole (its CRC32 as the manifest says), and resumes bit for bit.
    """
    data = regression_data(getkey(), 64, features=700)
    model = eqfit.models.MLP(700, "scalar", 700, 1, key=getkey())
    kwargs = dict(loss=eqfit.losses.mse, key=getkey(), epochs=3, batch_size=32, optimizer=ADAM)
    full = eqfit.fit(model, data, **kwargs)
    policy = eqfit.Checkpoint(tmp_path, background=background)
    assert_trees_equal(eqfit.fit(model, data, checkpoint=policy, **kwargs).model, full.model)
    eqfit.wait_for_checkpoints()  # in the background, the last write goes on after `fit`
    newest = tmp_path / "ckpt-000003-000000"
    state = (newest / "state.eqx").read_bytes()
    assert len(state) > 3 * 700 * 700 * 4
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["crc32"] == f"{zlib.crc32(state):08x}"
    shutil.rmtree(newest)  # resumed from epoch 2's, whose checksum is checked
    resumed = eqfit.fit(model, data, checkpoint=policy, **kwargs)
    assert_trees_equal(resumed.model, full.model)
    assert_trees_equal(resumed.opt_state, full.opt_state)


def as_an_earlier_eqfit_wrote_it(folder):
    """The manifest as eqfit wrote it before CRC32s: format 2, a SHA-256 of the state."""
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["crc32"]
    manifest["format"] = 2
    manifest["sha256"] = hashlib.sha256((folder / "state.eqx").read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_checkpoints_carry_a_crc32_and_those_with_a_sha256_still_resume(getkey, tmp_path):
    model, data, kwargs = small_run(getkey)
    full = eqfit.fit(model, data, **kwargs)
    eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    # On a GPU or TPU the writes are in the background: the last may still be written.
    eqfit.wait_for_checkpoints(tmp_path)
    newest, older = tmp_path / "ckpt-000004-000000", tmp_path / "ckpt-000003-000000"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["crc32"] == f"{zlib.crc32((newest / 'state.eqx').read_bytes()):08x}"
    assert "sha256" not in manifest
    for folder in (older, newest):
        as_an_earlier_eqfit_wrote_it(folder)
    resumed = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)  # no warning
    assert_trees_equal(resumed.model, full.model)
    assert_trees_equal(resumed.opt_state, full.opt_state)
    # A SHA-256 is checked as it was: a byte changed skips that checkpoint, and the run
    # resumes from the one before it.
    flip_a_byte(newest)
    match = r"ckpt-000004-000000: its contents do not match the checksum in its manifest"
    with pytest.warns(UserWarning, match=match):
        resumed = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(resumed.model, full.model)
    assert_trees_equal(resumed.opt_state, full.opt_state)


def test_stale_folders_that_sort_last_do_not_evict_new_checkpoints(getkey, tmp_path):
    model, data, kwargs = small_run(getkey)
    for name in ("ckpt-000008-000000", "ckpt-000009-000000"):  # litter from an old run
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "manifest.json").write_text("null")
    (tmp_path / ".tmp-abc").mkdir()  # and a write cut short
    with pytest.warns(UserWarning, match=r"ckpt-00000[89]-000000: its manifest is a JSON NoneType"):
        eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    eqfit.wait_for_checkpoints(tmp_path)  # a GPU's or TPU's last write, in the background
    names = checkpoints(tmp_path)
    assert "ckpt-000003-000000" in names and "ckpt-000004-000000" in names  # kept
    assert not (tmp_path / ".tmp-abc").exists()  # litter removed


def test_checkpoint_every(getkey, tmp_path):
    model, data, kwargs = small_run(getkey)
    kwargs["epochs"] = 5
    eqfit.fit(model, data, checkpoint=tmp_path, checkpoint_every=2, **kwargs)
    eqfit.wait_for_checkpoints(tmp_path)  # a GPU's or TPU's last write, in the background
    assert checkpoints(tmp_path) == ["ckpt-000004-000000", "ckpt-000005-000000"]
    with pytest.raises(ValueError, match=r"`checkpoint_every` must be an integer of 1 or more"):
        eqfit.fit(model, data, checkpoint=tmp_path, checkpoint_every=0, **kwargs)


def test_checkpoint_from_another_configuration_is_refused(getkey, tmp_path):
    model, data, kwargs = small_run(getkey)
    eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=r"different training configuration.*What differs: state"):
        eqfit.fit(model, data, checkpoint=tmp_path, **{**kwargs, "optimizer": optax.sgd(1e-2)})
    with pytest.raises(ValueError, match=r"What differs: data"):
        eqfit.fit(model, regression_data(getkey(), 99), checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=r"What differs: key"):
        eqfit.fit(model, data, checkpoint=tmp_path, **{**kwargs, "key": getkey()})


def test_checkpoint_keeps_early_stopping_state(getkey, tmp_path):
    from test_features import drifting_problem

    model, data, val, loss = drifting_problem()
    kwargs = dict(
        loss=loss,
        optimizer=optax.sgd(0.2),
        key=getkey(),
        epochs=100,
        batch_size=4,
        validation_data=val,
        early_stopping=eqfit.EarlyStopping(patience=2),
    )
    full = eqfit.fit(model, data, **kwargs)
    first = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    again = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    for result in (first, again):
        assert result.history.epochs == full.history.epochs == 4
        assert result.history.best_epoch == 2  # counted from 1
        np.testing.assert_array_equal(result.model.w, full.model.w)


def test_save_and_load(getkey, tmp_path):
    from test_features import batchnorm_loss, BatchNormNet

    model, state = eqx.nn.make_with_state(BatchNormNet)(getkey())
    data = regression_data(getkey(), 64)
    kwargs = dict(loss=batchnorm_loss, optimizer=ADAM, batch_size=16)
    result = eqfit.fit(model, data, state=state, key=getkey(), epochs=2, **kwargs)
    eqfit.save(tmp_path / "run.eqx", result)
    like = eqfit.fit(model, data, state=state, key=getkey(), epochs=0, **kwargs)
    loaded = eqfit.load(tmp_path / "run.eqx", like=like)
    assert_trees_equal(loaded.model, result.model)
    assert_trees_equal(loaded.opt_state, result.opt_state)
    assert_trees_equal(loaded.state, result.state)
    np.testing.assert_array_equal(loaded.history.loss, result.history.loss)
    np.testing.assert_array_equal(loaded.history.batch_sizes, result.history.batch_sizes)
    # Just the model, given a model to fill, or a skeleton with no arrays made (as
    # Equinox's serialisation guide makes one).
    only = eqfit.load(tmp_path / "run.eqx", like=model)
    assert_trees_equal(only, result.model)
    skeleton, _ = eqx.filter_eval_shape(eqx.nn.make_with_state(BatchNormNet), getkey())
    assert not any(eqx.is_array(x) for x in jax.tree.leaves(skeleton))
    assert_trees_equal(eqfit.load(tmp_path / "run.eqx", like=skeleton), result.model)


def test_a_model_of_bfloat16_arrays_resumes_and_loads_as_it_trained(getkey, tmp_path):
    # numpy writes a dtype it does not know by name (bfloat16) as raw bytes, which it
    # reads back as `|V2`: such a checkpoint was skipped as unreadable, and the run
    # trained again from its start.
    model = eqx.nn.MLP(4, "scalar", 8, 1, key=getkey())
    model = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)
    x, y = regression_data(getkey(), 64)

    def loss(m, x, y):
        out = jax.vmap(m)(x.astype(jnp.bfloat16)).astype(jnp.float32)
        return jnp.mean((out - y) ** 2)

    kwargs = dict(loss=loss, optimizer=ADAM, batch_size=16, key=getkey())
    whole = eqfit.fit(model, (x, y), epochs=3, **kwargs)
    eqfit.fit(model, (x, y), epochs=2, checkpoint=tmp_path / "ckpt", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no checkpoint skipped
        resumed = eqfit.fit(model, (x, y), epochs=3, checkpoint=tmp_path / "ckpt", **kwargs)
    assert_trees_equal(resumed.model, whole.model)
    np.testing.assert_array_equal(resumed.history.loss, whole.history.loss)
    eqfit.save(tmp_path / "run.eqx", whole)
    loaded = eqfit.load(tmp_path / "run.eqx", like=model)
    assert jax.tree.leaves(loaded)[0].dtype == jnp.bfloat16
    assert_trees_equal(loaded, whole.model)


def test_load_refuses_what_it_cannot_read(getkey, tmp_path):
    model, data, kwargs = small_run(getkey)
    result = eqfit.fit(model, data, **kwargs)
    path = tmp_path / "run.eqx"
    eqfit.save(path, result)
    for like in (None, "hello"):
        with pytest.raises(TypeError, match=r"`like` must be a `FitResult`.*holds no arrays"):
            eqfit.load(path, like=like)
    whole = path.read_bytes()
    (tmp_path / "longer.eqx").write_bytes(whole + b"extra")
    with pytest.raises(ValueError, match=r"has 5 bytes more than `like`'s arrays take"):
        eqfit.load(tmp_path / "longer.eqx", like=result)
    (tmp_path / "cut.eqx").write_bytes(whole[: len(whole) - 40])
    with pytest.raises(ValueError, match=r"does not read back into `like`: the file is truncated"):
        eqfit.load(tmp_path / "cut.eqx", like=result)
    (tmp_path / "other.eqx").write_bytes(b"nonsense")
    with pytest.raises(ValueError, match=r"not an eqfit file"):
        eqfit.load(tmp_path / "other.eqx", like=model)


@pytest.mark.slow
def test_ensemble_with_a_stopped_member_checkpoints_to_the_end(getkey, tmp_path):
    """A member that stops early must not hold the others' checkpoints back."""
    import jax
    import jax.numpy as jnp

    data = regression_data(getkey(), 64)
    keys = jax.random.split(getkey(), 2)
    members = eqx.filter_vmap(lambda k: eqfit.models.LinearRegression(4, key=k))(keys)
    # Member 1 starts with an infinite weight: its first loss is not finite, so it stops.
    members = eqx.tree_at(lambda m: m.weight, members, members.weight.at[1, 0, 0].set(jnp.inf))
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.05),
        key=getkey(),
        epochs=4,
        batch_size=16,
        ensemble=True,
        on_nan="stop",
    )
    plain = eqfit.fit(members, data, **kwargs)
    saved = eqfit.fit(members, data, checkpoint=tmp_path / "run", **kwargs)
    assert plain.history.stop_reason == (None, "non_finite_loss")
    assert_trees_equal(plain.model, saved.model)
    assert checkpoints(tmp_path / "run")[-1].startswith("ckpt-000004")
