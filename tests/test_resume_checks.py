"""A resume checks that the run is the one checkpointed: its data, validation data,
metrics and optimizer by their fingerprints, refused where one differs, naming it with
both values, unless `Checkpoint(allow_changes=)` says the change is meant.
"""

import json
import re

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, regression_data

import eqfit


def problem(classes=False):
    """A tiny problem: 40 rows of 3 features, a linear model (or a 2-class MLP)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    if classes:
        y = (x.sum(1) > 0).astype(np.int32)
        model = eqfit.models.MLP(3, 2, 8, 1, key=jax.random.key(1))
        loss = eqfit.losses.softmax_cross_entropy
    else:
        y = x @ np.array([1.0, -2.0, 0.5], np.float32)
        model = eqfit.models.LinearRegression(3, key=jax.random.key(1))
        loss = eqfit.losses.mse
    kwargs = dict(loss=loss, optimizer=optax.adam(1e-2), key=jax.random.key(2), batch_size=16)
    return model, (x, y), kwargs


def refused(directory, *what):
    """The refusal's start, with each `(concern, old, new)` of `what` named in it."""
    said = [
        rf"{re.escape(c)}[^;]*: the checkpoint's {re.escape(old)}[^;]*, now {re.escape(new)}"
        for c, old, new in what
    ]
    return rf"written by a run that differs from this one.*{'.*'.join(said)}.*allow_changes"


@pytest.mark.slow
@pytest.mark.parametrize(
    "before, after, named",
    [
        (
            eqfit.metrics.ConfusionMatrix(2),
            eqfit.metrics.ConfusionMatrix(2, normalize="true"),
            ("metrics at `m.normalize`", "null", '"true"'),
        ),
        (
            eqfit.metrics.F1(2, average="macro"),
            eqfit.metrics.F1(2, average="micro"),
            ("metrics at `m.average`", '"macro"', '"micro"'),
        ),
    ],
)
def test_another_metric_configuration_is_refused(tmp_path, before, after, named):
    model, data, kwargs = problem(classes=True)
    kwargs |= dict(validation_data=data)
    first = eqfit.fit(model, data, metrics={"m": before}, epochs=2, checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=refused(tmp_path, named)):
        eqfit.fit(model, data, metrics={"m": after}, epochs=3, checkpoint=tmp_path, **kwargs)
    # Said to be meant, it resumes: the epochs before are the checkpoint's, the last
    # computed with the new configuration.
    allowed = eqfit.Checkpoint(tmp_path, allow_changes=("metrics",))
    result = eqfit.fit(model, data, metrics={"m": after}, epochs=3, checkpoint=allowed, **kwargs)
    np.testing.assert_array_equal(result.history.epoch, [1, 2, 3])
    np.testing.assert_array_equal(result.history["val_m"][:2], first.history["val_m"])
    alone = eqfit.evaluate(result.model, data, loss=kwargs["loss"], metrics={"m": after})
    np.testing.assert_allclose(result.history["val_m"][2], alone["m"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_another_learning_rate_is_refused(tmp_path):
    model, data, kwargs = problem()
    first = eqfit.fit(model, data, epochs=2, checkpoint=tmp_path, **kwargs)
    slower = kwargs | dict(optimizer=optax.adam(1e-3))
    # optax's `adam` scales by minus the rate: its `scale` step's `step_size`.
    named = ("optimizer at `optimizer.", "-0.01", "-0.001")
    with pytest.raises(ValueError, match=refused(tmp_path, named) + r'=\("optimizer",\)'):
        eqfit.fit(model, data, epochs=3, checkpoint=tmp_path, **slower)
    allowed = eqfit.Checkpoint(tmp_path, allow_changes="optimizer")
    result = eqfit.fit(model, data, epochs=3, checkpoint=allowed, **slower)
    # As the first run's end continued by hand with the new rate.
    by_hand = eqfit.fit(
        first.model,
        data,
        epochs=3,
        initial_epoch=2,
        opt_state=first.opt_state,
        **slower,
    )
    assert_trees_equal(result.model, by_hand.model)
    np.testing.assert_array_equal(result.history.loss[2:], by_hand.history.loss)


@pytest.mark.slow
def test_another_injected_learning_rate_is_refused_and_allowed_takes_effect(tmp_path):
    """`inject_hyperparams` keeps the rate in the optimizer's state, which the checkpoint
    holds: an allowed change must take the new one, not go on with the checkpoint's.
    """
    model, data, kwargs = problem()
    injected = lambda rate: optax.inject_hyperparams(optax.adam)(learning_rate=rate)  # noqa: E731
    kwargs.pop("optimizer")
    eqfit.fit(model, data, optimizer=injected(0.01), epochs=2, checkpoint=tmp_path, **kwargs)
    named = ("optimizer at `optimizer.init.numeric_hps.learning_rate`", "0.01", "0.001")
    with pytest.raises(ValueError, match=refused(tmp_path, named)):
        eqfit.fit(model, data, optimizer=injected(1e-3), epochs=3, checkpoint=tmp_path, **kwargs)
    allowed = eqfit.Checkpoint(tmp_path, allow_changes=("optimizer",))
    result = eqfit.fit(
        model, data, optimizer=injected(1e-3), epochs=3, checkpoint=allowed, **kwargs
    )
    np.testing.assert_allclose(result.history["learning_rate"], [0.01, 0.01, 0.001])
    np.testing.assert_allclose(result.opt_state.hyperparams["learning_rate"], 0.001)


def test_another_rate_given_in_opt_state_is_refused(tmp_path):
    """A sweep's rate given through `opt_state`'s injected hyperparameters."""
    model, data, kwargs = problem()
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    kwargs = kwargs | dict(optimizer=optimizer)

    def state(rate):
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        opt_state.hyperparams["learning_rate"] = np.float32(rate)
        return opt_state

    eqfit.fit(model, data, opt_state=state(0.1), epochs=2, checkpoint=tmp_path, **kwargs)
    named = ("optimizer at `hyperparams.learning_rate`", "0.10000000149011612", "0.05")
    with pytest.raises(ValueError, match=refused(tmp_path, named)):
        eqfit.fit(model, data, opt_state=state(0.05), epochs=3, checkpoint=tmp_path, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrays", "memmaps"])
def test_other_training_data_of_the_same_shapes_is_refused(tmp_path, kind):
    model, (x, y), kwargs = problem()
    other = (x[::-1].copy(), y[::-1].copy())  # the same rows in another order
    if kind == "memmaps":
        paths = []
        for name, a in (("x", x), ("y", y), ("x2", other[0]), ("y2", other[1])):
            np.save(tmp_path / f"{name}.npy", a)
            paths.append(np.load(tmp_path / f"{name}.npy", mmap_mode="r"))
        (x, y), other = paths[:2], tuple(paths[2:])
    directory = tmp_path / "run"
    eqfit.fit(model, (x, y), epochs=2, checkpoint=directory, **kwargs)
    with pytest.raises(ValueError, match=refused(directory, ("data", '"', '"'))):
        eqfit.fit(model, other, epochs=3, checkpoint=directory, **kwargs)
    allowed = eqfit.Checkpoint(directory, allow_changes=("data",))
    result = eqfit.fit(model, other, epochs=3, checkpoint=allowed, **kwargs)
    np.testing.assert_array_equal(result.history.epoch, [1, 2, 3])


@pytest.mark.slow
def test_other_validation_data_is_refused(tmp_path):
    model, data, kwargs = problem()
    val, other = regression_data(jax.random.key(3), 8, 3), regression_data(jax.random.key(4), 8, 3)
    eqfit.fit(model, data, validation_data=val, epochs=2, checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=refused(tmp_path, ("validation_data", '"', '"'))):
        eqfit.fit(model, data, validation_data=other, epochs=3, checkpoint=tmp_path, **kwargs)
    # Named sets: the one that differs is named.
    sets = lambda b: eqfit.ValidationSets(a=val, b=b)  # noqa: E731
    named = tmp_path / "named"
    eqfit.fit(model, data, validation_data=sets(val), epochs=2, checkpoint=named, **kwargs)
    with pytest.raises(ValueError, match=refused(named, ("validation_data at `b`", '"', '"'))):
        eqfit.fit(model, data, validation_data=sets(other), epochs=3, checkpoint=named, **kwargs)
    allowed = eqfit.Checkpoint(named, allow_changes=("validation_data",))
    result = eqfit.fit(
        model, data, validation_data=sets(other), epochs=3, checkpoint=allowed, **kwargs
    )
    by_hand = eqfit.evaluate(result.model, other, loss=kwargs["loss"])
    np.testing.assert_allclose(result.history["val_b_loss"][2], by_hand["loss"], rtol=1e-5)


def test_buckets_of_another_key_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    tokens = [
        rng.normal(size=(n, 2)).astype(np.float32) for n in rng.integers(2, 5, 24)
    ]  # all in one bucket
    labels = rng.normal(size=24).astype(np.float32)

    def buckets(key):
        return eqfit.Buckets((tokens, labels), lengths=(4, 8), batch_size=4, key=key)

    class Pool(eqx.Module):
        w: jax.Array

        def __call__(self, tokens, mask):
            return (tokens @ self.w * mask).sum() / mask.sum()

    def loss(model, tokens, labels, mask):
        return ((jax.vmap(model)(tokens, mask) - labels) ** 2).mean()

    model = Pool(jax.numpy.zeros(2))
    kwargs = dict(loss=loss, optimizer=optax.sgd(0.1), key=jax.random.key(0))
    first, second = buckets(jax.random.key(5)), buckets(jax.random.key(6))
    assert [b.shape for b in next(iter(first))] == [b.shape for b in next(iter(second))]
    eqfit.fit(model, first, epochs=1, checkpoint=tmp_path, **kwargs)
    with pytest.raises(ValueError, match=refused(tmp_path, ("data", '"', '"'))):
        eqfit.fit(model, second, epochs=2, checkpoint=tmp_path, **kwargs)
    allowed = eqfit.Checkpoint(tmp_path, allow_changes=("data",))
    assert eqfit.fit(model, second, epochs=2, checkpoint=allowed, **kwargs).history.epochs == 2


def test_several_changes_are_named_together(tmp_path):
    model, data, kwargs = problem()
    eqfit.fit(model, data, epochs=2, checkpoint=tmp_path, **kwargs)
    other = (data[0] + 1, data[1])
    changed = kwargs | dict(optimizer=optax.adam(1e-3))
    both = r'allow_changes=\("data", "optimizer"\)'
    with pytest.raises(ValueError, match=r"resumed: data \(a hash.*; optimizer at .*" + both):
        eqfit.fit(model, other, epochs=3, checkpoint=tmp_path, **changed)
    # One of the two allowed: the other is still refused, alone.
    with pytest.raises(ValueError, match=r"resumed: optimizer at [^;]*\. Resume.*" + both):
        eqfit.fit(
            model,
            other,
            epochs=3,
            checkpoint=eqfit.Checkpoint(tmp_path, allow_changes="data"),
            **changed,
        )


@pytest.mark.slow
def test_a_checkpoint_without_fingerprints_resumes_unchecked(tmp_path):
    """An earlier eqfit's checkpoints keep no fingerprints: they resume as before."""
    model, data, kwargs = problem()
    full = eqfit.fit(model, data, epochs=3, **kwargs)
    eqfit.fit(model, data, epochs=2, checkpoint=tmp_path, **kwargs)
    for manifest in tmp_path.glob("ckpt-*/manifest.json"):
        kept = json.loads(manifest.read_text())
        del kept["config"]["fingerprints"]
        manifest.write_text(json.dumps(kept))
    result = eqfit.fit(model, data, epochs=3, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(result.model, full.model)


def test_allow_changes_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"`allow_changes` must be a tuple of .*'optimizer'.*'lr'"):
        eqfit.Checkpoint(tmp_path, allow_changes=("lr",))
    assert eqfit.Checkpoint(tmp_path, allow_changes="data").allow_changes == ("data",)


# `eqfit.load` into a `like`: arrays by path and class.


class Pair(eqx.Module):
    first: jax.Array
    second: jax.Array

    def __call__(self, x):
        return x @ self.first @ self.second


def saved_pair(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = x @ rng.normal(size=(3, 3)).astype(np.float32)
    model = Pair(jax.numpy.eye(3) * 0.5, jax.numpy.eye(3) * 2.0)
    result = eqfit.fit(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.05),
        key=jax.random.key(0),
        epochs=2,
        batch_size=8,
    )
    eqfit.save(tmp_path / "pair.eqx", result)
    return result, x


def test_load_reads_each_array_at_its_path(tmp_path):
    """The same class with its fields declared in another order (the same shapes): each
    array goes to its field, where by position they would be swapped.
    """
    result, x = saved_pair(tmp_path)

    class Pair(eqx.Module):  # noqa: F811 (the saved class, as another version declares it)
        second: jax.Array
        first: jax.Array

        def __call__(self, x):
            return x @ self.first @ self.second

    skeleton = eqx.filter_eval_shape(Pair, jax.numpy.zeros((3, 3)), jax.numpy.zeros((3, 3)))
    loaded = eqfit.load(tmp_path / "pair.eqx", like=skeleton)
    np.testing.assert_array_equal(loaded.first, result.model.first)
    np.testing.assert_array_equal(loaded.second, result.model.second)
    np.testing.assert_array_equal(loaded(x), result.model(x))


def test_load_refuses_another_architecture(tmp_path):
    saved_pair(tmp_path)
    zeros = jax.numpy.zeros((3, 3))

    class Other(eqx.Module):  # the same leaves, other names
        u: jax.Array
        v: jax.Array

    class Swapped(eqx.Module):  # the same names, another class
        first: jax.Array
        second: jax.Array

    with pytest.raises(
        ValueError,
        match=r"`like`'s model differs .*: the file holds float32\[3, 3\] at `\.first` \(in "
        r"Pair\), which `like` has not; `like` has `\.u`, `\.v` instead",
    ):
        eqfit.load(tmp_path / "pair.eqx", like=Other(zeros, zeros))
    with pytest.raises(
        ValueError,
        match=r"at `\.first` the file holds float32\[3, 3\] in Pair, `like` holds "
        r"float32\[3, 3\] in Swapped",
    ):
        eqfit.load(tmp_path / "pair.eqx", like=Swapped(zeros, zeros))
    with pytest.raises(ValueError, match=r"at `\.second` the file holds float32\[3, 3\] in Pair, "):
        eqfit.load(tmp_path / "pair.eqx", like=Pair(zeros, jax.numpy.zeros((3, 2))))


@pytest.mark.slow
def test_load_names_another_activation(tmp_path):
    """The difference is named, not hidden behind the first leaves of both sides."""
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    model = eqx.nn.MLP(3, "scalar", 4, 2, key=jax.random.key(0))
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=jax.random.key(1))
    result = eqfit.fit(model, (x, x.sum(1)), epochs=1, batch_size=8, **kwargs)
    eqfit.save(tmp_path / "mlp.eqx", result)
    other = eqx.nn.MLP(3, "scalar", 4, 2, activation=jax.nn.tanh, key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"at `\.activation` the file holds function relu in MLP, `like` holds function "
        r"tanh in MLP\. Pass a result \(or model\) of the saved model's structure",
    ):
        eqfit.load(tmp_path / "mlp.eqx", like=other)
    assert_trees_equal(eqfit.load(tmp_path / "mlp.eqx", like=model), result.model)


def test_load_reads_a_file_without_paths_in_order(tmp_path):
    """A file of an eqfit before paths: read in order, as it was."""
    result, _ = saved_pair(tmp_path)
    path = tmp_path / "pair.eqx"
    magic, header, rest = path.read_bytes().split(b"\n", 2)
    kept = json.loads(header)
    for part in kept["structure"].values():
        del part["paths"]
    path.write_bytes(magic + b"\n" + json.dumps(kept).encode() + b"\n" + rest)
    loaded = eqfit.load(path, like=result)
    assert_trees_equal((loaded.model, loaded.opt_state), (result.model, result.opt_state))
