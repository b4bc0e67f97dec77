"""The time to a first trained model: what a script that calls `fit` once waits for.

Each variant runs in a fresh Python process (imports, data and model made before the
clock starts), and the time is from the `fit` call to the trained model, compilation
included. Processes of the variants alternate, A B C D A B C D, and each figure is the
median over `--repeats` processes. Problem: `eqfit.models.MLP(16, "scalar", 64, 2)`,
`optax.adam(1e-3)`, MSE, N = 8192, batch 32, 3 epochs.

1. `compiled`: `eqfit.fit(..., progress=False)`.
2. `progress`: `eqfit.fit(..., progress=True)`, the bar written to os.devnull.
3. `cached`: `compiled` with `eqfit.enable_compilation_cache()` on and warm (a process
   before the timed ones filled it).
4. `keras`: Keras 3's `model.fit` of the same model (JAX backend), if Keras is installed
   (`pip install -e ".[bench]"`), built beforehand (`keras.Input` first): its weights are
   made before the clock starts, as eqfit's model's are.
5. `keras_lazy`: the same without `keras.Input`, so that Keras makes the weights inside
   `fit` (a Keras model given no input shape is built by its first call). Many Keras
   scripts are written this way; it is also what a figure of 1.36 s for "Keras's first
   fit" on this kind of machine measured.

Each process also counts the XLA compilations its `fit` started, and times a second
figure from the model's construction (eqfit's `MLP(...)`, Keras's `Sequential` and
`compile`) to the trained model: what a script waits for whichever way its model is made.

Then, in one process, the cost of a recompilation: `fit` with a new optimizer object
against Keras's `fit` of a newly built model (the same work), and the compile time of
eqfit's program by what it holds: the step once (no remainder batch), the step twice (a
remainder batch), and the forward pass for validation.

    python benchmarks/first_fit.py [--repeats 7] [--out PATH]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import CompileEvents, regression_data


HERE = Path(__file__).parent
NUM_SAMPLES, FEATURES, EPOCHS, BATCH = 8192, 16, 3, 32
VARIANTS = ("compiled", "progress", "cached", "keras", "keras_lazy")


def _keras_model(keras: Any, built: bool = True) -> Any:
    inputs = [keras.Input((FEATURES,))] if built else []
    model = keras.Sequential(
        [
            *inputs,
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _timings(constructed: float, called: float, events: CompileEvents) -> dict[str, Any]:
    """Seconds until now from the model's construction and from the `fit` call, and the
    compilations since `events` was made (at the call).
    """
    end = time.perf_counter()
    return {
        "seconds": end - called,
        "with_construction": end - constructed,
        "compiles": events.backend_compiles(),
        "cache_hits": events.cache_hits(),
    }


def worker(variant: str, cache_dir: str) -> dict[str, Any]:
    """One process's first `fit`: its seconds (from the call, and from the model's
    construction) and its compilations.
    """
    x, y = regression_data(NUM_SAMPLES, FEATURES)
    if variant.startswith("keras"):
        os.environ["KERAS_BACKEND"] = "jax"
        import keras

        constructed = time.perf_counter()
        model = _keras_model(keras, built=variant == "keras")
        events = CompileEvents()
        called = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
        return _timings(constructed, called, events)

    import jax
    import optax

    import eqfit

    if variant == "cached":
        eqfit.enable_compilation_cache(cache_dir)
    data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
    jax.block_until_ready(data)
    constructed = time.perf_counter()
    model = eqfit.models.MLP(FEATURES, "scalar", 64, 2, key=jax.random.key(0))
    optimizer, key = optax.adam(1e-3), jax.random.key(1)
    events = CompileEvents()
    devnull = open(os.devnull, "w")  # noqa: SIM115
    quiet = (
        contextlib.redirect_stderr(devnull) if variant == "progress" else contextlib.nullcontext()
    )
    called = time.perf_counter()
    with quiet:
        result = eqfit.fit(
            model,
            data,
            loss=eqfit.losses.mse,
            optimizer=optimizer,
            key=key,
            epochs=EPOCHS,
            batch_size=BATCH,
            progress=variant == "progress",
        )
        jax.block_until_ready(result.model)
    return _timings(constructed, called, events)


def _run_worker(variant: str, cache_dir: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", variant, "--cache-dir", cache_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode:
        raise RuntimeError(f"{variant} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def recompile_costs(repeats: int, has_keras: bool) -> dict[str, Any]:
    """In this process: `fit` with a new optimizer object (a recompilation) against Keras's
    `fit` of a newly built model; and compile seconds by what the program holds.
    """
    import jax
    import optax

    import eqfit

    x, y = regression_data(NUM_SAMPLES, FEATURES)
    data = (jax.numpy.asarray(x), jax.numpy.asarray(y))

    def eqfit_new_optimizer(n: int = NUM_SAMPLES, validation: bool = False) -> float:
        model = eqfit.models.MLP(FEATURES, "scalar", 64, 2, key=jax.random.key(0))
        extra = {"validation_data": (data[0][:1000], data[1][:1000])} if validation else {}
        start = time.perf_counter()
        result = eqfit.fit(
            model,
            (data[0][:n], data[1][:n]),
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-3),
            key=jax.random.key(1),
            epochs=EPOCHS,
            batch_size=BATCH,
            **extra,
        )
        jax.block_until_ready(result.model)
        return time.perf_counter() - start

    keras = None
    if has_keras:
        os.environ["KERAS_BACKEND"] = "jax"
        import keras

    def keras_new_model() -> float:
        assert keras is not None
        model = _keras_model(keras)
        start = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
        return time.perf_counter() - start

    eqfit_new_optimizer()  # warm: imports, JAX's caches of small operations
    if keras is not None:
        keras_new_model()
    samples: dict[str, list[float]] = {"eqfit": [], "keras": []}
    for _ in range(repeats):
        samples["eqfit"].append(eqfit_new_optimizer())
        if keras is not None:
            samples["keras"].append(keras_new_model())
    # What each copy of the step costs to compile: 8192 is 256 batches of 32 exactly, and
    # 8008 is 250 of them and a remainder batch of 8, which is a second copy of the step.
    shapes = {
        "step once (no remainder)": {"n": NUM_SAMPLES},
        "step twice (a remainder batch)": {"n": 8008},
        "step once + validation": {"n": NUM_SAMPLES, "validation": True},
        "step twice + validation": {"n": 8008, "validation": True},
    }
    compile_seconds: dict[str, float] = {}
    for name, kwargs in shapes.items():
        times = []
        for _ in range(max(3, repeats // 2)):
            times.append(eqfit_new_optimizer(**kwargs))
        compile_seconds[name] = statistics.median(times)
    return {"new_optimizer_fit_s": samples, "by_contents_s": compile_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "first_fit.json")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--cache-dir", default="")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.cache_dir)))
        return

    os.environ["KERAS_BACKEND"] = "jax"  # before Keras is imported
    try:
        import keras  # noqa: F401

        has_keras = True
    except ImportError:
        has_keras = False
        print("Keras is not installed (pip install -e '.[bench]'): no Keras rows", file=sys.stderr)
    variants = [v for v in VARIANTS if has_keras or not v.startswith("keras")]
    cache_dir = tempfile.mkdtemp(prefix="eqfit-cache-")
    _run_worker("cached", cache_dir)  # fills the cache
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            runs[variant].append(_run_worker(variant, cache_dir))
        print(f"  fresh processes: repeat {r + 1}/{args.repeats}", file=sys.stderr)
    median = {v: statistics.median(x["seconds"] for x in runs[v]) for v in variants}
    built = {v: statistics.median(x["with_construction"] for x in runs[v]) for v in variants}
    compiles = {v: statistics.median(x["compiles"] for x in runs[v]) for v in variants}
    hits = {v: statistics.median(x["cache_hits"] for x in runs[v]) for v in variants}

    print("\n# first_fit\n")
    print(
        f"MLP({FEATURES}, 'scalar', 64, 2), adam(1e-3), MSE, N={NUM_SAMPLES}, batch {BATCH}, "
        f"{EPOCHS} epochs; median of {args.repeats} fresh processes each\n"
    )
    print(
        "| variant | from `fit`, s | from the model's construction, s "
        "| XLA compilations in `fit` | cache hits |"
    )
    print("| --- | --- | --- | --- | --- |")
    for v in variants:
        spread = [x["seconds"] for x in runs[v]]
        print(
            f"| {v} | {median[v]:.3f} ({min(spread):.3f}–{max(spread):.3f}) | "
            f"{built[v]:.3f} | {compiles[v]:.0f} | {hits[v]:.0f} |"
        )
    ratios = {
        "progress / compiled": median["progress"] / median["compiled"],
        "cached / compiled": median["cached"] / median["compiled"],
    }
    if has_keras:
        ratios["compiled / keras"] = median["compiled"] / median["keras"]
        ratios["compiled / keras_lazy"] = median["compiled"] / median["keras_lazy"]
        ratios["from construction: compiled / keras"] = built["compiled"] / built["keras"]
    print("\n| ratio | value |\n| --- | --- |")
    for name, value in ratios.items():
        print(f"| {name} | {value:.2f} |")

    print("\nIn one process, recompiling ...", file=sys.stderr)
    recompile = recompile_costs(args.repeats, has_keras)
    eq = statistics.median(recompile["new_optimizer_fit_s"]["eqfit"])
    print("\n## In one process (median)\n")
    print(f"- `fit` with a new optimizer object (a recompilation): {eq:.3f} s")
    if has_keras:
        ke = statistics.median(recompile["new_optimizer_fit_s"]["keras"])
        print(
            f"- Keras `fit` of a newly built model: {ke:.3f} s "
            f"(eqfit's recompile is {eq / ke:.2f}x this)"
        )
        ratios["recompile eqfit / keras"] = eq / ke
    print("\n| the program holds | `fit` with a new optimizer, s |\n| --- | --- |")
    for name, seconds in recompile["by_contents_s"].items():
        print(f"| {name} | {seconds:.3f} |")

    import jax

    payload = {
        "config": {"jax": jax.__version__, "repeats": args.repeats, "keras": has_keras},
        "runs": runs,
        "median_s": median,
        "median_with_construction_s": built,
        "compiles": compiles,
        "ratios": ratios,
        "recompile": recompile,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
