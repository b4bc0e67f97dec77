"""Several updates in a step (`fit(..., updates=)`): each against a hand-written Equinox +
optax loop, in every way of running the steps, on several devices, resumed from a
checkpoint between an update's steps; an update of the user's own; and the refusals.
(The DCGAN, with BatchNorm state, is in `test_updates.py`.)
"""

import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_trees_equal, Pair, pair, PAIR_X, PAIR_Y
from jax.sharding import AxisType, Mesh

import eqfit


X, Y = PAIR_X, PAIR_Y


def loss_a(m, x, y):
    """`a` fits the targets; it reports `b`'s mean output as an aux value."""
    return jnp.mean((jax.vmap(m.a)(x) - y) ** 2), {"out": jnp.mean(jax.vmap(m.b)(x))}


def loss_b(m, x, y):
    """`b` follows `a`, as `a` is after its own update in the step."""
    return jnp.mean((jax.vmap(m.b)(x) - jax.vmap(m.a)(x)) ** 2)


def updates(every=2, opt_a=None):
    return [
        eqfit.Update("a", loss_a, opt_a or optax.sgd(0.1), trains=lambda m: m.a),
        eqfit.Update("b", loss_b, optax.adam(0.01), trains=lambda m: m.b, every=every),
    ]


def spec(model, part):
    nothing = jax.tree.map(lambda _: False, model)
    chosen = eqx.tree_at(part, nothing, replace_fn=lambda p: jax.tree.map(lambda _: True, p))
    return jax.tree.map(lambda s, x: s and eqx.is_inexact_array(x), chosen, model)


def hand_loop(model, epochs, batch_size, every):
    """The same alternating step as plain Equinox and optax: `a`'s update, then on steps
    `every`, `2 * every`, ... `b`'s, each on the model the one before left. Returns the
    model, `b`'s optimizer state and each epoch's mean losses.
    """
    opt_a, opt_b = optax.sgd(0.1), optax.adam(0.01)
    sa, sb = spec(model, lambda m: m.a), spec(model, lambda m: m.b)
    state_a, state_b = opt_a.init(eqx.filter(model, sa)), opt_b.init(eqx.filter(model, sb))

    @eqx.filter_jit
    def step_a(m, state, x, y):
        p, rest = eqx.partition(m, sa)
        (value, aux), g = jax.value_and_grad(
            lambda p: loss_a(eqx.combine(p, rest), x, y), has_aux=True
        )(p)
        u, state = opt_a.update(g, state, p)
        return eqx.combine(eqx.apply_updates(p, u), rest), state, value, aux["out"]

    @eqx.filter_jit
    def step_b(m, state, x, y):
        p, rest = eqx.partition(m, sb)
        value, g = jax.value_and_grad(lambda p: loss_b(eqx.combine(p, rest), x, y))(p)
        u, state = opt_b.update(g, state, p)
        return eqx.combine(eqx.apply_updates(p, u), rest), state, value

    t, history = 0, {"a_loss": [], "a_out": [], "b_loss": []}
    for _ in range(epochs):
        a_losses, outs, b_losses = [], [], []
        for i in range(0, len(X), batch_size):
            x, y = X[i : i + batch_size], Y[i : i + batch_size]
            model, state_a, value, out = step_a(model, state_a, x, y)
            a_losses.append(value)
            outs.append(out)
            t += 1
            if t % every == 0:
                model, state_b, value = step_b(model, state_b, x, y)
                b_losses.append(value)
        history["a_loss"].append(np.mean(a_losses))
        history["a_out"].append(np.mean(outs))
        history["b_loss"].append(np.mean(b_losses))
    return model, state_b, history


FIT = dict(key=jax.random.key(1), batch_size=8, epochs=2, shuffle=False)


# The other ways run with the heavy tests (`pytest -m heavy`), as CI does; the quick
# suite's test of the ways below compares them bit for bit.
@pytest.mark.parametrize(
    "way",
    [
        "whole",
        pytest.param("per_step", marks=pytest.mark.heavy),
        pytest.param("progress", marks=pytest.mark.heavy),
    ],
)
def test_updates_in_turn_equal_a_hand_loop(way):
    kwargs = {
        "whole": dict(execution=eqfit.WholeRun()),
        "per_step": dict(execution=eqfit.PerStep(2)),
        "progress": dict(progress=True),
    }[way]
    result = eqfit.fit(pair(), (X, Y), updates=updates(every=4), **FIT, **kwargs)
    model, state_b, history = hand_loop(pair(), epochs=2, batch_size=8, every=4)
    assert_trees_close(result.model, model, rtol=1e-5, atol=1e-6)
    # `b` ran on steps 4, 8 and 12 of 12: its optimizer counted three updates.
    assert int(result.opt_state["b"][0].count) == int(state_b[0].count) == 3
    for name in ("a_loss", "a_out", "b_loss"):  # `b_loss`: over the steps where `b` ran
        np.testing.assert_allclose(result.history[name], history[name], rtol=1e-5)
    # The step's loss is the sum of the losses of the updates that ran in it.
    steps = result.history.step_loss
    assert steps.shape == (2, 6)
    np.testing.assert_allclose(np.mean(steps, axis=1), result.history["loss"], rtol=1e-6)
    assert result.history["loss"][0] > result.history["a_loss"][0]


def test_the_ways_of_running_several_updates_agree_bit_for_bit():
    runs = [
        eqfit.fit(pair(), (X, Y), updates=updates(), **FIT, **kwargs)
        for kwargs in (dict(execution=eqfit.WholeRun()), dict(progress=True))
    ]
    assert_trees_equal(runs[0].model, runs[1].model)
    assert_trees_equal(runs[0].opt_state, runs[1].opt_state)
    np.testing.assert_array_equal(runs[0].history.step_loss, runs[1].history.step_loss)


# With the heavy tests (`pytest -m heavy`), as CI runs them: the several-device variants
# of the newest tests.
@pytest.mark.heavy
@pytest.mark.parametrize("place", ["devices", "mesh"])
def test_several_updates_on_eight_devices_equal_one(place):
    placement = (
        dict(devices=8)
        if place == "devices"
        else dict(mesh=Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,)))
    )
    one = eqfit.fit(pair(), (X, Y), updates=updates(), **FIT)
    many = eqfit.fit(pair(), (X, Y), updates=updates(), **FIT, **placement)
    assert_trees_close(many.model, one.model, rtol=1e-5, atol=1e-6)
    for name in ("loss", "a_loss", "a_out", "b_loss"):
        np.testing.assert_allclose(many.history[name], one.history[name], rtol=1e-5)


def test_a_checkpoint_between_an_updates_steps_resumes_bit_for_bit(tmp_path):
    """`b` runs every 5 steps; checkpoints every 3 fall between its updates."""
    kwargs = dict(FIT, epochs=3, updates=updates(every=5))
    whole = eqfit.fit(pair(), (X, Y), **kwargs)
    policy = eqfit.Checkpoint(tmp_path / "all", every_epochs=None, every_steps=3, keep=100)
    checkpointed = eqfit.fit(pair(), (X, Y), checkpoint=policy, **kwargs)
    assert_trees_equal(checkpointed.model, whole.model)
    names = sorted(p.name for p in (tmp_path / "all").iterdir() if p.name.startswith("ckpt-"))
    # Step 9 (epoch 1, step 3): after `b`'s update at step 5, before its next at 10.
    name = "ckpt-000001-000003"
    assert name in names
    alone = tmp_path / "alone"
    shutil.copytree(tmp_path / "all" / name, alone / name)
    resumed = eqfit.fit(pair(), (X, Y), checkpoint=alone, **kwargs)
    assert_trees_equal(resumed.model, whole.model)
    assert_trees_equal(resumed.opt_state, whole.opt_state)
    np.testing.assert_array_equal(resumed.history.step_loss, whole.history.step_loss)
    np.testing.assert_array_equal(resumed.history["b_loss"], whole.history["b_loss"])


class Polyak(eqfit.AbstractUpdate):
    """A target network moved towards the online one by Polyak averaging."""

    name: str = "target"
    trains: Callable[[Pair], Any] | None = lambda m: m.b
    tau: float = 0.25

    def init(self, params):
        return jnp.zeros((), jnp.int32)  # counts its updates

    def apply(self, model, state, batch, *, model_state, key):
        target = jax.tree.map(lambda t, o: (1 - self.tau) * t + self.tau * o, model.b, model.a)
        distance = optax.tree.norm(jax.tree.map(jnp.subtract, target, model.a))
        model = eqx.tree_at(lambda m: m.b, model, target)
        return eqfit.Applied(model, state + 1, model_state, {"distance": distance})


def test_an_update_of_ones_own_trains_in_the_same_program():
    def online(m, x, y):
        return jnp.mean((jax.vmap(m.a)(x) - y) ** 2)

    result = eqfit.fit(
        pair(),
        (X, Y),
        updates=[eqfit.Update("q", online, optax.sgd(0.1), trains=lambda m: m.a), Polyak()],
        validation_data=(X, Y),
        **FIT,
    )
    # By hand: an SGD step of the online network, then the target moved towards it.
    model, opt = pair(), optax.sgd(0.1)
    distances = []
    for _ in range(2):
        for i in range(0, len(X), 8):
            x, y = X[i : i + 8], Y[i : i + 8]
            g = jax.grad(lambda a: online(eqx.tree_at(lambda m: m.a, model, a), x, y))(model.a)
            a = eqx.apply_updates(model.a, opt.update(g, opt.init(model.a))[0])
            b = jax.tree.map(lambda t, o: 0.75 * t + 0.25 * o, model.b, a)
            distances.append(float(optax.tree.norm(jax.tree.map(jnp.subtract, b, a))))
            model = Pair(a, b)
    assert_trees_close(result.model, model, rtol=1e-5, atol=1e-6)
    assert int(result.opt_state["target"]) == 12
    np.testing.assert_allclose(
        result.history["target_distance"], np.mean(np.reshape(distances, (2, 6)), 1), rtol=1e-5
    )
    # Validation computes the losses' updates' values: the user's own records none there.
    names = result.history.to_dict()
    assert "val_q_loss" in names and "val_target_distance" not in names


def test_each_update_records_its_norms_and_hyperparameters_under_its_name():
    opt_a = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    result = eqfit.fit(pair(), (X, Y), updates=updates(every=3, opt_a=opt_a), norms=True, **FIT)
    names = set(result.history.to_dict())
    assert {"a_grad_norm", "a_update_norm", "a_learning_rate", "b_grad_norm"} <= names
    np.testing.assert_allclose(result.history["a_learning_rate"], [0.1, 0.1])
    # `b` ran on 2 of each epoch's 6 steps: its norms are means over those, not NaN.
    assert np.all(np.isfinite(result.history["b_grad_norm"]))
    assert np.all(np.asarray(result.history["b_update_norm"]) > 0)


def test_early_stopping_monitors_an_updates_validation_value():
    stopping = eqfit.EarlyStopping(monitor="val_b_loss", patience=0, min_delta=1e9)
    result = eqfit.fit(
        pair(),
        (X, Y),
        updates=updates(every=1),
        validation_data=(X, Y),
        early_stopping=stopping,
        **dict(FIT, epochs=5),
    )
    assert len(result.history["val_b_loss"]) == 2  # no epoch improves by 1e9


@pytest.mark.heavy  # with the several-device variants
def test_an_ensemble_of_several_updates_trains_each_member_as_alone():
    members = [pair(0), pair(1)]
    stack = jax.tree.map(lambda *x: jnp.stack(x), *members)
    together = eqfit.fit(stack, (X, Y), updates=updates(), ensemble=True, **FIT)
    alone = eqfit.fit(members[1], (X, Y), updates=updates(), **FIT)
    second = jax.tree.map(lambda x: x[1], together.model)
    assert_trees_close(second, alone.model, rtol=1e-5, atol=1e-6)


def test_a_non_finite_loss_in_an_update_stops_the_run():
    def bad(m, x, y):
        return loss_b(m, x, y) / 0.0 * 0.0  # NaN

    with pytest.raises(eqfit.NonFiniteLossError) as error:
        eqfit.fit(
            pair(),
            (X, Y),
            updates=[updates()[0], eqfit.Update("b", bad, optax.sgd(0.1), trains=lambda m: m.b)],
            **FIT,
        )
    assert error.value.result.history.step_loss.shape[1] == 6


def test_several_updates_are_refused_with_what_says_one_update():
    with pytest.raises(ValueError, match="`updates` and `loss` both say"):
        eqfit.fit(pair(), (X, Y), loss=loss_b, updates=updates(), **FIT)
    with pytest.raises(ValueError, match="`updates` and `trains` both say what trains"):
        eqfit.fit(pair(), (X, Y), trains=lambda m: m.a, updates=updates(), **FIT)
    with pytest.raises(TypeError, match="`fit` needs `optimizer`"):
        eqfit.fit(pair(), (X, Y), loss=loss_b, **FIT)


@pytest.mark.parametrize(
    "given, error, words",
    [
        (lambda: [*updates()[:1], updates()[0]], ValueError, "two updates named 'a'"),
        (lambda: [eqfit.Update("a b", loss_a, optax.sgd(0.1))], ValueError, "is named 'a b'"),
        (lambda: [eqfit.Update("val", loss_a, optax.sgd(0.1))], ValueError, "records 'val_loss'"),
        (lambda: updates()[0], TypeError, r"`updates` .*a list of updates, run in turn"),
        (lambda: [optax.sgd(0.1)], TypeError, r"`updates` .*a list of updates, run in turn"),
        (lambda: [], TypeError, "`updates` must be a non-empty list of updates"),
        (
            lambda: [eqfit.Update("a", loss_a, optax.sgd(0.1), trains=lambda m: m.c)],
            ValueError,
            "update 'a''s `trains` must pick parts of the model",
        ),
    ],
)
def test_bad_updates_are_refused_before_compiling(given, error, words):
    with pytest.raises(error, match=words):
        eqfit.fit(pair(), (X, Y), updates=given(), **FIT)


def test_an_update_run_every_zero_steps_is_refused_at_once():
    with pytest.raises(ValueError, match="`every` must be an integer of 1 or more"):
        eqfit.Update("g", loss_b, optax.sgd(0.1), every=0)


def test_an_update_that_trains_no_array_is_refused():
    class Frozen(eqx.Module):
        a: eqx.nn.Linear
        steps: jax.Array

    model = Frozen(pair().a, jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match="update 'n''s `trains` picks no floating-point"):
        eqfit.fit(
            model,
            (X, Y),
            updates=[eqfit.Update("n", loss_b, optax.sgd(0.1), trains=lambda m: m.steps)],
            **FIT,
        )


def test_a_name_an_update_records_that_a_metric_has_is_refused():
    def metric(m, x, y):
        return jnp.mean(x)

    with pytest.raises(ValueError, match="update 'a' records 'a_loss', and `metrics` has"):
        eqfit.fit(pair(), (X, Y), updates=updates(), metrics={"a_loss": metric}, **FIT)


def test_an_update_of_ones_own_under_devices_is_refused():
    with pytest.raises(ValueError, match="`devices=` with update 'target' of your own"):
        eqfit.fit(pair(), (X, Y), updates=[updates()[0], Polyak()], devices=8, **FIT)


class Seeded(eqfit.AbstractUpdate):
    """An update whose state starts from a key: a random draw it records every step."""

    name: str = "seeded"

    def init(self, params, *, key=None):
        assert key is not None
        return jax.random.normal(key, (3,))

    def apply(self, model, state, batch, *, model_state, key):
        return eqfit.Applied(model, state, model_state, {"first": state[0]})


@pytest.mark.slow
def test_an_updates_init_gets_a_key_of_its_own_per_member(getkey):
    members = 3
    key = jax.random.key(5)
    models = eqx.filter_vmap(lambda k: pair(0))(jax.random.split(getkey(), members))
    kwargs = dict(epochs=1, batch_size=16, updates=[updates()[0], Seeded()])
    result = eqfit.fit(models, (X, Y), key=key, ensemble=True, **kwargs)
    states = np.asarray(result.opt_state["seeded"])
    assert states.shape == (members, 3)
    assert len({tuple(s) for s in states}) == members  # each member starts apart
    for m, member_key in enumerate(jax.random.split(key, members)):
        # As the member would alone, with its key; the update is the second (index 1).
        alone = eqfit.fit(pair(0), (X, Y), key=member_key, **kwargs)
        np.testing.assert_array_equal(alone.opt_state["seeded"], states[m])
        init_key = jax.random.fold_in(jax.random.fold_in(member_key, 3), 1)
        np.testing.assert_array_equal(states[m], jax.random.normal(init_key, (3,)))
        # Its value every step, the epoch's mean of it (the history's columns are members).
        np.testing.assert_allclose(result.history["seeded_first"][:, m], states[m, 0], rtol=1e-6)


def test_an_update_that_says_its_samples_shows_them_in_samples_per_second():
    # Each step of this update processes 1,000 samples of its own (a rollout's
    # environment steps, say); the batch's 16 rows are a dummy's.
    kwargs = dict(key=jax.random.key(0), epochs=2, batch_size=16, progress="lines")
    rows = eqfit.fit(pair(), (X, Y), updates=[Seeded()], **kwargs)
    said = eqfit.fit(pair(), (X, Y), updates=[Seeded(samples=np.int64(1000))], **kwargs)
    for result, per_step in ((rows, 16), (said, 1000)):
        throughput = result.history.throughput
        np.testing.assert_allclose(
            throughput["samples_per_second"], per_step * throughput["steps_per_second"]
        )
    with pytest.raises(ValueError, match=r"Update 'seeded': `samples` must be an integer"):
        Seeded(samples=0)


def test_numpy_integers_are_integers_for_every_and_samples():
    update = eqfit.Update("b", loss_b, optax.sgd(0.1), every=np.int64(2), samples=np.int32(8))
    assert type(update.every) is int and update.every == 2 and type(update.samples) is int
    result = eqfit.fit(pair(), (X, Y), updates=[updates()[0], update], **FIT)
    assert np.isfinite(result.history["b_loss"]).all()


@pytest.mark.slow
def test_an_update_with_no_optimizer_is_refused_where_it_is_built():
    # In a plain process: the tests' jaxtyping hook checks a Module's fields by their
    # annotations first, which a user's `import eqfit` does not.
    script = """
import optax, eqfit
for optimizer in (optax.adam, "adam", None):
    try:
        eqfit.Update("d", lambda m, x, y: 0.0, optimizer)
    except TypeError as e:
        print(e)
try:
    eqfit.Update("d", "mse", optax.sgd(0.1))
except TypeError as e:
    print(e)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 4, done.stderr[-2000:]
    must = "`eqfit.Update('d')`'s `optimizer` must be an optax `GradientTransformation`"
    assert all(line.startswith(must) for line in lines[:3])
    assert lines[0].endswith(
        "got function. `adam` itself makes one when called: `adam(1e-3)`, say."
    )
    assert lines[1].endswith("got str.") and lines[2].endswith("got NoneType.")
    assert lines[3].startswith("`eqfit.Update('d')`'s `loss` must be a function")
