"""Several devices: `devices=` (filter_pmap) and `mesh=` (sharding) give the one-device answer."""

import json
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, regression_data, worker_env
from shared_problem import problem

import eqfit


ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs


def mesh8():
    return jax.make_mesh((8,), ("batch",))


def test_eight_simulated_devices():
    assert len(jax.devices()) == 8


# 203: a remainder of 11, which 8 does not split; two of its four variants run with the
# heavy tests (each path and each kind of several devices meet it in the quick suite).
@pytest.mark.parametrize(
    "n, progress, parallel",
    [
        pytest.param(256, False, "devices", marks=pytest.mark.heavy),
        (256, False, "mesh"),
        pytest.param(256, True, "devices", marks=pytest.mark.heavy),
        pytest.param(256, True, "mesh", marks=pytest.mark.heavy),
        pytest.param(203, False, "devices", marks=pytest.mark.heavy),
        (203, True, "mesh"),
        pytest.param(203, False, "mesh", marks=pytest.mark.heavy),
        pytest.param(203, True, "devices", marks=pytest.mark.heavy),
    ],
)
def test_same_answer_as_one_device(getkey, parallel, progress, n):
    data = regression_data(getkey(), n)
    model = eqfit.models.MLP(4, "scalar", 16, 2, key=getkey())
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=32,
    )
    one = eqfit.fit(model, data, **kwargs)
    extra = {"devices": 8} if parallel == "devices" else {"mesh": mesh8()}
    many = eqfit.fit(model, data, progress=progress, **extra, **kwargs)
    assert_trees_close(many.model, one.model)
    assert_trees_close(many.opt_state, one.opt_state)
    np.testing.assert_allclose(many.history.step_loss, one.history.step_loss, rtol=1e-5)
    # An ordinary, unreplicated model comes back.
    assert many.model.layers[0].weight.shape == model.layers[0].weight.shape
    assert type(many.model) is type(model)


@pytest.mark.slow
def test_pmap_over_a_list_of_devices(getkey):
    data = regression_data(getkey(), 64)
    model = eqfit.models.LinearRegression(4, key=getkey())
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=getkey(), batch_size=16)
    one = eqfit.fit(model, data, **kwargs)
    four = eqfit.fit(model, data, devices=jax.devices()[2:6], **kwargs)
    assert_trees_close(four.model, one.model)


def dropout_loss(model, x, y, *, key):
    keys = jax.random.split(key, x.shape[0])
    return jnp.mean((jax.vmap(lambda a, k: model(a, key=k))(x, keys) - y) ** 2)


def dropout_run(getkey):
    """A dropout MLP over 4 devices: each device's keys show in the result. (One program
    for the two tests below.)
    """
    data = regression_data(getkey(), 100)  # a remainder batch of 4, one row a device
    model = eqfit.models.MLP(4, "scalar", 16, 1, dropout=0.5, key=getkey())
    kwargs = dict(
        loss=dropout_loss,
        optimizer=ADAM,  # a state to carry from call to call
        key=getkey(),
        epochs=2,
        batch_size=16,
        devices=4,
    )
    return model, data, kwargs


@pytest.mark.heavy
def test_pmap_progress_equals_pmap_compiled(getkey):
    model, data, kwargs = dropout_run(getkey)
    compiled = eqfit.fit(model, data, **kwargs)
    bar = eqfit.fit(model, data, progress=True, **kwargs)
    assert_trees_close(bar.model, compiled.model, rtol=0, atol=0)


@pytest.mark.slow
def test_mesh_with_data_not_divisible_by_devices(getkey):
    # 203 rows cannot be split over 8 devices: the data is replicated, batches still split.
    data = regression_data(getkey(), 203)
    model = eqfit.models.LinearRegression(4, key=getkey())
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.05), key=getkey(), batch_size=16)
    one = eqfit.fit(model, data, **kwargs)
    many = eqfit.fit(model, data, mesh=mesh8(), **kwargs)
    assert_trees_close(many.model, one.model)


@pytest.mark.slow
def test_per_device_keys_are_distinct_and_deterministic(getkey):
    model, data, kwargs = dropout_run(getkey)
    a = eqfit.fit(model, data, **kwargs)
    b = eqfit.fit(model, data, **kwargs)
    assert_trees_close(a.model, b.model, rtol=0, atol=0)


def test_batch_size_not_divisible_by_devices(getkey):
    data = regression_data(getkey(), 64)
    model = eqfit.models.LinearRegression(4, key=getkey())
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=getkey(), batch_size=20)
    with pytest.raises(ValueError, match=r"`batch_size`=20 does not split evenly over 8 devices"):
        eqfit.fit(model, data, devices=8, **kwargs)
    with pytest.raises(ValueError, match=r"over 8 devices \(the mesh axis 'batch'\).*16 or 24"):
        eqfit.fit(model, data, mesh=mesh8(), **kwargs)


def test_empty_device_list(getkey):
    model = eqfit.models.LinearRegression(4, key=getkey())
    with pytest.raises(ValueError, match=r"`devices` is empty"):
        eqfit.fit(
            model,
            regression_data(getkey(), 64),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=getkey(),
            devices=[],
        )


def test_more_devices_than_available(getkey):
    model = eqfit.models.LinearRegression(4, key=getkey())
    with pytest.raises(ValueError, match=r"`devices=16` asks for 16 devices, but 8 local"):
        eqfit.fit(
            model,
            regression_data(getkey(), 64),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=getkey(),
            devices=16,
        )


def test_devices_and_mesh_together(getkey):
    model = eqfit.models.LinearRegression(4, key=getkey())
    with pytest.raises(ValueError, match=r"not both: got 8 devices and a mesh of shape"):
        eqfit.fit(
            model,
            regression_data(getkey(), 64),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=getkey(),
            devices=8,
            mesh=mesh8(),
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_processes(outs, directory=None, *mode):
    here = Path(__file__).parent
    port = _free_port()
    env = worker_env(here)
    extra = ([] if directory is None else [str(directory)]) + list(mode)
    return [
        subprocess.Popen(
            [sys.executable, str(here / "distributed_worker.py"), str(i), str(port), str(outs[i])]
            + extra,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


def finish(workers, timeout=180):
    logs = []
    try:
        for w in workers:
            logs.append(w.communicate(timeout=timeout)[0])
    finally:
        for w in workers:
            w.kill()
    for w, log in zip(workers, logs):
        assert w.returncode == 0, log[-3000:]


def expected_leaves(result):
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(result.model, eqx.is_array))]


@pytest.mark.heavy
def test_two_processes_with_jax_distributed(tmp_path):
    """Two real processes, two CPU devices each, joined by `jax.distributed` over gloo."""
    outs = [tmp_path / f"process{i}.npz" for i in range(2)]
    finish(start_two_processes(outs))
    model, data, kwargs = problem()
    reference = eqfit.fit(model, data, **kwargs)
    for out in outs:
        got = np.load(out)
        for progress in (False, True):
            np.testing.assert_allclose(got[f"loss_{progress}"], reference.history.loss, rtol=1e-5)
            for i, leaf in enumerate(expected_leaves(reference)):
                np.testing.assert_allclose(got[f"leaf{i}_{progress}"], leaf, rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", [(), ("shard",)])
def test_two_processes_share_a_checkpoint_directory_through_a_kill(tmp_path, mode):
    """Process 0 writes the checkpoints (and holds the lock), process 1 waits for each;
    both killed mid-run, both resume from the shared directory and end as one run would.
    With `shard`: 2 processes of 4 devices, FSDP over the 8, each process writing its
    shards of each checkpoint.
    """
    directory = tmp_path / "shared"
    outs = [tmp_path / f"process{i}.npz" for i in range(2)]
    workers = start_two_processes(outs, directory, *mode)
    try:
        for line in workers[0].stdout:
            if line.startswith("epoch 30"):
                break
        else:
            pytest.fail(workers[0].communicate()[0][-3000:])
    finally:
        for w in workers:
            w.kill()
            w.communicate()
    written = sorted(p.name for p in directory.glob("ckpt-*"))
    assert written and written[-1] < "ckpt-000120", written
    if mode:
        assert (directory / written[-1] / "state").is_dir()  # Orbax's format
    finish(start_two_processes(outs, directory, *mode))
    model, data, kwargs = problem()
    reference = eqfit.fit(model, data, **{**kwargs, "epochs": 120})
    for out in outs:
        got = np.load(out)
        if mode:
            assert got["split"].any()  # no process held those arrays whole
        np.testing.assert_allclose(got["loss"], reference.history.loss, rtol=1e-4, atol=1e-6)
        for i, leaf in enumerate(expected_leaves(reference)):
            np.testing.assert_allclose(got[f"leaf{i}"], leaf, rtol=1e-4, atol=1e-5)


@pytest.mark.heavy
def test_a_signal_to_one_of_two_processes_stops_both_at_one_step(tmp_path):
    """SIGTERM to process 1 alone, during an epoch of a million steps: both processes stop
    at the same step, with a checkpoint there that a single process restores whole.
    """
    directory = tmp_path / "shared"
    outs = [tmp_path / f"process{i}.npz" for i in range(2)]
    workers = start_two_processes(outs, directory, "signal")
    try:
        for worker in workers:
            for line in worker.stdout:
                if line.startswith("training"):
                    break
            else:
                pytest.fail(worker.communicate()[0][-3000:])
        time.sleep(3)
        workers[1].send_signal(signal.SIGTERM)
        logs = [w.communicate(timeout=120)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert [w.returncode for w in workers] == [3, 3], logs[0][-2000:] + logs[1][-2000:]
    got = [np.load(out) for out in outs]
    steps = [int(g["steps"]) for g in got]
    assert steps[0] == steps[1] and 0 < steps[0] < 10**6
    assert [str(g["signal"]) for g in got] == ["SIGTERM", "SIGTERM"]
    newest = sorted(p.name for p in directory.glob("ckpt-*"))[-1]
    assert newest == f"ckpt-000000-{steps[0]:06d}"
    manifest = json.loads((directory / newest / "manifest.json").read_text())
    state = (directory / newest / "state.eqx").read_bytes()
    assert f"{zlib.crc32(state):08x}" == manifest["crc32"]  # whole
