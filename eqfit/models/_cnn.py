import equinox as eqx
import jax
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped, Key

from .._checks import checked
from ._check import check_input


class CNN(eqx.Module):
    """A small convolutional classifier for single images `(channels, height, width)`.

    Two 3x3 convolutions with ReLU, a 2x2 average pool, then a linear layer to logits.
    Sized for small images such as the 8x8 digits or 28x28 MNIST.

    **Arguments:**

    - `in_channels`: channels of one image.
    - `image_size`: `(height, width)` of one image.
    - `num_classes`: the number of logits.
    - `channels`: channels of the two convolutions.
    - `key`: initialises the weights.
    """

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.AvgPool2d
    head: eqx.nn.Linear
    input_shape: tuple[int, int, int] = eqx.field(static=True)

    @checked("CNN", {"key": "a single PRNG key such as `jax.random.key(0)`"})
    def __init__(
        self,
        in_channels: int,
        image_size: tuple[int, int],
        num_classes: int,
        *,
        channels: tuple[int, int] = (16, 32),
        key: Key[Array, ""],
    ):
        k1, k2, k3 = jax.random.split(key, 3)
        c1, c2 = channels
        self.conv1 = eqx.nn.Conv2d(in_channels, c1, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(c1, c2, 3, padding=1, key=k2)
        self.pool = eqx.nn.AvgPool2d(2, stride=2)
        height, width = image_size
        self.input_shape = (in_channels, height, width)
        self.head = eqx.nn.Linear(c2 * (height // 2) * (width // 2), num_classes, key=k3)

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "c h w"]) -> Float[Array, " classes"]:
        """**Arguments:** `x`, one image. **Returns:** its logits."""
        check_input("CNN", x, self.input_shape)
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        return self.head(self.pool(x).ravel())
