"""Compiled programs kept on disk, so that a script that runs again starts fast."""

import os
from pathlib import Path

import jax


def default_cache_directory() -> Path:
    """`$XDG_CACHE_HOME/eqfit/jax` (by default `~/.cache/eqfit/jax`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eqfit" / "jax"


def enable_compilation_cache(
    directory: str | os.PathLike[str] | None = None, *, min_compile_seconds: float = 0.0
) -> Path:
    """Turns on JAX's persistent compilation cache, so that the programs `fit` compiles
    (and every other JAX program of this process) are kept on disk and loaded, not
    compiled again, the next time a script with the same configuration runs.

    It sets JAX's own options (`jax_compilation_cache_dir` and
    `jax_persistent_cache_min_compile_time_secs`); nothing is switched on at import. JAX
    by default keeps only programs that took over a second to compile, which would leave
    out most of eqfit's, hence the lower threshold here.

    **Arguments:**

    - `directory`: where to keep the programs; by default `default_cache_directory()`,
        `~/.cache/eqfit/jax`.
    - `min_compile_seconds`: keep only programs that took at least this long to compile.

    **Returns:**

    The cache directory.
    """
    path = Path(directory) if directory is not None else default_cache_directory()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    return path
