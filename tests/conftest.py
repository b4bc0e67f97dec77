import os
import tempfile

import jax


# Most of the suite's time is XLA compiling small programs, and LLVM's optimisation of
# their kernels is about a third of it. The tests check behaviour, and every comparison
# they make is between programs compiled alike, or within a tolerance, so they compile
# without it (XLA reads its flags when the backend starts, below). A level given in
# `XLA_FLAGS` is kept. The examples, which the tests run in processes of their own, and the
# benchmarks compile with XLA's default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = flags.strip()

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
