"""The optimizer's hyperparameters in the history: `inject_hyperparams`' and `schedules=`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import regression_data

import eqfit


SCHEDULE = optax.cosine_decay_schedule(1e-2, 100)
EPOCHS, BATCH = 3, 16  # 52 samples: 4 steps an epoch, the last a remainder of 4
STEPS = 4


def compiled(schedule, n):
    """`schedule` at counts `0..n-1`, as XLA computes it in a program (bitwise): it folds
    `pi * count / steps` into `count * (pi / steps)`, so eager evaluation, one operation at
    a time, may differ in the last bit.
    """
    return np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(n, dtype=jnp.int32)), np.float32)


def by_epoch(values):
    return np.asarray(values, np.float32).reshape(EPOCHS, STEPS)


@pytest.fixture(scope="module")
def problem():
    x, y = regression_data(jax.random.key(7), 52)
    return eqfit.models.MLP(4, "scalar", 8, 1, key=jax.random.key(3)), (x, y)


def train(problem, optimizer, **kwargs):
    model, data = problem
    kwargs = dict(epochs=EPOCHS, batch_size=BATCH, key=jax.random.key(0)) | kwargs
    return eqfit.fit(model, data, loss=eqfit.losses.mse, optimizer=optimizer, **kwargs)


@pytest.mark.slow
def test_an_injected_schedule_is_recorded_at_every_step(problem):
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    history = train(problem, optimizer).history
    assert history.batch_sizes[0, -1] == 4  # with a remainder step
    lr = history.step_values["learning_rate"]
    np.testing.assert_array_equal(lr, by_epoch(compiled(SCHEDULE, EPOCHS * STEPS)))
    eager = [SCHEDULE(i) for i in range(EPOCHS * STEPS)]
    np.testing.assert_allclose(lr, by_epoch(eager), rtol=1e-6)
    np.testing.assert_array_equal(history["learning_rate"], lr[:, -1])  # the epoch's last
    # Every numeric hyperparameter, the constant ones too.
    assert set(history.step_values) == {"learning_rate", "b1", "b2", "eps", "eps_root"}
    np.testing.assert_array_equal(history["b1"], np.float32(0.9))


@pytest.mark.heavy
def test_inside_chain_multi_transform_and_multi_steps(problem):
    inject = optax.inject_hyperparams(optax.sgd)
    chained = optax.chain(optax.clip_by_global_norm(1.0), inject(learning_rate=SCHEDULE))
    history = train(problem, chained).history
    np.testing.assert_array_equal(
        history.step_values["learning_rate"], by_epoch(compiled(SCHEDULE, EPOCHS * STEPS))
    )

    # Two injected states with the same name: the first keeps it, the second is named by
    # its path in the optimizer's state.
    def labels(params):
        return jax.tree.map(lambda x: "a" if x.ndim == 2 else "b", params)

    slow = optax.linear_schedule(1e-3, 0.0, 100)
    parts = {"a": inject(learning_rate=SCHEDULE), "b": inject(learning_rate=slow)}
    history = train(problem, optax.multi_transform(parts, labels)).history
    other = "inner_states/b/inner_state/learning_rate"
    assert set(history.step_values) == {"learning_rate", other}
    n = EPOCHS * STEPS
    np.testing.assert_array_equal(
        history.step_values["learning_rate"], by_epoch(compiled(SCHEDULE, n))
    )
    np.testing.assert_array_equal(history.step_values[other], by_epoch(compiled(slow, n)))

    # Accumulating over 2 steps: the inner optimizer's update, and with it the rate,
    # comes every second step; the first step's is the state's initial one.
    every_two = optax.MultiSteps(inject(learning_rate=SCHEDULE), every_k_schedule=2)
    history = train(problem, every_two).history
    values = compiled(SCHEDULE, n)
    used = [values[max(t - 1, 0) // 2] for t in range(n)]  # 0, 0, 0, 1, 1, 2, 2, ...
    np.testing.assert_array_equal(history.step_values["learning_rate"], by_epoch(used))


@pytest.mark.slow
def test_schedules_are_evaluated_at_the_optimizers_count(problem):
    history = train(problem, optax.adam(SCHEDULE), schedules={"learning_rate": SCHEDULE}).history
    n = EPOCHS * STEPS
    np.testing.assert_array_equal(
        history.step_values["learning_rate"], by_epoch(compiled(SCHEDULE, n))
    )
    np.testing.assert_array_equal(
        history["learning_rate"], history.step_values["learning_rate"][:, -1]
    )
    # With `optax.MultiSteps`, at its `gradient_step`: the inner updates done before.
    every_two = optax.MultiSteps(optax.adam(SCHEDULE), every_k_schedule=2)
    history = train(problem, every_two, schedules={"lr": SCHEDULE}).history
    values = compiled(SCHEDULE, n)
    np.testing.assert_array_equal(
        history.step_values["lr"], by_epoch([values[t // 2] for t in range(n)])
    )


def test_compiled_and_with_the_bar_agree_and_callbacks_see_them(problem):
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)

    class Logs:
        def __init__(self):
            self.seen = []

        def on_epoch_end(self, epoch, logs):
            self.seen.append(logs)

    logs = Logs()
    kwargs = dict(schedules={"twice": lambda count: 2 * SCHEDULE(count)})
    whole = train(problem, optimizer, callbacks=[logs], **kwargs)
    bar = train(problem, optimizer, progress="bar", **kwargs)
    for name in ("learning_rate", "twice"):
        np.testing.assert_array_equal(
            whole.history.step_values[name], bar.history.step_values[name]
        )
        np.testing.assert_array_equal(whole.history[name], bar.history[name])
    assert [log["learning_rate"] for log in logs.seen] == whole.history["learning_rate"].tolist()
    assert [log["twice"] for log in logs.seen] == whole.history["twice"].tolist()


@pytest.mark.heavy  # several devices: CI runs it, the README's command leaves it out
def test_an_ensemble_and_several_devices_record_them(problem):
    model, data = problem
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    want = by_epoch(compiled(SCHEDULE, EPOCHS * STEPS))
    kwargs = dict(schedules={"lr": SCHEDULE})
    make = lambda key: eqfit.models.MLP(4, "scalar", 8, 1, key=key)  # noqa: E731
    stack = eqx.filter_vmap(make)(jax.random.split(jax.random.key(4), 2))
    ensemble = train((stack, data), optimizer, ensemble=True, **kwargs).history
    for name in ("learning_rate", "lr"):
        assert ensemble.step_values[name].shape == (EPOCHS, STEPS, 2)
        np.testing.assert_array_equal(ensemble.step_values[name], np.stack([want] * 2, -1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    data = jax.tree.map(lambda a: a[:48], data)  # batches of 16 split over 2 devices
    want = compiled(SCHEDULE, EPOCHS * 3).reshape(EPOCHS, 3)
    for placement in (dict(devices=2), dict(mesh=mesh)):
        history = train((model, data), optimizer, **placement, **kwargs).history
        np.testing.assert_array_equal(history.step_values["learning_rate"], want)
        np.testing.assert_array_equal(history.step_values["lr"], want)


def test_a_resumed_run_records_them_as_an_uninterrupted_one(problem, tmp_path):
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    kwargs = dict(schedules={"lr": SCHEDULE})
    whole = train(problem, optimizer, **kwargs).history

    class StopAfterOne:
        def on_epoch_end(self, epoch, logs):
            return epoch == 1

    train(problem, optimizer, checkpoint=tmp_path, callbacks=[StopAfterOne()], **kwargs)
    resumed = train(problem, optimizer, checkpoint=tmp_path, **kwargs).history
    for name in ("learning_rate", "lr"):
        np.testing.assert_array_equal(whole[name], resumed[name])
    # Another set of schedules is another run: its checkpoints are refused.
    with pytest.raises(ValueError, match="schedules"):
        train(problem, optimizer, checkpoint=tmp_path, schedules={"other": SCHEDULE})


def test_without_hyperparameters_nothing_is_recorded(problem):
    history = train(problem, optax.adam(SCHEDULE)).history
    assert history.step_values == {} and set(history.values) == {"loss"}


def test_bad_schedules_are_refused_before_compiling(problem):
    adam = optax.adam(SCHEDULE)
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)

    def refused(error, match, optimizer=adam, **kwargs):
        with pytest.raises(error, match=match):
            train(problem, optimizer, epochs=1, **kwargs)

    refused(TypeError, r"`schedules`", schedules=[SCHEDULE])
    # (beartype checks one entry of a mapping, and eqfit every entry: both name it.)
    refused(TypeError, r"`schedules", schedules={"lr": 1e-3})
    refused(TypeError, r"`schedules", schedules={"lr": SCHEDULE, "bad": 1e-3})
    refused(ValueError, r"`schedules`.*built-in 'loss'", schedules={"loss": SCHEDULE})
    refused(ValueError, r"`schedules`.*validation's", schedules={"val_lr": SCHEDULE})
    refused(
        ValueError,
        r"`schedules`.*metric 'mae'",
        schedules={"mae": SCHEDULE},
        metrics={"mae": eqfit.metrics.mae},
    )
    refused(
        ValueError,
        r"`schedules`.*injected hyperparameter 'learning_rate'",
        injected,
        schedules={"learning_rate": SCHEDULE},
    )
    # A schedule that gives no scalar, and an optimizer that counts nothing.
    refused(
        ValueError,
        r"`schedules\['lr'\]` must return a scalar",
        schedules={"lr": lambda c: jnp.zeros(2)},
    )
    refused(ValueError, r"`schedules`.*holds none", optax.sgd(0.1), schedules={"lr": SCHEDULE})

    # An aux value named as a schedule or an injected hyperparameter.
    def with_aux(name):
        def loss(model, x, y):
            return eqfit.losses.mse(model, x, y), {name: jnp.zeros(())}

        return loss

    model, data = problem
    kwargs = dict(optimizer=adam, key=jax.random.key(0), batch_size=BATCH)
    with pytest.raises(ValueError, match=r"`schedules`.*aux value 'lr'"):
        eqfit.fit(model, data, loss=with_aux("lr"), schedules={"lr": SCHEDULE}, **kwargs)
    with pytest.raises(ValueError, match=r"`inject_hyperparams`.*'b1'.*aux value 'b1'"):
        eqfit.fit(model, data, loss=with_aux("b1"), **kwargs | {"optimizer": injected})
