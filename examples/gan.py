"""A DCGAN that learns to draw scikit-learn's 8x8 digits (shipped with the package: no
download), its discriminator's update and then its generator's on each batch.

Equinox's DCGAN example (`docs/examples/deep_convolutional_gan.ipynb`: MNIST at 64x64)
with the same layers at 16x16: the digits are resized to 16x16, as the notebook resizes
MNIST's, and scaled to [-1, 1]. The generator and the discriminator are one model with one
BatchNorm state, and `fit(..., updates=[...])` runs the notebook's two steps in turn on
each batch, each with its own Adam and each training its own network, the second seeing
the model and the state the first left. Each loss takes a `key`, and so draws new noise
each step, as the notebook's do. A callback that sees the model draws a few generated
digits at each epoch's end.

Run: `pip install -e ".[examples]" && python examples/gan.py [--epochs N]`
"""

import argparse
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray
from sklearn.datasets import load_digits

import eqfit


# The notebook's sizes are 100 latents and 64 features (its images' width) at 64x64;
# at 16x16 the networks lose two levels each.
LATENT, FEATURES, SIZE = 16, 16, 16
BATCH_SIZE = 32
SHADES = " .:-=+*#%@"  # from -1 (background) to 1 (ink)

Images = Float[Array, "batch 1 size size"]
Latents = Float[Array, "batch latent 1 1"]


def run_layers(
    layers: list[Callable[..., Any]], x: Array, state: eqx.nn.State
) -> tuple[Array, eqx.nn.State]:
    """The notebook's `__call__`: BatchNorm takes and returns the state, the rest do not."""
    for layer in layers:
        if isinstance(layer, eqx.nn.BatchNorm):
            x, state = layer(x, state)
        else:
            x = layer(x)
    return x, state


def up(
    channels_in: int, channels_out: int, stride: int, padding: int, key: PRNGKeyArray
) -> eqx.nn.ConvTranspose2d:
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


def down(
    channels_in: int, channels_out: int, stride: int, padding: int, key: PRNGKeyArray
) -> eqx.nn.Conv2d:
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


class Generator(eqx.Module):
    """From a 1x1 latent up to a 16x16 image: transposed convolutions, BatchNorm and relu
    between them, tanh at the end."""

    layers: list[Callable[..., Any]]

    def __init__(self, key: PRNGKeyArray):
        keys = jax.random.split(key, 3)
        # mode="batch": batch statistics in training, the running ones in inference, as
        # PyTorch's BatchNorm, whose DCGAN the notebook follows.
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

    def __call__(self, x: Array, state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        return run_layers(self.layers, x, state)


class Discriminator(eqx.Module):
    """From a 16x16 image down to one logit, "real": strided convolutions, PReLU between
    them and BatchNorm after all but the first."""

    layers: list[Callable[..., Any]]

    def __init__(self, key: PRNGKeyArray):
        keys = jax.random.split(key, 3)
        self.layers = [
            down(1, FEATURES, 2, 1, keys[0]),  # 16x16 -> 8x8
            eqx.nn.PReLU(0.2),
            down(FEATURES, FEATURES * 2, 2, 1, keys[1]),  # -> 4x4
            eqx.nn.BatchNorm(FEATURES * 2, axis_name="batch", mode="batch"),
            eqx.nn.PReLU(0.2),
            down(FEATURES * 2, 1, 1, 0, keys[2]),  # -> 1x1, one logit
        ]

    def __call__(self, x: Array, state: eqx.nn.State) -> tuple[Array, eqx.nn.State]:
        return run_layers(self.layers, x, state)


class GAN(eqx.Module):
    """The two networks as one model, with one state: what `fit` trains."""

    generator: Generator
    discriminator: Discriminator

    def __init__(self, key: PRNGKeyArray):
        generator_key, discriminator_key = jax.random.split(key)
        self.generator = Generator(generator_key)
        self.discriminator = Discriminator(discriminator_key)


def batched(
    network: Generator | Discriminator, state: eqx.nn.State, x: Array
) -> tuple[Array, eqx.nn.State]:
    """`network` over a batch, its BatchNorm's statistics taken over the batch."""
    return jax.vmap(network, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)


def cross_entropy(logits: Array, label: float) -> Float[Array, ""]:
    logits = logits.reshape(-1)
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label)).mean()


# The notebook's two losses, given the latents. Both networks run in training mode in
# both, so each updates both networks' BatchNorm state; `fit` differentiates each with
# respect to the network its update trains only.


def discriminator_loss(
    gan: GAN, state: eqx.nn.State, latents: Latents, images: Images
) -> tuple[Float[Array, ""], eqx.nn.State]:
    """How far the discriminator is from calling the fakes fake and the images real."""
    fake, state = batched(gan.generator, state, latents)
    fake_logits, state = batched(gan.discriminator, state, fake)
    real_logits, state = batched(gan.discriminator, state, images)
    return (cross_entropy(fake_logits, 0.0) + cross_entropy(real_logits, 1.0)) / 2, state


def generator_loss(
    gan: GAN, state: eqx.nn.State, latents: Latents
) -> tuple[Float[Array, ""], eqx.nn.State]:
    """How far the generator is from making the discriminator call its fakes real."""
    fake, state = batched(gan.generator, state, latents)
    logits, state = batched(gan.discriminator, state, fake)
    return cross_entropy(logits, 1.0), state


# As `fit` calls them, `loss(model, state, *batch, key=key)`: a new key each step, and new
# noise from it.


def noise(key: PRNGKeyArray, images: Images) -> Latents:
    return jax.random.normal(key, (images.shape[0], LATENT, 1, 1))


def d_loss(
    gan: GAN, state: eqx.nn.State, images: Images, *, key: PRNGKeyArray
) -> tuple[Float[Array, ""], eqx.nn.State]:
    return discriminator_loss(gan, state, noise(key, images), images)


def g_loss(
    gan: GAN, state: eqx.nn.State, images: Images, *, key: PRNGKeyArray
) -> tuple[Float[Array, ""], eqx.nn.State]:
    return generator_loss(gan, state, noise(key, images))


def digits() -> np.ndarray:
    """The 1,797 digits as float32 images of shape `(1, 16, 16)` in [-1, 1]."""
    pixels, _ = load_digits(return_X_y=True)
    pixels = (np.asarray(pixels) / 16.0).astype(np.float32).reshape(-1, 8, 8)
    images = jax.image.resize(jnp.asarray(pixels), (len(pixels), SIZE, SIZE), "bilinear")
    return np.asarray(images * 2 - 1).reshape(-1, 1, SIZE, SIZE)


@eqx.filter_jit
def generate(generator: Generator, state: eqx.nn.State, latents: Latents) -> Images:
    # In training mode, so BatchNorm normalises by these latents' own statistics and the
    # state's values are never read (a `ModelCallback` is handed the model, not its
    # state, and training mode needs none trained).
    return batched(generator, state, latents)[0]


def render(images: np.ndarray) -> str:
    """Images of shape `(n, 1, 16, 16)` side by side as text, two pixel rows a line (a
    terminal's character is about twice as tall as it is wide)."""
    n = images.shape[0]
    shades = (images[:, 0].reshape(n, SIZE // 2, 2, SIZE).mean(axis=2) + 1) / 2
    index = np.clip(np.rint(shades * (len(SHADES) - 1)), 0, len(SHADES) - 1).astype(int)
    return "\n".join(
        "   ".join("".join(SHADES[i] for i in image[row]) for image in index)
        for row in range(SIZE // 2)
    )


class ShowDigits(eqfit.ModelCallback[GAN]):
    """Prints the epoch's losses and, from the model as it stands at the epoch's end, the
    digits the generator draws from the same latents each epoch."""

    stops_training = False  # the device trains on while it draws

    def __init__(self, latents: Latents, state: eqx.nn.State):
        self.latents = latents
        self.state = state

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        print(f"epoch {epoch}: d_loss {logs['d_loss']:.3f}, g_loss {logs['g_loss']:.3f}")

    def on_epoch_model(self, epoch: int, model: GAN, ema_model: GAN | None) -> None:
        images = generate(model.generator, self.state, self.latents)
        print(f"generated after epoch {epoch}:\n{render(np.asarray(images)[:4])}")


def main() -> None:
    parser = argparse.ArgumentParser(description="A DCGAN on scikit-learn's digits.")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()

    images = digits()
    model_key, fit_key, sample_key = jax.random.split(jax.random.key(2003), 3)
    gan, state = eqx.nn.make_with_state(GAN)(model_key)
    # Sixteen latents: the generator's BatchNorm takes its statistics over them.
    latents = jax.random.normal(sample_key, (16, LATENT, 1, 1))
    print(f"{len(images)} digits of {SIZE}x{SIZE}; a few of them:\n{render(images[:4])}")

    # The notebook's optimizers, Adam with b1=0.5, at 1e-3 for its 2e-4: the run is short.
    result = eqfit.fit(
        gan,
        (images,),
        key=fit_key,
        state=state,
        epochs=args.epochs,
        batch_size=BATCH_SIZE,
        drop_remainder=True,  # BatchNorm's statistics over whole batches only
        updates=[
            eqfit.Update("d", d_loss, optax.adam(1e-3, b1=0.5), trains=lambda m: m.discriminator),
            eqfit.Update("g", g_loss, optax.adam(1e-3, b1=0.5), trains=lambda m: m.generator),
        ],
        callbacks=[ShowDigits(latents, state)],
    )
    history = result.history
    print("d_loss per epoch:", [round(v, 3) for v in history["d_loss"].tolist()])
    print("g_loss per epoch:", [round(v, 3) for v in history["g_loss"].tolist()])
    print(f"trained in {history.wall_time:.2f} s, compilation included")


if __name__ == "__main__":
    main()
