"""Where eqfit's compiled programs live: a bounded cache in memory, and optionally JAX's
persistent cache on disk, so that a script that runs again starts fast.
"""

import collections
import os
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jax

from ._state import TrainState


# Each configuration (model structure, loss, optimizer object, shapes, settings) compiles
# its own programs, and a compiled program holds on to about ten megabytes and a few
# hundred memory mappings of machine code (the operating system allows 65530 mappings).
# JAX's own caches keep thousands of programs, so a sweep that makes a new optimizer for
# each fit would use up memory; eqfit keeps the programs of the last `PROGRAMS` of them,
# and compiles them through functions of its own that it drops on eviction, taking JAX's
# cache entries (keyed on those functions) with them.
PROGRAMS = 32


class ProgramCache:
    """A least-recently-used cache of compiled programs, `PROGRAMS` configurations big,
    with what was measured of each: the seconds per step last measured (which sizes a
    later run's calls), a step's FLOPs, the run's plan.
    """

    def __init__(self, size: int = PROGRAMS):
        self.size = size
        self.entries: collections.OrderedDict[Hashable, Callable[..., Any]] = (
            collections.OrderedDict()
        )
        self.facts: dict[Hashable, dict[Hashable, Any]] = {}
        self.lock = threading.Lock()  # fits may run in several threads at once
        self.beside: list[Callable[[], None]] = []  # cleared with it (`keep_beside`)

    def get(self, key: Hashable, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """The program cached under `key`, made by `make()` if there is none."""
        with self.lock:
            program = self.entries.get(key)
            if program is not None:
                self.entries.move_to_end(key)
                return program
        program = make()
        with self.lock:
            self.entries[key] = program
            while len(self.entries) > self.size:
                evicted, _ = self.entries.popitem(last=False)
                self.facts.pop(evicted, None)
        return program

    def fact(self, key: Hashable, name: Hashable) -> Any:
        """What was measured as `name` of the program cached under `key`, if anything:
        `"seconds_per_step"` (of the last call read), `"mean_seconds_per_step"` (of the
        run so far), `"flops_per_step"`, a plan for given inputs.
        """
        with self.lock:
            return self.facts.get(key, {}).get(name)

    def set_fact(self, key: Hashable, name: Hashable, value: Any) -> None:
        """Keeps `value` as `name` of the program cached under `key`, while it is; or
        of one about to be compiled (a step's FLOPs, counted before the run compiles),
        with the `size` newest such facts.
        """
        with self.lock:
            self.facts.setdefault(key, {})[name] = value
            waiting = [k for k in self.facts if k not in self.entries]
            for old in waiting[: max(0, len(waiting) - self.size)]:
                del self.facts[old]

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.facts.clear()
        for clear in self.beside:
            clear()

    def keep_beside(self, clear: Callable[[], None]) -> None:
        """Has `clear()` called with `clear`: for what is kept beside the programs (the
        filled arrays `_uncompiled` keeps on the device).
        """
        self.beside.append(clear)


PROGRAM_CACHE = ProgramCache()


def clear_cache() -> None:
    """Frees every program eqfit compiled and keeps in memory: those of `fit`, `predict`,
    `evaluate`, `sharding.init` and the ready models' constructors (it keeps those of its
    `PROGRAMS` = 32 most recent configurations), and the filled arrays (optimizers' zeros)
    that it keeps on the device for later fits (16 MiB at most). A later call compiles
    again what it needs.

    For a sweep, no compilation at all is cheaper still: an optimizer whose
    hyperparameters are arrays (`optax.inject_hyperparams`) compiles once for every
    learning rate, and `fit(..., ensemble=True)` trains the whole sweep in one program.
    `jax.clear_caches()` frees the programs of every JAX function, eqfit's included.
    """
    PROGRAM_CACHE.clear()


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


class Starting:
    """The training state while `start` makes it in a thread: on one device, XLA compiles
    `start` there while the host traces `run` (`ready`), so a first `fit` waits for the
    one compilation, not for both in turn. Its shapes are known at once.
    """

    def __init__(
        self,
        program: Callable[..., tuple[TrainState, Any]],
        args: tuple[Any, ...],
        made: Callable[[], None] = lambda: None,
    ):
        self.shapes: TrainState = jax.eval_shape(program, *args)[0]
        self.made: tuple[TrainState, Any] | None = None
        self.error: BaseException | None = None
        # Not a daemon: Python waits for it before it exits, so that no exit (a third
        # Ctrl-C while `fit` waits for it, say) leaves XLA compiling in the process.
        self.thread = threading.Thread(target=self._make, args=(program, args, made))
        self.thread.start()

    def _make(
        self,
        program: Callable[..., tuple[TrainState, Any]],
        args: tuple[Any, ...],
        made: Callable[[], None],
    ) -> None:
        try:
            self.made = program(*args)
            made()
        except BaseException as e:  # raised in the training thread, by `ready`
            self.error = e

    def ready(self, run: Any, *args: Any) -> TrainState:
        """The state, once the run's program (`_calls.Program`) is lowered for it with
        `args`.
        """
        try:
            run.lower(self.shapes, *args)  # the call then finds it in JAX's caches
        except Exception:  # the call itself raises it, with eqfit's notes
            pass
        return self.result()

    def join(self) -> None:
        """Waits for the thread that makes the state (its compilation included)."""
        self.thread.join()

    def result(self) -> TrainState:
        """The state, once made."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.made is not None
        return self.made[0]
