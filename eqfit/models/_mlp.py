from collections.abc import Callable
from typing import Literal

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
    sizes: tuple[int, ...], out_features: int | Literal["scalar"], key: PRNGKey
) -> tuple[eqx.nn.Linear, ...]:
    keys = jax.random.split(key, len(sizes))
    hidden = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes, sizes[1:], keys)]
    return (*hidden, eqx.nn.Linear(sizes[-1], out_features, key=keys[-1]))


class MLP(eqx.Module):
    """A multi-layer perceptron with optional dropout after each hidden layer.

    **Arguments:**

    - `in_features`: the size of one input.
    - `out_features`: the size of one output, or `"scalar"`.
    - `width`: the size of each hidden layer.
    - `depth`: the number of hidden layers.
    - `activation`: applied after each hidden layer.
    - `dropout`: the probability of dropping a hidden unit while training. With
        `dropout > 0` the model needs a `key` when called, unless in inference mode
        (`eqx.nn.inference_mode`).
    - `key`: initialises the weights: `jax.random.key(seed)` or `jax.random.PRNGKey(seed)`.
    """

    layers: tuple[eqx.nn.Linear, ...]
    dropout: eqx.nn.Dropout
    activation: Callable[[Array], Array] = eqx.field(static=True)
    in_features: int = eqx.field(static=True)

    @checked("MLP", {"key": KEY_HINT})
    def __init__(
        self,
        in_features: int,
        out_features: int | Literal["scalar"],
        width: int,
        depth: int,
        *,
        activation: Callable[[Array], Array] = jax.nn.relu,
        dropout: float = 0.0,
        key: PRNGKey,
    ):
        sizes = (in_features,) + (width,) * depth
        # A raw key as the typed key of its bits: one program for both kinds.
        self.layers = _layers(sizes, out_features, as_key(key))
        self.dropout = eqx.nn.Dropout(dropout)
        self.activation = activation
        self.in_features = in_features

    @jaxtyped(typechecker=beartype)
    def __call__(
        self, x: Float[Array, " in"], *, key: PRNGKey | None = None
    ) -> Float[Array, "..."]:
        """**Arguments:** `x`, one example; `key`, for dropout. **Returns:** the output."""
        check_input("MLP", x, (self.in_features,))
        # Keys only for a dropout that drops: splitting one costs a threefry per call.
        drops = not (isinstance(self.dropout.p, (int, float)) and self.dropout.p == 0)
        keys = (
            list(jax.random.split(key, len(self.layers)))
            if key is not None and drops and not self.dropout.inference
            else [None] * len(self.layers)
        )
        for layer, k in zip(self.layers[:-1], keys):
            x = self.dropout(self.activation(layer(x)), key=k)
        return self.layers[-1](x)
