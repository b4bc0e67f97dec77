"""`fit`'s validation on every kind of data `fit` trains on: memmaps, loaders with and
without `len`, a generator where the run validates once, streamed in chunks at each
epoch's end; its values equal validation over the same data in memory, on every way of
running, and training unchanged by it.
"""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from jax.sharding import AxisType, Mesh

import eqfit


N, VAL, FEATURES, BATCH = 160, 83, 4, 16  # 83: a smaller last validation batch


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    rng = np.random.default_rng(3)
    w = np.arange(1.0, FEATURES + 1, dtype=np.float32)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    xv = rng.normal(size=(VAL, FEATURES)).astype(np.float32)
    y, yv = np.sin(x @ w), np.sin(xv @ w)
    folder = tmp_path_factory.mktemp("validation")
    np.save(folder / "xv.npy", xv)
    np.save(folder / "yv.npy", yv.astype(np.float32))
    memmaps = tuple(np.load(folder / f"{n}.npy", mmap_mode="r") for n in ("xv", "yv"))
    return (x, y.astype(np.float32)), (xv, yv.astype(np.float32)), memmaps


class Batches:
    """A re-iterable loader, in order, with `len` or without; counts its passes."""

    def __init__(self, data, with_len=True):
        self.data, self.with_len, self.passes = data, with_len, 0

    def __len__(self):
        if not self.with_len:
            raise TypeError("no len")
        return -(-len(self.data[0]) // BATCH)

    def __iter__(self):
        self.passes += 1
        for i in range(0, len(self.data[0]), BATCH):
            yield tuple(a[i : i + BATCH] for a in self.data)


def generator(data):
    for i in range(0, len(data[0]), BATCH):
        yield tuple(a[i : i + BATCH] for a in data)


def model_of(key=0):
    return eqfit.models.MLP(FEATURES, "scalar", 8, 1, key=jax.random.key(key))


def kwargs(**more):
    return (
        dict(
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-2),
            key=jax.random.key(1),
            epochs=3,
            batch_size=BATCH,
            metrics={"mae": lambda m, x, y: abs(jax.vmap(m)(x) - y).mean()},
        )
        | more
    )


def streamed(kind, problem):
    _, val, memmaps = problem
    if kind == "memmaps":
        return memmaps
    if kind == "generator":
        return generator(val)
    return Batches(val, with_len=kind == "loader")


def assert_same_run(got, expected, exact_values=False):
    """The same validation values (to float tolerance) and the same training."""
    names = [n for n in expected.history.values if n.startswith("val_")]
    assert names and names == [n for n in got.history.values if n.startswith("val_")]
    for name in names:
        np.testing.assert_allclose(got.history[name], expected.history[name], rtol=1e-6)
    np.testing.assert_array_equal(got.history["loss"], expected.history["loss"])
    assert_trees_close(got.model, expected.model, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memmaps", "loader", "loader without len"])
def test_validation_streams_every_kind_of_data_as_arrays_in_memory(kind, problem):
    train, val, _ = problem
    expected = eqfit.fit(model_of(), train, validation_data=val, **kwargs())
    got = eqfit.fit(model_of(), train, validation_data=streamed(kind, problem), **kwargs())
    assert_same_run(got, expected)


def test_a_generator_validates_a_run_that_validates_once(problem):
    train, val, _ = problem
    once = kwargs(validation_freq=3)
    expected = eqfit.fit(model_of(), train, validation_data=val, **once)
    got = eqfit.fit(model_of(), train, validation_data=generator(val), **once)
    assert_same_run(got, expected)
    assert np.isnan(got.history["val_loss"][:2]).all()


def test_a_generator_read_more_than_once_is_refused_before_training(problem):
    train, val, _ = problem
    loader = Batches(train)
    with pytest.raises(ValueError, match=r"`validation_data` is an iterator .* validates 3 times"):
        eqfit.fit(model_of(), loader, validation_data=generator(val), **kwargs())
    assert loader.passes == 0  # refused before any data was read
    sets = eqfit.ValidationSets(a=val, b=generator(val))
    with pytest.raises(ValueError, match=r"`validation_data`'s set 'b' is an iterator"):
        eqfit.fit(model_of(), train, validation_data=sets, **kwargs(validation_freq=2, epochs=4))


def mesh():
    return Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,))


WAYS = {
    "per step": dict(execution=eqfit.PerStep(3)),
    "devices": dict(devices=8, batch_size=32),
    "mesh": dict(batch_size=32),  # the mesh is made in the test: jax.devices() at run time
    "bar": dict(progress=True),
    "early stopping": dict(early_stopping=eqfit.EarlyStopping(patience=0, monitor="val_mae")),
    "ema": dict(ema=0.9, validate_ema=True),
}


# Several devices and the options that only add to the loop with the heavy tests: the
# README's command runs one device's ways of calling the programs.
HEAVY = ("devices", "mesh", "early stopping", "ema")


@pytest.mark.slow
@pytest.mark.parametrize(
    "way", [pytest.param(w, marks=pytest.mark.heavy) if w in HEAVY else w for w in WAYS]
)
def test_streamed_validation_on_every_way_of_running(way, problem, capsys):
    train, val, memmaps = problem
    more = WAYS[way] | ({"mesh": mesh()} if way == "mesh" else {})
    expected = eqfit.fit(model_of(), train, validation_data=val, **kwargs(**more))
    for data in (Batches(val), memmaps):
        got = eqfit.fit(model_of(), train, validation_data=data, **kwargs(**more))
        assert_same_run(got, expected)
    capsys.readouterr()


@pytest.mark.slow
def test_streamed_validation_of_an_ensemble_validates_each_member(problem):
    train, val, memmaps = problem
    keys = jax.random.split(jax.random.key(4), 3)
    stack = eqx.filter_vmap(lambda k: eqfit.models.MLP(FEATURES, "scalar", 8, 1, key=k))(keys)
    expected = eqfit.fit(stack, train, validation_data=val, ensemble=True, **kwargs())
    got = eqfit.fit(stack, train, validation_data=memmaps, ensemble=True, **kwargs())
    assert_same_run(got, expected)
    # Each member's own value: its trained model's, evaluated alone.
    second = jax.tree.map(lambda a: a[1] if eqx.is_array(a) else a, got.model)
    alone = eqfit.evaluate(second, val, loss=eqfit.losses.mse, batch_size=BATCH)
    np.testing.assert_allclose(got.history["val_loss"][-1, 1], alone["loss"], rtol=1e-5)


@pytest.mark.slow
def test_named_sets_stream_each_its_own_way(problem):
    train, val, memmaps = problem
    half = tuple(a[:40] for a in val)
    in_memory = eqfit.ValidationSets(whole=val, half=half, again=val)
    sets = eqfit.ValidationSets(whole=memmaps, half=half, again=Batches(val, with_len=False))
    expected = eqfit.fit(model_of(), train, validation_data=in_memory, **kwargs())
    got = eqfit.fit(model_of(), train, validation_data=sets, **kwargs())
    assert_same_run(got, expected)
    assert set(got.history.values) >= {"val_whole_loss", "val_half_loss", "val_again_mae"}


def test_streamed_validation_is_checked_against_the_data(problem):
    train, val, _ = problem
    wide = (np.zeros((10, FEATURES + 1), np.float32), np.zeros(10, np.float32))
    with pytest.raises(ValueError, match=r"`validation_data` must hold arrays like `data`'s"):
        eqfit.fit(model_of(), train, validation_data=Batches(wide), **kwargs())


def test_a_loader_that_fails_in_validation_hands_back_the_training(problem):
    train, val, _ = problem

    class Failing(Batches):
        def __iter__(self):
            yield tuple(a[:BATCH] for a in val)
            raise RuntimeError("the validation disk went away")

    with pytest.raises(RuntimeError, match="the validation disk went away"):
        eqfit.fit(model_of(), train, validation_data=Failing(val), **kwargs())


@pytest.mark.slow
def test_plan_counts_a_streamed_validation_pass(problem):
    train, val, memmaps = problem
    in_memory = eqfit.plan(model_of(), train, validation_data=val, **kwargs())
    plan = eqfit.plan(model_of(), train, validation_data=memmaps, **kwargs())
    assert plan.validations == in_memory.validations == 3
    assert plan.validation_flops == pytest.approx(in_memory.validation_flops, rel=1e-6)
    # The run's program holds no validation set: its arguments are smaller.
    assert plan.memory.argument < in_memory.memory.argument
    assert plan.validation_streamed and not in_memory.validation_streamed
    assert "its sets streamed a chunk at a time" in str(plan)
    unsized = eqfit.plan(model_of(), train, validation_data=Batches(val, False), **kwargs())
    assert unsized.flops_lower_bound == "a validation loader that does not say its length"


def test_a_loader_without_len_trains_and_a_loader_validates(problem):
    # The epoch's length is learned from the first pass; the epoch ends it finds are
    # where the host validates.
    train, val, _ = problem
    unsized = Batches(train, with_len=False)
    kw = kwargs(shuffle=False)
    expected = eqfit.fit(model_of(), unsized, validation_data=val, **kw)
    got = eqfit.fit(model_of(), unsized, validation_data=Batches(val, False), **kw)
    assert_same_run(got, expected)


@pytest.mark.slow
def test_a_run_stopped_and_resumed_validates_as_one_never_stopped(problem, tmp_path):
    train, val, memmaps = problem

    class StopAfterFirst:
        def on_epoch_end(self, epoch, logs):
            return epoch == 1

    once = eqfit.fit(model_of(), train, validation_data=Batches(val), **kwargs())
    policy = eqfit.Checkpoint(tmp_path, every_epochs=1)
    first = eqfit.fit(
        model_of(),
        train,
        validation_data=Batches(val),
        checkpoint=policy,
        callbacks=[StopAfterFirst()],
        **kwargs(),
    )
    assert first.history.stop_reason == "callback"
    resumed = eqfit.fit(
        model_of(), train, validation_data=Batches(val), checkpoint=policy, **kwargs()
    )
    assert_same_run(resumed, once)


@pytest.mark.slow
def test_a_validation_iterator_that_plan_read_is_refused_by_fit(problem):
    train, val, _ = problem
    once = kwargs(epochs=1)
    given = generator(val)
    eqfit.plan(model_of(), train, validation_data=given, **once)
    with pytest.raises(ValueError, match=r"`validation_data` is an iterator that `eqfit.plan`"):
        eqfit.fit(model_of(), train, validation_data=given, **once)
    # A fresh one trains, and validates as arrays in memory.
    got = eqfit.fit(model_of(), train, validation_data=generator(val), **once)
    expected = eqfit.fit(model_of(), train, validation_data=val, **once)
    assert_same_run(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("way", ["whole run", "per step"])
def test_a_stopped_run_reads_its_validation_sets_no_more(way, problem):
    # Early stopping ends the run at epoch 2 of 6 (the loss falls, "max" mode wants it to
    # rise): epochs 1 and 2 are validated, and the loader is not read after.
    # The second run knows the steps' speed from the first: one call of the drive holds
    # every epoch, and the host must look before it reads the sets at each epoch's end.
    train, val, _ = problem
    stop = eqfit.EarlyStopping(monitor="loss", mode="max", patience=0, restore_best=False)
    more = dict(epochs=6, early_stopping=stop)
    if way == "per step":
        more["execution"] = eqfit.PerStep(2)
    for _ in range(2):
        loader = Batches(val)
        result = eqfit.fit(model_of(), train, validation_data=loader, **kwargs(**more))
        assert result.history.stop_reason == "early_stopping"
        assert len(result.history["val_loss"]) == 2 and loader.passes == 2


def test_ctrl_c_during_a_streamed_validation_stops_at_that_epochs_end(problem):
    # Ctrl-C while the loader is read for epoch 2's validation: the run ends there, its
    # result holding both epochs' validation values, and the loader is not read again.
    import signal

    train, val, _ = problem

    class Interrupting(Batches):
        def __iter__(self):
            if self.passes == 1:  # the second validation: epoch 2's
                signal.raise_signal(signal.SIGINT)
            yield from super().__iter__()

    loader = Interrupting(val)
    with pytest.raises(eqfit.TrainingInterrupted) as info:
        eqfit.fit(model_of(), train, validation_data=loader, **kwargs(epochs=6))
    history = info.value.result.history
    assert len(history["val_loss"]) == 2 and np.isfinite(history["val_loss"]).all()
    assert loader.passes == 2
