"""`evaluate` and `predict` on every kind of data `fit` trains on: memmaps, re-iterable
loaders with and without `len`, iterators and generators, streamed in chunks; each equal
to the same data as arrays in memory, on both ways of running the batches.
"""

import gc
import subprocess
import sys
import textwrap
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import worker_env

import eqfit


N, FEATURES, CLASSES = 203, 5, 3  # 203: batches of 16 leave a smaller last one


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=N).astype(np.int32)
    mask = (rng.random(N) < 0.7).astype(np.float32)
    return x, labels, mask


@pytest.fixture(scope="module")
def memmaps(arrays, tmp_path_factory):
    folder = tmp_path_factory.mktemp("memmaps")
    for name, a in zip("xym", arrays):
        np.save(folder / f"{name}.npy", a)
    return tuple(np.load(folder / f"{name}.npy", mmap_mode="r") for name in "xym")


@pytest.fixture(scope="module")
def model():
    return eqfit.models.MLP(FEATURES, CLASSES, 8, 2, key=jax.random.key(3))


class Batches:
    """A re-iterable loader of `(x, labels, mask)` batches, in order; with `len` or not."""

    def __init__(self, data, batch, with_len=True):
        self.data, self.batch, self.with_len = data, batch, with_len

    def __len__(self):
        if not self.with_len:
            raise TypeError("no len")
        return -(-len(self.data[0]) // self.batch)

    def __iter__(self):
        for i in range(0, len(self.data[0]), self.batch):
            yield tuple(a[i : i + self.batch] for a in self.data)


def generator(data, batch):
    for i in range(0, len(data[0]), batch):
        yield tuple(a[i : i + batch] for a in data)


def masked_loss(model, x, labels, mask, *, key):
    """A token-weighted loss (an `eqfit.Mean`) that draws noise from its key: the
    weighting and the per-batch keys must both come out as over arrays in memory.
    """
    logits = jax.vmap(model)(x) + 0.01 * jax.random.normal(key, (x.shape[0], CLASSES))
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]
    return eqfit.Mean.of(ce, mask)


def accuracy(model, x, labels, mask):
    return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=1) == labels)


KINDS = ["memmaps", "loader", "loader without len", "generator"]
WAYS = {"whole run": eqfit.WholeRun(), "per step": eqfit.PerStep(3)}


def data_of(kind, arrays, memmaps, batch):
    if kind == "memmaps":
        return memmaps
    if kind == "generator":
        return generator(arrays, batch)
    return Batches(arrays, batch, with_len=kind == "loader")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, way",
    [
        # Each kind in the quick suite, and `PerStep` on memmaps; the rest in the whole.
        (k, w)
        if w == "whole run" or k == "memmaps"
        else pytest.param(k, w, marks=pytest.mark.heavy)
        for k in KINDS
        for w in WAYS
    ],
)
def test_evaluate_streams_every_kind_of_data_as_arrays_in_memory(kind, way, arrays, memmaps, model):
    kwargs = dict(
        loss=masked_loss,
        metrics={"accuracy": accuracy},
        batch_size=16,
        key=jax.random.key(5),
        execution=WAYS[way],
    )
    expected = eqfit.evaluate(model, arrays, **kwargs)
    got = eqfit.evaluate(model, data_of(kind, arrays, memmaps, 16), **kwargs)
    assert got.keys() == expected.keys() == {"loss", "accuracy"}
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7)
    # The weights count: a keyless masked loss streamed is the whole data's weighted mean.
    x, labels, mask = arrays
    keyless = dict(loss=_keyless, batch_size=16, execution=WAYS[way])
    weighted = _keyless(model, x, labels, mask)
    got = eqfit.evaluate(model, data_of(kind, arrays, memmaps, 16), **keyless)["loss"]
    np.testing.assert_allclose(got, weighted.total / weighted.weight, rtol=1e-6)


def _keyless(model, x, labels, mask):
    logits = jax.vmap(model)(x)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]
    return eqfit.Mean.of(ce, mask)


@pytest.mark.slow
def test_a_memmap_streams_in_chunks_of_many_batches(arrays, tmp_path, model):
    # A set larger than one chunk (32 MiB) of a wide sample: several chunks, the last one
    # padded, then the smaller last batch; the values still those of arrays in memory.
    rng = np.random.default_rng(1)
    rows, width = 9_000, 1_000  # 36 MB of inputs
    x = rng.normal(size=(rows, width)).astype(np.float32)
    y = rng.normal(size=rows).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    xm, ym = (np.load(tmp_path / f"{n}.npy", mmap_mode="r") for n in "xy")
    linear = eqfit.models.LinearRegression(width, key=jax.random.key(0))
    for execution in WAYS.values():
        kwargs = dict(loss=eqfit.losses.mse, batch_size=64, execution=execution)
        expected = eqfit.evaluate(linear, (x, y), **kwargs)["loss"]
        np.testing.assert_allclose(
            eqfit.evaluate(linear, (xm, ym), **kwargs)["loss"], expected, rtol=1e-5
        )
        predicted = eqfit.predict(linear, xm, batch_size=64, execution=execution)
        np.testing.assert_allclose(
            predicted, eqfit.predict(linear, x, batch_size=64), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kind", KINDS)
def test_predict_streams_every_kind_of_data_as_arrays_in_memory(kind, way, arrays, memmaps, model):
    x = arrays[0]
    expected = eqfit.predict(model, x, batch_size=16)
    data = memmaps[0] if kind == "memmaps" else data_of(kind, arrays, memmaps, 16)
    got = eqfit.predict(model, data, batch_size=16, execution=WAYS[way])
    assert got.shape == (N, CLASSES)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_predict_takes_a_loaders_inputs_as_keras_does(arrays, model):
    # A batch that is a tuple is `(inputs, ...)`; any other batch is the inputs.
    x = arrays[0]
    expected = eqfit.predict(model, x, batch_size=20)
    bare = (x[i : i + 20] for i in range(0, N, 20))
    single = [(x[i : i + 20],) for i in range(0, N, 20)]
    for loader in (bare, single):
        np.testing.assert_allclose(eqfit.predict(model, loader), expected, rtol=1e-6, atol=1e-6)
    # A PyTree of memmaps is the input as it is, as arrays in memory are.

    class Sum(eqx.Module):
        def __call__(self, x):
            return x["a"].sum() + x["b"]

    tree = {"a": x, "b": arrays[2]}
    np.testing.assert_allclose(
        eqfit.predict(Sum(), (t for t in [tree])), x.sum(axis=1) + arrays[2], rtol=1e-5
    )


def test_predict_of_an_ensemble_streams(arrays, memmaps):
    keys = jax.random.split(jax.random.key(0), 3)
    stack = eqx.filter_vmap(lambda k: eqfit.models.MLP(FEATURES, CLASSES, 8, 1, key=k))(keys)
    expected = eqfit.predict(stack, arrays[0], batch_size=16, ensemble=True)
    for data in (memmaps[0], generator(arrays, 16)):
        got = eqfit.predict(stack, data, batch_size=16, ensemble=True)
        assert got.shape == (3, N, CLASSES)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_predict_writes_into_out(arrays, memmaps, model, tmp_path):
    expected = np.asarray(eqfit.predict(model, arrays[0], batch_size=16))
    for i, data in enumerate([memmaps[0], generator(arrays, 16), arrays[0]]):
        out = np.lib.format.open_memmap(tmp_path / f"{i}.npy", "w+", np.float32, (N, CLASSES))
        assert eqfit.predict(model, data, batch_size=16, out=out) is out
        np.testing.assert_allclose(np.load(tmp_path / f"{i}.npy"), expected, rtol=1e-6, atol=1e-6)


def test_predict_refuses_an_out_that_does_not_fit(arrays, memmaps, model):
    with pytest.raises(
        ValueError, match=r"`out` has shape \(203, 4\), but the outputs are \(n, 3\)"
    ):
        eqfit.predict(model, memmaps[0], out=np.zeros((N, CLASSES + 1), np.float32))
    with pytest.raises(ValueError, match=r"`out` holds 300 examples, but `x` gave 203"):
        eqfit.predict(model, memmaps[0], out=np.zeros((300, CLASSES), np.float32))
    with pytest.raises(ValueError, match=r"`out` has shape \(200, 3\), .* n at least 203 so far"):
        eqfit.predict(model, generator(arrays, 16), out=np.zeros((200, CLASSES), np.float32))
    with pytest.raises(TypeError, match=r"`out` must be a numpy array of 2 dimensions"):
        eqfit.predict(model, memmaps[0], out=jnp.zeros((N, CLASSES)))


@pytest.mark.parametrize("where", ["in memory", "streamed"])
def test_predict_names_out_of_another_kind_or_read_only(arrays, memmaps, model, tmp_path, where):
    data = arrays[0] if where == "in memory" else memmaps[0]
    with pytest.raises(
        TypeError,
        match=r"`out` has dtype int32, which cannot hold the outputs, of dtype float32, .*: "
        r"give an array of dtype float32",
    ):
        eqfit.predict(model, data, out=np.zeros((N, CLASSES), np.int32))
    np.lib.format.open_memmap(tmp_path / "out.npy", "w+", np.float32, (N, CLASSES)).flush()
    read_only = np.load(tmp_path / "out.npy", mmap_mode="r")
    with pytest.raises(ValueError, match=r"`out` is read-only .*: give a writable array"):
        eqfit.predict(model, data, out=read_only)


@pytest.mark.parametrize("where", ["in memory", "streamed"])
def test_predict_names_an_ensemble_out_of_another_shape(arrays, memmaps, where):
    """Not taken for a single model passed as a stack: `out` is named, members first."""
    data = arrays[0] if where == "in memory" else memmaps[0]
    keys = jax.random.split(jax.random.key(0), 3)
    stack = eqx.filter_vmap(lambda k: eqfit.models.MLP(FEATURES, CLASSES, 8, 1, key=k))(keys)
    with pytest.raises(
        TypeError,
        match=r"`out` must be a numpy array of 3 dimensions .* outputs of shape \(3, n, 3\) "
        r"\(with `ensemble=True`, the members' axis first\); got ndarray of shape \(203, 3\)",
    ):
        eqfit.predict(stack, data, ensemble=True, out=np.zeros((N, CLASSES), np.float32))
    with pytest.raises(
        ValueError, match=r"`out` has shape \(2, 203, 3\), but the outputs are \(3, n, 3\) \(with"
    ):
        eqfit.predict(stack, data, ensemble=True, out=np.zeros((2, N, CLASSES), np.float32))


def test_a_bad_label_in_a_streamed_batch_is_found_and_padding_is_not(arrays, model):
    x, labels, mask = arrays
    bad = labels.copy()
    bad[150] = CLASSES + 4  # in the 10th batch of 16

    def loss(model, x, labels, mask):
        return eqfit.losses.softmax_cross_entropy(model, x, labels)

    # As over arrays in memory: the label, and where in its batch (row 150 is the 10th
    # batch's 7th).
    message = r"label 7 \(at \(6,\) of a batch\) is outside \[0, 3\)"
    with pytest.raises(ValueError, match=message):
        eqfit.evaluate(model, (x, bad, mask), loss=loss, batch_size=16)
    with pytest.raises(ValueError, match=message):
        eqfit.evaluate(model, Batches((x, bad, mask), 16), loss=loss)
    # Good labels: the zeros padding the last chunk find nothing, whatever they hold.
    assert np.isfinite(eqfit.evaluate(model, Batches(arrays, 16), loss=loss)["loss"])


def test_a_loader_that_fails_surfaces_and_stops_the_reader(arrays, model):
    def failing():
        yield tuple(a[:16] for a in arrays)
        yield tuple(a[16:32] for a in arrays)
        raise RuntimeError("the disk went away")

    threads = threading.active_count()
    with pytest.raises(RuntimeError, match="the disk went away"):
        eqfit.evaluate(model, failing(), loss=masked_loss, key=jax.random.key(0))
    with pytest.raises(RuntimeError, match="the disk went away"):
        eqfit.predict(model, failing())
    gc.collect()
    assert threading.active_count() <= threads


@pytest.mark.heavy
def test_evaluate_and_validation_over_a_memmap_larger_than_a_gib_hold_a_few_chunks(tmp_path):
    # Its own process, whose peak resident memory is read before and after the call.
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        import jax, numpy as np, optax, eqfit

        folder, rows = Path(sys.argv[1]), 2_200_000
        x = np.lib.format.open_memmap(folder / "x.npy", "w+", np.float32, (rows, 128))
        y = np.lib.format.open_memmap(folder / "y.npy", "w+", np.float32, (rows,))
        for i in range(0, rows, 2**17):
            x[i : i + 2**17] = 1.0 / (1 + i % 7)
            y[i : i + 2**17] = 0.5
        x.flush(); y.flush(); del x, y
        x, y = (np.load(folder / f"{n}.npy", mmap_mode="r") for n in "xy")
        model = eqfit.models.MLP(128, "scalar", 16, 1, key=jax.random.key(0))

        def status(field):
            line = next(l for l in open("/proc/self/status") if l.startswith(field))
            return int(line.split()[1]) / 1024

        eqfit.evaluate(model, (x[:1000], y[:1000]), loss=eqfit.losses.mse)  # compiled
        Path("/proc/self/clear_refs").write_text("5")
        before = status("VmRSS")
        value = eqfit.evaluate(model, (x, y), loss=eqfit.losses.mse)["loss"]
        print(status("VmHWM") - before, value)
        # The same set as `fit`'s validation data, for two epochs of a small training set.
        train = (np.asarray(x[:512]), np.asarray(y[:512]))
        kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.01), key=jax.random.key(1))
        Path("/proc/self/clear_refs").write_text("5")
        before = status("VmRSS")
        result = eqfit.fit(model, train, validation_data=(x, y), epochs=2, **kwargs)
        print(status("VmHWM") - before, result.history["val_loss"][-1])
        # A view of it, as a validation split by slicing is (its pages are found from the
        # data pointers: a view's `offset` is its parent's).
        Path("/proc/self/clear_refs").write_text("5")
        before = status("VmRSS")
        value = eqfit.evaluate(model, (x[100_000:], y[100_000:]), loss=eqfit.losses.mse)["loss"]
        print(status("VmHWM") - before, value)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    added, value, fit_added, val_loss, view_added, view_value = map(float, done.stdout.split())
    assert np.isfinite(value) and np.isfinite(val_loss) and np.isfinite(view_value)
    assert added < 512, f"evaluate of a 1.05 GiB memmap added {added:.0f} MiB at its peak"
    assert fit_added < 512, f"validating on a 1.05 GiB memmap added {fit_added:.0f} MiB"
    assert view_added < 512, f"evaluate of a view of it added {view_added:.0f} MiB"


class Normed(eqx.Module):
    """A model with BatchNorm: inference reads its state's running statistics."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(FEATURES, CLASSES, key=key)
        self.norm = eqx.nn.BatchNorm(CLASSES, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


@pytest.mark.slow
def test_a_stateful_model_and_a_precision_stream_as_in_memory(arrays, memmaps):
    model, state = eqx.nn.make_with_state(Normed)(jax.random.key(2))
    # Running statistics that are not the initial ones: a few training steps' worth.
    result = eqfit.fit(
        model,
        arrays[:2],
        state=state,
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.sgd(0.1),
        key=jax.random.key(0),
        epochs=1,
        batch_size=32,
    )
    loss = eqfit.losses.softmax_cross_entropy
    for kw in (dict(state=result.state), dict(state=result.state, precision="bfloat16")):
        expected = eqfit.predict(result.model, arrays[0], batch_size=16, **kw)
        got = eqfit.predict(result.model, memmaps[0], batch_size=16, **kw)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        expected = eqfit.evaluate(result.model, arrays[:2], loss=loss, batch_size=16, **kw)
        got = eqfit.evaluate(result.model, generator(arrays[:2], 16), loss=loss, **kw)
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-6)
