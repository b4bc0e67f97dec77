"""Shared helpers for the benchmarks: timing, compile-event counting, the run's configuration."""

import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.monitoring
import numpy as np


# JAX reports each stage of a compilation as a duration event. Listening to them lets a
# benchmark prove that its steady-state loop compiled nothing, and split a first call's
# cost into tracing, lowering and XLA compilation.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a program loaded from disk


class CompileEvents:
    """Counts and sums JAX's compilation events since the last `reset`."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        jax.monitoring.register_event_duration_secs_listener(self._record)
        jax.monitoring.register_event_listener(self._event)

    def _record(self, event: str, duration: float, **_: Any) -> None:
        self.count[event] = self.count.get(event, 0) + 1
        self.seconds[event] = self.seconds.get(event, 0.0) + duration

    def _event(self, event: str, **_: Any) -> None:
        self.count[event] = self.count.get(event, 0) + 1

    def reset(self) -> None:
        self.count.clear()
        self.seconds.clear()

    def cache_hits(self) -> int:
        """How many programs JAX's persistent cache supplied since the last `reset`."""
        return self.count.get(CACHE_HIT_EVENT, 0)

    def backend_compiles(self) -> int:
        """How many XLA programs were compiled since the last `reset`."""
        return self.count.get(COMPILE_EVENT, 0)

    def breakdown(self) -> dict[str, float]:
        """Seconds spent tracing, lowering and compiling since the last `reset`."""
        return {
            "trace_s": self.seconds.get(TRACE_EVENT, 0.0),
            "lower_s": self.seconds.get(LOWER_EVENT, 0.0),
            "xla_compile_s": self.seconds.get(COMPILE_EVENT, 0.0),
            "xla_compiles": float(self.backend_compiles()),
        }


class Keeps:
    """A callback that keeps what it is told."""

    stops_training = False

    def __init__(self) -> None:
        self.told: list[Any] = []

    def on_train_batch_end(self, step: int, logs: dict[str, float]) -> None:
        self.told.append((step, logs))

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        self.told.append((epoch, logs))


def regression_data(n: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The benchmarks' problem: `x` standard normal, of shape `(n, features)`, and a smooth
    target `y = sin(x @ w / 4)` with a little noise; float32 numpy arrays.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    w = rng.normal(size=features).astype(np.float32)
    y = np.sin(x @ w / 4) + 0.1 * rng.normal(size=n).astype(np.float32)
    return x, y.astype(np.float32)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds taken by `fn()`, which must block until its device work is done."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def config() -> dict[str, Any]:
    """What the numbers depend on besides the benchmark's own settings: the libraries'
    versions, the machine, and the eqfit that ran (where it was imported from, and a
    fingerprint of its source).
    """
    import equinox
    import optax

    import eqfit

    device = jax.devices()[0]
    source = Path(eqfit.__file__).parent
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "equinox": equinox.__version__,
        "optax": optax.__version__,
        "eqfit": eqfit.__version__,
        "eqfit_path": str(source),
        "eqfit_source_sha256": source_fingerprint(source),
        "backend": jax.default_backend(),
        "device": str(device),
        "device_kind": getattr(device, "device_kind", None),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def source_fingerprint(package: Path) -> str:
    """A hash of a package's Python sources, to tie numbers to the code that made them."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, columns padded for reading in a terminal."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def interleave(
    runs: dict[str, Callable[[], Any]], repeats: int, inner: int = 3
) -> dict[str, float]:
    """Median seconds per run of each variant, timed A B A B in turn after a warm-up.

    Each repeat times `inner` back-to-back runs of a variant (after one untimed run of it)
    and keeps their median, so that no variant pays for the one timed before it.
    """
    for run in runs.values():  # compile and warm every variant first
        run()
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            runs[name]()
            samples[name].append(median([timed(runs[name]) for _ in range(inner)]))
    return {name: median(xs) for name, xs in samples.items()}


def load_average() -> tuple[float, float, float]:
    """The load average now, with a warning on stderr where another process is busy
    (1-minute load above 0.5): times are then noisy, ratios less so. Call it before the
    first timing, and keep what it returns with the results.
    """
    load = os.getloadavg()
    if load[0] > 0.5:
        print(
            f"warning: load average {load[0]:.2f} before starting: another process "
            "is using the CPU, so times will be noisy (ratios less so)",
            file=sys.stderr,
        )
    return load


def finish(
    out: Path, results: dict[str, Any], started: float, load_before: tuple[float, ...]
) -> None:
    """Ends a benchmark's run: `results` gains its wall time (since `started`, a
    `time.perf_counter()`) and the load averages before (`load_average`'s) and after,
    both printed, and is written to `out` as JSON.
    """
    results["total_wall_s"] = time.perf_counter() - started
    results["loadavg_before"] = load_before
    results["loadavg_after"] = os.getloadavg()
    print(
        f"\ntotal wall time {results['total_wall_s']:.0f} s; 1-min load average "
        f"{load_before[0]:.2f} before, {results['loadavg_after'][0]:.2f} after"
    )
    write_json(out, results)
