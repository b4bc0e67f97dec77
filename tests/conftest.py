import jax


# Before any device is touched: eight simulated CPU devices for the multi-device tests.
# (Equinox's own suite also turns on strict dtype promotion; optax's Adam does
# `1 - decay**count` with an int32 count, which strict promotion refuses.)
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture
def getkey():
    """Returns a function that gives a fresh PRNG key on each call."""
    keys = iter(jax.random.split(jax.random.key(1234), 1000))
    return lambda: next(keys)
