"""The time to a first trained model: what a script that calls `fit` once waits for.

Each variant runs in a fresh Python process (imports, data and model made before the
clock starts), and the time is from the `fit` call to the trained model, compilation
included. Processes of the variants alternate, A B C D A B C D, and each figure is the
median over `--repeats` processes. Problem: `eqfit.models.MLP(16, "scalar", 64, 2)`,
`optax.adam(1e-3)`, MSE, N = 8192, batch 32, 3 epochs; and for the `_val` variants,
N = 8100 (each epoch's last batch has 4 samples) with `validation_data` of 1,000 samples
(the same regression function), evaluated after each epoch.

1. `compiled`: `eqfit.fit(..., progress=False)`.
2. `progress`: `eqfit.fit(..., progress="bar")`, the bar written to os.devnull.
3. `cached`: `compiled` with `eqfit.enable_compilation_cache()` on and warm (a process
   before the timed ones filled it).
4. `keras`: Keras 3's `model.fit` of the same model (JAX backend), if Keras is installed
   (`pip install -e ".[bench]"`), built beforehand (`keras.Input` first): its weights are
   made before the clock starts, as eqfit's model's are.
5. `keras_lazy`: the same without `keras.Input`, so that Keras makes the weights inside
   `fit` (a Keras model given no input shape is built by its first call). Many Keras
   scripts are written this way; it is also what a figure of 1.36 s for "Keras's first
   fit" on this kind of machine measured.
6. `handwritten`: the whole-run training a user writes by hand for the same problem, the
   floor for a first fit: `eqx.partition` of the model, then one `jax.jit` of a function
   that makes the optimizer's state, `lax.scan`s over the epochs, shuffles each epoch with
   `jax.random.permutation(jax.random.fold_in(key, epoch), N)` and `lax.scan`s the step
   (MSE on `jax.vmap(model)`, `optax.adam`) over the reshaped batches; timed from the
   `eqx.partition` to the trained model (`eqx.combine`, `block_until_ready`), compile
   included, with the same model, key and data on the device as `compiled`.
7. `compiled_val`: `compiled` on the second problem, `eqfit.fit(..., validation_data=)`.
8. `handwritten_val`: `handwritten` on the second problem: each epoch's last 4 samples
   are a step of their own (the step traced at its own shape, as eqfit does), and after
   each epoch the mean loss over the validation set, in batches of 32 and a last one of
   8, each weighted by its size (as `eqfit/_evaluate.py` does), inside the same program.

9. `cnn`: `eqfit.fit` (its default `execution`) of the CNN of `model_families.py`
   (`Conv2d` 1->32->32, 3x3, on 16x16 images, 10 classes, softmax cross-entropy,
   `optax.adam(1e-3)`), N = 1280, batch 32, 1 epoch (40 steps).
10. `cnn_usual`: the same training as the usual loop (`model_families.py`'s `usual`): an
   `eqx.filter_jit` step called from Python for each batch, the epoch's permutation made
   by a `jax.jit` of `jax.random.permutation`, the batch gathered inside the step; timed
   from the first call to the trained model, compile included.

Each process reports its last epoch's mean training loss (each step weighted by its
batch size) and validation loss, printed beside the times: eqfit and the hand-written
loop shuffle differently, so these agree closely but not bitwise.

Each process also counts the XLA compilations its `fit` started, and times a second
figure from the model's construction (eqfit's `MLP(...)`, Keras's `Sequential` and
`compile`) to the trained model: what a script waits for whichever way its model is made.

Then, in one process, the cost of a recompilation: `fit` with a new optimizer object
against Keras's `fit` of a newly built model (the same work), and the compile time of
eqfit's program by what it holds: the step once (no remainder batch), the step twice (a
remainder batch), and the forward pass for validation.

    python benchmarks/first_fit.py [--repeats 7] [--out PATH]
        [--variants compiled,handwritten,compiled_val,handwritten_val] [--no-recompile]
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

from _common import CompileEvents, load_average, regression_data


HERE = Path(__file__).parent
NUM_SAMPLES, FEATURES, EPOCHS, BATCH = 8192, 16, 3, 32
VAL_SAMPLES, VAL_HELD_OUT = 8100, 1000  # the `_val` problem: 8100 = 253 * 32 + 4
VARIANTS = (
    "compiled",
    "progress",
    "cached",
    "keras",
    "keras_lazy",
    "handwritten",
    "compiled_val",
    "handwritten_val",
    "cnn",
    "cnn_usual",
)
# The ratios the aim is about: a new process's first `fit` against the first call
# of the hand-written whole-run `jit(lax.scan)`, on each problem (issue #57, item 4).
HANDWRITTEN_AIM = 1.10
HANDWRITTEN_PAIRS = (("compiled", "handwritten"), ("compiled_val", "handwritten_val"))
# A CNN's first `fit` against the usual loop's first epoch (issue "Never slower than the
# usual loop").
CNN_AIM = 1.10
CNN_SAMPLES = 1280  # 40 steps, as the issue that measured it 1.13x ran


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


def _problem(validate: bool) -> tuple[Any, Any, Any]:
    """The training arrays and the validation arrays (or `None`), as numpy arrays: N =
    8192, or N = 8100 and 1,000 more samples of the same function to validate on.
    """
    if not validate:
        return (*regression_data(NUM_SAMPLES, FEATURES), None)
    x, y = regression_data(VAL_SAMPLES + VAL_HELD_OUT, FEATURES)
    return x[:VAL_SAMPLES], y[:VAL_SAMPLES], (x[VAL_SAMPLES:], y[VAL_SAMPLES:])


def handwritten_train(static: Any, optimizer: Any, batch_size: int, epochs: int) -> Any:
    """The whole run as a user writes it by hand: one `jax.jit` of a `lax.scan` over
    epochs, each shuffled with `jax.random.permutation` and a `lax.scan` of the step over
    its full batches, then the smaller last batch (if any) as one more step, traced at
    its own shape; with validation data, its mean loss after each epoch.

    Returns `train(params, x, y, key, validation) -> (params, epoch_loss, val_loss)`, the
    optimizer's state made inside; `validation` is `(xv, yv)` or `None` (then `val_loss`
    is `None`). Epoch losses weight each step by its batch size, as eqfit's do.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def batches(a: Any, count: int) -> Any:
        return a[: count * batch_size].reshape(count, batch_size, *a.shape[1:])

    def mean_loss(params: Any, x: Any, y: Any) -> Any:
        """The mean loss over `(x, y)` in batches, the last one smaller."""
        full, rest = divmod(x.shape[0], batch_size)

        def add(total: Any, batch: Any) -> Any:
            return total + loss_fn(params, *batch) * batch_size, None

        total, _ = jax.lax.scan(add, jnp.zeros(()), (batches(x, full), batches(y, full)))
        if rest:
            tail = full * batch_size
            total = total + loss_fn(params, x[tail:], y[tail:]) * rest
        return total / x.shape[0]

    @jax.jit
    def train(params: Any, x: Any, y: Any, key: Any, validation: Any) -> Any:
        n = x.shape[0]
        full, rest = divmod(n, batch_size)

        def step(carry: Any, idx: Any) -> Any:
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, x[idx], y[idx])
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        def epoch(carry: Any, e: Any) -> Any:
            order = jax.random.permutation(jax.random.fold_in(key, e), n)
            carry, losses = jax.lax.scan(step, carry, batches(order, full))
            total = jnp.sum(losses) * batch_size
            if rest:
                carry, last = step(carry, order[full * batch_size :])
                total = total + last * rest
            val = None if validation is None else mean_loss(carry[0], *validation)
            return carry, (total / n, val)

        carry = (params, optimizer.init(params))
        (params, _), (epoch_loss, val_loss) = jax.lax.scan(epoch, carry, jnp.arange(epochs))
        return params, epoch_loss, val_loss

    return train


def worker(variant: str, cache_dir: str) -> dict[str, Any]:
    """One process's first `fit`: its seconds (from the call, and from the model's
    construction) and its compilations.
    """
    x, y, val = _problem(validate=variant.endswith("_val"))
    if variant.startswith("keras"):
        os.environ["KERAS_BACKEND"] = "jax"
        import keras

        constructed = time.perf_counter()
        model = _keras_model(keras, built=variant == "keras")
        events = CompileEvents()
        called = time.perf_counter()
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
        timings = _timings(constructed, called, events)
        return timings | {"loss": float(history.history["loss"][-1]), "val_loss": None}

    import equinox as eqx
    import jax
    import optax

    import eqfit

    if variant.startswith("cnn"):
        return cnn_worker(variant)
    if variant == "cached":
        eqfit.enable_compilation_cache(cache_dir)
    data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
    validation = None if val is None else (jax.numpy.asarray(val[0]), jax.numpy.asarray(val[1]))
    jax.block_until_ready((data, validation))
    constructed = time.perf_counter()
    model = eqfit.models.MLP(FEATURES, "scalar", 64, 2, key=jax.random.key(0))
    optimizer, key = optax.adam(1e-3), jax.random.key(1)
    events = CompileEvents()
    if variant.startswith("handwritten"):
        called = time.perf_counter()
        params, static = eqx.partition(model, eqx.is_inexact_array)
        train = handwritten_train(static, optimizer, BATCH, EPOCHS)
        params, epoch_loss, val_loss = train(params, *data, key, validation)
        jax.block_until_ready(eqx.combine(params, static))
        timings = _timings(constructed, called, events)
        last_val = None if val_loss is None else float(val_loss[-1])
        return timings | {"loss": float(epoch_loss[-1]), "val_loss": last_val}
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
            progress="bar" if variant == "progress" else False,
            validation_data=validation,
        )
        jax.block_until_ready(result.model)
    timings = _timings(constructed, called, events)
    last_val = None if result.history.val_loss is None else float(result.history.val_loss[-1])
    return timings | {"loss": float(result.history.loss[-1]), "val_loss": last_val}


def cnn_worker(variant: str) -> dict[str, Any]:
    """The CNN's first epoch, by `eqfit.fit` or by the usual loop (`cnn_usual`)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from model_families import CNN

    import eqfit

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(CNN_SAMPLES, 1, 16, 16)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, CNN_SAMPLES).astype(np.int32))
    jax.block_until_ready((x, y))
    steps = CNN_SAMPLES // BATCH

    def loss(model: Any, x: Any, y: Any) -> Any:
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    constructed = time.perf_counter()
    model = CNN(jax.random.key(0))
    optimizer, key = optax.adam(1e-3), jax.random.key(1)
    events = CompileEvents()
    called = time.perf_counter()
    if variant == "cnn":
        result = eqfit.fit(
            model, (x, y), loss=loss, optimizer=optimizer, key=key, epochs=1, batch_size=BATCH
        )
        jax.block_until_ready(result.model)
        timings = _timings(constructed, called, events)
        return timings | {"loss": float(result.history.loss[-1]), "val_loss": None}
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @jax.jit
    def shuffle(key: Any) -> Any:
        order = jax.random.permutation(key, CNN_SAMPLES)
        return order[: steps * BATCH].reshape(steps, BATCH)

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, order: Any, i: Any) -> Any:
        idx = order[i]
        value, grads = eqx.filter_value_and_grad(loss)(model, x[idx], y[idx])
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, value

    order, losses = shuffle(key), []
    for i in range(steps):
        model, opt_state, value = step(model, opt_state, order, jnp.asarray(i, jnp.int32))
        losses.append(value)
    jax.block_until_ready(model)
    timings = _timings(constructed, called, events)
    return timings | {"loss": float(jnp.mean(jnp.stack(losses))), "val_loss": None}


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
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated variants to run (default: all; Keras's only if installed)",
    )
    parser.add_argument(
        "--no-recompile", action="store_true", help="skip the in-process recompile section"
    )
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--cache-dir", default="")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.cache_dir)))
        return
    chosen = args.variants.split(",")
    if unknown := set(chosen) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    os.environ["KERAS_BACKEND"] = "jax"  # before Keras is imported
    try:
        import keras  # noqa: F401

        has_keras = True
    except ImportError:
        has_keras = False
        print("Keras is not installed (pip install -e '.[bench]'): no Keras rows", file=sys.stderr)
    variants = [v for v in VARIANTS if v in chosen and (has_keras or not v.startswith("keras"))]
    load_before = load_average()
    cache_dir = tempfile.mkdtemp(prefix="eqfit-cache-")
    if "cached" in variants:
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
        f"MLP({FEATURES}, 'scalar', 64, 2), adam(1e-3), MSE, batch {BATCH}, {EPOCHS} epochs; "
        f"N={NUM_SAMPLES}, or for `_val` N={VAL_SAMPLES} (a last batch of "
        f"{VAL_SAMPLES % BATCH}) with {VAL_HELD_OUT} validation samples; median of "
        f"{args.repeats} fresh processes each\n"
    )
    print(
        "| variant | from `fit`, s | from the model's construction, s "
        "| XLA compilations in `fit` | cache hits | last epoch's loss | val loss |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v in variants:
        spread = [x["seconds"] for x in runs[v]]
        loss = statistics.median(x["loss"] for x in runs[v])
        vals = [x["val_loss"] for x in runs[v] if x["val_loss"] is not None]
        val = f"{statistics.median(vals):.4f}" if vals else "–"
        print(
            f"| {v} | {median[v]:.3f} ({min(spread):.3f}–{max(spread):.3f}) | "
            f"{built[v]:.3f} | {compiles[v]:.0f} | {hits[v]:.0f} | {loss:.4f} | {val} |"
        )

    def ratio(a: str, b: str, of: dict[str, float] = median) -> float | None:
        return of[a] / of[b] if a in of and b in of else None

    def paired(a: str, b: str) -> float | None:
        """The median of the per-repeat ratios: the two processes of a repeat ran close
        together in time, so saw more nearly the same state of the machine.
        """
        if a not in runs or b not in runs:
            return None
        return statistics.median(
            x["seconds"] / y["seconds"] for x, y in zip(runs[a], runs[b], strict=True)
        )

    candidates = {
        "progress / compiled": ratio("progress", "compiled"),
        "cached / compiled": ratio("cached", "compiled"),
        "compiled / keras": ratio("compiled", "keras"),
        "compiled / keras_lazy": ratio("compiled", "keras_lazy"),
        "from construction: compiled / keras": ratio("compiled", "keras", built),
    }
    for a, b in (*HANDWRITTEN_PAIRS, ("cnn", "cnn_usual")):
        candidates[f"{a} / {b}"] = ratio(a, b)
        candidates[f"{a} / {b} (median of paired)"] = paired(a, b)
    ratios = {name: value for name, value in candidates.items() if value is not None}
    if ratios:
        print("\n| ratio | value |\n| --- | --- |")
    for name, value in ratios.items():
        print(f"| {name} | {value:.2f} |")
    if any(a in runs and b in runs for a, b in HANDWRITTEN_PAIRS):
        print(
            f"\n(The aim: eqfit's first `fit` at most {HANDWRITTEN_AIM}x the first call of "
            "the hand-written `jit(lax.scan)`, on both problems.)"
        )
    if "cnn" in runs and "cnn_usual" in runs:
        print(
            f"(The aim: the CNN's first `fit` at most {CNN_AIM}x the usual loop's first "
            "epoch, compile included.)"
        )

    recompile: dict[str, Any] | None = None
    if not args.no_recompile:
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

    load_after = os.getloadavg()
    print(f"\n1-min load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    payload = {
        "config": {
            "jax": jax.__version__,
            "repeats": args.repeats,
            "keras": has_keras,
            "variants": variants,
            "problems": {
                "default": {"num_samples": NUM_SAMPLES, "validation": None},
                "_val": {"num_samples": VAL_SAMPLES, "validation": VAL_HELD_OUT},
            },
            "batch_size": BATCH,
            "epochs": EPOCHS,
        },
        "runs": runs,
        "median_s": median,
        "median_with_construction_s": built,
        "compiles": compiles,
        "ratios": ratios,
        "recompile": recompile,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
