"""Real models in the step: mixed precision, a moving average, norms, aux values."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, regression_data

import eqfit


ADAM = optax.adam(1e-2)


def mse_with_aux(model, x, y):
    """The mean squared error, and what a research loss reports beside it."""
    pred = jax.vmap(model)(x)
    err = pred - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err)), "err": err}


def mlp(key, features=4, width=8):
    return eqfit.models.MLP(features, "scalar", width, 1, key=key)


def reference(model, x, y, loss, optimizer, epochs, batch_size, momentum):
    """A hand-written loop of the same run (no shuffle): the weights, their average, and
    per step the loss, the aux values, and the norms of the gradient and the update.
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state, average = optimizer.init(params), params

    @eqx.filter_jit
    def step(params, opt_state, average, xb, yb):
        def value(p):
            return loss(eqx.combine(p, static), xb, yb)

        (value, aux), grads = eqx.filter_value_and_grad(value, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
        average = jax.tree.map(lambda a, w: momentum * a + (1 - momentum) * w, average, params)
        aux = {k: jnp.mean(v) for k, v in aux.items()}
        norms = (optax.tree.norm(grads), optax.tree.norm(updates))
        return params, opt_state, average, value, aux, norms

    steps = []
    n = x.shape[0]
    for _ in range(epochs):
        for start in range(0, n, batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            params, opt_state, average, value, aux, norms = step(params, opt_state, average, xb, yb)
            steps.append((xb.shape[0], float(value), {k: float(v) for k, v in aux.items()}, norms))
    return eqx.combine(params, static), eqx.combine(average, static), steps


def epoch_means(steps, epochs, name):
    per_epoch = np.array_split(np.arange(len(steps)), epochs)
    return np.array(
        [
            sum(steps[i][0] * steps[i][2][name] for i in rows) / sum(steps[i][0] for i in rows)
            for rows in per_epoch
        ]
    )


@pytest.fixture(scope="module")
def problem():
    key = jax.random.key(7)
    x, y = regression_data(key, 52)  # batches of 16: a remainder batch of 4
    return mlp(jax.random.key(3)), x, y


@pytest.mark.slow
def test_aux_ema_and_norms_equal_a_hand_written_loop(problem):
    model, x, y = problem
    epochs, batch_size, momentum = 3, 16, 0.9
    result = eqfit.fit(
        model,
        (x, y),
        loss=mse_with_aux,
        optimizer=ADAM,
        key=jax.random.key(0),
        epochs=epochs,
        batch_size=batch_size,
        shuffle=False,
        ema=momentum,
        norms=True,
    )
    weights, average, steps = reference(
        model, x, y, mse_with_aux, ADAM, epochs, batch_size, momentum
    )
    history = result.history
    assert type(result.ema_model) is type(model)
    np.testing.assert_allclose(history["mae"], epoch_means(steps, epochs, "mae"), rtol=1e-6)
    np.testing.assert_allclose(history["err"], epoch_means(steps, epochs, "err"), atol=1e-6)
    step_mae = np.array([s[2]["mae"] for s in steps]).reshape(epochs, -1)
    np.testing.assert_allclose(history.step_values["mae"], step_mae, rtol=1e-6)
    grad_norms = np.array([float(s[3][0]) for s in steps]).reshape(epochs, -1)
    update_norms = np.array([float(s[3][1]) for s in steps]).reshape(epochs, -1)
    np.testing.assert_allclose(history.step_values["grad_norm"], grad_norms, rtol=1e-5)
    np.testing.assert_allclose(history.step_values["update_norm"], update_norms, rtol=1e-5)
    sizes = history.batch_sizes
    np.testing.assert_allclose(
        history["grad_norm"], (grad_norms * sizes).sum(1) / sizes.sum(1), rtol=1e-5
    )
    for got, want in zip(jax.tree.leaves(result.ema_model), jax.tree.leaves(average)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for got, want in zip(jax.tree.leaves(result.model), jax.tree.leaves(weights)):
        np.testing.assert_allclose(got, want, atol=1e-6)
    # The average moved from the initial weights, and is not the last weights.
    first = jax.tree.leaves(model)[0]
    assert not np.allclose(jax.tree.leaves(result.ema_model)[0], first)
    assert not np.allclose(jax.tree.leaves(result.ema_model)[0], jax.tree.leaves(weights)[0])


@pytest.mark.slow
def test_the_model_runs_once_per_step_with_aux(problem):
    model, x, y = problem
    calls = []

    class Counted(eqx.Module):
        inner: eqx.Module

        def __call__(self, x):
            calls.append(1)  # while JAX traces
            return self.inner(x)

    def plain(model, x, y):
        return mse_with_aux(model, x, y)[0]

    def traced(loss, **kwargs):
        calls.clear()
        eqfit.fit(
            Counted(model), (x, y), loss=loss, optimizer=ADAM, key=jax.random.key(0), **kwargs
        )
        return len(calls)

    # The aux values ride out of the loss's one forward pass; a metric would run the
    # model again.
    metric = {"mae": lambda model, x, y: mse_with_aux(model, x, y)[1]["mae"]}
    with_metric = traced(plain, epochs=1, batch_size=16, metrics=metric)
    plain_calls = traced(plain, epochs=1, batch_size=16)
    # Each loss is traced once before the run, to find what it returns (its aux names,
    # whether it is a weighted mean): the aux values cost no call of the model besides.
    assert traced(mse_with_aux, epochs=1, batch_size=16) == plain_calls
    assert with_metric > plain_calls


@pytest.mark.slow
def test_aux_values_are_validated_and_monitored(problem):
    model, x, y = problem
    val = (x[:20], y[:20])
    kwargs = dict(loss=mse_with_aux, optimizer=ADAM, key=jax.random.key(0), batch_size=16)
    result = eqfit.fit(
        model,
        (x, y),
        epochs=4,
        validation_data=val,
        early_stopping=eqfit.EarlyStopping(patience=10, monitor="val_mae", restore_best=False),
        **kwargs,
    )
    assert result.history.best_epoch is not None
    assert {"mae", "err", "val_loss", "val_mae", "val_err"} <= set(result.history.values)
    last = eqfit.evaluate(result.model, val, loss=mse_with_aux, batch_size=16)
    assert set(last) == {"loss", "mae", "err"}
    np.testing.assert_allclose(result.history["val_mae"][-1], last["mae"], rtol=1e-6)
    # Early stopping on a training aux value, and on the gradient norm.
    stop = eqfit.EarlyStopping(monitor="mae", patience=0, min_delta=1e9)
    stopped = eqfit.fit(model, (x, y), epochs=5, early_stopping=stop, **kwargs)
    assert stopped.history.epochs == 2 and stopped.history.stop_reason == "early_stopping"
    stop = eqfit.EarlyStopping(monitor="grad_norm", patience=0, min_delta=1e9)
    stopped = eqfit.fit(model, (x, y), epochs=5, early_stopping=stop, norms=True, **kwargs)
    assert stopped.history.epochs == 2


def test_bad_names_and_options_are_refused_before_compiling(problem):
    model, x, y = problem
    kwargs = dict(optimizer=ADAM, key=jax.random.key(0), batch_size=16)

    def named(name):
        return lambda model, x, y: (mse_with_aux(model, x, y)[0], {name: jnp.zeros(())})

    with pytest.raises(ValueError, match=r"aux value 'mae'.*metric 'mae'"):
        eqfit.fit(model, (x, y), loss=named("mae"), metrics={"mae": eqfit.metrics.mae}, **kwargs)
    with pytest.raises(ValueError, match=r"aux value 'grad_norm'.*built-in 'grad_norm'"):
        eqfit.fit(model, (x, y), loss=named("grad_norm"), **kwargs)
    with pytest.raises(ValueError, match="val_loss"):
        eqfit.fit(model, (x, y), loss=named("val_loss"), **kwargs)
    with pytest.raises(ValueError, match=r"`norms=True`"):
        stop = eqfit.EarlyStopping(monitor="grad_norm")
        eqfit.fit(model, (x, y), loss=eqfit.losses.mse, early_stopping=stop, **kwargs)
    with pytest.raises(ValueError, match=r"`ema` must be a number in \(0, 1\)"):
        eqfit.fit(model, (x, y), loss=eqfit.losses.mse, ema=1.0, **kwargs)
    with pytest.raises(ValueError, match="validate_ema"):
        eqfit.fit(model, (x, y), loss=eqfit.losses.mse, validate_ema=True, **kwargs)
    with pytest.raises(TypeError, match="`precision`"):
        eqfit.fit(model, (x, y), loss=eqfit.losses.mse, precision="float8", **kwargs)  # type: ignore
    with pytest.raises(ValueError, match="not a regular expression"):
        eqfit.Precision(keep=("(",))
    with pytest.raises(ValueError, match=r"returned a tuple of 3"):
        three = lambda model, x, y: (jnp.zeros(()), 1, 2)  # noqa: E731
        eqfit.fit(model, (x, y), loss=three, **kwargs)


def _dots(folder):
    """The operand types of every `dot_general` in the dumped run programs."""
    types = []
    for path in folder.iterdir():
        if "jit_run" in path.name:
            for line in path.read_text().splitlines():
                if "stablehlo.dot_general" in line:
                    types.append(re.findall(r"tensor<([^>]*)>", line.split(" : ")[-1]))
    return types


def test_bfloat16_runs_the_dots_in_bfloat16_and_returns_float32(tmp_path, getkey):
    x, y = regression_data(getkey(), 40, features=6)  # shapes of this test's own
    model = eqfit.models.MLP(6, "scalar", 12, 2, key=getkey())
    jax.config.update("jax_dump_ir_to", str(tmp_path))
    jax.config.update("jax_dump_ir_modes", "stablehlo")
    try:
        result = eqfit.fit(
            model,
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=ADAM,
            key=getkey(),
            batch_size=8,
            precision="bfloat16",
            validation_data=(x, y),
        )
    finally:
        jax.config.update("jax_dump_ir_to", "")
    dots = _dots(tmp_path)
    matrix = [d for d in dots if any(t.count("x") >= 2 for t in d)]  # not a mean's
    assert len(matrix) >= 9  # 3 layers: forward, and two in the backward pass each
    assert all(t.endswith("bf16") for d in matrix for t in d), [
        d for d in matrix if not all(t.endswith("bf16") for t in d)
    ]
    arrays = jax.tree.leaves(eqx.filter(result.model, eqx.is_array))
    assert all(leaf.dtype == jnp.float32 for leaf in arrays)
    assert np.isfinite(result.history.loss).all()
    assert result.opt_state[0].mu.layers[0].weight.dtype == jnp.float32  # pyright: ignore


def test_keep_leaves_matching_arrays_in_float32(getkey):
    seen = {}

    class Probe(eqx.Module):
        norm: jax.Array
        weight: jax.Array

        def __call__(self, x):
            seen["norm"], seen["weight"], seen["x"] = self.norm.dtype, self.weight.dtype, x.dtype
            return jnp.dot(self.weight, x * self.norm.astype(x.dtype))

    model = Probe(jnp.ones(4), jnp.ones(4))
    x, y = regression_data(getkey(), 16)
    policy = eqfit.Precision(jnp.bfloat16, keep=(r"\.norm$",))
    result = eqfit.fit(
        model, (x, y), loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), precision=policy
    )
    assert seen == {"norm": jnp.float32, "weight": jnp.bfloat16, "x": jnp.bfloat16}
    assert result.model.weight.dtype == jnp.float32
    out = eqfit.predict(result.model, x, precision=policy)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, jax.vmap(result.model)(x), rtol=2e-2, atol=2e-2)


def test_a_keep_pattern_that_matches_no_array_is_refused_before_compiling(getkey):
    x, y = regression_data(getkey(), 16)
    model = eqfit.models.MLP(4, "scalar", 8, 2, key=getkey())
    policy = eqfit.Precision(jnp.bfloat16, keep=(r"\.layers\[0\]", "nomatch_typo"))
    match = r"`precision`'s `keep` holds 'nomatch_typo'.*'\.layers\[0\]\.weight'"
    with pytest.raises(ValueError, match=match):
        eqfit.fit(
            model, (x, y), loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), precision=policy
        )
    with pytest.raises(ValueError, match=match):
        eqfit.predict(model, x, precision=policy)


def test_a_bfloat16_model_trains_on_a_float32_master_copy(getkey):
    x, y = regression_data(getkey(), 64)
    model = jax.tree.map(
        lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, mlp(getkey())
    )
    result = eqfit.fit(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(1e-3),
        key=getkey(),
        epochs=10,
        precision="bfloat16",
        ema=0.5,
    )
    arrays = lambda tree: jax.tree.leaves(eqx.filter(tree, eqx.is_array))  # noqa: E731
    assert all(a.dtype == jnp.bfloat16 for a in arrays(result.model))
    assert all(a.dtype == jnp.bfloat16 for a in arrays(result.ema_model))
    # The master copy trained in float32; the result is it, rounded.
    assert any(not np.array_equal(a, b) for a, b in zip(arrays(result.model), arrays(model)))
    state = result.opt_state[0]  # pyright: ignore
    assert all(a.dtype == jnp.float32 for a in arrays(state))


def _tiny_loss_problem(getkey):
    x, y = regression_data(getkey(), 64)

    def loss(model, x, y):
        # eqfit's losses take the outputs in float32; the gradient that reaches the
        # float16 model is about 1e-9 of the errors: zero in float16, unscaled.
        return eqfit.losses.mse(model, x, y) * 1e-9

    return eqfit.models.LinearRegression(4, key=getkey()), (x, y), loss


def test_float16_loss_scaling_learns_where_unscaled_float16_does_not(getkey):
    model, data, loss = _tiny_loss_problem(getkey)
    kwargs = dict(loss=loss, optimizer=optax.adam(0.3), key=getkey(), epochs=10, batch_size=16)
    start = eqfit.evaluate(model, data, loss=loss)["loss"]
    full = eqfit.fit(model, data, **kwargs)
    scaled = eqfit.fit(model, data, precision="float16", **kwargs)
    unscaled = eqfit.fit(
        model, data, precision=eqfit.Precision(jnp.float16, loss_scaling=False), **kwargs
    )
    assert full.history.loss[-1] < start / 10
    assert scaled.history.loss[-1] < start / 10
    assert "loss_scale" in scaled.history.values and "loss_scale" not in full.history.values
    # Without the scale, every gradient is zero in float16: the model does not move.
    assert_trees_equal(unscaled.model, model)


def test_an_overflowing_gradient_is_skipped_and_halves_the_scale(getkey):
    x, y = regression_data(getkey(), 32)
    model = eqfit.models.LinearRegression(4, key=getkey())

    def loss(model, x, y):  # large errors: the scaled gradient overflows float16
        return eqfit.losses.mse(model, x, 10.0 * y)

    policy = eqfit.Precision(jnp.float16, initial_scale=2.0**15, growth_steps=3)
    result = eqfit.fit(
        model,
        (x, y),
        loss=loss,
        optimizer=optax.sgd(1e-4),
        key=getkey(),
        epochs=3,
        batch_size=8,
        precision=policy,
    )
    history = result.history
    scales = history.step_values["loss_scale"].reshape(-1)
    skipped = history.step_values["skipped_steps"].reshape(-1)
    assert skipped[0] == 1 and skipped.sum() >= 1 and skipped[-1] == 0
    # The scale each step used follows Keras's rule from the steps' outcomes.
    expected, scale, good = [], 2.0**15, 0
    for was_skipped in skipped:
        expected.append(scale)
        if was_skipped:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == 3:
                scale, good = scale * 2, 0
    np.testing.assert_array_equal(scales, expected)
    np.testing.assert_array_equal(history["skipped_steps"], skipped.reshape(3, -1).sum(1))
    np.testing.assert_array_equal(history["loss_scale"], scales.reshape(3, -1)[:, -1])
    # A skipped step counts as a step, with a finite loss, and changes nothing.
    assert np.isfinite(history.step_loss).all() and history.batch_sizes.sum() == 3 * 32
    first = eqfit.fit(
        model,
        (x, y),
        loss=loss,
        optimizer=optax.sgd(1e-4),
        key=getkey(),
        epochs=1,
        steps_per_epoch=1,
        batch_size=8,
        precision=policy,
    )
    assert first.history["skipped_steps"][0] == 1
    assert_trees_equal(first.model, model)


@pytest.fixture(scope="module")
def everything():
    """A run with all four: float16 with scaling, an average, norms and aux values."""
    model = mlp(jax.random.key(5))
    x, y = regression_data(jax.random.key(6), 52)
    kwargs = dict(
        loss=mse_with_aux,
        optimizer=ADAM,
        batch_size=16,
        precision=eqfit.Precision(jnp.float16, growth_steps=2),
        ema=0.8,
        norms=True,
        validation_data=(x[:20], y[:20]),
        validate_ema=True,
    )
    return model, (x, y), kwargs


def test_all_four_agree_compiled_and_with_the_bar(everything):
    model, data, kwargs = everything
    compiled = eqfit.fit(model, data, key=jax.random.key(1), epochs=3, **kwargs)
    bar = eqfit.fit(model, data, key=jax.random.key(1), epochs=3, progress=True, **kwargs)
    assert_trees_equal(compiled.model, bar.model)
    assert_trees_equal(compiled.ema_model, bar.ema_model)
    for name, value in compiled.history.values.items():
        np.testing.assert_array_equal(value, bar.history[name], err_msg=name)
    # `validate_ema`: the validation values are the average's.
    val = eqfit.evaluate(
        compiled.ema_model,
        kwargs["validation_data"],
        loss=mse_with_aux,
        batch_size=16,
        precision=kwargs["precision"],
    )
    np.testing.assert_allclose(compiled.history["val_loss"][-1], val["loss"], rtol=1e-5)


def test_all_four_resume_from_a_checkpoint_bit_for_bit(everything, tmp_path):
    model, data, kwargs = everything
    whole = eqfit.fit(model, data, key=jax.random.key(1), epochs=4, **kwargs)

    class StopAfterTwo:
        def on_epoch_end(self, epoch, logs):
            return epoch == 2

    stopped = eqfit.fit(
        model,
        data,
        key=jax.random.key(1),
        epochs=4,
        checkpoint=tmp_path,
        callbacks=[StopAfterTwo()],
        **kwargs,
    )
    assert stopped.history.epochs == 2
    resumed = eqfit.fit(model, data, key=jax.random.key(1), epochs=4, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(whole.model, resumed.model)
    assert_trees_equal(whole.ema_model, resumed.ema_model)
    # The resumed run's history holds the epochs before the checkpoint too.
    for name, value in whole.history.values.items():
        np.testing.assert_array_equal(value, resumed.history[name], err_msg=name)
    assert resumed.history["skipped_steps"].sum() > 0  # the scale moved, and was kept
    # Another precision is another run: its checkpoints are refused.
    with pytest.raises(ValueError, match="precision"):
        other = {**kwargs, "precision": "bfloat16"}
        eqfit.fit(model, data, key=jax.random.key(1), epochs=4, checkpoint=tmp_path, **other)


@pytest.mark.heavy  # the suite's slowest; CI runs it
def test_all_four_on_several_devices_agree_with_one(everything):
    model, data, kwargs = everything
    kwargs = {**kwargs, "precision": "bfloat16"}  # float16 sums differ by device order
    one = eqfit.fit(model, data, key=jax.random.key(1), epochs=2, **kwargs)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    sharded = eqfit.fit(model, data, key=jax.random.key(1), epochs=2, mesh=mesh, **kwargs)
    pmapped = eqfit.fit(model, data, key=jax.random.key(1), epochs=2, devices=4, **kwargs)
    for other in (sharded, pmapped):
        for name in ("loss", "mae", "grad_norm", "val_loss"):
            np.testing.assert_allclose(one.history[name], other.history[name], rtol=2e-2)
        for a, b in zip(jax.tree.leaves(one.ema_model), jax.tree.leaves(other.ema_model)):
            np.testing.assert_allclose(a, b, atol=2e-2)


@pytest.mark.heavy  # the suite's slowest; CI runs it
def test_an_ensemble_with_all_four_trains_as_its_members(everything):
    model, data, kwargs = everything
    keys = jax.random.split(jax.random.key(2), 2)
    members = [mlp(k) for k in keys]
    stacked = eqx.filter_vmap(mlp)(keys)
    ensemble = eqfit.fit(stacked, data, key=jax.random.key(1), epochs=2, ensemble=True, **kwargs)
    member_keys = jax.random.split(jax.random.key(1), 2)
    for i, member in enumerate(members):
        alone = eqfit.fit(member, data, key=member_keys[i], epochs=2, **kwargs)
        np.testing.assert_allclose(ensemble.history["mae"][:, i], alone.history["mae"], rtol=1e-5)
        got = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, ensemble.ema_model)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(alone.ema_model)):
            np.testing.assert_allclose(a, b, atol=1e-5)


class Normed(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(4, 8, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema")
        self.out = eqx.nn.Linear(8, "scalar", key=k2)

    def __call__(self, x, state):
        # Equinox's BatchNorm takes its input in its statistics' dtype, which stay
        # float32 under a precision policy: so the norm runs in float32, as Keras's do.
        h, state = self.norm(self.linear(x).astype(jnp.float32), state)
        return self.out(jax.nn.relu(h)), state


def test_a_stateful_model_returns_aux_beside_its_state(getkey):
    model, state = eqx.nn.make_with_state(Normed)(getkey())
    x, y = regression_data(getkey(), 24)

    def loss(model, state, x, y):
        value, state = eqfit.losses.mse(model, state, x, y)
        return (value, {"half": value / 2}), state

    result = eqfit.fit(
        model,
        (x, y),
        loss=loss,
        optimizer=ADAM,
        key=getkey(),
        batch_size=8,
        state=state,
        precision="bfloat16",
        ema=0.5,  # below 0.5**3: the average moves off the initial weights
        norms=True,
    )
    np.testing.assert_allclose(result.history["half"], result.history.loss / 2, rtol=1e-6)
    # The state stays in its own dtypes, and moved.
    new, old = jax.tree.leaves(result.state), jax.tree.leaves(state)
    assert [a.dtype for a in new] == [a.dtype for a in old]
    assert not all(np.array_equal(a, b) for a, b in zip(new, old))


@pytest.mark.slow
def test_a_loader_trains_with_all_four_as_in_memory(everything):
    model, (x, y), kwargs = everything
    kwargs = {k: v for k, v in kwargs.items() if k not in ("validation_data", "validate_ema")}
    in_memory = eqfit.fit(model, (x, y), key=jax.random.key(1), epochs=2, shuffle=False, **kwargs)

    class Batches:
        def __iter__(self):
            for start in range(0, 52, 16):
                yield x[start : start + 16], y[start : start + 16]

    streamed = eqfit.fit(model, Batches(), key=jax.random.key(1), epochs=2, **kwargs)
    # The loader's programs and the in-memory run's are two programs. XLA:CPU computes
    # float16 alike in both (they agree to the bit). An accelerator's compiler fuses them
    # differently, and its float16 arithmetic is not the CPU's, so the two round at other
    # places: they agree to float16's resolution, its epsilon, not float32's. (On a TPU
    # v5e the history's values differed by up to 6.6e-5 relative, the average's arrays by
    # up to 3.5e-4.)
    rtol = 1e-6 if jax.default_backend() == "cpu" else float(np.finfo(np.float16).eps)
    for name, value in in_memory.history.values.items():
        np.testing.assert_allclose(value, streamed.history[name], rtol=rtol, err_msg=name)
    for a, b in zip(jax.tree.leaves(in_memory.ema_model), jax.tree.leaves(streamed.ema_model)):
        np.testing.assert_allclose(a, b, rtol=rtol)


@pytest.mark.slow
def test_fsdp_lays_out_the_average_as_the_parameters(getkey):
    model = eqfit.models.MLP(64, "scalar", 256, 2, key=getkey())
    x, y = regression_data(getkey(), 64, features=64)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    result = eqfit.fit(
        model,
        (x, y),
        loss=mse_with_aux,
        optimizer=ADAM,
        key=getkey(),
        batch_size=32,
        mesh=mesh,
        shard=eqfit.sharding.fsdp("data", min_bytes=0),
        precision="bfloat16",
        ema=0.5,  # two steps: a larger one would be warned of
        norms=True,
    )
    state = (result.model, result.opt_state, result.ema_model)
    total = sum(a.nbytes for a in jax.tree.leaves(state) if eqx.is_array(a))
    fullest = max(eqfit.sharding.bytes_per_device(state).values())
    # Each device holds its share, however many the mesh has: the tests' 8 CPU devices, or
    # one chip, whose share is all of it (the average's layout, below, still counts there).
    assert fullest <= total / mesh.devices.size * 1.02
    assert result.ema_model.layers[1].weight.sharding == result.model.layers[1].weight.sharding
    assert np.isfinite(result.history["grad_norm"]).all()


@pytest.mark.heavy  # the suite's slowest; CI runs it
def test_bfloat16_trains_the_digits_mlp_as_well_as_float32():
    from sklearn.datasets import load_digits

    pixels, target = load_digits(return_X_y=True)
    x = (np.asarray(pixels) / 16.0).astype(np.float32)
    y = np.asarray(target).astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[:1500], order[1500:]
    model = eqfit.models.MLP(64, 10, 64, 2, key=jax.random.key(0))
    kwargs = dict(
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.adam(3e-3),
        key=jax.random.key(1),
        epochs=20,
        batch_size=64,
    )
    accuracy = {"accuracy": eqfit.metrics.accuracy}
    scores = {}
    for precision in (None, "bfloat16"):
        result = eqfit.fit(model, (x[train], y[train]), precision=precision, **kwargs)
        scores[precision] = eqfit.evaluate(
            result.model,
            (x[test], y[test]),
            loss=eqfit.losses.softmax_cross_entropy,
            metrics=accuracy,
            precision=precision,
        )["accuracy"]
    assert scores[None] > 0.9
    assert abs(scores["bfloat16"] - scores[None]) <= 0.01, scores


@pytest.mark.heavy
def test_sharded_checkpoints_resume_the_average_and_the_scale_bit_for_bit(tmp_path, getkey):
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=getkey())
    x, y = regression_data(getkey(), 96, features=16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    kwargs = dict(
        loss=mse_with_aux,
        optimizer=ADAM,
        key=getkey(),
        batch_size=32,
        mesh=mesh,
        shard=eqfit.sharding.fsdp("data", min_bytes=0),
        precision=eqfit.Precision(jnp.float16, growth_steps=2),
        ema=0.9,
        norms=True,
    )

    class StopAfterTwo:
        def on_epoch_end(self, epoch, logs):
            return epoch == 2

    whole = eqfit.fit(model, (x, y), epochs=4, **kwargs)
    eqfit.fit(model, (x, y), epochs=4, checkpoint=tmp_path, callbacks=[StopAfterTwo()], **kwargs)
    resumed = eqfit.fit(model, (x, y), epochs=4, checkpoint=tmp_path, **kwargs)
    assert_trees_equal(whole.model, resumed.model)
    assert_trees_equal(whole.ema_model, resumed.ema_model)
    for name, value in whole.history.values.items():
        np.testing.assert_array_equal(value, resumed.history[name], err_msg=name)


def test_targets_stay_as_given_and_a_bfloat16_model_averages_in_float32(getkey):
    x, y = regression_data(getkey(), 32)
    big = 1e5 + y  # beyond float16's 65504: cast, it would be inf
    model = eqfit.models.LinearRegression(4, key=getkey())
    result = eqfit.fit(
        model, (x, big), loss=eqfit.losses.mse, optimizer=ADAM, key=getkey(), precision="float16"
    )
    assert np.isfinite(result.history.loss).all()
    # A bfloat16 model and an average of momentum 0.999: the average moves (in bfloat16,
    # 0.999 rounds to 1 and it never would), and comes back in bfloat16. Over five steps
    # the average is still almost all the initial weights, which `fit` warns of.
    low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model)
    with pytest.warns(UserWarning, match=r"`ema=0\.999` over this run's 5 steps leaves 99\.5%"):
        averaged = eqfit.fit(
            low,
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=getkey(),
            epochs=5,
            ema=0.999,
        )
    assert averaged.ema_model.weight.dtype == jnp.bfloat16
    assert not np.array_equal(averaged.ema_model.weight, low.weight)
