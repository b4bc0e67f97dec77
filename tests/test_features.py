"""Training features inside the compiled loop, equal on both paths."""

import csv

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_trees_equal, normal, regression_data

import eqfit


ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs


def both_paths(model, data, **kwargs):
    """Runs `fit` compiled and with the bar, checks they agree bitwise, returns one."""
    compiled = eqfit.fit(model, data, progress=False, **kwargs)
    bar = eqfit.fit(model, data, progress="bar", **kwargs)
    assert_trees_equal(compiled.model, bar.model)
    assert_trees_equal(compiled.state, bar.state)
    assert compiled.history.values.keys() == bar.history.values.keys()
    for name in compiled.history.values:
        np.testing.assert_array_equal(compiled.history[name], bar.history[name])
    assert compiled.history.stop_reason == bar.history.stop_reason
    assert compiled.history.best_epoch == bar.history.best_epoch
    return compiled


@pytest.fixture
def problem(getkey):
    x, y = regression_data(getkey(), 120)
    xv, yv = regression_data(getkey(), 37)
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())
    return model, (x, y), (xv, yv)


def test_validation_data_is_evaluated_after_each_epoch(getkey, problem):
    model, data, val = problem
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), batch_size=16)
    result = both_paths(model, data, validation_data=val, epochs=3, **kwargs)
    assert result.history.val_loss is not None and result.history.val_loss.shape == (3,)
    # The last epoch's value is the final model's loss on the whole validation set
    # (in batches of 16 with a remainder of 5: still the exact mean).
    expected = eqfit.losses.mse(eqx.nn.inference_mode(result.model), *val)
    np.testing.assert_allclose(result.history.val_loss[-1], expected, rtol=1e-5)
    # After one epoch, it is that model's loss too. (The run is stopped there by a callback:
    # its 10 epochs are test_callbacks_see_each_epoch_and_can_stop's program.)
    one = eqfit.fit(model, data, validation_data=val, epochs=10, callbacks=[StopAt(1)], **kwargs)
    assert one.history.epochs == 1
    np.testing.assert_allclose(one.history.val_loss[0], result.history.val_loss[0], rtol=1e-6)
    expected = eqfit.losses.mse(eqx.nn.inference_mode(one.model), *val)
    np.testing.assert_allclose(one.history.val_loss[0], expected, rtol=1e-5)


def test_validation_split_is_deterministic(getkey, problem):
    model, data, _ = problem
    key = getkey()
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, batch_size=10, epochs=2)
    a = eqfit.fit(model, data, validation_split=0.25, key=key, **kwargs)
    b = eqfit.fit(model, data, validation_split=0.25, key=key, **kwargs)
    c = eqfit.fit(model, data, validation_split=0.25, key=getkey(), **kwargs)
    np.testing.assert_array_equal(a.history.val_loss, b.history.val_loss)
    assert not np.array_equal(a.history.val_loss, c.history.val_loss)
    np.testing.assert_array_equal(a.history.batch_sizes, [[10] * 9] * 2)  # 90 of 120 train
    with pytest.raises(ValueError, match=r"`validation_split` must be in \(0, 1\)"):
        eqfit.fit(model, data, validation_split=1.0, key=key, **kwargs)
    with pytest.raises(ValueError, match=r"not both"):
        eqfit.fit(model, data, validation_split=0.2, validation_data=data, key=key, **kwargs)


def test_validation_data_must_match_data(getkey, problem):
    model, data, _ = problem
    with pytest.raises(ValueError, match=r"`validation_data` must hold arrays like `data`'s"):
        eqfit.fit(
            model,
            data,
            validation_data=(jnp.ones((5, 3)), jnp.ones(5)),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=getkey(),
        )


def test_metrics_on_training_and_validation_data(getkey):
    kx, kv = getkey(), getkey()
    x = normal(kx, (90, 4))
    y = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    xv = normal(kv, (31, 4))
    yv = (xv[:, 0] > 0).astype(jnp.int32) + (xv[:, 1] > 0).astype(jnp.int32)
    model = eqfit.models.MLP(4, 3, 16, 1, key=getkey())
    result = both_paths(
        model,
        (x, y),
        loss=eqfit.losses.softmax_cross_entropy,
        metrics={"accuracy": eqfit.metrics.accuracy, "again": eqfit.losses.softmax_cross_entropy},
        validation_data=(xv, yv),
        optimizer=ADAM,
        key=getkey(),
        epochs=4,
        batch_size=16,
    )
    h = result.history
    assert set(h.values) == {"loss", "accuracy", "again", "val_loss", "val_accuracy", "val_again"}
    assert h["accuracy"].shape == (4,) and np.all((h["accuracy"] >= 0) & (h["accuracy"] <= 1))
    # A metric equal to the loss reads back equal to the loss (same weighting).
    np.testing.assert_allclose(h["again"], h.loss, rtol=1e-6)
    np.testing.assert_allclose(h["val_again"], h.val_loss, rtol=1e-6)
    expected = eqfit.metrics.accuracy(result.model, xv, yv)
    np.testing.assert_allclose(h["val_accuracy"][-1], expected, rtol=1e-6)
    assert h["val_accuracy"][-1] > 0.6
    with pytest.raises(KeyError, match=r"No 'precision' in the history"):
        h["precision"]


def test_ready_metrics_against_direct_computation(getkey):
    model = eqfit.models.MLP(3, 4, 8, 1, key=getkey())
    x, y = normal(getkey(), (20, 3)), jnp.arange(20) % 4
    logits = jax.vmap(model)(x)
    np.testing.assert_allclose(
        eqfit.metrics.accuracy(model, x, y), np.mean(np.argmax(logits, -1) == np.asarray(y))
    )
    reg = eqfit.models.LinearRegression(3, key=getkey())
    t = normal(getkey(), (20,))
    pred = jax.vmap(reg)(x)
    np.testing.assert_allclose(eqfit.metrics.mae(reg, x, t), np.mean(np.abs(pred - t)), rtol=1e-6)
    labels = (t > 0).astype(jnp.int32)
    np.testing.assert_allclose(
        eqfit.metrics.binary_accuracy(reg, x, labels), np.mean((pred > 0) == (labels > 0))
    )


class Scalar(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return self.w * x


def drifting_problem():
    """Training pulls w from 0 to 1; validation prefers w = 0.3, so it gets worse after
    the second epoch: w = 1 - 0.8**e is 0.2, 0.36, 0.49, 0.59, ...
    """
    x, y = jnp.ones((4,)), jnp.ones((4,))
    val = (jnp.ones((4,)), jnp.full((4,), 0.3))

    def loss(model, x, y):
        return 0.5 * jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return Scalar(jnp.asarray(0.0)), (x, y), val, loss


@pytest.mark.parametrize("restore_best", [True, False])
def test_early_stopping_in_the_compiled_program(getkey, restore_best):
    model, data, val, loss = drifting_problem()
    result = both_paths(
        model,
        data,
        loss=loss,
        optimizer=optax.sgd(0.2),
        key=getkey(),
        epochs=100,
        batch_size=4,
        validation_data=val,
        early_stopping=eqfit.EarlyStopping(patience=2, restore_best=restore_best),
    )
    h = result.history
    assert h.epochs == 4  # best at epoch 2, no better at 3 and 4: stop
    assert h.best_epoch == 2
    assert h.stop_reason == "early_stopping"
    np.testing.assert_allclose(h.val_loss, 0.5 * (1 - 0.8 ** np.arange(1, 5) - 0.3) ** 2, rtol=1e-5)
    w = 0.36 if restore_best else 1 - 0.8**4
    np.testing.assert_allclose(result.model.w, w, rtol=1e-5)


def test_the_bar_counts_the_steps_run_when_early_stopping_ends_a_run(getkey, capsys):
    """Slow steps make the bar's calls short, so calls are queued past the early stop:
    the bar must end at the steps that ran, not count the queued calls' steps.
    """
    model, data, val, loss = drifting_problem()

    def slow_loss(model, x, y):  # milliseconds a step, computed on the device
        a = jax.lax.fori_loop(0, 30, lambda i, a: jnp.tanh(a @ a), jnp.full((256, 256), 0.01))
        return loss(model, x, y) + 0.0 * a[0, 0]

    result = eqfit.fit(
        model,
        data,
        loss=slow_loss,
        optimizer=optax.sgd(0.2),
        key=getkey(),
        epochs=100,
        batch_size=4,
        validation_data=val,
        early_stopping=eqfit.EarlyStopping(patience=2),
        progress="bar",
    )
    assert result.history.epochs == 4
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "epoch 4/100" in last and " 4/100 " in last, last


def test_early_stopping_on_a_maximised_metric(getkey):
    model, data, val, loss = drifting_problem()

    def closeness(model, x, y):
        return -jnp.mean(jnp.abs(jax.vmap(model)(x) - y))

    result = both_paths(
        model,
        data,
        loss=loss,
        metrics={"closeness": closeness},
        optimizer=optax.sgd(0.2),
        key=getkey(),
        epochs=50,
        batch_size=4,
        validation_data=val,
        early_stopping=eqfit.EarlyStopping(3, monitor="val_closeness", mode="max"),
    )
    assert result.history.best_epoch == 2 and result.history.epochs == 5


class Level(eqx.Module):
    a: jax.Array


def test_a_nan_monitor_never_improves_and_is_warned_of(getkey):
    """A monitored value that is NaN (a validation set whose weights sum to 0) is no
    improvement, even at the first epoch, and `fit` warns of it: with a validation
    weight that is 0 while the parameter is below 0 (after epoch 1), the best epoch is
    the first finite one and the patience counts from there.
    """
    x = jnp.ones((8, 1))

    def loss(model, x):
        return jnp.mean((model.a - 1.0) ** 2 + 0 * x)

    def val_loss(model, x):  # weight 0 while `a` is below 0
        weight = jnp.sum(x) * (model.a > 0)
        return eqfit.Mean(weight * (model.a - 1.0) ** 2, weight)

    kwargs = dict(
        epochs=8,
        batch_size=8,
        key=getkey(),
        validation_data=(x,),
        optimizer=optax.sgd(0.1),
        metrics={"val": val_loss},
        early_stopping=eqfit.EarlyStopping(2, monitor="val_val", mode="min", min_delta=10.0),
    )
    with pytest.warns(RuntimeWarning, match=r"monitor 'val_val' was NaN at epoch\(s\) 1 "):
        result = eqfit.fit(Level(jnp.asarray(-0.5)), (x,), loss=loss, **kwargs)
    h = result.history
    assert np.isnan(h["val_val"][0]) and np.isfinite(h["val_val"][1:]).all()
    # Epoch 2 is the first finite value and so the best; 3 and 4 do not beat it by 10.
    assert h.best_epoch == 2 and h.epochs == 4 and h.stop_reason == "early_stopping"


def test_early_stopping_monitor_must_exist(getkey, problem):
    model, data, _ = problem
    with pytest.raises(ValueError, match=r"monitor` is 'val_loss'.*computes \['loss'\]"):
        eqfit.fit(
            model,
            data,
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=getkey(),
            early_stopping=eqfit.EarlyStopping(2),
        )
    with pytest.raises(ValueError, match=r"patience` must be an integer of 0 or more, got -1"):
        eqfit.EarlyStopping(-1)


class BatchNormNet(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(4, 8, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(8, "scalar", key=k2)

    def __call__(self, x, state):
        h, state = self.norm(jax.nn.relu(self.linear(x)), state)
        return self.head(h), state


def batchnorm_loss(model, state, x, y):
    pred, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
    )
    return jnp.mean((pred - y) ** 2), state


@pytest.mark.slow
def test_stateful_model(getkey, problem):
    _, data, val = problem
    model, state = eqx.nn.make_with_state(BatchNormNet)(getkey())
    result = both_paths(
        model,
        data,
        state=state,
        loss=batchnorm_loss,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=16,
        validation_data=val,
    )
    assert result.state is not None
    before = state.get(model.norm.batch_state_index)[0]
    after = result.state.get(result.model.norm.batch_state_index)[0]
    assert not np.allclose(before, after)  # running statistics moved
    # Validation ran in inference mode with the final state.
    inference = eqx.nn.inference_mode(result.model)
    expected, _ = batchnorm_loss(inference, result.state, *val)
    np.testing.assert_allclose(result.history.val_loss[-1], expected, rtol=1e-5)
    assert result.history.loss[-1] < result.history.loss[0]


def nan_problem(getkey):
    """40 samples, batches of 10 in order; sample 25 is NaN, so step 2 of each epoch is."""
    x, y = regression_data(getkey(), 40)
    x = x.at[25, 0].set(jnp.nan)
    model = eqfit.models.LinearRegression(4, key=getkey())
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        batch_size=10,
        shuffle=False,
    )
    return model, (x, y), kwargs


@pytest.mark.parametrize("progress", [False, True])
def test_non_finite_loss_raises_with_the_last_finite_model(getkey, progress):
    model, (x, y), kwargs = nan_problem(getkey)
    with pytest.raises(eqfit.NonFiniteLossError, match=r"epoch 1, step 3 of 4") as info:
        eqfit.fit(model, (x, y), epochs=3, progress=progress, **kwargs)
    error = info.value
    assert (error.epoch, error.step) == (1, 3)  # counted from 1
    # The model it holds is the one after steps 0 and 1: the clean first 20 samples.
    clean = eqfit.fit(model, (x[:20], y[:20]), epochs=1, **kwargs)
    assert_trees_equal(error.result.model, clean.model)
    assert error.result.history.stop_reason == "non_finite_loss"
    assert np.isnan(error.result.history.step_loss[0, 2:]).all()


def test_non_finite_loss_stop(getkey):
    model, data, kwargs = nan_problem(getkey)
    result = both_paths(model, data, epochs=3, on_nan="stop", **kwargs)
    assert result.history.epochs == 1 and result.history.stop_reason == "non_finite_loss"
    assert np.isfinite(result.model.weight).all()


def test_every_nan_policy_trains_alike_on_clean_data(getkey, problem):
    """One guarded step for every policy: on finite losses they give the same bits."""
    model, data, val = problem
    # The settings of test_validation_data_is_evaluated_after_each_epoch: its program, for
    # "raise" and "stop".
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=16,
        validation_data=val,
    )
    results = [eqfit.fit(model, data, on_nan=policy, **kwargs) for policy in ("raise", "stop")]
    results.append(both_paths(model, data, on_nan="skip", **kwargs))
    for other in results[1:]:
        assert_trees_equal(results[0].model, other.model)
        assert_trees_equal(results[0].opt_state, other.opt_state)


def test_non_finite_loss_skip(getkey):
    model, (x, y), kwargs = nan_problem(getkey)
    result = both_paths(model, (x, y), epochs=3, on_nan="skip", **kwargs)
    # Skipping batch 2 every epoch trains exactly as if it were not there (Adam's count
    # is not advanced either).
    keep = np.r_[0:20, 30:40]
    without = eqfit.fit(model, (x[keep], y[keep]), epochs=3, **kwargs)
    assert_trees_close(result.model, without.model, rtol=1e-6, atol=1e-7)
    assert result.history.epochs == 3 and result.history.stop_reason is None
    assert np.isnan(result.history.step_loss[:, 2]).all()
    # The epoch's loss is the mean over the steps that trained.
    weights = np.array([10, 10, 0, 10]) / 30
    expected = np.nan_to_num(result.history.step_loss) @ weights
    np.testing.assert_allclose(result.history.loss, expected, rtol=1e-6)


def test_non_finite_loss_skip_twice_in_an_epoch(getkey):
    model, (x, y), kwargs = nan_problem(getkey)
    x = x.at[5, 1].set(jnp.inf)  # step 0 too, besides step 2
    # 3 epochs: test_non_finite_loss_skip's program.
    result = both_paths(model, (x, y), epochs=3, on_nan="skip", **kwargs)
    keep = np.r_[10:20, 30:40]
    without = eqfit.fit(model, (x[keep], y[keep]), epochs=3, **kwargs)
    assert_trees_close(result.model, without.model, rtol=1e-6, atol=1e-7)
    assert not np.isfinite(result.history.step_loss[:, [0, 2]]).any()
    assert np.isfinite(result.history.step_loss[:, [1, 3]]).all()


def test_optax_schedule_and_chain(getkey, problem):
    model, data, _ = problem
    schedule = optax.exponential_decay(1e-2, transition_steps=8, decay_rate=0.5)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    result = both_paths(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=optimizer,
        key=getkey(),
        epochs=2,
        batch_size=16,
    )
    assert int(result.opt_state[1][0].count) == 16  # 8 steps per epoch
    assert result.history.loss[-1] < result.history.loss[0]


def test_optax_multisteps_accumulates_gradients(getkey, problem):
    model, (x, y), _ = problem
    kwargs = dict(loss=eqfit.losses.mse, key=getkey(), epochs=2, shuffle=False)
    accumulated = eqfit.fit(
        model, (x, y), optimizer=optax.MultiSteps(optax.sgd(0.05), 2), batch_size=12, **kwargs
    )
    direct = eqfit.fit(model, (x, y), optimizer=optax.sgd(0.05), batch_size=24, **kwargs)
    assert_trees_close(accumulated.model, direct.model, rtol=1e-5, atol=1e-6)


def test_optax_reduce_on_plateau_reads_the_loss(getkey):
    model, data, _, loss = drifting_problem()
    optimizer = optax.chain(
        optax.sgd(1.0),
        optax.contrib.reduce_on_plateau(patience=1, factor=0.5, accumulation_size=1),
    )
    # Constant data that the model fits at once: the loss plateaus at zero.
    result = both_paths(
        Scalar(jnp.asarray(1.0)),
        data,
        loss=loss,
        optimizer=optimizer,
        key=getkey(),
        epochs=6,
        batch_size=4,
    )
    assert float(result.opt_state[1].scale) < 1.0


@pytest.mark.slow
def test_sam_in_opaque_mode_equals_a_hand_loop_that_calls_it_so(getkey, problem):
    """SAM's opaque mode asks for a `grad_fn`, the gradient at other parameters on the
    step's batch, and refuses the `value` that eqfit gives optimizers that read the loss:
    each optimizer gets the extra arguments it takes.
    """
    model, (x, y), _ = problem
    x, y = x[:48], y[:48]

    def sam() -> optax.GradientTransformationExtraArgs:
        return optax.contrib.sam(optax.sgd(0.05), optax.sgd(0.02), sync_period=3, opaque_mode=True)

    result = eqfit.fit(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=sam(),
        key=getkey(),
        epochs=2,
        batch_size=12,
        shuffle=False,
    )
    optimizer = sam()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    def loss(params, xb, yb):
        return eqfit.losses.mse(eqx.combine(params, static), xb, yb)

    for _ in range(2):
        for i in range(0, 48, 12):
            xb, yb = x[i : i + 12], y[i : i + 12]
            grads = jax.grad(loss)(params, xb, yb)
            grad_fn = lambda p, _: jax.grad(loss)(p, xb, yb)  # noqa: B023, E731
            updates, state = optimizer.update(grads, state, params, grad_fn=grad_fn)
            params = optax.apply_updates(params, updates)
    assert_trees_close(result.model, eqx.combine(params, static), rtol=1e-5, atol=1e-6)
    assert not jnp.allclose(
        jax.tree.leaves(eqx.filter(result.model, eqx.is_array))[0],
        jax.tree.leaves(eqx.filter(model, eqx.is_array))[0],
    )


@pytest.mark.slow
def test_history_exports(getkey, problem, tmp_path):
    model, data, val = problem
    result = eqfit.fit(
        model,
        data,
        validation_data=val,
        metrics={"mae": eqfit.metrics.mae},
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=32,
    )
    h = result.history
    d = h.to_dict()
    assert d["epoch"] == [1, 2, 3]
    assert d["val_mae"] == pytest.approx(h["val_mae"].tolist())
    h.to_csv(tmp_path / "history.csv")
    with open(tmp_path / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and float(rows[2]["loss"]) == pytest.approx(float(h.loss[2]))
    assert h.wall_time > 0
    pytest.importorskip("matplotlib")  # the plot alone needs the extra `eqfit[plot]`
    h.plot(tmp_path / "history.png")
    assert (tmp_path / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class StopAt:
    def __init__(self, epoch):
        self.epoch, self.seen = epoch, []

    def on_epoch_end(self, epoch, logs):
        self.seen.append((epoch, dict(logs)))
        return epoch >= self.epoch


@pytest.mark.parametrize("progress", [False, True])
def test_callbacks_see_each_epoch_and_can_stop(getkey, problem, progress):
    model, data, val = problem
    callback = StopAt(3)
    kwargs = dict(
        validation_data=val,
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        batch_size=16,
    )
    result = eqfit.fit(model, data, epochs=10, progress=progress, callbacks=[callback], **kwargs)
    assert [e for e, _ in callback.seen] == [1, 2, 3]  # counted from 1
    assert result.history.epochs == 3 and result.history.stop_reason == "callback"
    assert callback.seen[1][1]["val_loss"] == pytest.approx(float(result.history.val_loss[1]))
    # Stopped after epoch 3: the model is what three epochs give.
    three = eqfit.fit(model, data, epochs=3, **kwargs)
    assert_trees_equal(result.model, three.model)


@pytest.mark.parametrize("progress", [False, True])
def test_each_epoch_is_timed_and_its_throughput_given(getkey, problem, progress):
    model, data, _ = problem
    callback = StopAt(10**6)
    result = eqfit.fit(
        model,
        data,
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=getkey(),
        epochs=3,
        batch_size=16,  # a smaller last batch: samples are not steps times 16
        progress=progress,
        callbacks=[callback],
    )
    figures = result.history.throughput
    seconds = figures["epoch_seconds"]
    assert seconds.shape == (3,) and (seconds > 0).all()
    assert seconds.sum() <= result.history.wall_time
    samples = result.history.batch_sizes.sum(axis=1)
    np.testing.assert_allclose(figures["samples_per_second"] * seconds, samples, rtol=1e-9)
    steps = (result.history.batch_sizes > 0).sum(axis=1)
    np.testing.assert_allclose(figures["steps_per_second"] * seconds, steps, rtol=1e-9)
    # Callbacks see each epoch's figures as it ends.
    for (epoch, logs), value in zip(callback.seen, seconds):
        assert logs["epoch_seconds"] == value
