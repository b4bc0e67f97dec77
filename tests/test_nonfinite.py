"""A NaN found, not only stopped: the step whose loss was not finite is replayed from the
state it began from, on its batch and key, and the error (or with `on_nan="stop"` the
history) names the operation and its line, the parameters whose gradient is not finite
and the rows of the data that did it.
"""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal

import eqfit


class Three(eqx.Module):
    """Three layers: the model the replay looks into."""

    layers: tuple[eqx.nn.Linear, eqx.nn.Linear, eqx.nn.Linear]

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = (
            eqx.nn.Linear(3, 8, key=k1),
            eqx.nn.Linear(8, 8, key=k2),
            eqx.nn.Linear(8, 1, key=k3),
        )

    def __call__(self, x):
        x = jax.nn.tanh(self.layers[0](x))
        x = jax.nn.tanh(self.layers[1](x))
        return self.layers[2](x)[0]


N, BATCH, BAD = 64, 8, 37  # row 37's first feature makes its loss's `log` NaN


def data():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, size=(N, 3)).astype(np.float32)
    y = x.sum(1).astype(np.float32)
    x[BAD, 0] = -2.0  # log(-2 + 1): NaN, for this row only
    return x, y


def weighted_loss(model, x, y):
    weight = jnp.log(x[:, 0] + 1.0)  # the planted NaN
    return jnp.mean(weight * (jax.vmap(model)(x) - y) ** 2)


LOG_LINE = inspect.getsourcelines(weighted_loss)[1] + 1  # the `log`'s line in this file


def norm_loss(model, x, y):
    residual = jax.vmap(model)(x) - y
    # The gradient of a square root at 0 is infinite: a residual of exactly 0 (the
    # third layer's weights and bias zeroed) makes a NaN in the backward pass only.
    return jnp.sqrt(jnp.sum(residual**2)) + 0.0 * jnp.sum(x)


FIT = dict(batch_size=BATCH, epochs=2, key=jax.random.key(3))


@pytest.mark.slow
def test_a_planted_nan_names_its_step_line_parameters_and_row():
    x, y = data()
    model = Three(jax.random.key(0))
    optimizer = optax.adam(1e-2)
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(model, (x, y), loss=weighted_loss, optimizer=optimizer, shuffle=False, **FIT)
    e = info.value
    t = BAD // BATCH  # the step (counted from 0) whose batch holds row 37
    assert (e.epoch, e.step) == (1, t + 1)
    found = e.found
    assert found is not None and found.not_reproduced is None
    assert (found.epoch, found.step, found.member) == (1, t + 1, None)
    assert found.operation == "invalid value (nan) encountered in log"
    assert found.pass_ == "forward"
    assert found.source is not None
    assert found.source.startswith(f"{__file__}:{LOG_LINE}: ")
    assert "jnp.log(x[:, 0] + 1.0)" in found.source
    # Every layer's weights and biases get a NaN gradient from the row's loss.
    assert set(found.parameters) == {
        f".layers[{i}].{name}" for i in range(3) for name in ("weight", "bias")
    }
    assert found.rows == (BAD,)
    assert found.seconds > 0
    message = str(e)
    assert f"epoch 1, step {t + 1} of 8" in message and "encountered in log" in message
    assert f"rows whose loss is not finite: {BAD}" in message
    # The model returned is the hand loop's after the step before, bit for bit.
    update = eqfit.Update("", weighted_loss, optimizer)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = update.init(params)
    hand = model
    apply = eqx.filter_jit(update.apply)
    for i in range(t):
        batch = (x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
        out = apply(hand, state, batch, model_state=None, key=jax.random.key(0))
        hand, state = out.model, out.state
    assert_trees_equal(e.result.model, hand)


@pytest.mark.slow
def test_the_row_is_found_where_the_shuffle_put_it_and_stop_keeps_it_in_the_history(tmp_path):
    x, y = data()
    model = Three(jax.random.key(0))
    result = eqfit.fit(
        model, (x, y), loss=weighted_loss, optimizer=optax.sgd(1e-2), on_nan="stop", **FIT
    )
    assert result.history.stop_reason == "non_finite_loss"
    found = result.history.non_finite
    assert found is not None and found.rows == (BAD,)
    eqfit.save(tmp_path / "run.eqx", result)  # and it is saved with the history
    assert eqfit.load(tmp_path / "run.eqx", like=result).history.non_finite == found
    # The step is the one whose loss is NaN in the history, as the shuffle placed row 37.
    losses = result.history.step_loss.reshape(-1)
    assert np.isnan(losses[(found.epoch - 1) * 8 + found.step - 1])
    assert np.isfinite(losses[: (found.epoch - 1) * 8 + found.step - 1]).all()


def test_a_nan_of_the_backward_pass_names_the_line_it_differentiates():
    x, y = data()
    x[BAD, 0] = 1.0
    model = Three(jax.random.key(0))
    # The last layer outputs its bias, set to each row's target: a residual of 0.
    model = eqx.tree_at(lambda m: m.layers[2].weight, model, jnp.zeros((1, 8)))
    y = np.full_like(y, 0.25)
    model = eqx.tree_at(lambda m: m.layers[2].bias, model, jnp.full((1,), 0.25))
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(model, (x, y), loss=norm_loss, optimizer=optax.sgd(1e-2), norms=True, **FIT)
    # With `norms=True`, a gradient that is not finite stops the run as a loss would.
    assert "The loss (or its gradient) was not finite at epoch 1, step 1" in str(info.value)
    assert_trees_equal(info.value.result.model, model)
    found = info.value.found
    assert found is not None and found.not_reproduced is None
    assert (found.epoch, found.step) == (1, 1)
    assert found.pass_ == "backward"
    assert found.source is not None and "residual**2" in found.source
    # The loss is finite; its gradient is not, for every trained array.
    assert ".layers[2].weight" in found.parameters
    assert found.rows is None  # the loss is no mean over rows: no row alone is NaN


def test_a_memmaps_row_is_named_by_its_index_in_the_file(tmp_path):
    x, y = data()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    memmaps = (
        np.load(tmp_path / "x.npy", mmap_mode="r"),
        np.load(tmp_path / "y.npy", mmap_mode="r"),
    )
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(
            Three(jax.random.key(0)), memmaps, loss=weighted_loss, optimizer=optax.sgd(1e-2), **FIT
        )
    found = info.value.found
    assert found is not None and found.rows == (BAD,)
    assert found.operation == "invalid value (nan) encountered in log"


def test_a_generators_batch_cannot_be_read_again_and_says_so():
    x, y = data()

    def batches():
        for i in range(0, N, BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]

    result = eqfit.fit(
        Three(jax.random.key(0)),
        batches(),
        loss=weighted_loss,
        optimizer=optax.sgd(1e-2),
        on_nan="stop",
        key=jax.random.key(3),
        steps_per_epoch=N // BATCH,
    )
    found = result.history.non_finite
    assert found is not None and found.step == BAD // BATCH + 1
    assert found.not_reproduced is not None
    assert "could not be read again" in found.not_reproduced


def test_a_nan_in_the_data_names_its_row_and_eqfits_loss_line():
    x, y = data()
    x[BAD, 0] = 1.0
    y[BAD] = np.nan  # a target missing
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(
            Three(jax.random.key(0)),
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(1e-2),
            shuffle=False,
            **FIT,
        )
    found = info.value.found
    assert found is not None and found.rows == (BAD,)
    # No line of this file computes it: the line is the one inside eqfit's loss (optax's
    # squared error, which it calls) that met the NaN, not `fit`'s call here.
    assert found.operation == "invalid value (nan) encountered in sub"
    assert found.source is not None and "predictions - targets" in found.source
    assert __file__ not in found.source


@pytest.mark.slow
def test_an_ensemble_replays_the_member_that_met_the_nan():
    x, y = data()
    keys = jax.random.split(jax.random.key(0), 2)
    members = eqx.filter_vmap(Three)(keys)
    result = eqfit.fit(
        members,
        (x, y),
        loss=weighted_loss,
        optimizer=optax.sgd(1e-2),
        on_nan="stop",
        ensemble=True,
        **FIT,
    )
    found = result.history.non_finite
    assert found is not None and found.member in (0, 1) and found.rows == (BAD,)
    # Each member meets row 37 where its own shuffle puts it: the replay's is the first.
    losses = result.history.step_loss[..., found.member].reshape(-1)
    first = int(np.flatnonzero(np.isnan(losses))[0])
    assert (found.epoch, found.step) == (first // 8 + 1, first % 8 + 1)
    assert found.source is not None and f"{__file__}:{LOG_LINE}" in found.source


class Batches:
    """A re-iterable loader: the batches in order, every pass."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(0, N, BATCH):
            yield self.x[i : i + BATCH], self.y[i : i + BATCH]

    def __len__(self):
        return N // BATCH


@pytest.mark.slow
@pytest.mark.parametrize("where", ["loader", "devices"])
def test_a_loaders_row_and_a_run_on_devices_are_replayed(where):
    x, y = data()
    kwargs = dict(loss=weighted_loss, optimizer=optax.sgd(1e-2), **FIT)
    if where == "loader":
        given = Batches(x, y)  # read again, up to the step, as a resumed run reads it
    else:
        given = (x, y)
        kwargs |= dict(devices=2, shuffle=False)
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(Three(jax.random.key(0)), given, **kwargs)
    found = info.value.found
    assert found is not None and found.not_reproduced is None
    # A loader's rows are named by their place in the pass: here, in the data too.
    assert found.rows == (BAD,) and found.step == BAD // BATCH + 1
    assert found.source is not None and f"{__file__}:{LOG_LINE}" in found.source


def test_several_updates_are_replayed_in_turn_and_the_failing_one_named():
    # A GAN-like pair: `a` trains first on each batch, then `b` on the model `a` left;
    # `b`'s loss takes the log of a value only row 37 makes negative.
    from helpers import pair

    x, y = data()
    x = x[:, :3]

    def a_loss(m, x, y):
        return jnp.mean((jax.vmap(m.a)(x)[:, 0] - y) ** 2)

    def b_loss(m, x, y):
        weight = jnp.log(x[:, 0] + 1.0)  # the planted NaN
        return jnp.mean(weight * (jax.vmap(m.b)(x)[:, 0] - y) ** 2)

    updates = [
        eqfit.Update("a", a_loss, optax.sgd(1e-3), trains=lambda m: m.a),
        eqfit.Update("b", b_loss, optax.sgd(1e-3), trains=lambda m: m.b),
    ]
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(pair(), (x, y), updates=updates, shuffle=False, **FIT)
    found = info.value.found
    assert found is not None and found.not_reproduced is None
    assert found.update == "b" and found.step == BAD // BATCH + 1
    assert found.operation == "invalid value (nan) encountered in log"
    assert found.parameters == (".b.weight", ".b.bias")  # only `b`'s arrays: its `trains`
    assert found.rows == (BAD,)
    assert "update 'b'" in str(info.value)


def test_a_row_is_named_in_the_data_given_when_validation_split_holds_some_out():
    x, y = data()
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(
            Three(jax.random.key(0)),
            (x, y),
            loss=weighted_loss,
            optimizer=optax.sgd(1e-2),
            validation_split=0.25,
            **FIT,
        )
    found = info.value.found
    assert found is not None and found.rows == (BAD,)  # not its index among those trained


T = BAD // BATCH  # the step (counted from 0) whose batch holds row 37, unshuffled


def given(kind, x, y, directory):
    """The data as `kind`: arrays, memmaps of them, or a loader over them."""
    if kind == "memmaps":
        directory.mkdir(exist_ok=True)
        np.save(directory / "x.npy", x)
        np.save(directory / "y.npy", y)
        return tuple(np.load(directory / f"{n}.npy", mmap_mode="r") for n in ("x", "y"))
    if kind == "loader":
        return Rows(x, y)
    return x, y


class Rows(Batches):
    """A re-iterable loader of any number of rows: every batch of them, each pass."""

    def __iter__(self):
        for i in range(0, len(self.x), BATCH):
            yield self.x[i : i + BATCH], self.y[i : i + BATCH]

    def __len__(self):
        return len(self.x) // BATCH


UNGUARDED = eqfit.WholeRun(guard=False)
GUARDED = eqfit.WholeRun(guard=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, options",
    [
        ("arrays", dict(execution=UNGUARDED)),
        ("arrays", dict(execution=eqfit.PerStep(3, guard=False))),
        ("arrays", dict(execution=UNGUARDED, progress="lines")),
        pytest.param(
            "arrays",
            dict(execution=UNGUARDED, mesh=jax.make_mesh((8,), ("batch",))),
            marks=pytest.mark.heavy,
        ),
        ("memmaps", dict(execution=UNGUARDED)),
        ("loader", dict(execution=UNGUARDED)),
    ],
)
def test_the_model_returned_is_the_run_replayed_to_the_step_before(tmp_path, kind, options):
    # With no guard, the step applies the non-finite update, the run stops, and `fit`
    # replays it from its start to the step before: the model it returns equals a run of
    # those steps alone, bit for bit, whatever the data and the way of running.
    x, y = data()
    kwargs = dict(loss=weighted_loss, optimizer=optax.adam(1e-2), shuffle=False, **options)
    with pytest.raises(eqfit.NonFiniteLossError) as info:
        eqfit.fit(Three(jax.random.key(0)), given(kind, x, y, tmp_path), **kwargs, **FIT)
    e = info.value
    assert e.step == T + 1 and e.found is not None and e.found.replayed_from == 0
    assert "the run replayed from the start" in str(e)
    before = given(kind, x[: T * BATCH], y[: T * BATCH], tmp_path / "before")
    short = dict(FIT, epochs=1)
    alone = eqfit.fit(Three(jax.random.key(0)), before, **kwargs, **short)
    assert_trees_equal(e.result.model, alone.model)
    assert_trees_equal(e.result.opt_state, alone.opt_state)
    # The history is the run's: the step's loss is there, NaN, and none after it.
    losses = e.result.history.step_loss.reshape(-1)
    assert np.isnan(losses[T]) and np.isfinite(losses[:T]).all()


def test_the_replay_starts_from_the_newest_checkpoint_and_none_holds_the_nan(tmp_path):
    x, y = data()
    kwargs = dict(loss=weighted_loss, optimizer=optax.adam(1e-2), shuffle=False, **FIT)
    kwargs |= dict(execution=UNGUARDED)
    policy = eqfit.Checkpoint(tmp_path, every_steps=3)  # at step 3, the last before the NaN
    for attempt in range(2):  # the same call again resumes the newest: step 3's
        result = eqfit.fit(
            Three(jax.random.key(0)), (x, y), on_nan="stop", checkpoint=policy, **kwargs
        )
        found = result.history.non_finite
        assert found is not None and found.replayed_from == 3 and found.seconds > 0
        assert found.rows == (BAD,) and found.step == T + 1
        assert "the run replayed from step 3" in str(found)
        assert np.isfinite(result.history.step_loss.reshape(-1)[3:T]).all()
    plain = eqfit.fit(Three(jax.random.key(0)), (x, y), on_nan="stop", **kwargs)
    assert plain.history.non_finite is not None
    assert plain.history.non_finite.replayed_from == 0
    assert_trees_equal(result.model, plain.model)
    assert all(
        np.isfinite(a).all() for a in jax.tree.leaves(eqx.filter(result.model, eqx.is_array))
    )


@pytest.mark.slow
def test_no_guard_by_default_where_a_replay_can_give_the_bits_else_the_guard():
    x, y = data()
    kwargs = dict(loss=weighted_loss, optimizer=optax.sgd(1e-2), on_nan="stop", **FIT)
    # By default (the CPU backend too) the update has no `cond`: the state before the
    # step is replayed, and it is the guarded run's, bit for bit.
    replayed = eqfit.fit(Three(jax.random.key(0)), (x, y), **kwargs)
    assert replayed.history.non_finite is not None
    assert replayed.history.non_finite.replayed_from == 0
    guarded = eqfit.fit(Three(jax.random.key(0)), (x, y), execution=GUARDED, **kwargs)
    assert guarded.history.non_finite is not None
    assert guarded.history.non_finite.replayed_from is None
    assert_trees_equal(guarded.model, replayed.model)
    assert_trees_equal(guarded.opt_state, replayed.opt_state)
    # Where a replay could not give the same bits, the default keeps the guard, and no
    # guard is refused.
    pmapped = eqfit.fit(Three(jax.random.key(0)), (x, y), devices=2, **kwargs)
    assert pmapped.history.non_finite is not None
    assert pmapped.history.non_finite.replayed_from is None
    with pytest.raises(ValueError, match=r"guard.*under `devices=` \(`pmap`\)"):
        eqfit.fit(Three(jax.random.key(0)), (x, y), execution=UNGUARDED, devices=2, **kwargs)

    def batches():
        yield from Rows(x, y)

    once = dict(kwargs, epochs=1, steps_per_epoch=N // BATCH)
    streamed = eqfit.fit(Three(jax.random.key(0)), batches(), **once)
    assert streamed.history.non_finite is not None
    assert streamed.history.non_finite.replayed_from is None
    with pytest.raises(ValueError, match="one-shot iterator"):
        eqfit.fit(Three(jax.random.key(0)), batches(), execution=UNGUARDED, **once)


@pytest.mark.slow
def test_with_no_guard_the_result_is_the_guarded_runs_with_norms_ema_and_restore_best():
    # Everything `fit` returns, the history's per-step values (the update's norm of the
    # non-finite step: 0, as the guard's skipped update records it) and `restore_best`'s
    # model (no epoch monitored yet: the last finite one) included.
    x, y = data()
    kwargs = dict(
        loss=weighted_loss,
        optimizer=optax.adam(1e-2),
        on_nan="stop",
        shuffle=False,
        norms=True,
        ema=0.9,
        validation_data=(x[:16] + 1.0, y[:16]),
        early_stopping=eqfit.EarlyStopping(monitor="val_loss", patience=3, restore_best=True),
        **FIT,
    )
    runs = []
    for guard in (True, False):
        # The run stops inside epoch 1, whose validation is then NaN: said, as always.
        with pytest.warns(RuntimeWarning, match="'val_loss' was NaN at epoch"):
            execution = eqfit.WholeRun(guard=guard)
            runs.append(eqfit.fit(Three(jax.random.key(0)), (x, y), execution=execution, **kwargs))
    guarded, replayed = runs
    assert replayed.history.non_finite is not None
    assert replayed.history.non_finite.replayed_from == 0
    assert_trees_equal(guarded.model, replayed.model)
    assert_trees_equal(guarded.ema_model, replayed.ema_model)
    assert_trees_equal(guarded.opt_state, replayed.opt_state)
    for name, values in guarded.history.step_values.items():
        np.testing.assert_array_equal(values, replayed.history.step_values[name], err_msg=name)
    assert replayed.history.step_values["update_norm"].reshape(-1)[T] == 0.0


@pytest.mark.slow
def test_several_updates_with_no_guard_return_the_state_before_the_whole_step():
    from helpers import pair

    x, y = data()

    def a_loss(m, x, y):
        return jnp.mean((jax.vmap(m.a)(x)[:, 0] - y) ** 2)

    def b_loss(m, x, y):
        return jnp.mean(jnp.log(x[:, 0] + 1.0) * (jax.vmap(m.b)(x)[:, 0] - y) ** 2)

    updates = [
        eqfit.Update("a", a_loss, optax.sgd(1e-3), trains=lambda m: m.a),
        eqfit.Update("b", b_loss, optax.sgd(1e-3), trains=lambda m: m.b),
    ]
    kwargs = dict(updates=updates, shuffle=False, on_nan="stop", execution=UNGUARDED)
    result = eqfit.fit(pair(), (x, y), **kwargs, **FIT)
    found = result.history.non_finite
    assert found is not None and found.update == "b" and found.replayed_from == 0
    # `a`'s update of that step is not in it, as it is with the guard: the steps before.
    before = eqfit.fit(pair(), (x[: T * BATCH], y[: T * BATCH]), **kwargs, **dict(FIT, epochs=1))
    assert_trees_equal(result.model, before.model)


class Breaking(Rows):
    """A loader that raises from its `fail_from`-th pass on (counted from 1)."""

    def __init__(self, x, y, fail_from=None):
        super().__init__(x, y)
        self.passes, self.fail_from = 0, fail_from

    def __iter__(self):
        self.passes += 1
        if self.fail_from is not None and self.passes >= self.fail_from:
            raise RuntimeError("the disk went away")
        return super().__iter__()


@pytest.mark.slow
def test_a_replay_that_fails_keeps_the_runs_result_and_says_so():
    x, y = data()
    kwargs = dict(loss=weighted_loss, optimizer=optax.sgd(1e-2), on_nan="stop", **FIT)
    counting = Breaking(x, y)
    eqfit.fit(
        Three(jax.random.key(0)), counting, execution=GUARDED, **kwargs
    )  # the run's, and the step's
    # The run's passes, then the replay's: the replay's first pass fails.
    breaking = Breaking(x, y, fail_from=counting.passes)
    result = eqfit.fit(Three(jax.random.key(0)), breaking, execution=UNGUARDED, **kwargs)
    found = result.history.non_finite
    assert found is not None and found.not_reproduced is not None
    assert "replay did not reach the step" in found.not_reproduced
    assert "the disk went away" in found.not_reproduced
    assert "the model returned is the one after it" in found.not_reproduced
    assert result.history.stop_reason == "non_finite_loss"
