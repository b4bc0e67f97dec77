"""An update of one's own (`eqfit.AbstractUpdate`) under bad input: what its `init` and
`apply` give is checked before the run, each refusal naming the update and what to write;
and the weighted means (`eqfit.Mean`) it records, reduced per epoch as a sum over a sum.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Pair, pair, PAIR_X, PAIR_Y

import eqfit


X, Y = PAIR_X, PAIR_Y
FIT = dict(key=jax.random.key(1), batch_size=8, epochs=2, shuffle=False)


class Own(eqfit.AbstractUpdate):
    """An update whose `init` and `apply` give what it was built with."""

    make: Callable[..., Any]
    state: Callable[[], Any] = lambda: jnp.zeros(())
    name: str = "own"
    trains: Callable[[Pair], Any] | None = eqx.field(default=lambda m: m.b, kw_only=True)

    def init(self, params):
        return self.state()

    def apply(self, model, state, batch, *, model_state, key):
        return self.make(model, state, batch, model_state)


def applied(values):
    return lambda model, state, batch, model_state: eqfit.Applied(
        model, state, model_state, values(batch)
    )


def mse(m, x, y):
    return jnp.mean((jax.vmap(m.a)(x) - y) ** 2)


def run(update):
    online = eqfit.Update("q", mse, optax.sgd(0.1), trains=lambda m: m.a)
    return eqfit.fit(pair(), (X, Y), updates=[online, update], **FIT)


def rows(batch):
    return batch[0][:, 0]


BAD = [
    (
        Own(lambda m, s, b, ms: (m, s)),
        TypeError,
        r"Update 'own''s `apply` returned a tuple of 2: it must return `eqfit.Applied\(",
    ),
    (Own(lambda m, s, b, ms: m), TypeError, r"'own''s `apply` returned a Pair: it must return"),
    (
        Own(applied(lambda b: [1.0])),
        TypeError,
        r"'own''s `apply` recorded a list as `Applied.values`: it must be a dict",
    ),
    (
        Own(applied(lambda b: {"rows": rows(b)})),
        TypeError,
        r"recorded 'rows' as an array of shape \(8,\), not a scalar.*`jnp.mean\(...\)`.*Mean.of",
    ),
    (
        Own(applied(lambda b: {"z": jnp.asarray(1 + 2j)})),
        TypeError,
        r"recorded 'z' as an array of dtype complex64, not a real number",
    ),
    (Own(applied(lambda b: {"s": "high"})), TypeError, r"recorded 's' as a str, not an array"),
    (Own(applied(lambda b: {"n": None})), TypeError, r"recorded 'n' as None, not an array"),
    (
        Own(applied(lambda b: {"d": {"x": jnp.zeros(())}})),
        TypeError,
        r"recorded 'd' as a dict, not an array",
    ),
    (
        Own(applied(lambda b: {1: jnp.zeros(())})),
        TypeError,
        r"recorded a value named 1: .* a word such as 'lag'",
    ),
    (
        Own(applied(lambda b: {}), state=lambda: "ready"),
        TypeError,
        r"'own''s `init` returned a state holding a str: its state must be a PyTree of arrays",
    ),
    (
        Own(lambda m, s, b, ms: eqfit.Applied(m, jnp.zeros(3), ms, {})),
        TypeError,
        r"'own''s `apply` returned a state unlike .*float32\[3\].*against.*float32\[\]",
    ),
    (
        Own(
            lambda m, s, b, ms: eqfit.Applied(
                eqx.tree_at(lambda m: m.a.bias, m, m.a.bias + 1), s, ms, {}
            )
        ),
        ValueError,
        r"'own''s `apply` changed the model outside the arrays it `trains` "
        r"\(model\.a\.bias\).*Widen its `trains`",
    ),
    (
        Own(
            lambda m, s, b, ms: eqfit.Applied(
                eqx.tree_at(lambda m: m.b.bias, m, jnp.zeros(3)), s, ms, {}
            )
        ),
        TypeError,
        r"returned arrays it trains of another shape or dtype than it was given "
        r"\(model\.b\.bias: float32\[3\] where float32\[1\] was\)",
    ),
    (
        Own(
            lambda m, s, b, ms: eqfit.Applied(
                eqx.tree_at(lambda m: m.b.bias, m, m.b.bias.astype(jnp.bfloat16)), s, ms, {}
            )
        ),
        TypeError,
        r"\(model\.b\.bias: bfloat16\[1\] where float32\[1\] was\)",
    ),
    (
        Own(lambda m, s, b, ms: eqfit.Applied(m, s, jnp.zeros(()), {})),
        TypeError,
        r"returned a model state unlike the one it was given \(an array float32\[\] against "
        r"None\)",
    ),
    (
        Own(lambda m, s, b, ms: eqfit.Applied(m, jnp.zeros(2), ms, {})),
        TypeError,
        r"returned a state unlike .*\(its `init`'s\): an array float32\[2\] against an array",
    ),
]


@pytest.mark.parametrize("update, error, words", BAD)
def test_what_an_update_of_ones_own_gives_is_checked_before_the_run(update, error, words):
    with pytest.raises(error, match=words):
        run(update)


def test_an_update_that_gives_back_the_parts_it_does_not_train_as_they_came_runs():
    """Replacing only the parts it trains, or recording numbers, ints and bools, is fine."""

    def make(m, s, b, ms):
        m = eqx.tree_at(lambda m: m.b, m, jax.tree.map(lambda x: 0.5 * x, m.b))
        values = {"half": jnp.asarray(0.5), "n": jnp.asarray(3), "yes": True, "f": 2.0}
        return eqfit.Applied(m, s + 1, ms, values)

    result = run(Own(make))
    assert result.history["own_n"].tolist() == [3.0, 3.0]
    assert result.history["own_yes"].tolist() == [1.0, 1.0]
    assert int(result.opt_state["own"]) == 12


class Returns(eqfit.AbstractUpdate):
    """Records an episodic return as a weighted mean: the sum of the returns of the
    episodes that ended in the step over their number, which is often 0.
    """

    name: str = "rl"
    trains: Callable[[Pair], Any] | None = lambda m: m.b

    def init(self, params):
        return jnp.zeros((), jnp.int32)

    def apply(self, model, state, batch, *, model_state, key):
        x, _ = batch
        ended = x[:, 0] > 1.0  # few rows: many steps end no episode
        ret = x[:, 1]
        value = eqfit.Mean(jnp.sum(jnp.where(ended, ret, 0.0)), jnp.sum(ended))
        return eqfit.Applied(model, state + 1, model_state, {"return": value, "plain": ret[0]})


def test_an_update_of_ones_own_records_weighted_means_as_a_sum_over_a_sum():
    """Each epoch's `rl_return` is the sum of the returns over the episodes that ended in
    it, as a hand sum over sum gives; an epoch in which none ended records NaN for itself
    alone; the step's value is NaN where its weight is 0 and the epoch leaves it out.
    """
    x = X.copy()
    x[24:, 0] = 0.0  # the second epoch's rows (3 steps of 8) end no episode
    result = eqfit.fit(
        pair(), (x[:48], Y), updates=[Returns()], **(FIT | dict(epochs=1, batch_size=8))
    )
    steps = result.history.step_values["rl_return"][0]
    ended = x[:, 0] > 1.0
    for i in range(6):
        e = ended[8 * i : 8 * i + 8]
        if e.any():
            np.testing.assert_allclose(steps[i], x[8 * i : 8 * i + 8, 1][e].mean(), rtol=1e-6)
        else:
            assert np.isnan(steps[i])
    np.testing.assert_allclose(result.history["rl_return"][0], x[ended, 1].mean(), rtol=1e-6)
    np.testing.assert_allclose(result.history["rl_plain"][0], x[::8, 1].mean(), rtol=1e-6)

    def batches():  # the second epoch's three batches end no episode
        for i in range(6):
            yield x[8 * i : 8 * i + 8], Y[8 * i : 8 * i + 8]

    halves = eqfit.fit(
        pair(), batches(), updates=[Returns()], steps_per_epoch=3, key=FIT["key"], epochs=2
    )
    first, second = halves.history["rl_return"]
    np.testing.assert_allclose(first, x[:24][ended[:24], 1].mean(), rtol=1e-6)
    assert not ended[24:].any() and np.isnan(second)
    assert halves.history.stop_reason is None


@pytest.mark.parametrize("option", [dict(norms=True), dict(precision="bfloat16")])
def test_step_options_that_act_on_a_loss_are_refused_with_only_updates_of_ones_own(option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=rf"`{name}=.*` with only updates of your own \('rl'\)"):
        eqfit.fit(pair(), (X, Y), updates=[Returns()], **option, **FIT)


def test_norms_beside_an_update_of_ones_own_are_the_losses_updates():
    result = eqfit.fit(
        pair(),
        (X, Y),
        updates=[eqfit.Update("q", mse, optax.sgd(0.1), trains=lambda m: m.a), Returns()],
        norms=True,
        **FIT,
    )
    names = set(result.history.values)
    assert {"q_grad_norm", "q_update_norm"} <= names
    assert not any(n.startswith("rl_") and "norm" in n for n in names)


class Count(eqfit.AbstractUpdate):
    """A state of weakly typed scalars, as `jnp.asarray(0)` makes (gymnax's states hold
    them)."""

    name: str = "c"

    def init(self, params):
        return {"n": jnp.asarray(0), "x": jnp.asarray(0.0)}

    def apply(self, model, state, batch, *, model_state, key):
        return eqfit.Applied(model, {"n": state["n"] + 1, "x": state["x"] + 0.5}, model_state, {})


def test_a_run_goes_on_from_a_state_of_weak_types_and_a_refusal_says_what_differs():
    first = eqfit.fit(pair(), (X, Y), updates=[Count()], **FIT)
    then = eqfit.fit(
        first.model,
        (X, Y),
        updates=[Count()],
        opt_state=first.opt_state,
        **(FIT | dict(epochs=4)),
        initial_epoch=2,
    )
    assert int(then.opt_state["c"]["n"]) == 24 and float(then.opt_state["c"]["x"]) == 12.0
    wrong = {"c": {"n": jnp.zeros(3, jnp.int32), "x": jnp.asarray(0.0)}}
    with pytest.raises(
        ValueError,
        match=r"at `opt_state\['c'\]\['n'\]` it holds int32\[3\] where int32\[\] belongs",
    ):
        eqfit.fit(pair(), (X, Y), updates=[Count()], opt_state=wrong, **FIT)


class Walk(eqfit.AbstractUpdate):
    """A random walk that makes its own data: no batch, its key threaded in its state,
    and the step's key recorded so that its documented derivation can be checked."""

    name: str = "walk"
    reads: bool = False

    def init(self, params, *, key=None):
        return {"pos": jnp.zeros(()), "key": key}

    def apply(self, model, state, batch, *, model_state, key):
        if self.reads:
            batch = batch[0]
        assert batch is None
        threaded, step = jax.random.split(state["key"])
        pos = state["pos"] + jax.random.normal(step)
        drawn = jax.random.uniform(key)
        values = {"pos": pos, "drawn": drawn}
        return eqfit.Applied(model, {"pos": pos, "key": threaded}, model_state, values)


def test_training_with_no_data_runs_updates_that_make_their_own():
    key = jax.random.key(7)
    result = eqfit.fit(pair(), updates=[Walk()], steps_per_epoch=4, epochs=3, key=key)
    h = result.history
    assert h.step_loss.shape == (3, 4) and (h.batch_sizes == 1).all()
    # The state's key, from `init`'s, threaded by hand as the update does.
    state_key = jax.random.fold_in(jax.random.fold_in(key, 3), 0)
    pos, positions = 0.0, []
    for _ in range(12):
        state_key, step = jax.random.split(state_key)
        pos = pos + float(jax.random.normal(step))
        positions.append(pos)
    np.testing.assert_allclose(h.step_values["walk_pos"].reshape(-1), positions, rtol=1e-5)
    # The key `apply` gets at step t: fold_in(fold_in(fold_in(key, 1), t), 0).
    drawn = [
        float(
            jax.random.uniform(
                jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 1), t), 0)
            )
        )
        for t in range(12)
    ]
    np.testing.assert_allclose(h.step_values["walk_drawn"].reshape(-1), drawn, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(updates=[Walk()]), ValueError, r"give `steps_per_epoch=`"),
        (
            dict(loss=mse, optimizer=optax.sgd(0.1), steps_per_epoch=2),
            TypeError,
            r"`data` is None, but `loss=` is computed on batches",
        ),
        (
            dict(updates=[eqfit.Update("q", mse, optax.sgd(0.1)), Walk()], steps_per_epoch=2),
            ValueError,
            r"update 'q' is an `eqfit.Update`, whose loss is computed on a batch",
        ),
        (
            dict(updates=[Walk()], steps_per_epoch=2, batch_size=8),
            ValueError,
            r"`batch_size=` with `data=None`",
        ),
        (
            dict(updates=[Walk(reads=True)], steps_per_epoch=2),
            ValueError,
            r"Update 'walk''s `apply` failed on `batch=None`.*TypeError",
        ),
    ],
)
def test_training_with_no_data_refuses_what_needs_a_batch(kwargs, error, words):
    with pytest.raises(error, match=words):
        eqfit.fit(pair(), key=jax.random.key(0), **kwargs)


class Fails(eqfit.AbstractUpdate):
    """Moves `b` by 1 each step and records a loss that is NaN on the third batch."""

    name: str = "f"
    trains: Callable[[Pair], Any] | None = eqx.field(default=lambda m: m.b, kw_only=True)

    def init(self, params):
        return jnp.zeros((), jnp.int32)

    def apply(self, model, state, batch, *, model_state, key):
        model = eqx.tree_at(lambda m: m.b.bias, model, model.b.bias + 1.0)
        third = jnp.all(batch[0][0] == X[16])  # the third batch's first row
        loss = jnp.where(third, jnp.nan, 0.5)
        return eqfit.Applied(model, state + 1, model_state, {"loss": loss})


def test_on_nan_acts_on_the_loss_an_update_of_ones_own_records():
    """A non-finite `loss` value is a non-finite step, as a loss's: its update is not
    applied (its model and state stay), and `on_nan` stops, raises or skips there."""
    model = pair()
    kwargs = dict(updates=[Fails()], key=jax.random.key(0), batch_size=8, epochs=1, shuffle=False)
    skipped = eqfit.fit(model, (X, Y), on_nan="skip", **kwargs)
    # Six steps, the third not applied: the bias moved five times, the state counted 5.
    np.testing.assert_allclose(skipped.model.b.bias, model.b.bias + 5.0, rtol=1e-6)
    assert int(skipped.opt_state["f"]) == 5
    with pytest.raises(eqfit.NonFiniteLossError, match="epoch 1, step 3") as raised:
        eqfit.fit(model, (X, Y), on_nan="raise", **kwargs)
    np.testing.assert_allclose(raised.value.result.model.b.bias, model.b.bias + 2.0, rtol=1e-6)


def test_ema_averages_what_an_update_of_ones_own_trains():
    """`ema=` averages every trained array after the step, an update of one's own's too:
    a bias moved by 1 each step, averaged with decay 0.5 as a hand loop averages it."""
    model = pair()
    result = eqfit.fit(
        model,
        (X, Y),
        updates=[Fails()],
        ema=0.5,
        key=jax.random.key(0),
        batch_size=12,
        shuffle=False,
        epochs=1,
        on_nan="skip",
    )  # four steps (48 rows, batches of 12): none begins at row 16, the NaN one
    bias, average = np.asarray(model.b.bias), np.asarray(model.b.bias)
    for _ in range(4):
        bias = bias + 1.0
        average = 0.5 * average + 0.5 * bias
    np.testing.assert_allclose(result.model.b.bias, bias, rtol=1e-6)
    assert result.ema_model is not None
    np.testing.assert_allclose(result.ema_model.b.bias, average, rtol=1e-6)


class Counted(eqx.Module):
    """A model with a field that is no array."""

    linear: eqx.nn.Linear
    n: int = 3


def test_an_apply_that_changes_a_field_that_is_no_array_is_refused():
    class SetsN(eqfit.AbstractUpdate):
        name: str = "n"

        def init(self, params):
            return None

        def apply(self, model, state, batch, *, model_state, key):
            return eqfit.Applied(eqx.tree_at(lambda m: m.n, model, 5), state, model_state, {})

    model = Counted(eqx.nn.Linear(3, 1, key=jax.random.key(0)))
    with pytest.raises(
        ValueError, match=r"changed the model outside the arrays it `trains` \(model\.n\)"
    ):
        eqfit.fit(model, (X, Y), updates=[SetsN()], **FIT)


def test_validation_with_only_updates_of_ones_own_is_refused():
    with pytest.raises(ValueError, match=r"Validation .* with only updates of your own \('rl'\)"):
        eqfit.fit(pair(), (X, Y), updates=[Returns()], validation_data=(X, Y), **FIT)


def test_a_way_of_running_of_ones_own_that_says_zero_steps_is_refused():
    class Nothing(eqfit.Execution):
        def describe(self):
            return "nothing"

        def steps_per_program(self):
            return 0

        def program(self, whole_run, steps):
            return steps(0)

        def batches(self, scanned, in_calls):
            return in_calls(0)

    with pytest.raises(ValueError, match=r"says its programs run 0 steps each"):
        eqfit.fit(pair(), (X, Y), loss=mse, optimizer=optax.sgd(0.1), execution=Nothing(), **FIT)
