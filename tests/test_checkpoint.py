"""Checkpoints, exact resume after SIGKILL or Ctrl-C, and refusing the wrong checkpoint."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, regression_data
from shared_problem import checkpoint_problem

import eqfit


HERE = Path(__file__).parent


def worker(directory, mode):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [sys.executable, str(HERE / "checkpoint_worker.py"), str(directory), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def checkpoints(directory):
    return sorted(p.name for p in Path(directory).glob("ckpt-*"))


@pytest.fixture(scope="module")
def uninterrupted():
    model, data, kwargs = checkpoint_problem()
    return eqfit.fit(model, data, **kwargs)


def test_resume_after_sigkill_is_bitwise_equal(tmp_path, uninterrupted):
    with worker(tmp_path, "compiled") as process:
        deadline = time.monotonic() + 120
        while len(checkpoints(tmp_path)) < 2 or checkpoints(tmp_path)[-1] < "ckpt-000003":
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.005)
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


def test_ctrl_c_checkpoints_mid_epoch_and_resumes_bitwise_equal(tmp_path, uninterrupted):
    with worker(tmp_path, "progress") as process:
        for line in process.stdout:
            if line.startswith("epoch 2"):
                break
        else:
            pytest.fail(process.stderr.read()[-3000:])
        time.sleep(0.05)  # somewhere inside epoch 3
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err[-3000:]
    assert "interrupted" in out
    names = checkpoints(tmp_path)
    assert names and names[-1] >= "ckpt-000003"
    # Resume on the compiled path, from wherever inside an epoch it stopped.
    model, data, kwargs = checkpoint_problem()
    resumed = eqfit.fit(model, data, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(resumed.model, uninterrupted.model)
    np.testing.assert_array_equal(resumed.history.step_loss, uninterrupted.history.step_loss)


def small_run(getkey):
    data = regression_data(getkey(), 100)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    kwargs = dict(loss=eqfit.losses.mse, key=getkey(), epochs=4, batch_size=16)
    return model, data, kwargs


@pytest.mark.parametrize("progress", [False, True])
def test_truncated_newest_checkpoint_falls_back(getkey, tmp_path, progress):
    model, data, kwargs = small_run(getkey)
    optimizer = optax.adam(1e-2)
    full = eqfit.fit(model, data, optimizer=optimizer, **kwargs)
    eqfit.fit(model, data, optimizer=optimizer, checkpoint=tmp_path, progress=progress, **kwargs)
    assert checkpoints(tmp_path) == ["ckpt-000003-000000", "ckpt-000004-000000"]
    state = tmp_path / "ckpt-000004-000000" / "state.eqx"
    state.write_bytes(state.read_bytes()[:100])  # a crash mid-write of the disk's contents
    with pytest.warns(UserWarning, match=r"Skipping checkpoint .*ckpt-000004-000000: its contents"):
        resumed = eqfit.fit(
            model, data, optimizer=optimizer, checkpoint=tmp_path, progress=progress, **kwargs
        )
    assert_trees_equal(resumed.model, full.model)
    assert_trees_equal(resumed.opt_state, full.opt_state)


def test_checkpoint_every(getkey, tmp_path):
    model, data, kwargs = small_run(getkey)
    kwargs["epochs"] = 5
    eqfit.fit(
        model, data, optimizer=optax.sgd(0.1), checkpoint=tmp_path, checkpoint_every=2, **kwargs
    )
    assert checkpoints(tmp_path) == ["ckpt-000004-000000", "ckpt-000005-000000"]
    with pytest.raises(ValueError, match=r"`checkpoint_every` must be an integer of 1 or more"):
        eqfit.fit(
            model, data, optimizer=optax.sgd(0.1), checkpoint=tmp_path, checkpoint_every=0, **kwargs
        )


def test_checkpoint_from_another_configuration_is_refused(getkey, tmp_path):
    model, data, kwargs = small_run(getkey)
    eqfit.fit(model, data, optimizer=optax.adam(1e-2), checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=r"different training configuration.*What differs: state"):
        eqfit.fit(model, data, optimizer=optax.sgd(1e-2), checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=r"What differs: data"):
        other = regression_data(getkey(), 99)
        eqfit.fit(model, other, optimizer=optax.adam(1e-2), checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=r"What differs: key"):
        eqfit.fit(
            model,
            data,
            optimizer=optax.adam(1e-2),
            checkpoint=tmp_path,
            **{**kwargs, "key": getkey()},
        )


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
    kwargs = dict(loss=batchnorm_loss, optimizer=optax.adam(1e-2), batch_size=16)
    result = eqfit.fit(model, data, state=state, key=getkey(), epochs=2, **kwargs)
    eqfit.save(tmp_path / "run.eqx", result)
    like = eqfit.fit(model, data, state=state, key=getkey(), epochs=0, **kwargs)
    loaded = eqfit.load(tmp_path / "run.eqx", like=like)
    assert_trees_equal(loaded.model, result.model)
    assert_trees_equal(loaded.opt_state, result.opt_state)
    assert_trees_equal(loaded.state, result.state)
    np.testing.assert_array_equal(loaded.history.loss, result.history.loss)
    np.testing.assert_array_equal(loaded.history.batch_sizes, result.history.batch_sizes)
    # Just the model, given a model to fill.
    only = eqfit.load(tmp_path / "run.eqx", like=model)
    assert_trees_equal(only, result.model)
    with pytest.raises(ValueError, match=r"not an eqfit file"):
        (tmp_path / "other.eqx").write_bytes(b"nonsense")
        eqfit.load(tmp_path / "other.eqx", like=model)


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
