from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

from .._core._checks import checked
from .._core._data import as_key
from .._core._typing import PRNGKey
from ._check import check_input, KEY_HINT


class LinearRegression(eqx.Module):
    """`y = w . x + b`, the model of eqfit's first example.

    **Arguments:**

    - `in_features`: the size of one input.
    - `out_features`: the size of one output, or `"scalar"` for a scalar output.
    - `key`: initialises the weights (normal, scaled by `1/sqrt(in_features)`):
        `jax.random.key(seed)` or `jax.random.PRNGKey(seed)`.
    """

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"]
    scalar: bool = eqx.field(static=True)

    @checked("LinearRegression", {"key": KEY_HINT})
    def __init__(
        self,
        in_features: int,
        out_features: int | Literal["scalar"] = "scalar",
        *,
        key: PRNGKey,
    ):
        self.scalar = out_features == "scalar"
        out = 1 if out_features == "scalar" else out_features
        scale = 1.0 / jnp.sqrt(in_features)
        # A raw key as the typed key of its bits: the same numbers, one program for both.
        self.weight = scale * jax.random.normal(as_key(key), (out, in_features))
        self.bias = jnp.zeros(out)

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, " in"]) -> Float[Array, "..."]:
        """**Arguments:** `x`, one example. **Returns:** its prediction."""
        check_input("LinearRegression", x, self.weight.shape[1:])
        y = self.weight @ x + self.bias
        return y[0] if self.scalar else y
