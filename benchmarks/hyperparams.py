"""What recording the learning rate costs: `fit(..., schedules=)` and `inject_hyperparams`.

Trains an MLP 16->128->128->1 with Adam on a cosine-decay schedule and MSE on N=8192
synthetic samples for 5 epochs at batch 256 (160 steps), a new shuffle every epoch, three
ways:

- `plain`: `optax.adam(schedule)`, nothing recorded, the reference;
- `schedules`: the same optimizer with `schedules={"learning_rate": schedule}`, the
    schedule evaluated in the program at the optimizer's count every step;
- `injected`: `optax.inject_hyperparams(optax.adam)(learning_rate=schedule)`, whose
    hyperparameters (5 of them) the run reads from the optimizer's state every step. Its
    optimizer differs too (optax rebuilds Adam from the injected values each step), so
    this ratio is optax's wrapper and the recording together.

The three run in one process, interleaved, the median of `--repeats` repeats (each the
median of 3 back-to-back runs); nothing recompiles in the timed loop (a JAX
compile-event listener counts). Target: `schedules` / `plain` at most 1.05.

    python benchmarks/hyperparams.py [--repeats 7] [--quick] [--out PATH]
"""

import argparse
import sys
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
    interleave,
    load_average,
    regression_data,
    table,
)

import eqfit


IN_FEATURES, WIDTH, DEPTH = 16, 128, 2
NUM_SAMPLES, EPOCHS, BATCH_SIZE = 8192, 5, 256
STEPS = EPOCHS * (NUM_SAMPLES // BATCH_SIZE)
SCHEDULE = optax.cosine_decay_schedule(1e-3, STEPS)
CASES = ("plain", "schedules", "injected")
TARGET = 1.05


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def make_run(case: str, model: Any, data: tuple[jax.Array, jax.Array]) -> Callable[[], Any]:
    """One `eqfit.fit` of the case; it returns once its program has finished."""
    options: dict[str, Any] = {}
    if case == "injected":
        optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    else:
        optimizer = optax.adam(SCHEDULE)
    if case == "schedules":
        options["schedules"] = {"learning_rate": SCHEDULE}

    def run() -> eqfit.FitResult:
        return eqfit.fit(
            model,
            data,
            loss=mse,
            optimizer=optimizer,
            key=jax.random.key(0),
            epochs=EPOCHS,
            batch_size=BATCH_SIZE,
            **options,
        )

    return run


def check(results: dict[str, eqfit.FitResult]) -> dict[str, Any]:
    """The recorded rates against the schedule compiled alone, and the trained weights
    of `schedules` against `plain`'s (the recording must not change the training).
    """
    want = np.asarray(jax.jit(jax.vmap(SCHEDULE))(jnp.arange(STEPS, dtype=jnp.int32)))
    out: dict[str, Any] = {}
    for case in ("schedules", "injected"):
        got = results[case].history.step_values["learning_rate"].reshape(-1)
        out[f"{case}_lr_max_abs_diff"] = float(np.max(np.abs(got - want)))
    same = all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(eqx.filter(results["plain"].model, eqx.is_array)),
            jax.tree.leaves(eqx.filter(results["schedules"].model, eqx.is_array)),
        )
    )
    out["schedules_model_bitwise_equal_to_plain"] = same
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 repeats")
    default_out = Path(__file__).parent / "results" / "hyperparams.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    inner = 1 if args.quick else 3

    start = time.perf_counter()
    load_before = load_average()
    x, y = regression_data(NUM_SAMPLES, IN_FEATURES)
    data = (jnp.asarray(x), jnp.asarray(y))
    model = eqfit.models.MLP(IN_FEATURES, "scalar", WIDTH, DEPTH, key=jax.random.key(0))
    runs = {case: make_run(case, model, data) for case in CASES}
    checks = check({case: run() for case, run in runs.items()})

    print("timing the steady state...", file=sys.stderr)
    events = CompileEvents()
    events.reset()
    times = interleave(runs, repeats, inner)
    recompiles = events.backend_compiles()

    cfg = {
        **config(),
        "model": f"eqfit.models.MLP({IN_FEATURES}, 'scalar', {WIDTH}, {DEPTH})",
        "schedule": f"optax.cosine_decay_schedule(1e-3, {STEPS})",
        "num_samples": NUM_SAMPLES,
        "epochs": EPOCHS,
        "batch_size": BATCH_SIZE,
        "repeats": repeats,
        "inner_runs_per_sample": inner,
        "quick": args.quick,
    }
    print("\n# hyperparams\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); {cfg['model']}, "
        f"Adam on {cfg['schedule']}, N={NUM_SAMPLES}, batch {BATCH_SIZE}, {EPOCHS} epochs "
        f"({STEPS} steps); repeats={repeats}, each the median of {inner} runs\n"
    )
    plain = times["plain"]
    rows = [[case, f"{times[case] * 1e3:.1f}", f"{times[case] / plain:.3f}"] for case in CASES]
    print(table(["case", "median ms per fit", "against plain"], rows))
    ratio = times["schedules"] / plain
    verdict = "within" if ratio <= TARGET else "above"
    print(f"\n`schedules` / `plain` = {ratio:.3f}: {verdict} the target of {TARGET}")
    print(f"XLA compilations during the timed steady state: {recompiles}")
    print(", ".join(f"{k} {v}" for k, v in checks.items()))
    results = {
        "seconds": times,
        "ratios": {case: times[case] / plain for case in CASES},
        "target": TARGET,
        "checks": checks,
        "steady_recompiles": recompiles,
        "config": cfg,
    }
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
