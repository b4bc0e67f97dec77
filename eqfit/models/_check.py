from jaxtyping import Array


# What the constructors' `key` must be, as their errors say it. Equinox's layers take
# both kinds of key, and so do the ready models.
KEY_HINT = "a single PRNG key, `jax.random.key(0)` or a raw `jax.random.PRNGKey(0)`"


def check_input(model: str, x: Array, expected: tuple[int, ...]) -> None:
    """Refuses an input of the wrong shape with both shapes, before XLA does cryptically."""
    if tuple(x.shape) != expected:
        raise ValueError(
            f"`{model}` expects one example `x` of shape {expected}, got {tuple(x.shape)}. "
            "Call it on a single example, or `jax.vmap` it over a batch."
        )
