"""Data larger than memory: memmaps and loaders, streamed in double-buffered chunks."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_trees_equal

import eqfit
import eqfit._host._sources


ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs


@pytest.fixture
def small_chunks(monkeypatch):
    # 7 batches of 16 rows of (4 + 1) float32s per chunk: several chunks and a partial one.
    monkeypatch.setattr(eqfit._host._sources, "CHUNK_BYTES", 7 * 16 * 20)


@pytest.fixture
def on_disk(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(250, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0) + np.sin(x[:, 0])).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    mapped = (
        np.load(tmp_path / "x.npy", mmap_mode="r"),
        np.load(tmp_path / "y.npy", mmap_mode="r"),
    )
    return (x, y), mapped


def kwargs(getkey, **extra):
    return dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=16,  # 15 full batches and a remainder of 10
        shuffle=False,
        **extra,
    )


@pytest.mark.parametrize("progress", [False, True])
def test_memmap_trains_as_in_memory_in_the_same_order(getkey, small_chunks, on_disk, progress):
    memory, mapped = on_disk
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    kw = kwargs(getkey, validation_data=(memory[0][:30], memory[1][:30]))
    expected = eqfit.fit(model, memory, **kw)
    streamed = eqfit.fit(model, mapped, progress=progress, **kw)
    assert_trees_equal(streamed.model, expected.model)
    np.testing.assert_array_equal(streamed.history.step_loss, expected.history.step_loss)
    np.testing.assert_array_equal(streamed.history.val_loss, expected.history.val_loss)


def test_memmap_epochs_ending_inside_passes_train_as_in_memory(getkey, small_chunks, on_disk):
    # A pass is 16 steps in chunks of 7 batches: epochs of 5 steps end inside passes and
    # inside chunks.
    memory, mapped = on_disk
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    val = (memory[0][:30], memory[1][:30])
    kw = kwargs(getkey, steps_per_epoch=5, validation_data=val)
    expected = eqfit.fit(model, memory, **kw)
    streamed = eqfit.fit(model, mapped, **kw)
    assert_trees_equal(streamed.model, expected.model)
    np.testing.assert_array_equal(streamed.history.step_loss, expected.history.step_loss)
    np.testing.assert_array_equal(streamed.history.val_loss, expected.history.val_loss)


class Loader:
    """A re-iterable of batches, in order, as a PyTorch or Grain loader would yield them."""

    def __init__(self, arrays, batch_size, drop_last=False):
        self.arrays, self.batch_size, self.drop_last = arrays, batch_size, drop_last

    def __iter__(self):
        n = len(self.arrays[0])
        end = n - n % self.batch_size if self.drop_last else n
        for i in range(0, end, self.batch_size):
            yield tuple(a[i : i + self.batch_size] for a in self.arrays)


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_loader_trains_as_in_memory(getkey, small_chunks, on_disk, drop_remainder):
    memory, _ = on_disk
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    # With the validation data of the memmap test: without dropping, its programs.
    kw = kwargs(getkey, validation_data=(memory[0][:30], memory[1][:30]))
    expected = eqfit.fit(model, memory, drop_remainder=drop_remainder, **kw)
    streamed = eqfit.fit(model, Loader(memory, 16, drop_last=drop_remainder), **kw)
    assert_trees_equal(streamed.model, expected.model)
    np.testing.assert_array_equal(streamed.history.step_loss, expected.history.step_loss)
    np.testing.assert_array_equal(streamed.history.val_loss, expected.history.val_loss)


def test_shuffled_memmap_uses_every_sample_once_per_epoch(getkey, small_chunks, tmp_path):
    n = 250
    np.save(tmp_path / "i.npy", np.arange(n, dtype=np.int32))
    index = np.load(tmp_path / "i.npy", mmap_mode="r")

    def loss(weights, i):
        return jnp.sum(weights[i])

    kw = dict(loss=loss, optimizer=optax.sgd(1.0), epochs=3, batch_size=16, shuffle=True)
    result = eqfit.fit(jnp.zeros(n), (index,), key=getkey(), **kw)
    np.testing.assert_array_equal(-np.asarray(result.model), np.full(n, 3.0))

    # The order is random: another key, another model of a position-weighted loss.
    def weighted(weights, i):
        return jnp.sum(weights[i] * jnp.arange(1.0, i.shape[0] + 1.0))

    a = eqfit.fit(jnp.zeros(n), (index,), key=getkey(), **{**kw, "loss": weighted})
    b = eqfit.fit(jnp.zeros(n), (index,), key=getkey(), **{**kw, "loss": weighted})
    assert not np.array_equal(a.model, b.model)


def test_streaming_checks_its_input(getkey, on_disk):
    memory, mapped = on_disk
    model = eqfit.models.LinearRegression(4, key=getkey())
    with pytest.raises(ValueError, match=r"`batch_size`=32, but the loader yields batches of 16"):
        eqfit.fit(model, Loader(memory, 16), **{**kwargs(getkey), "batch_size": 32})
    with pytest.raises(ValueError, match=r"share their leading \(sample\) axis"):
        eqfit.fit(model, (mapped[0], mapped[1][:10]), **kwargs(getkey))

    class Ragged:
        def __iter__(self):
            yield memory[0][:16], memory[1][:16]
            yield memory[0][:8], memory[1][:8]
            yield memory[0][:16], memory[1][:16]

    with pytest.raises(ValueError, match=r"batch 2 follows a batch of 8 samples in the same pass"):
        eqfit.fit(model, Ragged(), **kwargs(getkey))


def test_streamed_run_checkpoints_and_resumes(getkey, small_chunks, on_disk, tmp_path):
    memory, mapped = on_disk
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    # With the memmap test's validation data: its programs.
    kw = kwargs(getkey, validation_data=(memory[0][:30], memory[1][:30]))
    kw["shuffle"] = True
    expected = eqfit.fit(model, mapped, **kw)
    eqfit.fit(model, mapped, checkpoint=tmp_path / "ck", **{**kw, "epochs": 3})
    resumed = eqfit.fit(model, mapped, checkpoint=tmp_path / "ck", **kw)
    assert_trees_equal(resumed.model, expected.model)


@pytest.mark.heavy
def test_a_memmap_larger_than_the_memory_allowed(tmp_path):
    """1.5 GiB on disk trains while the process grows by well under a third of that."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "stream_worker.py"), str(tmp_path), "1.5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    numbers = dict(re.findall(r"(\w+)=([\d.]+)", run.stdout))
    file_mb, before, peak = (float(numbers[k]) for k in ("file_mb", "before_mb", "peak_mb"))
    assert file_mb >= 1500
    assert peak - before < 400, run.stdout  # the file is more than 3.75 times this
    assert int(numbers["steps"]) == 192


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["mesh", pytest.param("devices", marks=pytest.mark.heavy)])
def test_streaming_over_eight_devices_equals_in_memory(getkey, small_chunks, on_disk, parallel):
    import jax

    memory, mapped = on_disk
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    kw = kwargs(getkey, validation_data=(memory[0][:30], memory[1][:30]))
    expected = eqfit.fit(model, memory, **kw)
    extra = {"mesh": jax.make_mesh((8,), ("batch",))} if parallel == "mesh" else {"devices": 8}
    streamed = eqfit.fit(model, mapped, **extra, **kw)
    assert_trees_close(streamed.model, expected.model)
    np.testing.assert_allclose(streamed.history.step_loss, expected.history.step_loss, rtol=1e-5)


@pytest.mark.heavy
def test_streaming_an_ensemble_equals_in_memory(getkey, small_chunks, on_disk):
    import equinox as eqx
    import jax

    memory, mapped = on_disk
    make = lambda k: eqfit.models.MLP(4, "scalar", 16, 1, key=k)  # noqa: E731
    models = eqx.filter_vmap(make)(jax.random.split(getkey(), 3))
    kw = kwargs(getkey, ensemble=True)
    expected = eqfit.fit(models, memory, **kw)
    streamed = eqfit.fit(models, mapped, **kw)
    assert_trees_close(streamed.model, expected.model, rtol=1e-6, atol=1e-7)
    assert streamed.history.loss.shape == (3, 3)


@pytest.mark.heavy
def test_validation_split_on_a_memmap_holds_out_the_same_rows(getkey, small_chunks, on_disk):
    memory, mapped = on_disk
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    kw = kwargs(getkey, validation_split=0.2)
    expected = eqfit.fit(model, memory, **kw)
    streamed = eqfit.fit(model, mapped, **kw)
    np.testing.assert_array_equal(streamed.history.batch_sizes, expected.history.batch_sizes)
    np.testing.assert_array_equal(expected.history.batch_sizes[0], [16] * 12 + [8])
    assert_trees_equal(streamed.model, expected.model)
    np.testing.assert_array_equal(streamed.history.val_loss, expected.history.val_loss)
