from jaxtyping import Array


def check_input(model: str, x: Array, expected: tuple[int, ...]) -> None:
    """Refuses an input of the wrong shape with both shapes, before XLA does cryptically."""
    if tuple(x.shape) != expected:
        raise ValueError(
            f"`{model}` expects one example `x` of shape {expected}, got {tuple(x.shape)}. "
            "Call it on a single example, or `jax.vmap` it over a batch."
        )
