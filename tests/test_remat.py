"""Activation checkpointing (`fit(..., remat=)`, `eqfit.Update(..., remat=)`): each of
JAX's policies by name, and one of the user's, trains as the run without it (bit for bit
where the backward pass is the same arithmetic, else to float rounding), with one loss,
through updates, in microbatches and in a loop written by hand; the plan counts the
model's FLOPs, not the recomputation's; bad values are refused, naming `remat`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_trees_equal, programs_compiled

import eqfit


X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
Y = np.sin(X.sum(1, keepdims=True))


def tanh_saveable(prim, *avals, **params):
    """A policy of one's own: the forward pass keeps its `tanh`s, and nothing else."""
    return prim is jax.lax.tanh_p


# With `"nothing"` the backward pass computes the forward pass again as it was, and is
# the one without checkpointing: the gradients, and so the model, are the same bits. A
# policy that keeps some values has JAX write the backward pass anew from them, its
# arithmetic in another order (a mean's divisor applied to the cotangent rather than
# folded into a constant, say): the same model to float rounding. The values recorded
# (the loss, its aux values) are the forward pass's, which XLA:CPU at the suite's
# optimisation level fuses otherwise when nothing of it is kept (its sums, the loss's
# mean, in another order): the same to float rounding under every policy. (At XLA's
# default level, `"nothing"` records the same bits too.)
POLICIES = [
    ("nothing", True),
    ("dots", False),
    ("dots_no_batch", False),
    (tanh_saveable, False),
]


def model(seed=0):
    return eqx.nn.MLP(4, 1, 16, 2, activation=jnp.tanh, key=jax.random.key(seed))


def noisy_loss(m, x, y, *, key):
    """A loss that takes a key (noise on the inputs) and returns an aux value."""
    x = x + 0.01 * jax.random.normal(key, x.shape)
    out = jax.vmap(m)(x)
    return jnp.mean((out - y) ** 2), {"mae": jnp.mean(jnp.abs(out - y))}


def mean_output(m, x, y):
    return jnp.mean(jax.vmap(m)(x))


SGD = optax.sgd(0.1)
FIT = dict(
    loss=noisy_loss,
    optimizer=SGD,
    metrics={"out": mean_output},
    key=jax.random.key(1),
    epochs=2,
    batch_size=16,
)


def assert_same_run(a, b, exact):
    """`a` trained as `b`: its model bit for bit where `exact`, else to float rounding;
    its history to float rounding (`POLICIES` says why).
    """
    if exact:
        assert_trees_equal(a.model, b.model)
    else:
        assert_trees_close(a.model, b.model, rtol=1e-5, atol=1e-6)
    assert a.history.values.keys() == b.history.values.keys()
    for name, value in b.history.values.items():
        np.testing.assert_allclose(a.history[name], value, rtol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize(("remat", "exact"), POLICIES)
def test_each_policy_trains_as_the_run_without_it(remat, exact, microbatches):
    """A loss with a key, an aux value and a metric in its forward pass, each batch whole
    or in 2 microbatches (each microbatch's forward pass checkpointed).
    """
    without = eqfit.fit(model(), (X, Y), microbatches=microbatches, **FIT)
    result = eqfit.fit(model(), (X, Y), microbatches=microbatches, remat=remat, **FIT)
    assert_same_run(result, without, exact)


def recording(seen):
    """A policy of one's own that keeps nothing and notes each operation it is asked
    about: what JAX checkpointed.
    """

    def policy(prim, *avals, **params):
        seen.append(prim.name)
        return False

    return policy


@pytest.mark.slow
def test_the_policy_is_asked_about_the_forward_pass_of_each_way_a_loss_is_trained():
    """The policy of `fit`'s `remat=` sees the loss's matrix products: with one loss, in
    microbatches and for each `eqfit.Update`; an update's own `remat=` is used over it.
    """
    for kwargs in (
        dict(FIT),
        dict(FIT, microbatches=2),
        dict(FIT, loss=None, optimizer=None, updates=[eqfit.Update("u", noisy_loss, SGD)]),
    ):
        seen = []
        eqfit.fit(model(), (X, Y), **{**kwargs, "remat": recording(seen)})
        assert "dot_general" in seen and "tanh" in seen, kwargs.keys()
    fits, own = [], []
    update = eqfit.Update("u", noisy_loss, SGD, remat=recording(own))
    kwargs = {**FIT, "loss": None, "optimizer": None}
    eqfit.fit(model(), (X, Y), updates=[update], remat=recording(fits), **kwargs)
    assert "dot_general" in own and fits == []


@pytest.mark.slow
@pytest.mark.parametrize(("remat", "exact"), POLICIES[:2])
def test_updates_with_remat_train_as_without(remat, exact):
    """Two updates, each on its own layer: one checkpointed by its own `remat=`, then
    both by `fit`'s, as the run without; and `Update.apply` in a loop written by hand.
    """
    kwargs = {**FIT, "loss": None, "optimizer": None}

    def updates(first=None):
        return [
            eqfit.Update("a", noisy_loss, SGD, trains=lambda m: m.layers[0], remat=first),
            eqfit.Update("b", noisy_loss, SGD, trains=lambda m: m.layers[1:]),
        ]

    without = eqfit.fit(model(), (X, Y), updates=updates(), **kwargs)
    own = eqfit.fit(model(), (X, Y), updates=updates(remat), **kwargs)
    every = eqfit.fit(model(), (X, Y), updates=updates(), remat=remat, **kwargs)
    assert_same_run(own, without, exact)
    assert_same_run(every, without, exact)

    def hand_loop(update):
        m, key = model(), jax.random.key(2)
        state = update.init(eqx.filter(m, eqx.is_inexact_array))
        step = eqx.filter_jit(update.apply)
        for i in range(0, 64, 16):
            key, k = jax.random.split(key)
            m, state, _, _ = step(m, state, (X[i : i + 16], Y[i : i + 16]), model_state=None, key=k)
        return m

    plain = hand_loop(eqfit.Update("u", noisy_loss, SGD))
    checkpointed = hand_loop(eqfit.Update("u", noisy_loss, SGD, remat=remat))
    if exact:
        assert_trees_equal(checkpointed, plain)
    else:
        assert_trees_close(checkpointed, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_stateful_loss_in_microbatches_trains_as_without():
    """BatchNorm's state passes through the checkpointed forward pass of each microbatch."""
    net, state = eqx.nn.make_with_state(
        lambda key: eqx.nn.Sequential(
            [
                eqx.nn.Linear(4, 8, key=key),
                eqx.nn.BatchNorm(8, "batch", mode="batch"),
                eqx.nn.Lambda(jnp.tanh),
                eqx.nn.Linear(8, 1, key=key),
            ]
        )
    )(jax.random.key(3))

    def loss(m, s, x, y):
        out, s = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, s)
        return jnp.mean((out - y) ** 2), s

    kwargs = dict(FIT, loss=loss, metrics=None, state=state, microbatches=2)
    without = eqfit.fit(net, (X, Y), **kwargs)
    result = eqfit.fit(net, (X, Y), remat="nothing", **kwargs)
    assert_same_run(result, without, exact=True)
    assert_trees_equal(result.state, without.state)


@pytest.mark.slow
def test_the_plan_counts_the_models_flops_and_compiles_the_checkpointed_run():
    """The FLOPs per step (and so the MFU) are the model's with and without `remat=`: the
    forward pass computed again is not counted. The plan compiles the checkpointed run,
    a program of its own, and a `fit` after it compiles nothing more.
    """
    net = eqx.nn.MLP(4, 1, 64, 4, activation=jnp.tanh, key=jax.random.key(4))
    kwargs = {**FIT, "batch_size": 64}
    without = eqfit.plan(net, (X, Y), **kwargs)
    with programs_compiled() as planned:
        plan = eqfit.plan(net, (X, Y), remat="nothing", **kwargs)
    assert planned, "the checkpointed run is a program of its own"
    assert plan.flops_per_step == without.flops_per_step > 0
    assert eqfit.plan(net, (X, Y), remat="dots", **kwargs).flops_per_step == plan.flops_per_step
    with programs_compiled() as compiled:
        eqfit.fit(net, (X, Y), remat="nothing", **kwargs)
    assert compiled == [], "fit after plan compiled again"


def test_the_callbacks_configuration_names_the_policy():
    told = {}

    class Config:
        def on_train_begin(self, config):
            told.update(config)

        def on_epoch_end(self, epoch, logs):
            pass

    dots = jax.checkpoint_policies.dots_saveable
    eqfit.fit(model(), (X, Y), remat=dots, callbacks=[Config()], **FIT)
    assert told["remat"] == "dots"  # JAX's policy by its object is the one by its name
    eqfit.fit(model(), (X, Y), callbacks=[Config()], **FIT)
    assert told["remat"] is None


class Nudge(eqfit.AbstractUpdate):
    """An update of one's own: it has no loss's forward pass for `remat=` to checkpoint."""

    name: str = "nudge"

    def init(self, params):
        return None

    def apply(self, model, state, batch, *, model_state, key):
        return eqfit.Applied(model, state, model_state, {})


def test_bad_values_are_refused_naming_remat():
    """Under the suite's jaxtyping hook, by the annotations' check (`fit`'s with its hint);
    with the runtime checks off, as a user meets them, by eqfit's own.
    """
    for bad in ("everything", 3):
        with pytest.raises(TypeError, match="`fit`'s argument `remat` must be None, 'nothing'"):
            eqfit.fit(model(), (X, Y), remat=bad, **FIT)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="'remat'"):
            eqfit.Update("u", noisy_loss, SGD, remat=bad)  # type: ignore[arg-type]
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        for bad, error in (("everything", ValueError), (3, TypeError)):
            allowed = r"must be None, 'nothing', 'dots', 'dots_no_batch' or a policy function"
            with pytest.raises(error, match=rf"^`remat` {allowed}.*got {bad!r}\.$"):
                eqfit.fit(model(), (X, Y), remat=bad, **FIT)  # type: ignore[arg-type]
            with pytest.raises(error, match=rf"^`eqfit.Update\('u'\)`'s `remat` {allowed}"):
                eqfit.Update("u", noisy_loss, SGD, remat=bad)  # type: ignore[arg-type]
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    kwargs = {**FIT, "loss": None, "optimizer": None, "metrics": None}
    with pytest.raises(ValueError, match=r"`remat=` with only updates of your own \('nudge'\)"):
        eqfit.fit(model(), (X, Y), updates=[Nudge()], remat="nothing", **kwargs)
