import equinox as eqx
import jax
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

from .._core._checks import checked
from .._core._data import as_key
from .._core._typing import PRNGKey
from .._program._jit import cached_jit
from ._check import check_input, KEY_HINT


# One compiled program makes every layer (the parameters are the same as when made one
# operation at a time, which would compile a program for each weight's random numbers),
# kept in eqfit's cache of programs, which `eqfit.clear_cache()` frees.
@cached_jit
def _layers(
    in_channels: int, channels: tuple[int, int], flat: int, num_classes: int, key: PRNGKey
) -> tuple[eqx.nn.Conv2d, eqx.nn.Conv2d, eqx.nn.Linear]:
    k1, k2, k3 = jax.random.split(key, 3)
    c1, c2 = channels
    conv1 = eqx.nn.Conv2d(in_channels, c1, 3, padding=1, key=k1)
    conv2 = eqx.nn.Conv2d(c1, c2, 3, padding=1, key=k2)
    return conv1, conv2, eqx.nn.Linear(flat, num_classes, key=k3)


class CNN(eqx.Module):
    """A small convolutional classifier for single images `(channels, height, width)`.

    Two 3x3 convolutions with ReLU, a 2x2 average pool, then a linear layer to logits.
    Sized for small images such as the 8x8 digits or 28x28 MNIST.

    **Arguments:**

    - `in_channels`: channels of one image.
    - `image_size`: `(height, width)` of one image.
    - `num_classes`: the number of logits.
    - `channels`: channels of the two convolutions.
    - `key`: initialises the weights: `jax.random.key(seed)` or `jax.random.PRNGKey(seed)`.
    """

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.AvgPool2d
    head: eqx.nn.Linear
    input_shape: tuple[int, int, int] = eqx.field(static=True)

    @checked("CNN", {"key": KEY_HINT})
    def __init__(
        self,
        in_channels: int,
        image_size: tuple[int, int],
        num_classes: int,
        *,
        channels: tuple[int, int] = (16, 32),
        key: PRNGKey,
    ):
        height, width = image_size
        flat = channels[1] * (height // 2) * (width // 2)
        # A raw key as the typed key of its bits: one program for both kinds.
        key = as_key(key)
        self.conv1, self.conv2, self.head = _layers(in_channels, channels, flat, num_classes, key)
        self.pool = eqx.nn.AvgPool2d(2, stride=2)
        self.input_shape = (in_channels, height, width)

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "c h w"]) -> Float[Array, " classes"]:
        """**Arguments:** `x`, one image. **Returns:** its logits."""
        check_input("CNN", x, self.input_shape)
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        return self.head(self.pool(x).ravel())
