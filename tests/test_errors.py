"""Bad input fails at the call, with a message naming the argument and the sizes."""

import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

import eqfit


@pytest.fixture
def setup(getkey):
    model = eqfit.models.LinearRegression(3, key=getkey())
    x, y = jnp.ones((10, 3)), jnp.ones(10)
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=getkey())
    return model, x, y, kwargs


def test_lengths_differ(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`data\[0\]` has 10 samples but `data\[1\]` has 9"):
        eqfit.fit(model, (x, y[:9]), **kwargs)


def test_empty_data(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`data` is empty: its arrays have 0 samples"):
        eqfit.fit(model, (x[:0], y[:0]), **kwargs)
    with pytest.raises(ValueError, match=r"`data` is empty"):
        eqfit.fit(model, (), **kwargs)


@pytest.mark.parametrize("batch_size", [0, -4])
def test_bad_batch_size(setup, batch_size):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=rf"`batch_size` must be at least 1, got {batch_size}"):
        eqfit.fit(model, (x, y), batch_size=batch_size, **kwargs)


def test_batch_larger_than_data_with_drop_remainder(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`batch_size`=32 is larger than the 10 samples"):
        eqfit.fit(model, (x, y), batch_size=32, drop_remainder=True, **kwargs)


def test_negative_epochs(setup):
    model, x, y, kwargs = setup
    with pytest.raises(ValueError, match=r"`epochs` must be an integer of 0 or more, got -1"):
        eqfit.fit(model, (x, y), epochs=-1, **kwargs)


def test_data_not_arrays(setup):
    model, x, y, kwargs = setup
    with pytest.raises(TypeError, match=r"`data\[0\]` must be a numpy or JAX array, got a list"):
        eqfit.fit(model, ([1.0, 2.0], [3.0, 4.0]), **kwargs)
    with pytest.raises(TypeError, match=r"tuple of arrays.*shape \(10, 3\).*pass `\(x,\)`"):
        eqfit.fit(model, x, **kwargs)
    with pytest.raises(TypeError, match=r"`data` must be a tuple of arrays.*got a float"):
        eqfit.fit(model, 3.0, **kwargs)


def test_data_of_strings(setup):
    model, x, _, kwargs = setup
    with pytest.raises(TypeError, match=r"`data\[1\]` has dtype <U1"):
        eqfit.fit(model, (x, np.array(["a"] * 10)), **kwargs)


def test_scalar_data(setup):
    model, x, _, kwargs = setup
    with pytest.raises((TypeError, ValueError), match=r"data"):
        eqfit.fit(model, (x, np.float32(1.0)), **kwargs)


@pytest.mark.parametrize("progress", [False, True])
def test_loss_not_scalar(setup, progress):
    model, x, y, kwargs = setup
    kwargs["loss"] = lambda m, a, b: jax.vmap(m)(a) - b
    with pytest.raises(ValueError, match=r"must return a scalar.*shape \(10,\)"):
        eqfit.fit(model, (x, y), progress=progress, **kwargs)


def test_loss_not_float(setup):
    model, x, y, kwargs = setup
    kwargs["loss"] = lambda m, a, b: jnp.sum(a > 0)
    with pytest.raises(TypeError, match=r"float scalar, got dtype int32"):
        eqfit.fit(model, (x, y), **kwargs)


@pytest.mark.parametrize("key", [jnp.ones(3), 0, jax.random.split(jax.random.key(0))])
def test_not_a_key(setup, key):
    model, x, y, kwargs = setup
    kwargs["key"] = key
    with pytest.raises(
        TypeCheckError, match=r"`fit`'s argument `key` must be a single PRNG key"
    ) as info:
        eqfit.fit(model, (x, y), **kwargs)
    assert len(str(info.value)) < 800 and "Called with parameters" not in str(info.value)


def test_optimizer_factory_instead_of_optimizer(setup):
    model, x, y, kwargs = setup
    kwargs["optimizer"] = optax.sgd
    with pytest.raises(
        TypeCheckError,
        match=r"`fit`'s argument `optimizer` must be one optax `GradientTransformation`, such "
        r"as `optax.adam\(1e-3\)` \(`optax.adam` itself makes one when called",
    ):
        eqfit.fit(model, (x, y), **kwargs)


def test_features_do_not_fit_the_model(setup):
    model, _, y, kwargs = setup
    with pytest.raises(ValueError, match=r"expects one example `x` of shape \(3,\), got \(4,\)"):
        eqfit.fit(model, (jnp.ones((10, 4)), y), **kwargs)


def test_target_shape_does_not_fit_the_outputs(setup):
    model, x, _, kwargs = setup
    with pytest.raises(ValueError, match=r"outputs have shape \(10,\) but `y` has shape \(10, 1\)"):
        eqfit.fit(model, (x, jnp.ones((10, 1))), **kwargs)


def test_float_labels_for_cross_entropy(getkey):
    model = eqfit.models.MLP(3, 4, 8, 1, key=getkey())
    with pytest.raises(
        TypeCheckError, match=r"`fit`'s argument `data` does not suit.*parameter `y`"
    ):
        eqfit.fit(
            model,
            (jnp.ones((10, 3)), jnp.ones(10)),
            loss=eqfit.losses.softmax_cross_entropy,
            optimizer=optax.sgd(0.1),
            key=getkey(),
        )


@pytest.fixture
def classes(getkey):
    model = eqfit.models.MLP(4, 3, 16, 1, key=getkey())  # a constructor other tests compile
    x = jnp.ones((12, 4))
    kwargs = dict(loss=eqfit.losses.softmax_cross_entropy, optimizer=optax.sgd(0.1), key=getkey())
    return model, x, kwargs


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
@pytest.mark.parametrize("label", [-1, 7])
def test_labels_out_of_range_are_named(classes, progress, label):
    model, x, kwargs = classes
    y = jnp.zeros(12, jnp.int32).at[5].set(label)
    match = rf"label {label} \(at \(5,\) of a batch\) is outside \[0, 3\): the model gives 3"
    with pytest.raises(ValueError, match=match) as info:
        eqfit.fit(model, (x, y), batch_size=12, progress=progress, **kwargs)
    assert isinstance(info.value.result, eqfit.FitResult)  # what it trained, untouched
    np.testing.assert_array_equal(info.value.result.model.layers[0].weight, model.layers[0].weight)


@pytest.mark.slow
def test_labels_checked_by_every_ready_function(classes, getkey):
    model, x, kwargs = classes
    good = jnp.zeros(12, jnp.int32)
    bad = good.at[0].set(3)
    with pytest.raises(ValueError, match=r"label 3 .* outside \[0, 3\)"):
        eqfit.fit(model, (x, good), validation_data=(x, bad), **kwargs)
    with pytest.raises(ValueError, match=r"`accuracy`: label 3 .* outside \[0, 3\)"):
        eqfit.metrics.accuracy(model, x, bad)
    with pytest.raises(ValueError, match=r"`softmax_cross_entropy`: label 3"):
        eqfit.evaluate(model, (x, bad), loss=eqfit.losses.softmax_cross_entropy)
    linear = eqfit.models.LinearRegression(4, key=getkey())
    with pytest.raises(ValueError, match=r"`binary_cross_entropy`: label 2.0 .* outside \[0, 1\]"):
        eqfit.fit(
            linear,
            (x, jnp.zeros(12).at[4].set(2.0)),
            loss=eqfit.losses.binary_cross_entropy,
            optimizer=optax.sgd(0.1),
            key=getkey(),
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad, reported",
    [
        ({9: 5, 6: 4}, "label 4 (at (2,)"),
        ({13: 7}, "label 7 (at (1,)"),
        pytest.param({13: 7, 2: 3}, "label 3 (at (2,)", marks=pytest.mark.heavy),
    ],
)
def test_evaluation_reports_the_first_bad_label_of_any_batch(getkey, bad, reported):
    # 14 rows in batches of 4: three full batches (a scan), then a last one of 2.
    model = eqx.nn.Linear(4, 3, key=getkey())
    x = jax.random.normal(getkey(), (14, 4))
    labels = np.zeros(14, np.int32)
    for at, label in bad.items():
        labels[at] = label
    loss = eqfit.losses.softmax_cross_entropy
    with pytest.raises(ValueError, match=re.escape(reported)):
        eqfit.evaluate(model, (x, labels), loss=loss, batch_size=4)
    with pytest.raises(ValueError, match=re.escape(reported)):
        eqfit.fit(
            model,
            (x, np.zeros(14, np.int32)),
            loss=loss,
            optimizer=optax.sgd(0.1),
            key=getkey(),
            batch_size=4,
            validation_data=(x, labels),
        )


def test_unclear_inputs_get_clear_errors(setup, getkey):
    model, x, y, kwargs = setup
    with pytest.raises(TypeError, match=r"`data` is a list of 2 arrays; pass them as a tuple"):
        eqfit.fit(model, [x, y], **kwargs)
    with pytest.raises(ValueError, match=r"more than the 2\*\*31 - 1 a run can count"):
        eqfit.fit(model, (x, y), epochs=10**12, **kwargs)
    with pytest.raises(ValueError, match=r"`opt_state` is not this optimizer's state.*Adam"):
        eqfit.fit(model, (x, y), opt_state=optax.adam(0.1).init(model), **kwargs)
    with pytest.raises(ValueError, match=r"`validation_split` must be in \(0, 1\).*got nan"):
        eqfit.fit(model, (x, y), validation_split=float("nan"), **kwargs)
    with pytest.raises(ValueError, match=r"stack of members.*is it a single model\?"):
        eqfit.fit(eqfit.models.MLP(3, 4, 8, 1, key=getkey()), (x, y), ensemble=True, **kwargs)
    with pytest.raises(ValueError, match=r"`validation_data\[0\]` has 3 samples but `validation"):
        eqfit.fit(model, (x, y), validation_data=(x[:3], y[:4]), **kwargs)
    with pytest.raises(ValueError, match=r"no floating-point arrays that `filter_spec` chooses"):
        eqfit.fit(jnp.arange(3), (x, y), **kwargs)
    with pytest.raises(ValueError, match=r"no floating-point arrays that `filter_spec` chooses"):
        eqfit.fit(model, (x, y), filter_spec=False, **kwargs)


def test_an_unstacked_model_or_a_stateless_one_is_named_as_the_cause(setup):
    model, x, y, kwargs = setup  # LinearRegression(3): weight (1, 3), bias (1,)
    x4 = jnp.ones((10, 4))
    single = eqfit.models.LinearRegression(4, key=jax.random.key(0))
    # Every array starts with 1, so it passes for a stack of one member.
    with pytest.raises(ValueError, match=r"`fit` took `model` for a stack of 1 members.*leave out"):
        eqfit.fit(single, (x4, y), ensemble=True, **kwargs)
    with pytest.raises(ValueError, match=r"`predict` took `model` for a stack of 1 members"):
        eqfit.predict(single, x4, ensemble=True)
    state = eqx.nn.State(eqx.nn.BatchNorm(3, axis_name="batch", mode="batch"))
    with pytest.raises(TypeError, match=r"`model\(x, state\)`.*takes no state.*leave out"):
        eqfit.fit(model, (x, y), state=state, **kwargs)


def _short(info: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(info.value)
    assert len(message) < 800, message
    return message


def test_integer_features_are_reported_as_data(setup):
    model, x, y, kwargs = setup
    with pytest.raises(TypeCheckError, match=r"`fit`'s argument `data` does not suit") as info:
        eqfit.fit(model, (np.asarray(x).astype(np.int32), y), **kwargs)
    assert "Actual value: i32[3]" in _short(info)
    with pytest.raises(TypeCheckError, match=r"`predict`'s argument `x` does not suit") as info:
        eqfit.predict(model, np.asarray(x).astype(np.int32))
    _short(info)


def test_constructors_check_their_arguments(getkey):
    with pytest.raises(TypeCheckError, match=r"`MLP`'s argument `out_features`") as info:
        eqfit.models.MLP(4, "vector", 8, 2, key=getkey())  # type: ignore[arg-type]
    assert "Actual value: 'vector'" in _short(info)
    with pytest.raises(TypeCheckError, match=r"`CNN`'s argument `key` must be a single PRNG"):
        eqfit.models.CNN(1, (8, 8), 10, key=0)  # type: ignore[arg-type]
    with pytest.raises(TypeCheckError, match=r"`LinearRegression`'s argument `in_features`"):
        eqfit.models.LinearRegression(2.5, key=getkey())  # type: ignore[arg-type]


def test_saving_a_model_instead_of_a_result(setup, tmp_path):
    model, *_ = setup
    with pytest.raises(TypeCheckError, match=r"`save`'s argument `result` must be the `FitResult`"):
        eqfit.save(tmp_path / "model.eqx", model)  # type: ignore[arg-type]
    assert not (tmp_path / "model.eqx").exists()


def test_with_the_runtime_checks_off_eqfit_still_names_the_argument(setup):
    import jaxtyping

    model, x, y, kwargs = setup
    kwargs["key"] = 0
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        with pytest.raises(TypeError, match=r"`key` must be a single PRNG key"):
            eqfit.fit(model, (x, y), **kwargs)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


# Each bad input of the issue that asked for short errors, as a user meets it: in a fresh
# process, without the test suite's jaxtyping import hook (which wraps every eqfit function
# and dataclass in a second check of its own, with jaxtyping's long message).
_AS_A_USER = """
import os, tempfile
import jax, numpy as np, optax, eqfit
k = jax.random.key(0)
x, y = np.zeros((10, 2), np.float32), np.zeros(10, np.float32)
model = eqfit.models.LinearRegression(2, key=k)
fit = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1))
cases = {
    "key": lambda: eqfit.fit(model, (x, y), key=0, **fit),
    "data": lambda: eqfit.fit(model, (x.astype(np.int32), y), key=k, **fit),
    "patience": lambda: eqfit.EarlyStopping("3"),
    "restore_best": lambda: eqfit.EarlyStopping(2, restore_best="yes"),
    "out_features": lambda: eqfit.models.MLP(4, "vector", 8, 2, key=k),
    "key ": lambda: eqfit.models.CNN(1, (8, 8), 10, key=0),
    "result": lambda: eqfit.save(os.path.join(tempfile.mkdtemp(), "m.eqx"), model),
}
for argument, call in cases.items():
    try:
        call()
        print("NO ERROR", argument)
    except Exception as e:
        print(repr(argument.strip()), len(str(e)), repr(str(e)))
"""


def test_bad_inputs_get_short_messages_naming_the_argument():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    out = subprocess.run(
        [sys.executable, "-c", _AS_A_USER], capture_output=True, text=True, env=env, check=True
    ).stdout.splitlines()
    assert len(out) == 7, out
    for line in out:
        argument, length, message = line.split(" ", 2)
        assert int(length) < 800, line
        assert f"{argument.strip(chr(39))}`" in message, line
