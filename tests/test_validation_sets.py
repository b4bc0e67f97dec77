"""Named validation sets, `validation_freq`, and fresh keys for a validation loss that
takes one.
"""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, regression_data

import eqfit


ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs
FROZEN = optax.set_to_zero()  # the weights never move: only the noise changes the loss


def both_paths(model, data, **kwargs):
    """Runs `fit` compiled and with the bar, checks they agree bitwise, returns one."""
    compiled = eqfit.fit(model, data, progress=False, **kwargs)
    bar = eqfit.fit(model, data, progress=True, **kwargs)
    assert_trees_equal(compiled.model, bar.model)
    assert compiled.history.values.keys() == bar.history.values.keys()
    for name in compiled.history.values:
        np.testing.assert_array_equal(compiled.history[name], bar.history[name])
    assert compiled.history.best_epoch == bar.history.best_epoch
    return compiled


@pytest.fixture
def problem(getkey):
    x, y = regression_data(getkey(), 48)
    sets = {"a": regression_data(getkey(), 21), "b": regression_data(getkey(), 13)}
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    return model, (x, y), sets


MAE = {"mae": eqfit.metrics.mae}


def mse_and_half(model, x, y):
    """The mean squared error, with an aux value."""
    value = eqfit.losses.mse(model, x, y)
    return value, {"half": value / 2}


@pytest.mark.slow
def test_each_named_set_is_evaluated_and_recorded_by_its_name(getkey, problem):
    model, data, sets = problem
    result = both_paths(
        model,
        data,
        loss=mse_and_half,
        optimizer=ADAM,
        key=getkey(),
        epochs=2,
        batch_size=8,
        metrics=MAE,
        validation_data=eqfit.ValidationSets(**sets),
        # A set's aux value is a monitor (known once the loss is traced).
        early_stopping=eqfit.EarlyStopping(monitor="val_b_half", patience=5, restore_best=False),
    )
    h = result.history
    assert list(h.values) == [
        "loss",
        "half",
        "mae",
        "val_a_loss",
        "val_a_half",
        "val_a_mae",
        "val_b_loss",
        "val_b_half",
        "val_b_mae",
    ]
    for name, val in sets.items():
        expected = eqfit.evaluate(result.model, val, loss=mse_and_half, metrics=MAE, batch_size=8)
        for value in ("loss", "half", "mae"):
            got = h[f"val_{name}_{value}"][-1]
            np.testing.assert_allclose(got, expected[value], rtol=1e-6)
    assert h.val_loss is None  # named sets have no plain `val_loss`


def test_one_unnamed_set_keeps_its_names_and_checkpoint_config(getkey, problem, tmp_path):
    model, data, sets = problem
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), batch_size=8)
    result = eqfit.fit(
        model, data, validation_data=sets["a"], metrics=MAE, checkpoint=tmp_path, **kwargs
    )
    assert list(result.history.values) == ["loss", "mae", "val_loss", "val_mae"]
    (manifest,) = tmp_path.glob("ckpt-*/manifest.json")
    config = json.loads(manifest.read_text())["config"]
    assert "validation_sets" not in config and "validation_freq" not in config
    # Named sets and a frequency are part of a run's identity: resuming under others is
    # refused, not mixed.
    with pytest.raises(ValueError, match="configuration"):
        eqfit.fit(
            model,
            data,
            validation_data=sets["a"],
            validation_freq=2,
            metrics=MAE,
            checkpoint=tmp_path,
            **kwargs,
        )


def test_early_stopping_and_keep_best_on_a_named_set(getkey, problem, tmp_path):
    model, data, sets = problem
    early = eqfit.EarlyStopping(patience=1, monitor="val_b_loss")
    result = eqfit.fit(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=optax.adam(0.3),  # large enough to overshoot: the loss does not fall evenly
        key=getkey(),
        epochs=8,
        batch_size=8,
        validation_data=eqfit.ValidationSets(**sets),
        early_stopping=early,
        checkpoint=eqfit.Checkpoint(tmp_path, keep=1, keep_best="val_b_loss"),
    )
    h = result.history
    values = h["val_b_loss"]
    assert h.best_epoch == int(np.argmin(values)) + 1
    assert h.stop_reason in ("early_stopping", None)
    monitors = [
        json.loads(path.read_text()).get("monitor")
        for path in tmp_path.glob("ckpt-*/manifest.json")
    ]
    kept = [m["value"] for m in monitors if m is not None]
    assert all(m["name"] == "val_b_loss" for m in monitors if m is not None)
    assert min(kept) == pytest.approx(float(np.min(values)), rel=1e-6)


def test_validation_freq_validates_every_nth_epoch(getkey, problem):
    model, data, sets = problem
    result = both_paths(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=2,
        batch_size=8,
        validation_data=eqfit.ValidationSets(**sets),
        validation_freq=2,
    )
    h = result.history
    for name, val in sets.items():
        column = h[f"val_{name}_loss"]
        assert np.isnan(column[0])
        expected = eqfit.evaluate(result.model, val, loss=eqfit.losses.mse, batch_size=8)
        np.testing.assert_allclose(column[1], expected["loss"], rtol=1e-6)
    assert np.all(np.isfinite(h.loss))


def test_early_stopping_waits_for_validated_epochs(getkey, problem):
    model, data, sets = problem
    # Frozen weights: every validated epoch has the same value, so the first validated
    # one (epoch 2) is the best and the next (epoch 4) does not improve on it. An epoch
    # not validated neither improves nor counts towards the patience.
    seen = []

    class Logs:
        stops_training = False

        def on_epoch_end(self, epoch, logs):
            seen.append(logs["val_loss"])

    result = eqfit.fit(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=FROZEN,
        key=getkey(),
        epochs=6,
        batch_size=16,
        validation_data=sets["a"],
        validation_freq=2,
        early_stopping=eqfit.EarlyStopping(patience=0),
        callbacks=[Logs()],
    )
    assert result.history.epochs == 4
    assert result.history.best_epoch == 2
    assert result.history.stop_reason == "early_stopping"
    # The callbacks see NaN for an epoch not validated.
    assert np.isnan(seen[0]) and np.isnan(seen[2])
    assert seen[1] == seen[3] == result.history.val_loss[1]


@pytest.mark.slow
def test_named_sets_in_an_ensemble(getkey, problem):
    model, data, sets = problem
    members = jax.tree.map(lambda a: jnp.stack([a, a * 0.5]) if eqx.is_array(a) else a, model)
    result = eqfit.fit(
        members,
        data,
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=2,
        batch_size=8,
        ensemble=True,
        validation_data=eqfit.ValidationSets(**sets),
        validation_freq=2,
    )
    column = result.history["val_b_loss"]  # (epochs, members)
    assert column.shape == (2, 2) and np.all(np.isnan(column[0]))
    for i in range(2):
        member = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, result.model)
        expected = eqfit.evaluate(member, sets["b"], loss=eqfit.losses.mse, batch_size=8)
        np.testing.assert_allclose(column[1, i], expected["loss"], rtol=1e-5)


@pytest.mark.heavy  # several devices: CI runs it, the README's command leaves it out
@pytest.mark.parametrize("where", ["devices", "mesh"])
def test_named_sets_on_several_devices(getkey, problem, where):
    model, data, sets = problem
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=2,
        batch_size=8,
        validation_data=eqfit.ValidationSets(**sets),
        validation_freq=2,
    )
    one = eqfit.fit(model, data, **kwargs)
    if where == "devices":
        several = eqfit.fit(model, data, devices=2, **kwargs)
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
        several = eqfit.fit(model, data, mesh=mesh, **kwargs)
    for name in ("val_a_loss", "val_b_loss"):
        assert np.isnan(several.history[name][0])
        np.testing.assert_allclose(several.history[name], one.history[name], rtol=1e-5)


@pytest.mark.slow
def test_plan_counts_every_set(getkey, problem):
    model, data, sets = problem
    big = regression_data(getkey(), 4000)  # 80 kB, far above the program's own changes
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), batch_size=8)
    one = eqfit.plan(model, data, validation_data=eqfit.ValidationSets(a=sets["a"]), **kwargs)
    two = eqfit.plan(
        model, data, validation_data=eqfit.ValidationSets(a=sets["a"], big=big), **kwargs
    )
    extra = sum(x.nbytes for x in big)
    assert extra <= two.memory.argument - one.memory.argument < extra + 1024


def test_clashing_and_bad_names_are_refused(getkey, problem, tmp_path):
    model, data, sets = problem
    a, b = sets["a"], sets["b"]
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=getkey())
    # Two sets whose names make one history entry.
    with pytest.raises(ValueError, match=r"`validation_data`: set 'a_b''s loss and set 'a'"):
        eqfit.fit(
            model,
            data,
            validation_data=eqfit.ValidationSets(a=a, a_b=b),
            metrics={"b_loss": eqfit.losses.mse},
            **kwargs,
        )
    # A metric named as a set's entry: every `val_` name is validation's, as for aux values.
    with pytest.raises(ValueError, match=r"metric 'val_a_loss', a name the run gives to valid"):
        eqfit.fit(
            model,
            data,
            validation_data=eqfit.ValidationSets(a=a),
            metrics={"val_a_loss": eqfit.losses.mse},
            **kwargs,
        )

    # A set's entry and an aux value's (known once the loss is traced, still before any
    # compilation).
    def with_aux(model, x, y):
        return eqfit.losses.mse(model, x, y), {"val_a_loss": jnp.zeros(())}

    with pytest.raises(ValueError, match=r"aux value 'val_a_loss'"):
        eqfit.fit(
            model, data, validation_data=eqfit.ValidationSets(a=a), **kwargs | {"loss": with_aux}
        )
    for bad in ("", "a-b", "_a", "2a", "a b"):
        with pytest.raises(ValueError, match=r"`eqfit.ValidationSets` has a set named"):
            eqfit.ValidationSets(**{bad: a})
    with pytest.raises(ValueError, match=r"holds no set"):
        eqfit.ValidationSets()
    # A set unlike `data`, named.
    with pytest.raises(ValueError, match=r"`validation_data`'s set 'b' must hold arrays like"):
        eqfit.fit(
            model, data, validation_data=eqfit.ValidationSets(a=a, b=(b[0][:, :3], b[1])), **kwargs
        )
    # Monitors that named sets do not make.
    with pytest.raises(ValueError, match=r"there is no plain `val_loss`"):
        eqfit.fit(
            model,
            data,
            validation_data=eqfit.ValidationSets(a=a),
            early_stopping=eqfit.EarlyStopping(),
            **kwargs,
        )
    with pytest.raises(ValueError, match=r"`checkpoint`'s `keep_best` is 'val_c_loss'"):
        eqfit.fit(
            model,
            data,
            validation_data=eqfit.ValidationSets(a=a),
            checkpoint=eqfit.Checkpoint(tmp_path, keep_best="val_c_loss"),
            **kwargs,
        )


def test_validation_freq_is_checked(getkey, problem):
    model, data, sets = problem
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=getkey())
    with pytest.raises(ValueError, match=r"`validation_freq=2` .* validates nothing"):
        eqfit.fit(model, data, validation_freq=2, **kwargs)
    with pytest.raises(ValueError, match=r"`validation_freq` must be 1 or more"):
        eqfit.fit(model, data, validation_data=sets["a"], validation_freq=0, **kwargs)
    with pytest.raises(TypeError, match=r"`validation_freq`"):
        eqfit.fit(model, data, validation_data=sets["a"], validation_freq=True, **kwargs)


def test_a_list_of_datasets_is_refused_with_advice_that_works(getkey, problem):
    model, data, sets = problem
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), batch_size=8)
    given = [sets["a"], sets["b"]]
    with pytest.raises(TypeError, match=r"list of 2 datasets") as info:
        eqfit.fit(model, data, validation_data=given, **kwargs)
    call = re.search(r"`validation_data=(eqfit\.ValidationSets\(.*?\))`", str(info.value))
    assert call is not None
    followed = eqfit.fit(
        model, data, validation_data=eval(call.group(1), {"eqfit": eqfit, "sets": given}), **kwargs
    )
    assert {"val_a_loss", "val_b_loss"} <= set(followed.history.values)
    # A tuple of datasets is one dataset of nested arrays, unlike `data`: said so.
    with pytest.raises(ValueError, match=r"a tuple of 2 datasets, each like `data`"):
        eqfit.fit(model, data, validation_data=tuple(given), **kwargs)
    # A list of arrays is still told to be a tuple.
    with pytest.raises(TypeError, match=r"Pass `tuple\(...\)`"):
        eqfit.fit(model, data, validation_data=list(sets["a"]), **kwargs)


# Fresh validation noise.


def noisy_mse(model, x, y, *, key):
    """A loss with noise, as a variational loss's sampling: it requires a key."""
    return eqfit.losses.mse(model, x, y) + 0.1 * jax.random.normal(key)


@pytest.mark.slow
def test_validation_noise_is_fresh_and_reproducible(getkey, problem):
    model, data, sets = problem
    key = getkey()
    kwargs = dict(
        loss=noisy_mse, optimizer=FROZEN, epochs=2, batch_size=8, validation_data=sets["a"]
    )
    result = both_paths(model, data, key=key, **kwargs)
    val = result.history.val_loss
    assert val[0] != val[1]  # the same weights, new noise
    again = eqfit.fit(model, data, key=key, **kwargs)
    np.testing.assert_array_equal(again.history.val_loss, val)
    other = eqfit.fit(model, data, key=getkey(), **kwargs)
    assert not np.array_equal(other.history.val_loss, val)
    # Each batch of the epoch has its own key: evaluating with that epoch's key gives the
    # epoch's value. (The run's fold for validation is 2; the steps' is 1.)
    for epoch in (1, 2):
        epoch_key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 2), epoch), 0)
        got = eqfit.evaluate(model, sets["a"], loss=noisy_mse, batch_size=8, key=epoch_key)
        np.testing.assert_allclose(val[epoch - 1], got["loss"], rtol=1e-6)


@pytest.mark.slow
def test_validation_leaves_the_training_keys_alone(getkey, problem):
    model, data, sets = problem
    kwargs = dict(loss=noisy_mse, optimizer=ADAM, key=getkey(), epochs=2, batch_size=8)
    plain = eqfit.fit(model, data, **kwargs)
    validated = eqfit.fit(model, data, validation_data=eqfit.ValidationSets(**sets), **kwargs)
    assert_trees_equal(plain.model, validated.model)
    np.testing.assert_array_equal(plain.history.step_loss, validated.history.step_loss)
    a, b = validated.history["val_a_loss"], validated.history["val_b_loss"]
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))


def test_evaluate_with_a_key(getkey, problem):
    model, _, sets = problem
    x, y = sets["a"]  # 21 samples: batches of 8, 8 and 5
    kwargs = dict(loss=noisy_mse, batch_size=8)
    key = getkey()
    first = eqfit.evaluate(model, (x, y), key=key, **kwargs)
    assert eqfit.evaluate(model, (x, y), key=key, **kwargs) == first
    assert eqfit.evaluate(model, (x, y), key=getkey(), **kwargs) != first
    # Batch `b` gets `fold_in(key, b)`; by default every batch gets `key(0)`, as before.
    inference = eqx.nn.inference_mode(model)
    parts = [(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:], y[16:])]

    def mean(keys):
        losses = [noisy_mse(inference, *p, key=k) * len(p[0]) for p, k in zip(parts, keys)]
        return float(sum(losses) / len(x))

    expected = mean([jax.random.fold_in(key, b) for b in range(3)])
    assert first["loss"] == pytest.approx(expected, rel=1e-6)
    default = eqfit.evaluate(model, (x, y), **kwargs)
    assert default["loss"] == pytest.approx(mean([jax.random.key(0)] * 3), rel=1e-6)


class Noisy(eqx.Module):
    """A model that adds noise to its input, given a key."""

    def __call__(self, x, *, key=None):
        if key is None:
            return x
        return x + jax.random.normal(key, x.shape)


def test_predict_with_a_key(getkey):
    x = jnp.zeros((10, 3))
    key = getkey()
    plain = eqfit.predict(Noisy(), x, batch_size=4)
    np.testing.assert_array_equal(plain, x)  # no key by default
    noisy = eqfit.predict(Noisy(), x, batch_size=4, key=key)
    np.testing.assert_array_equal(eqfit.predict(Noisy(), x, batch_size=4, key=key), noisy)
    assert not np.array_equal(eqfit.predict(Noisy(), x, batch_size=4, key=getkey()), noisy)
    # Each batch has its own key, and each example its own share of it.
    assert not np.array_equal(noisy[:4], noisy[4:8])
    assert len({tuple(row) for row in np.asarray(noisy).tolist()}) == 10


def test_plot_draws_each_set_on_its_validated_epochs():
    pytest.importorskip("matplotlib")
    nan = np.nan
    values = {
        "loss": np.array([3.0, 2.0, 1.5, 1.0]),
        "val_a_loss": np.array([nan, 2.5, nan, 1.2]),
        "val_b_loss": np.array([nan, 2.7, nan, 1.4]),
    }
    history = eqfit.History(values, np.zeros((4, 1)), np.ones((4, 1), int), 0.0)
    figure = history.plot()
    lines = figure.axes[0].lines
    assert [line.get_label() for line in lines] == [
        "train loss",
        "validation a loss",
        "validation b loss",
    ]
    assert list(lines[1].get_xdata()) == [2, 4] and list(lines[2].get_ydata()) == [2.7, 1.4]
    import matplotlib.pyplot as plt

    plt.close(figure)
