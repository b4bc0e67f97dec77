"""`fit(..., mesh=, shard=)`: the model and optimizer state laid out over the mesh, never
whole on one device, training as one device does.

Most are heavy (a 64-1024-1024-1 MLP over 8 devices, fitted several times): the quick
suite keeps the layout's memory and its errors.
"""

import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax.sharding import Mesh, PartitionSpec as P

import eqfit
from eqfit.sharding import bytes_per_device, fsdp, rules


N, FEATURES, HIDDEN = 256, 64, 1024


def mesh8():
    return Mesh(np.array(jax.devices()), ("data",))


def mesh2x4():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


# Megatron's split of an MLP over "model": the first layer by its outputs (column
# parallel), the next by its inputs (row parallel); `eqx.nn.Linear`'s weight is (out, in).
TENSOR_PARALLEL = rules(
    (r"layers\[0\]\.weight", P("model", None)),
    (r"layers\[0\]\.bias", P("model")),
    (r"layers\[1\]\.weight", P(None, "model")),
)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = np.tanh(x[:, :4].sum(1)).astype(np.float32)
    model = eqx.nn.MLP(FEATURES, "scalar", HIDDEN, 2, key=jax.random.key(0))
    # SGD for the comparisons with one device: Adam divides each gradient by its own
    # size, so where a gradient is near 0 a rounding apart (another order of the sums
    # over devices) moves a weight by up to the learning rate, whatever the layout.
    kw = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.05),
        key=jax.random.key(1),
        epochs=3,
        batch_size=32,
    )
    return model, (x, y), kw


@pytest.fixture(scope="module")
def alone(problem):
    """The one-device run the layouts are compared with (by the heavy tests only)."""
    model, data, kw = problem
    return eqfit.fit(model, data, **kw)


def arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def specs(model):
    return [a.sharding.spec for a in arrays(model)]


@pytest.mark.slow
def test_fsdp_holds_an_eighth_per_device(problem):
    model, data, kw = problem
    result = eqfit.fit(
        model, data, mesh=mesh8(), shard=fsdp("data"), **{**kw, "optimizer": optax.adam(1e-3)}
    )
    # The two large weights split over "data"; the small arrays replicated.
    assert specs(result.model) == [P("data"), P(), P("data"), P(), P(), P()]
    state = (eqx.filter(result.model, eqx.is_array), result.opt_state)
    total = sum(a.nbytes for a in jax.tree.leaves(state))
    fullest = max(bytes_per_device(state).values())
    assert fullest <= total / 8 + 0.02 * total
    # Adam's moments follow the parameters.
    mu = result.opt_state[0].mu
    assert mu.layers[1].weight.sharding.spec == P("data")


@pytest.mark.heavy
def test_fsdp_trains_as_one_device(problem, alone):
    model, data, kw = problem
    result = eqfit.fit(model, data, mesh=mesh8(), shard=fsdp("data"), **kw)
    assert_trees_close(result.model, alone.model, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.history.loss, alone.history.loss, rtol=1e-5)


@pytest.mark.heavy
def test_tensor_parallel_rules_on_a_2x4_mesh(problem, alone):
    model, data, kw = problem
    result = eqfit.fit(model, data, mesh=mesh2x4(), shard=TENSOR_PARALLEL, **kw)
    assert specs(result.model)[:3] == [P("model"), P("model"), P(None, "model")]
    assert_trees_close(result.model, alone.model, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.history.loss, alone.history.loss, rtol=1e-5)


@pytest.mark.heavy
@pytest.mark.parametrize("form", ["spec", "function", "prefix"])
def test_every_form_of_shard(problem, form):
    model, data, kw = problem
    if form == "spec":
        shard = P()  # every array replicated
        expected = [P()] * 6
    elif form == "function":

        def shard(path, leaf):
            return P(None, "data") if path.endswith("weight") and leaf.shape[-1] % 8 == 0 else None

        expected = [P(None, "data"), P(), P(None, "data"), P(), P(None, "data"), P()]
    else:
        shard = jax.tree.map(lambda _: None, model)
        shard = eqx.tree_at(lambda m: m.layers[1], shard, P("data"), is_leaf=lambda x: x is None)
        expected = [P(), P(), P("data"), P("data"), P(), P()]
    result = eqfit.fit(model, data, mesh=mesh8(), shard=shard, **{**kw, "epochs": 1})
    assert specs(result.model) == expected


def test_checkpoints_under_shard_need_orbax_and_say_so(problem, monkeypatch, tmp_path):
    model, data, kw = problem
    for name in ("orbax", "orbax.checkpoint"):  # as if it were not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=re.escape("pip install 'eqfit[sharding]'")):
        eqfit.fit(model, data, mesh=mesh8(), shard=fsdp("data"), checkpoint=tmp_path, **kw)
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_layout_errors_come_before_anything_compiles(problem):
    model, data, kw = problem
    with pytest.raises(ValueError, match=r"no axis 'model'.*`\.layers\[1\]\.weight`|`\.layers"):
        eqfit.fit(model, data, mesh=mesh8(), shard=rules((r"weight", P("model"))), **kw)
    with pytest.raises(ValueError, match=re.escape("(of size 1) does not split evenly")):
        eqfit.fit(model, data, mesh=mesh8(), shard=rules((r"layers\[2\]\.weight", P("data"))), **kw)
    with pytest.raises(ValueError, match=r"give `mesh=` too"):
        eqfit.fit(model, data, shard=fsdp("data"), **kw)
    stacked = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 2, key=k))(jax.random.split(kw["key"], 2))
    with pytest.raises(ValueError, match=r"`shard=` with `ensemble=True`"):
        eqfit.fit(stacked, data, mesh=mesh8(), shard=fsdp(), ensemble=True, **kw)


@pytest.mark.heavy
def test_a_sharded_model_predicts_and_evaluates(problem):
    model, (x, y), kw = problem
    result = eqfit.fit(model, (x, y), mesh=mesh8(), shard=fsdp("data"), **{**kw, "epochs": 1})
    out = eqfit.predict(result.model, x, batch_size=64)
    np.testing.assert_allclose(out, jax.vmap(result.model)(jnp.asarray(x)), rtol=1e-5, atol=1e-6)
    values = eqfit.evaluate(result.model, (x, y), loss=eqfit.losses.mse)
    assert np.isfinite(values["loss"])


@pytest.mark.heavy
def test_streamed_data_and_progress_under_shard(problem):
    model, (x, y), kw = problem
    compiled = eqfit.fit(model, (x, y), mesh=mesh8(), shard=fsdp("data"), shuffle=False, **kw)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, N, 32)]
    streamed = eqfit.fit(model, batches, mesh=mesh8(), shard=fsdp("data"), **kw)
    assert specs(streamed.model) == specs(compiled.model)
    assert_trees_close(streamed.model, compiled.model, rtol=1e-6, atol=1e-6)
    bar = eqfit.fit(
        model, (x, y), mesh=mesh8(), shard=fsdp("data"), shuffle=False, progress=True, **kw
    )
    for a, b in zip(arrays(bar.model), arrays(compiled.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _StopAfter:
    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs):
        return epoch >= self.epoch


def _stopped_run(model, data, kw, directory, mesh, shard):
    """A run cut short after epoch 2 by a callback, with a checkpoint there."""
    cut = eqfit.fit(
        model, data, mesh=mesh, shard=shard, checkpoint=directory, callbacks=[_StopAfter(2)], **kw
    )
    assert cut.history.epochs == 2 and cut.history.stop_reason == "callback"
    assert sorted(p.name for p in directory.glob("ckpt-*"))[-1] == "ckpt-000002-000000"
    assert (directory / "ckpt-000002-000000" / "state").is_dir()  # Orbax's format


@pytest.mark.heavy
def test_resume_on_the_same_layout_is_bitwise_equal(problem, tmp_path):
    model, data, kw = problem
    kw = {**kw, "epochs": 4}
    whole = eqfit.fit(model, data, mesh=mesh8(), shard=fsdp("data"), **kw)
    _stopped_run(model, data, kw, tmp_path, mesh8(), fsdp("data"))
    resumed = eqfit.fit(model, data, mesh=mesh8(), shard=fsdp("data"), checkpoint=tmp_path, **kw)
    assert specs(resumed.model) == specs(whole.model)
    for a, b in zip(
        arrays((resumed.model, resumed.opt_state)), arrays((whole.model, whole.opt_state))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(resumed.history.step_loss, whole.history.step_loss)


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["2x4", "4 devices"])
def test_resume_onto_another_layout(problem, tmp_path, layout):
    model, data, kw = problem
    kw = {**kw, "epochs": 4}
    whole = eqfit.fit(model, data, **kw)
    _stopped_run(model, data, kw, tmp_path, mesh8(), fsdp("data"))
    if layout == "2x4":
        mesh, shard, expected = mesh2x4(), TENSOR_PARALLEL, P("model")
    else:
        mesh, shard, expected = (
            Mesh(np.array(jax.devices()[:4]), ("data",)),
            fsdp("data"),
            P("data"),
        )
    resumed = eqfit.fit(model, data, mesh=mesh, shard=shard, checkpoint=tmp_path, **kw)
    assert arrays(resumed.model)[0].sharding.spec == expected
    assert len(arrays(resumed.model)[0].sharding.device_set) == mesh.size
    assert_trees_close(resumed.model, whole.model, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(resumed.history.loss, whole.history.loss, rtol=1e-5)


class _Normed(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(FEATURES, 64, key=k1)
        self.norm = eqx.nn.BatchNorm(64, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(64, "scalar", key=k2)

    def __call__(self, x, state):
        h, state = self.norm(jax.nn.relu(self.linear(x)), state)
        return self.head(h), state


@pytest.mark.heavy
def test_a_stateful_model_under_shard(problem):
    _, data, kw = problem
    model, state = eqx.nn.make_with_state(_Normed)(jax.random.key(3))
    kw = {**kw, "loss": eqfit.losses.mse, "epochs": 2}
    alone = eqfit.fit(model, data, state=state, **kw)
    every = lambda path, leaf: P("data") if leaf.ndim and leaf.shape[0] % 8 == 0 else None  # noqa: E731
    result = eqfit.fit(model, data, state=state, mesh=mesh8(), shard=every, **kw)
    assert result.model.linear.weight.sharding.spec == P("data")
    assert result.state is not None  # the model state, replicated, moved as one device's
    assert_trees_close(result.state, alone.state, rtol=1e-5, atol=1e-5)
    assert_trees_close(result.model, alone.model, rtol=1e-5, atol=1e-5)
