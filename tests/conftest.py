import os
import shutil
import subprocess
import sys
import tempfile

import jax


# Most of the suite's time is XLA compiling small programs. The tests check behaviour, and
# every comparison they make is between programs compiled alike, or within a tolerance, so
# they compile for the compiler's speed rather than the programs': without LLVM's
# optimisation, with XLA's older CPU fusion emitters (the newer ones take longer to
# compile each kernel), and each program as one LLVM module (not split into parts for
# several threads, which for programs this small adds more work than it spreads). XLA
# reads these flags when the backend starts (below) and aborts the process on one it does
# not know, so they are tried first in a process of their own; if this jaxlib refuses
# them, the optimisation level alone is used. A level given in `XLA_FLAGS` is kept, with
# no other flag added (the xdist workers inherit the flags set here). The examples, which
# the tests run in processes of their own, and the benchmarks compile with XLA's default.
FAST_COMPILE = [
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
]


def _xla_accepts(flags):
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    given = os.environ.get("XLA_FLAGS", "")
    flags = " ".join([given, *FAST_COMPILE]).strip()
    if not _xla_accepts(flags):
        flags = " ".join([given, FAST_COMPILE[0]]).strip()
    os.environ["XLA_FLAGS"] = flags

# Before any device is touched: eight simulated CPU devices for the multi-device tests.
# (Equinox's own suite also turns on strict dtype promotion; optax's Adam does
# `1 - decay**count` with an int32 count, which strict promotion refuses.)
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

import eqfit  # noqa: E402


# Many tests compile the same program from new (but equal) optimizer and model objects, and
# both xdist workers compile some of the same programs. JAX's persistent cache, in one
# directory for the whole run (made here in the first process, the workers inherit its
# name), compiles each distinct program once. The process that made it removes it at the
# end, in a process of its own that pytest does not wait for, since deleting its thousand
# files is slow on some disks.
_CACHE_VARIABLE = "EQFIT_TESTS_COMPILATION_CACHE"
_made_cache = _CACHE_VARIABLE not in os.environ
if _made_cache:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="eqfit-tests-")
eqfit.enable_compilation_cache(os.environ[_CACHE_VARIABLE])


def pytest_configure(config):
    # A worker may read a program's file while the other is still writing it: JAX then
    # warns and compiles the program itself, which is what it would have done without
    # the cache.
    config.addinivalue_line(
        "filterwarnings", "ignore:Error reading persistent compilation cache entry"
    )


def pytest_unconfigure(config):
    if not _made_cache:
        return
    directory = os.environ[_CACHE_VARIABLE]
    if not hasattr(os, "posix_spawn"):
        shutil.rmtree(directory, ignore_errors=True)
        return
    # Its output goes nowhere, so that a pipe from pytest (`pytest | tee`) ends with pytest.
    remove = "import shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True)"
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    command = [sys.executable, "-c", remove, directory]
    os.posix_spawn(sys.executable, command, os.environ, file_actions=quiet)


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
