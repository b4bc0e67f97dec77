"""Every option of the step with every update (`fit(..., updates=)`): validation of an
update of one's own through its `loss` method, and `microbatches=` beside one, each
against its hand loop or the run without the option.
"""

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_trees_equal, Pair, pair, PAIR_X, PAIR_Y
from jax.sharding import Mesh

import eqfit
from eqfit.sharding import fsdp


X, Y = PAIR_X, PAIR_Y
VX = np.random.default_rng(1).normal(size=(32, 3)).astype(np.float32)
VY = VX.sum(1, keepdims=True) + 0.5
FIT = dict(key=jax.random.key(1), batch_size=8, epochs=2, shuffle=False)


def mse(m, x, y):
    return jnp.mean((jax.vmap(m.a)(x) - y) ** 2)


class HandSGD(eqfit.AbstractUpdate):
    """An SGD step on `a` written by hand (as a TD update is), recording its loss and the
    mean prediction; its `loss` method gives validation the same two values.
    """

    name: str = "q"
    trains: Callable[[Pair], Any] | None = eqx.field(default=lambda m: m.a, kw_only=True)

    def init(self, params):
        return None

    def loss(self, model, x, y):
        return mse(model, x, y), {"pred": jnp.mean(jax.vmap(model.a)(x))}

    def apply(self, model, state, batch, *, model_state, key):
        x, y = batch
        (value, aux), g = eqx.filter_value_and_grad(self.loss, has_aux=True)(model, x, y)
        a = jax.tree.map(lambda p, d: p - 0.1 * d, model.a, g.a)
        model = eqx.tree_at(lambda m: m.a, model, a)
        return eqfit.Applied(model, state, model_state, {"loss": value, **aux})


class Polyak(eqfit.AbstractUpdate):
    """A target network moved towards the online one: it has no loss to validate."""

    name: str = "target"
    trains: Callable[[Pair], Any] | None = eqx.field(default=lambda m: m.b, kw_only=True)

    def init(self, params):
        return None

    def apply(self, model, state, batch, *, model_state, key):
        b = jax.tree.map(lambda t, o: 0.75 * t + 0.25 * o, model.b, model.a)
        return eqfit.Applied(eqx.tree_at(lambda m: m.b, model, b), state, model_state, {})


def test_an_update_of_ones_own_validates_with_its_loss_method():
    result = eqfit.fit(
        pair(), (X, Y), updates=[HandSGD(), Polyak()], validation_data=(VX, VY), **FIT
    )
    names = set(result.history.to_dict())
    assert {"q_loss", "q_pred", "val_q_loss", "val_q_pred"} <= names
    assert not any(n.startswith("val_target") for n in names)
    # The last epoch's validation is its loss on the validation data, at the epoch's end.
    model = result.model
    np.testing.assert_allclose(result.history["val_q_loss"][-1], mse(model, VX, VY), rtol=1e-5)
    np.testing.assert_allclose(
        result.history["val_q_pred"][-1], jnp.mean(jax.vmap(model.a)(VX)), rtol=1e-5, atol=1e-6
    )
    # By hand: the same SGD steps, then the target moved.
    hand = pair()
    for _ in range(2):
        for i in range(0, len(X), 8):
            x, y = X[i : i + 8], Y[i : i + 8]
            g = jax.grad(lambda a: mse(eqx.tree_at(lambda m: m.a, hand, a), x, y))(hand.a)
            a = jax.tree.map(lambda p, d: p - 0.1 * d, hand.a, g)
            b = jax.tree.map(lambda t, o: 0.75 * t + 0.25 * o, hand.b, a)
            hand = Pair(a, b)
    assert_trees_close(result.model, hand, rtol=1e-5, atol=1e-6)
    # `eqfit.evaluate` takes the method as a loss, as any.
    evaluated = eqfit.evaluate(result.model, (VX, VY), loss=HandSGD().loss, batch_size=8)
    np.testing.assert_allclose(evaluated["loss"], result.history["val_q_loss"][-1], rtol=1e-6)


def test_early_stopping_monitors_the_validation_loss_of_an_update_of_ones_own():
    stopping = eqfit.EarlyStopping(monitor="val_q_loss", patience=0, min_delta=1e9)
    result = eqfit.fit(
        pair(),
        (X, Y),
        updates=[HandSGD(), Polyak()],
        validation_data=(VX, VY),
        early_stopping=stopping,
        **dict(FIT, epochs=5),
    )
    assert len(result.history["val_q_loss"]) == 2


def test_a_loss_method_whose_values_apply_does_not_record_is_refused():
    class Silent(HandSGD):
        def apply(self, model, state, batch, *, model_state, key):
            return eqfit.Applied(model, state, model_state, {"loss": mse(model, *batch)})

    with pytest.raises(ValueError, match=r"Update 'q''s `loss` method returns \['loss', 'pred'\]"):
        eqfit.fit(pair(), (X, Y), updates=[Silent()], validation_data=(VX, VY), **FIT)


def test_validation_with_updates_of_ones_own_none_with_a_loss_is_refused():
    with pytest.raises(ValueError, match=r"none of which has a loss: .*`loss\(self, model"):
        eqfit.fit(pair(), (X, Y), updates=[Polyak()], validation_data=(VX, VY), **FIT)


def test_microbatches_split_each_loss_update_beside_an_update_of_ones_own():
    """`microbatches=4` splits `eqfit.Update`'s gradient into four passes; the update of
    one's own takes the whole batch: the run equals the one without, to float tolerance.
    """
    ups = [eqfit.Update("a", mse, optax.adam(0.05), trains=lambda m: m.a), Polyak()]
    whole = eqfit.fit(pair(), (X, Y), updates=ups, **FIT)
    split = eqfit.fit(pair(), (X, Y), updates=ups, microbatches=4, **FIT)
    assert_trees_close(split.model, whole.model, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(split.history["a_loss"], whole.history["a_loss"], rtol=1e-5)


def test_schedules_are_recorded_at_each_updates_own_count():
    """A schedule is evaluated at each update's optimizer's count before its step: `b`,
    run every second step, has counted half as many.
    """
    ups = [
        eqfit.Update("a", mse, optax.adam(0.01), trains=lambda m: m.a),
        eqfit.Update("b", mse, optax.adam(0.01), trains=lambda m: m.b, every=2),
        Polyak(trains=lambda m: m.b),
    ]
    result = eqfit.fit(pair(), (X, Y), updates=ups, schedules={"lr": lambda c: 0.1 * c}, **FIT)
    # Six steps an epoch: `a`'s last step of each counts 5 and 11 before it, `b`'s 2 and 5.
    np.testing.assert_allclose(result.history["a_lr"], [0.5, 1.1], rtol=1e-6)
    np.testing.assert_allclose(result.history["b_lr"], [0.2, 0.5], rtol=1e-6)
    assert "target_lr" not in result.history.to_dict()


def test_a_schedule_for_an_update_whose_optimizer_counts_nothing_names_it():
    ups = [eqfit.Update("a", mse, optax.sgd(0.1), trains=lambda m: m.a)]
    with pytest.raises(ValueError, match=r"Update 'a': `schedules` are evaluated at"):
        eqfit.fit(pair(), (X, Y), updates=ups, schedules={"lr": lambda c: 0.1 * c}, **FIT)


def _gan_example() -> Any:
    path = Path(__file__).parent.parent / "examples" / "gan.py"
    spec = importlib.util.spec_from_file_location("gan_example_options", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy  # 8 devices and the DCGAN's convolutions: the whole suite only
def test_the_dcgan_example_trains_under_fsdp_as_without_shard():
    """`examples/gan.py`'s two updates with `shard=fsdp()` over 8 simulated devices: each
    update's Adam state is laid out as the arrays it trains, an eighth per device, and
    the run equals the one without `shard=` on the same mesh.
    """
    gan = _gan_example()
    model, state = eqx.nn.make_with_state(gan.GAN)(jax.random.key(0))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    kwargs = dict(
        key=jax.random.key(1),
        state=state,
        epochs=1,
        batch_size=32,
        drop_remainder=True,
        mesh=mesh,
        updates=[
            eqfit.Update(
                "d", gan.d_loss, optax.adam(1e-3, b1=0.5), trains=lambda m: m.discriminator
            ),
            eqfit.Update("g", gan.g_loss, optax.adam(1e-3, b1=0.5), trains=lambda m: m.generator),
        ],
    )
    images = gan.digits()[:128]
    plain = eqfit.fit(model, (images,), **kwargs)
    sharded = eqfit.fit(model, (images,), shard=fsdp("data", min_bytes=0), **kwargs)
    assert_trees_close(sharded.model, plain.model, rtol=1e-4, atol=1e-5)
    assert_trees_close(sharded.opt_state, plain.opt_state, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sharded.history["d_loss"], plain.history["d_loss"], rtol=1e-5)
    np.testing.assert_allclose(sharded.history["g_loss"], plain.history["g_loss"], rtol=1e-5)
    # Each update's Adam moments are laid out as the arrays it trains: split, not whole.
    d_state = sharded.opt_state["d"]
    mu = [x for x in jax.tree.leaves(d_state) if x.ndim == 4]
    assert mu and all(not x.sharding.is_fully_replicated for x in mu)
    weight = sharded.model.discriminator.layers[0].weight  # pyright: ignore
    assert not weight.sharding.is_fully_replicated


def test_an_update_of_ones_own_trains_under_shard_as_without():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    big = Pair(
        eqx.nn.Linear(3, 64, key=jax.random.key(0)), eqx.nn.Linear(3, 64, key=jax.random.key(1))
    )
    y = np.repeat(Y, 64, axis=1)
    ups = [HandSGD(), Polyak()]
    plain = eqfit.fit(big, (X, y), updates=ups, mesh=mesh, **FIT)
    sharded = eqfit.fit(big, (X, y), updates=ups, mesh=mesh, shard=fsdp(min_bytes=0), **FIT)
    assert_trees_close(sharded.model, plain.model, rtol=1e-5, atol=1e-6)
    assert not sharded.model.b.weight.sharding.is_fully_replicated


F16 = eqfit.Precision(jnp.float16, initial_scale=2.0**10, growth_steps=3)


def loss_b(m, x, y):
    return jnp.mean((jax.vmap(m.b)(x) - y) ** 2)


@pytest.mark.slow
def test_float16_scales_each_updates_loss_with_its_own_scale():
    """Two updates under float16's dynamic loss scaling, `b` every second step: each
    scale grows after 3 of its own finite steps, so `a`'s equals a run of `a` alone and
    `b`'s has grown half as often; the model is the float32 run's, to float16's
    precision.
    """
    ups = [
        eqfit.Update("a", mse, optax.adam(0.01), trains=lambda m: m.a),
        eqfit.Update("b", loss_b, optax.adam(0.01), trains=lambda m: m.b, every=2),
    ]
    result = eqfit.fit(pair(), (X, Y), updates=ups, precision=F16, **FIT)
    alone = eqfit.fit(
        pair(),
        (X, Y),
        loss=mse,
        optimizer=optax.adam(0.01),
        trains=lambda m: m.a,
        precision=F16,
        **FIT,
    )
    np.testing.assert_array_equal(result.history["a_loss_scale"], alone.history["loss_scale"])
    # `a` used 2**11 at its 6th step and 2**13 at its 12th; `b`, 2**10 and 2**11 at its
    # 3rd and 6th.
    np.testing.assert_array_equal(result.history["a_loss_scale"], [2.0**11, 2.0**13])
    np.testing.assert_array_equal(result.history["b_loss_scale"], [2.0**10, 2.0**11])
    np.testing.assert_array_equal(result.history["b_skipped_steps"], [0, 0])
    full = eqfit.fit(pair(), (X, Y), updates=ups, **FIT)
    assert_trees_close(result.model, full.model, rtol=2e-2, atol=2e-2)


def test_an_update_whose_scaled_gradient_overflows_skips_only_itself():
    """`b`'s loss is large enough that its gradient at the starting scale overflows
    float16: `b` halves its own scale and skips those steps, `a` trains on, its scale
    growing.
    """

    def huge(m, x, y):
        return 300.0 * loss_b(m, x, y)

    ups = [
        eqfit.Update("a", mse, optax.adam(0.01), trains=lambda m: m.a),
        eqfit.Update("b", huge, optax.adam(0.01), trains=lambda m: m.b),
    ]
    result = eqfit.fit(pair(), (X, Y), updates=ups, precision=F16, norms=True, **FIT)
    h = result.history
    assert h["b_skipped_steps"][0] > 0 and h["a_skipped_steps"].sum() == 0
    assert h["b_loss_scale"][0] < 2.0**10 < h["a_loss_scale"][0]
    # `a`'s norms count its every step, `b`'s only those it applied.
    assert np.isfinite(h["a_grad_norm"]).all() and np.isfinite(h["b_update_norm"]).all()


def test_a_run_of_float16_updates_resumes_its_scales_bit_for_bit(tmp_path):
    ups = [
        eqfit.Update("a", mse, optax.adam(0.01), trains=lambda m: m.a),
        eqfit.Update("b", loss_b, optax.adam(0.01), trains=lambda m: m.b, every=2),
    ]
    kwargs = dict(FIT, epochs=3, updates=ups, precision=F16)
    whole = eqfit.fit(pair(), (X, Y), **kwargs)
    policy = eqfit.Checkpoint(tmp_path / "all", every_epochs=None, every_steps=5, keep=100)
    eqfit.fit(pair(), (X, Y), checkpoint=policy, **kwargs)
    name = "ckpt-000001-000004"  # step 10: `b`'s scale has moved apart from `a`'s
    alone = tmp_path / "alone"
    shutil.copytree(tmp_path / "all" / name, alone / name)
    resumed = eqfit.fit(pair(), (X, Y), checkpoint=alone, **kwargs)
    assert_trees_equal(resumed.model, whole.model)
    for key in ("a_loss_scale", "b_loss_scale", "b_loss"):
        np.testing.assert_array_equal(resumed.history[key], whole.history[key])
