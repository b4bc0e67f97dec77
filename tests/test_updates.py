"""Several updates per step, `fit(..., updates=[eqfit.Update(...), ...])` (issue 37):
Equinox's DCGAN example (`docs/examples/deep_convolutional_gan.ipynb`) at 16x16, its
discriminator's update then its generator's on each batch, against the notebook's own
loop of two `eqx.filter_jit` steps written out by hand.

The notebook draws each step's noise from a key it threads through its loop; here the
latents are part of the data, so that with `shuffle=False` both sides see the same
batches and the same noise, step for step.
"""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import eqfit


LATENT, FEATURES = 8, 4  # the notebook's 100 and 64 (its images' width), made tiny
SIZE = 16  # images are 1 x SIZE x SIZE: the notebook's layers, less two levels
BATCH, STEPS = 32, 10
# Both sides compute the same steps, but in programs that XLA compiles and fuses apart.
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def up(channels_in: int, channels_out: int, stride: int, padding: int, key):
    """The notebook's transposed convolution: 4x4, no bias (a BatchNorm follows)."""
    return eqx.nn.ConvTranspose2d(
        channels_in,
        channels_out,
        kernel_size=4,
        stride=stride,
        padding=padding,
        use_bias=False,
        key=key,
    )


def down(channels_in: int, channels_out: int, stride: int, padding: int, key):
    """The notebook's convolution: 4x4, no bias."""
    return eqx.nn.Conv2d(
        channels_in,
        channels_out,
        kernel_size=4,
        stride=stride,
        padding=padding,
        use_bias=False,
        key=key,
    )


def run_layers(layers, x, state):
    """The notebook's `__call__`: BatchNorm takes and returns the state, the rest do not."""
    for layer in layers:
        if isinstance(layer, eqx.nn.BatchNorm):
            x, state = layer(x, state)
        else:
            x = layer(x)
    return x, state


class Generator(eqx.Module):
    """The notebook's generator: transposed convolutions from a 1x1 latent up to the
    image, BatchNorm and relu between them, tanh at the end.
    """

    layers: list[Any]

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, 3)
        self.layers = [
            up(LATENT, FEATURES * 2, 1, 0, keys[0]),  # 1x1 -> 4x4
            eqx.nn.BatchNorm(FEATURES * 2, axis_name="batch", mode="batch"),
            jax.nn.relu,
            up(FEATURES * 2, FEATURES, 2, 1, keys[1]),  # -> 8x8
            eqx.nn.BatchNorm(FEATURES, axis_name="batch", mode="batch"),
            jax.nn.relu,
            up(FEATURES, 1, 2, 1, keys[2]),  # -> 16x16
            jax.nn.tanh,
        ]

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        return run_layers(self.layers, x, state)


class Discriminator(eqx.Module):
    """The notebook's discriminator: strided convolutions down to one logit, PReLU
    between them and BatchNorm after all but the first.
    """

    layers: list[Any]

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, 3)
        self.layers = [
            down(1, FEATURES, 2, 1, keys[0]),  # 16x16 -> 8x8
            eqx.nn.PReLU(0.2),
            down(FEATURES, FEATURES * 2, 2, 1, keys[1]),  # -> 4x4
            eqx.nn.BatchNorm(FEATURES * 2, axis_name="batch", mode="batch"),
            eqx.nn.PReLU(0.2),
            down(FEATURES * 2, 1, 1, 0, keys[2]),  # -> 1x1, one logit
        ]

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        return run_layers(self.layers, x, state)


class GAN(eqx.Module):
    """The two networks as one model, one state: what `fit` trains."""

    generator: Generator
    discriminator: Discriminator

    def __init__(self, key: jax.Array):
        g_key, d_key = jax.random.split(key)
        self.generator = Generator(g_key)
        self.discriminator = Discriminator(d_key)


def batched(network: Any, state: eqx.nn.State, x: jax.Array) -> tuple[jax.Array, eqx.nn.State]:
    return jax.vmap(network, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)


def cross_entropy(logits: jax.Array, label: float) -> jax.Array:
    logits = logits.reshape(-1)
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label)).mean()


# The notebook's two losses, each differentiated with respect to its first argument. Both
# networks run in training mode in both, so each updates both networks' BatchNorm state.


def discriminator_loss(discriminator, generator, state, latents, images):
    fake, state = batched(generator, state, latents)
    fake_logits, state = batched(discriminator, state, fake)
    real_logits, state = batched(discriminator, state, images)
    return (cross_entropy(fake_logits, 0.0) + cross_entropy(real_logits, 1.0)) / 2, state


def generator_loss(generator, discriminator, state, latents):
    fake, state = batched(generator, state, latents)
    logits, state = batched(discriminator, state, fake)
    return cross_entropy(logits, 1.0), state


# The same losses as `fit` calls them: `loss(model, state, *batch)`.


def d_loss(gan: GAN, state: eqx.nn.State, latents: jax.Array, images: jax.Array):
    return discriminator_loss(gan.discriminator, gan.generator, state, latents, images)


def g_loss(gan: GAN, state: eqx.nn.State, latents: jax.Array, images: jax.Array):
    del images
    return generator_loss(gan.generator, gan.discriminator, state, latents)


def adam() -> optax.GradientTransformation:
    return optax.adam(2e-4, b1=0.5)  # the notebook's, b2 its 0.999


def problem(steps: int = STEPS) -> tuple[GAN, eqx.nn.State, np.ndarray, np.ndarray]:
    gan, state = eqx.nn.make_with_state(GAN)(jax.random.key(2003))
    rng = np.random.default_rng(0)
    latents = rng.normal(size=(BATCH * steps, LATENT, 1, 1)).astype(np.float32)
    images = np.tanh(rng.normal(size=(BATCH * steps, 1, SIZE, SIZE))).astype(np.float32)
    return gan, state, latents, images


# The notebook's loop, written out: `step_discriminator` then `step_generator`, each its
# own `eqx.filter_jit`, the state of one the next one's.


@eqx.filter_jit
def step_discriminator(gan, state, opt_state, latents, images):
    grad = eqx.filter_value_and_grad(discriminator_loss, has_aux=True)
    (loss, state), grads = grad(gan.discriminator, gan.generator, state, latents, images)
    updates, opt_state = adam().update(grads, opt_state)
    discriminator = eqx.apply_updates(gan.discriminator, updates)
    return eqx.tree_at(lambda g: g.discriminator, gan, discriminator), state, opt_state, loss


@eqx.filter_jit
def step_generator(gan, state, opt_state, latents):
    grad = eqx.filter_value_and_grad(generator_loss, has_aux=True)
    (loss, state), grads = grad(gan.generator, gan.discriminator, state, latents)
    updates, opt_state = adam().update(grads, opt_state)
    generator = eqx.apply_updates(gan.generator, updates)
    return eqx.tree_at(lambda g: g.generator, gan, generator), state, opt_state, loss


class HandRun(NamedTuple):
    gan: GAN
    state: eqx.nn.State
    d_opt_state: Any
    g_opt_state: Any
    d_losses: list[float]
    g_losses: list[float]


def hand_loop(gan, state, latents, images, g_every=1) -> HandRun:
    """The discriminator's step on every batch, the generator's on steps `g_every`,
    `2 * g_every`, ... (counted from 1), batches in order."""
    d_opt_state = adam().init(eqx.filter(gan.discriminator, eqx.is_inexact_array))
    g_opt_state = adam().init(eqx.filter(gan.generator, eqx.is_inexact_array))
    d_losses, g_losses = [], []
    for step in range(1, len(latents) // BATCH + 1):
        z = jnp.asarray(latents[(step - 1) * BATCH : step * BATCH])
        x = jnp.asarray(images[(step - 1) * BATCH : step * BATCH])
        gan, state, d_opt_state, loss = step_discriminator(gan, state, d_opt_state, z, x)
        d_losses.append(float(loss))
        if step % g_every == 0:
            gan, state, g_opt_state, loss = step_generator(gan, state, g_opt_state, z)
            g_losses.append(float(loss))
    return HandRun(gan, state, d_opt_state, g_opt_state, d_losses, g_losses)


def fit_gan(gan, state, latents, images, g_every=1):
    return eqfit.fit(
        gan,
        (latents, images),
        key=jax.random.key(1),
        state=state,
        epochs=1,
        batch_size=BATCH,
        shuffle=False,
        updates=[
            eqfit.Update("d", d_loss, adam(), trains=lambda m: m.discriminator),
            eqfit.Update("g", g_loss, adam(), trains=lambda m: m.generator, every=g_every),
        ],
    )


def assert_changed(after: Any, before: Any) -> None:
    after_leaves = jax.tree.leaves(eqx.filter(after, eqx.is_inexact_array))
    before_leaves = jax.tree.leaves(eqx.filter(before, eqx.is_inexact_array))
    assert all(not np.array_equal(a, b) for a, b in zip(after_leaves, before_leaves))


@pytest.mark.slow
def test_a_dcgan_trains_as_the_notebooks_loop_of_two_steps():
    gan, state, latents, images = problem()
    result = fit_gan(gan, state, latents, images)
    hand = hand_loop(gan, state, latents, images)

    fake, _ = batched(gan.generator, state, jnp.asarray(latents[:2]))
    assert fake.shape == (2, 1, SIZE, SIZE)
    assert batched(gan.discriminator, state, fake)[0].shape == (2, 1, 1, 1)
    assert_changed(hand.gan.discriminator, gan.discriminator)
    assert_changed(hand.gan.generator, gan.generator)
    assert_trees_close(result.model, hand.gan, **TOLERANCE)
    assert_trees_close(result.state, hand.state, **TOLERANCE)  # both networks' BatchNorm
    # Each optimizer's state is over the whole model, `None` outside the part it trains.
    for name, part, mine in [
        ("d", lambda m: m.discriminator, hand.d_opt_state),
        ("g", lambda m: m.generator, hand.g_opt_state),
    ]:
        adam_state = result.opt_state[name][0]
        assert int(adam_state.count) == STEPS
        assert_trees_close(part(adam_state.mu), mine[0].mu, **TOLERANCE)
        assert_trees_close(part(adam_state.nu), mine[0].nu, **TOLERANCE)
    outside = result.opt_state["g"][0].mu.discriminator
    assert jax.tree.leaves(eqx.filter(outside, eqx.is_array)) == []

    # Each update's losses, and their sum.
    history = result.history
    np.testing.assert_allclose(history["d_loss"], [np.mean(hand.d_losses)], rtol=1e-5)
    np.testing.assert_allclose(history["g_loss"], [np.mean(hand.g_losses)], rtol=1e-5)
    total = np.mean(np.add(hand.d_losses, hand.g_losses))
    np.testing.assert_allclose(history["loss"], [total], rtol=1e-5)


@pytest.mark.slow
def test_an_update_every_five_steps_runs_on_steps_five_and_ten_only():
    gan, state, latents, images = problem()
    result = fit_gan(gan, state, latents, images, g_every=5)
    hand = hand_loop(gan, state, latents, images, g_every=5)

    assert len(hand.g_losses) == 2
    assert int(result.opt_state["d"][0].count) == STEPS
    assert int(result.opt_state["g"][0].count) == 2
    assert_trees_close(result.model, hand.gan, **TOLERANCE)
    assert_trees_close(result.state, hand.state, **TOLERANCE)
    assert_trees_close(result.opt_state["g"][0].mu.generator, hand.g_opt_state[0].mu, **TOLERANCE)
    np.testing.assert_allclose(result.history["d_loss"], [np.mean(hand.d_losses)], rtol=1e-5)


def drift(a: Any, b: Any) -> float:
    """The largest relative difference, in norm, between two models' arrays."""
    pairs = zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(b, eqx.is_inexact_array)),
    )
    return max(float(np.linalg.norm(x - y) / np.linalg.norm(y)) for x, y in pairs)


@pytest.mark.heavy
def test_a_dcgan_stays_as_close_to_the_notebooks_loop_over_hundreds_of_steps():
    """Over 300 steps a GAN's rounding differences grow: eqfit's run may drift from the
    notebook's loop, but no further than the notebook's loop drifts from itself started
    1 ulp away, so that a real difference in the step cannot hide behind rounding.
    """
    gan, state, latents, images = problem(steps=300)
    hand = hand_loop(gan, state, latents, images)
    nudged = jax.tree.map(
        lambda x: np.nextafter(np.asarray(x), np.inf) if eqx.is_inexact_array(x) else x, gan
    )
    rounding = drift(hand_loop(nudged, state, latents, images).gan, hand.gan)
    result = fit_gan(gan, state, latents, images)
    assert int(result.opt_state["d"][0].count) == 300
    assert 0 < rounding < 0.1  # the nudge's drift is small: a bound that can fail
    assert drift(result.model, hand.gan) <= 2 * rounding
