"""What a profile of a few steps costs a run, and the steps after it: `fit(..., profile=)`.

Trains an MLP 16->128->128->1 with Adam and MSE on N=8192 synthetic samples for 10
epochs at batch 256 (320 steps), a new shuffle every epoch, two ways:

- `plain`: no profile, the reference;
- `profile`: `profile=eqfit.Profile(directory, 64, 2)`, the first two steps of epoch 3
    traced with `jax.profiler` (each run writes its trace to a directory of its own).

Reported, each the median of `--repeats` interleaved repeats (each the median of 3
back-to-back runs), in one process, nothing recompiling in the timed loop (a JAX
compile-event listener counts):

- the whole `fit`, and what the profile adds to it: the trace's start and stop (the
    profiler's own set-up, and writing the trace), once per run whatever its length;
- the steps after the profile (epochs 4 to 10): the sum of their
    `history.throughput["epoch_seconds"]` (the driver's own wall timing of each epoch;
    the epochs before the profile are not comparable: the host's work at the first
    edge, `start_trace`, falls in the wall time of the call it reads then, the one
    before the profile). Target: `profile` / `plain` at most 1.05: nothing is left
    running to slow the rest of the run once the trace has stopped.

    python benchmarks/profile.py [--repeats 7] [--quick] [--out PATH]
"""

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    CompileEvents,
    config,
    finish,
    load_average,
    median,
    regression_data,
    table,
    timed,
)

import eqfit


IN_FEATURES, WIDTH, DEPTH = 16, 128, 2
NUM_SAMPLES, EPOCHS, BATCH_SIZE = 8192, 10, 256
STEPS_PER_EPOCH = NUM_SAMPLES // BATCH_SIZE
PROFILED_EPOCH = 3  # the profile's two steps are this epoch's first
START_STEP, STEPS = (PROFILED_EPOCH - 1) * STEPS_PER_EPOCH, 2
CASES = ("plain", "profile")
TARGET = 1.05


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_run(
    case: str, model: Any, data: tuple[jax.Array, jax.Array], traces: Path
) -> Callable[[], eqfit.FitResult]:
    """One `eqfit.fit` of the case; it returns once its program has finished."""
    optimizer = optax.adam(1e-3)
    count = [0]

    def run() -> eqfit.FitResult:
        options: dict[str, Any] = {}
        if case == "profile":
            count[0] += 1  # a directory per run: a trace is named by the second it began
            directory = traces / f"run-{count[0]}"
            options["profile"] = eqfit.Profile(directory, START_STEP, STEPS)
        result = eqfit.fit(
            model,
            data,
            loss=mse,
            optimizer=optimizer,
            key=jax.random.key(0),
            epochs=EPOCHS,
            batch_size=BATCH_SIZE,
            **options,
        )
        if case == "profile":
            shutil.rmtree(options["profile"].directory)
        return result

    return run


def after_seconds(result: eqfit.FitResult) -> float:
    """The driver's wall seconds of the epochs after the profiled one."""
    seconds = np.asarray(result.history.throughput["epoch_seconds"])
    return float(seconds[PROFILED_EPOCH:].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 repeats")
    default_out = Path(__file__).parent / "results" / "profile.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    inner = 1 if args.quick else 3

    start = time.perf_counter()
    load_before = load_average()
    x, y = regression_data(NUM_SAMPLES, IN_FEATURES)
    data = (jnp.asarray(x), jnp.asarray(y))
    model = eqfit.models.MLP(IN_FEATURES, "scalar", WIDTH, DEPTH, key=jax.random.key(0))
    traces = Path(tempfile.mkdtemp(prefix="eqfit-profile-"))
    try:
        runs = {case: make_run(case, model, data, traces) for case in CASES}
        first = {case: run() for case, run in runs.items()}
        same = all(
            np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(eqx.filter(first["plain"].model, eqx.is_array)),
                jax.tree.leaves(eqx.filter(first["profile"].model, eqx.is_array)),
            )
        )
        for run in runs.values():  # warm every variant
            run()

        print("timing the steady state...", file=sys.stderr)
        events = CompileEvents()
        events.reset()
        whole: dict[str, list[float]] = {case: [] for case in CASES}
        after_epochs: dict[str, list[float]] = {case: [] for case in CASES}
        for i in range(repeats):
            for case in CASES[i % 2 :] + CASES[: i % 2]:  # A B, then B A
                runs[case]()
                kept: list[eqfit.FitResult] = []
                seconds = [timed(lambda: kept.append(runs[case]())) for _ in range(inner)]
                whole[case].append(median(seconds))
                after_epochs[case].append(median([after_seconds(r) for r in kept]))
        recompiles = events.backend_compiles()
    finally:
        shutil.rmtree(traces, ignore_errors=True)

    times = {case: median(whole[case]) for case in CASES}
    after_times = {case: median(after_epochs[case]) for case in CASES}
    cfg = {
        **config(),
        "model": f"eqfit.models.MLP({IN_FEATURES}, 'scalar', {WIDTH}, {DEPTH})",
        "num_samples": NUM_SAMPLES,
        "epochs": EPOCHS,
        "batch_size": BATCH_SIZE,
        "profile": {"start_step": START_STEP, "steps": STEPS, "epoch": PROFILED_EPOCH},
        "repeats": repeats,
        "inner_runs_per_sample": inner,
        "quick": args.quick,
    }
    print("\n# profile\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); {cfg['model']}, "
        f"Adam, N={NUM_SAMPLES}, batch {BATCH_SIZE}, {EPOCHS} epochs "
        f"({EPOCHS * STEPS_PER_EPOCH} steps), a profile of steps {START_STEP} to "
        f"{START_STEP + STEPS - 1} (epoch {PROFILED_EPOCH}); repeats={repeats}, each the "
        f"median of {inner} runs\n"
    )
    rows = [
        [
            case,
            f"{times[case] * 1e3:.1f}",
            f"{times[case] / times['plain']:.3f}",
            f"{after_times[case] * 1e3:.1f}",
            f"{after_times[case] / after_times['plain']:.3f}",
        ]
        for case in CASES
    ]
    after = f"ms of epochs {PROFILED_EPOCH + 1}-{EPOCHS}"
    print(table(["case", "ms per fit", "against plain", after, "against plain"], rows))
    edges = times["profile"] - times["plain"]
    print(f"\nthe profile's start and stop add {edges * 1e3:.1f} ms to a fit")
    ratio = after_times["profile"] / after_times["plain"]
    verdict = "within" if ratio <= TARGET else "above"
    print(
        f"the epochs after the profile, `profile` / `plain` = {ratio:.3f}: {verdict} the "
        f"target of {TARGET}"
    )
    print(f"XLA compilations during the timed steady state: {recompiles}")
    print(f"model bitwise equal to plain's: {same}")
    results = {
        "seconds": times,
        "edges_seconds": edges,
        "after_seconds": after_times,
        "ratios": {case: times[case] / times["plain"] for case in CASES},
        "after_ratios": {case: after_times[case] / after_times["plain"] for case in CASES},
        "target": TARGET,
        "model_bitwise_equal_to_plain": same,
        "steady_recompiles": recompiles,
        "config": cfg,
    }
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
