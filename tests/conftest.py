import tempfile

import jax


# Before any device is touched: eight simulated CPU devices for the multi-device tests.
# (Equinox's own suite also turns on strict dtype promotion; optax's Adam does
# `1 - decay**count` with an int32 count, which strict promotion refuses.)
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

import eqfit  # noqa: E402


# Most of the suite's time is XLA compiling programs, and many tests compile the same
# program from new (but equal) optimizer and model objects. JAX's persistent cache, in a
# directory of this session's own, compiles each distinct program once.
eqfit.enable_compilation_cache(tempfile.mkdtemp(prefix="eqfit-tests-"))


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each module's compiled programs are freed when it ends, to bound the memory."""
    yield
    jax.clear_caches()


@pytest.fixture
def getkey():
    """Returns a function that gives a fresh PRNG key on each call."""
    keys = iter(jax.random.split(jax.random.key(1234), 1000))
    return lambda: next(keys)
