import os
import tempfile

import jax


# Before any device is touched: eight simulated CPU devices for the multi-device tests.
# (Equinox's own suite also turns on strict dtype promotion; optax's Adam does
# `1 - decay**count` with an int32 count, which strict promotion refuses.)
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

import eqfit  # noqa: E402


def _put_whole(cache_class):
    """JAX's file cache writes an entry in place, so another process reading it meanwhile
    would load part of a program (and warn: an error in this suite). Written aside and
    renamed into place, an entry is whole or absent.
    """
    put = cache_class.put

    def put_whole(self, key, value):
        if getattr(self, "eviction_enabled", True) or not hasattr(self, "path"):
            return put(self, key, value)  # (with eviction, JAX locks the directory)
        path = self.path / f"{key}-cache"
        if path.exists():
            return
        aside = self.path / f".{key}-{os.getpid()}.partial"
        aside.write_bytes(value)
        os.replace(aside, path)

    cache_class.put = put_whole


def _cache_directory():
    """The session's directory: made by the first process, which sets it in the
    environment, so that xdist's workers (started after this file is loaded) share it: a
    program one worker compiled, the other loads. If JAX's cache cannot be made to write
    its entries whole, each process keeps a directory of its own.
    """
    try:
        from jax._src.lru_cache import LRUCache

        _put_whole(LRUCache)
    except (ImportError, AttributeError):
        return tempfile.mkdtemp(prefix="eqfit-tests-")
    if "EQFIT_TESTS_CACHE" not in os.environ:
        os.environ["EQFIT_TESTS_CACHE"] = tempfile.mkdtemp(prefix="eqfit-tests-")
    return os.environ["EQFIT_TESTS_CACHE"]


# Most of the suite's time is XLA compiling programs, and many tests compile the same
# program from new (but equal) optimizer and model objects. JAX's persistent cache, in a
# directory of this session's own, compiles each distinct program once.
eqfit.enable_compilation_cache(_cache_directory())


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
