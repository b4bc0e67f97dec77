"""Speed of `eqfit.fit` against the hand-written floor and the usual Python loop.

Trains an MLP 16->64->64->1 with Adam(1e-3) and MSE on N=8192 synthetic samples for 5
epochs, at batch sizes 32 and 256, with a new shuffle every epoch, four ways:

1. `compiled`: `eqfit.fit(..., progress=False)`.
2. `progress`: `eqfit.fit(..., progress="bar")`, the bar written to os.devnull.
3. `floor`: a hand-written `jax.jit` of a `lax.scan` over epochs of a `lax.scan` over
   batches, shuffling with eqfit's own shuffle (`eqfit._core._data.epoch_order`, the same work)
   and gathering each batch with the same in-bounds promise eqfit makes.
   `floor_perm` is the same shuffling with `jax.random.permutation`, as a hand-written
   loop would.
4. `usual`: a Python `for` over epochs and batches calling an `eqx.filter_jit` step,
   batches gathered in Python from a per-epoch numpy permutation (Equinox tutorials).

The variants are timed in one process, interleaved, as medians over repeats after a
warm-up, with the same model and optimizer objects throughout so nothing recompiles (a
JAX compile-event listener checks that). Compile time and a "fresh run" (new model, new
optimizer, compile included) are measured apart.

    python benchmarks/fit_speed.py [--repeats 5] [--quick] [--out PATH]
"""

import argparse
import contextlib
import os
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
    load_average,
    median,
    regression_data,
    table,
    timed,
)

import eqfit
from eqfit._core._data import epoch_order, shuffle_seed


IN_FEATURES, WIDTH, DEPTH = 16, 64, 2
LEARNING_RATE = 1e-3
NUM_SAMPLES = 8192
EPOCHS = 5
BATCH_SIZES = (32, 256)
COMPILE_EPOCHS = (1, 5, 20)
VARIANTS = ("compiled", "progress", "floor", "floor_perm", "usual")

Data = tuple[jax.Array, jax.Array]
_DEVNULL = open(os.devnull, "w")  # noqa: SIM115 (open for the whole run)
Run = Callable[[], Any]  # one full training run; blocks until the device is done


def make_data(seed: int = 0) -> Data:
    """The benchmarks' regression problem, on the device once."""
    x, y = regression_data(NUM_SAMPLES, IN_FEATURES, seed)
    return jnp.asarray(x), jnp.asarray(y)


def make_model(seed: int) -> eqfit.models.MLP:
    return eqfit.models.MLP(IN_FEATURES, "scalar", WIDTH, DEPTH, key=jax.random.key(seed))


# ---------------------------------------------------------------------------------------
# 1 and 2: eqfit


def eqfit_run(
    model: Any,
    data: Data,
    optimizer: optax.GradientTransformation,
    key: jax.Array,
    batch_size: int,
    epochs: int,
    progress: bool,
) -> eqfit.FitResult:
    """One `eqfit.fit`; tqdm's bar (if any) goes to os.devnull.

    Nothing is left to block on when `fit` returns: it reads the run's history back, and
    every output of one XLA program becomes ready together. (`check_ready` verifies it.)
    A `jax.block_until_ready(result)` here would only time a walk over the model's tree
    after the run, which the floor does while its program is still running.
    """
    kwargs: dict[str, Any] = dict(
        loss=eqfit.losses.mse, optimizer=optimizer, key=key, epochs=epochs, batch_size=batch_size
    )
    # Only the bar writes: the compiled path is timed without the redirection.
    quiet = contextlib.redirect_stderr(_DEVNULL) if progress else contextlib.nullcontext()
    with quiet:
        return eqfit.fit(model, data, progress="bar" if progress else False, **kwargs)


def check_ready(runs: dict[str, Run]) -> dict[str, bool]:
    """Whether every array of each eqfit variant's result is ready as `fit` returns."""
    ready = {}
    for name in ("compiled", "progress"):
        leaves = jax.tree.leaves(runs[name]())
        ready[f"{name}_ready"] = all(x.is_ready() for x in leaves if isinstance(x, jax.Array))
        if not ready[f"{name}_ready"]:
            raise AssertionError(f"{name}: `fit` returned with work in flight")
    return ready


# ---------------------------------------------------------------------------------------
# 3: the floor, written plainly with eqx.partition/combine; of eqfit, only its shuffle


def make_floor(
    model: Any,
    optimizer: optax.GradientTransformation,
    batch_size: int,
    epochs: int,
    permutation: bool = False,
) -> tuple[Callable[..., Any], Any]:
    """A jitted whole-run `train(params, opt_state, x, y, key)` and the params.

    It shuffles as eqfit does (the same function, so that the trained parameters can be
    compared), or with `permutation`, with `jax.random.permutation` as a hand-written loop
    would. A new closure each call, so each floor has its own jit cache.
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)
    steps = NUM_SAMPLES // batch_size  # both batch sizes divide N: no remainder step

    def gather(a: jax.Array, idx: jax.Array) -> jax.Array:
        # The indices are a permutation, so in bounds and unique: saying so lets XLA
        # drop the bounds handling (eqfit's `take` makes the same promise).
        return a.at[idx].get(mode="promise_in_bounds", unique_indices=True)

    def order(key: jax.Array, e: jax.Array) -> jax.Array:
        if permutation:
            return jax.random.permutation(jax.random.fold_in(key, e), NUM_SAMPLES)
        return epoch_order(shuffle_seed(key), e, NUM_SAMPLES, True)

    def loss_fn(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return eqfit.losses.mse(eqx.combine(p, static), x, y)

    @jax.jit
    def train(p: Any, opt_state: Any, x: jax.Array, y: jax.Array, key: jax.Array) -> Any:
        def epoch(carry: Any, e: jax.Array) -> Any:
            def step(carry: Any, idx: jax.Array) -> Any:
                p, opt_state = carry
                loss, grads = jax.value_and_grad(loss_fn)(p, gather(x, idx), gather(y, idx))
                updates, opt_state = optimizer.update(grads, opt_state, p)
                return (optax.apply_updates(p, updates), opt_state), loss

            return jax.lax.scan(step, carry, order(key, e).reshape(steps, batch_size))

        return jax.lax.scan(epoch, (p, opt_state), jnp.arange(epochs))

    return train, params


# ---------------------------------------------------------------------------------------
# 4: the usual loop, as in the Equinox tutorials


def make_usual_step(optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    """A new `eqx.filter_jit` step (a new closure, so a new compilation cache)."""

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = eqx.filter_value_and_grad(eqfit.losses.mse)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def usual_loop(
    step: Callable[..., Any],
    model: Any,
    opt_state: Any,
    data: Data,
    batch_size: int,
    epochs: int,
    rng: np.random.Generator,
) -> tuple[Any, jax.Array]:
    """Python loops over epochs and batches; each batch is gathered eagerly, outside jit."""
    x, y = data
    losses = []
    for _ in range(epochs):
        perm = rng.permutation(NUM_SAMPLES)
        for start in range(0, NUM_SAMPLES, batch_size):
            idx = perm[start : start + batch_size]
            model, opt_state, loss = step(model, opt_state, x[idx], y[idx])
            # Kept on the device: reading each loss with float() would add a sync per step.
            losses.append(loss)
    return jax.block_until_ready((model, jnp.stack(losses)))


# ---------------------------------------------------------------------------------------
# Steady state


def make_runs(model: Any, data: Data, batch_size: int) -> dict[str, Run]:
    """The four variants at one batch size, each holding its own optimizer object."""
    key = jax.random.key(0)
    eqfit_opt = optax.adam(LEARNING_RATE)
    floor_opt = optax.adam(LEARNING_RATE)
    usual_opt = optax.adam(LEARNING_RATE)

    train, params = make_floor(model, floor_opt, batch_size, EPOCHS)
    train_perm, _ = make_floor(model, floor_opt, batch_size, EPOCHS, permutation=True)
    floor_state = floor_opt.init(params)

    usual_step = make_usual_step(usual_opt)
    usual_state = usual_opt.init(eqx.filter(model, eqx.is_array))
    rng = np.random.default_rng(0)

    return {
        "compiled": lambda: eqfit_run(model, data, eqfit_opt, key, batch_size, EPOCHS, False),
        "progress": lambda: eqfit_run(model, data, eqfit_opt, key, batch_size, EPOCHS, True),
        "floor": lambda: jax.block_until_ready(train(params, floor_state, *data, key)),
        "floor_perm": lambda: jax.block_until_ready(train_perm(params, floor_state, *data, key)),
        "usual": lambda: usual_loop(usual_step, model, usual_state, data, batch_size, EPOCHS, rng),
    }


def check_same_work(model: Any, runs: dict[str, Run]) -> dict[str, float]:
    """How far the trained parameters of progress and the floors are from compiled's."""
    _, static = eqx.partition(model, eqx.is_inexact_array)

    def trained(name: str) -> Any:
        out = runs[name]()
        if isinstance(out, eqfit.FitResult):
            return eqx.filter(out.model, eqx.is_inexact_array)
        (params, _), _ = out
        return eqx.filter(eqx.combine(params, static), eqx.is_inexact_array)

    def max_diff(a: Any, b: Any) -> float:
        leaves = jax.tree.leaves(jax.tree.map(lambda u, v: jnp.max(jnp.abs(u - v)), a, b))
        return float(max(leaves))

    reference = trained("compiled")
    return {
        f"{name}_vs_compiled_max_abs": max_diff(reference, trained(name))
        for name in ("progress", "floor")
    }


def steady_state(
    model: Any, data: Data, repeats: int, inner: int, events: CompileEvents
) -> tuple[dict[int, dict[str, list[float]]], dict[str, Any]]:
    """Interleaved timings of every variant at every batch size, after a warm-up.

    One sample per variant per repeat. The usual loop (about a second, itself an average
    over many steps) is one run. The fast variants (tens of ms) then run in turn, A B C D
    A B C D, `inner` times each, and a sample is the median of a variant's runs: runs
    side by side see the same state of this shared machine, whose noise comes in bursts
    longer than a run (timed in blocks of one variant at a time, single ratios spread
    from 0.9 to 1.3).
    """
    runs = {bs: make_runs(model, data, bs) for bs in BATCH_SIZES}
    first: dict[str, Any] = {}
    for bs, by_variant in runs.items():
        for name, run in by_variant.items():
            events.reset()
            first_s = timed(run)
            first[f"{name}@{bs}"] = {"first_call_s": first_s, **events.breakdown()}
            run()  # a second warm-up: caches, allocator, branch predictors
    checks = {bs: check_same_work(model, runs[bs]) | check_ready(runs[bs]) for bs in BATCH_SIZES}

    fast = [v for v in VARIANTS if v != "usual"]
    times: dict[int, dict[str, list[float]]] = {bs: {v: [] for v in VARIANTS} for bs in runs}
    events.reset()
    for r in range(repeats):
        # Rotate the order each repeat, so that no variant always runs after the same one.
        order = fast[r % len(fast) :] + fast[: r % len(fast)]
        for bs in BATCH_SIZES:
            times[bs]["usual"].append(timed(runs[bs]["usual"]))
            # The first run after a different workload is slower here (the floor right
            # after the usual loop: about 15%, caches and thread wake-ups), so each fast
            # variant runs once untimed after the usual loop.
            for name in order:
                runs[bs][name]()
            samples: dict[str, list[float]] = {name: [] for name in fast}
            for _ in range(inner):
                for name in order:
                    samples[name].append(timed(runs[bs][name]))
            for name in fast:
                times[bs][name].append(median(samples[name]))
        print(f"  steady state: repeat {r + 1}/{repeats}", file=sys.stderr)
    recompiles = events.backend_compiles()
    return times, {"first_calls": first, "checks": checks, "steady_recompiles": recompiles}


# ---------------------------------------------------------------------------------------
# Compile time against epochs, and the fresh run


def compile_vs_epochs(
    model: Any, data: Data, repeats: int, events: CompileEvents, batch_size: int = 32
) -> dict[int, dict[str, float]]:
    """eqfit's compile time (first call minus steady call) at several epoch counts.

    A new `optax.adam` object is a new static argument, so each first call compiles.
    """
    key = jax.random.key(0)
    samples: dict[int, list[dict[str, float]]] = {e: [] for e in COMPILE_EPOCHS}
    for _ in range(repeats):
        for epochs in COMPILE_EPOCHS:
            opt = optax.adam(LEARNING_RATE)
            events.reset()
            first = timed(lambda: eqfit_run(model, data, opt, key, batch_size, epochs, False))
            breakdown = events.breakdown()
            steady = median(
                [
                    timed(lambda: eqfit_run(model, data, opt, key, batch_size, epochs, False))
                    for _ in range(3)
                ]
            )
            samples[epochs].append(
                {"first_s": first, "steady_s": steady, "compile_s": first - steady, **breakdown}
            )
    return {e: {k: median([s[k] for s in rows]) for k in rows[0]} for e, rows in samples.items()}


def floor_compile(model: Any, data: Data, batch_size: int = 32) -> dict[str, float]:
    """The floor's trace+lower and XLA compile times, via `.lower().compile()`."""
    opt = optax.adam(LEARNING_RATE)
    train, params = make_floor(model, opt, batch_size, EPOCHS)
    args = (params, opt.init(params), *data, jax.random.key(0))
    start = time.perf_counter()
    lowered = train.lower(*args)
    mid = time.perf_counter()
    lowered.compile()
    end = time.perf_counter()
    return {"trace_lower_s": mid - start, "compile_s": end - mid, "total_s": end - start}


def fixed_cost(model: Any, data: Data, calls: int = 500) -> dict[str, float]:
    """The host work of one `fit` call, warm: `fit(epochs=0)` back to back (its program
    only makes the optimizer's state and an empty history), median seconds per call.
    """
    opt, key = optax.adam(LEARNING_RATE), jax.random.key(0)
    run = lambda: eqfit_run(model, data, opt, key, 256, 0, False)  # noqa: E731
    run()
    samples = [median([timed(run) for _ in range(calls // 10)]) for _ in range(10)]
    return {"epochs0_fit_s": median(samples)}


def fresh_runs(data: Data, repeats: int, batch_size: int = 32) -> dict[str, list[float]]:
    """New model, new optimizer, one full training run, compile included; interleaved."""
    out: dict[str, list[float]] = {"eqfit": [], "usual": []}
    for r in range(repeats):
        seed = 100 + r

        def eqfit_fresh() -> None:
            model = make_model(seed)
            opt = optax.adam(LEARNING_RATE)
            eqfit_run(model, data, opt, jax.random.key(seed), batch_size, EPOCHS, False)

        def usual_fresh() -> None:
            model = make_model(seed)
            opt = optax.adam(LEARNING_RATE)
            step = make_usual_step(opt)
            state = opt.init(eqx.filter(model, eqx.is_array))
            rng = np.random.default_rng(seed)
            usual_loop(step, model, state, data, batch_size, EPOCHS, rng)

        out["eqfit"].append(timed(eqfit_fresh))
        out["usual"].append(timed(usual_fresh))
        print(f"  fresh runs: repeat {r + 1}/{repeats}", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------
# Report


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def report(
    times: dict[int, dict[str, list[float]]],
    extra: dict[str, Any],
    compiles: dict[int, dict[str, float]],
    floor_c: dict[str, float],
    fresh: dict[str, list[float]],
) -> dict[str, Any]:
    """Prints the tables and returns the same numbers for the JSON file."""
    results: dict[str, Any] = {"steady": {}, "ratios": {}}
    rows = []
    for bs, by_variant in times.items():
        steps = EPOCHS * (NUM_SAMPLES // bs)
        results["steady"][bs] = {}
        for name, ts in by_variant.items():
            m = median(ts)
            entry = {
                "steps": steps,
                "median_s": m,
                "min_s": min(ts),
                "max_s": max(ts),
                "us_per_step": m / steps * 1e6,
                "steps_per_s": steps / m,
                "runs_s": ts,
            }
            results["steady"][bs][name] = entry
            rows.append(
                [
                    str(bs),
                    name,
                    str(steps),
                    fmt(m * 1e3, 2),
                    f"{fmt(min(ts) * 1e3, 2)}–{fmt(max(ts) * 1e3, 2)}",
                    fmt(entry["us_per_step"]),
                    fmt(entry["steps_per_s"], 0),
                ]
            )
    print("\n## Steady state (median of repeats, compile excluded)\n")
    header = ["batch", "variant", "steps", "ms/run", "min–max ms", "µs/step", "steps/s"]
    print(table(header, rows))

    pairs = [
        ("compiled", "floor"),
        ("progress", "compiled"),
        ("usual", "compiled"),
        ("compiled", "floor_perm"),
    ]
    rows = []
    for bs, by_variant in times.items():
        results["ratios"][bs] = {}
        for a, b in pairs:
            of_medians = median(by_variant[a]) / median(by_variant[b])
            paired = median([x / y for x, y in zip(by_variant[a], by_variant[b])])
            results["ratios"][bs][f"{a}/{b}"] = {"of_medians": of_medians, "paired_median": paired}
            rows.append([str(bs), f"{a} / {b}", f"{of_medians:.3f}", f"{paired:.3f}"])
    print("\n## Ratios (same process, interleaved)\n")
    print(table(["batch", "ratio", "of medians", "median of paired"], rows))

    rows = []
    for name, f in extra["first_calls"].items():
        variant, bs = name.split("@")
        steady = median(times[int(bs)][variant])
        rows.append(
            [
                bs,
                variant,
                fmt(f["first_call_s"] * 1e3, 0),
                fmt((f["first_call_s"] - steady) * 1e3, 0),
                fmt(f["trace_s"] * 1e3, 0),
                fmt(f["lower_s"] * 1e3, 0),
                fmt(f["xla_compile_s"] * 1e3, 0),
                str(int(f["xla_compiles"])),
            ]
        )
    print("\n## First call (compile included) per variant\n")
    print("(compile ms = first call − steady median; trace/lower/XLA from JAX's compile events)\n")
    header = ["batch", "variant", "first ms", "compile ms", "trace", "lower", "XLA", "programs"]
    print(table(header, rows))
    fc = floor_c
    print(
        f"\nfloor @32 via .lower().compile(): trace+lower {fmt(fc['trace_lower_s'] * 1e3, 0)} ms,"
        f" XLA compile {fmt(fc['compile_s'] * 1e3, 0)} ms"
    )

    rows = [
        [
            str(e),
            fmt(c["first_s"] * 1e3, 0),
            fmt(c["steady_s"] * 1e3, 1),
            fmt(c["compile_s"] * 1e3, 0),
            fmt(c["trace_s"] * 1e3, 0),
            fmt(c["lower_s"] * 1e3, 0),
            fmt(c["xla_compile_s"] * 1e3, 0),
        ]
        for e, c in compiles.items()
    ]
    print("\n## eqfit compile time against epochs (batch 32, progress=False)\n")
    header = ["epochs", "first ms", "steady ms", "compile ms", "trace", "lower", "XLA"]
    print(table(header, rows))

    eq, us = median(fresh["eqfit"]), median(fresh["usual"])
    print(f"\n## Fresh run (new model + new optax.adam, {EPOCHS} epochs, batch 32, compile in)\n")
    rows = [
        ["eqfit.fit", fmt(eq * 1e3, 0), f"{min(fresh['eqfit']) * 1e3:,.0f}", "1.00"],
        ["usual loop", fmt(us * 1e3, 0), f"{min(fresh['usual']) * 1e3:,.0f}", f"{us / eq:.2f}"],
    ]
    print(table(["variant", "median ms", "min ms", "vs eqfit"], rows))

    print("\n## Checks\n")
    print(f"XLA compilations during the timed steady state: {extra['steady_recompiles']}")
    for bs, c in extra["checks"].items():
        diffs = ", ".join(
            f"{k.removesuffix('_max_abs')} {v:.1e}" for k, v in c.items() if k.endswith("_max_abs")
        )
        ready = ", ".join(k.removesuffix("_ready") for k, v in c.items() if k.endswith("_ready"))
        print(f"batch {bs}: max |Δparam| {diffs}; every array ready as `fit` returns: {ready}")
    results.update(
        first_calls=extra["first_calls"],
        floor_lower_compile_batch32=floor_c,
        compile_vs_epochs_batch32=compiles,
        fresh_run_batch32={"eqfit_s": fresh["eqfit"], "usual_s": fresh["usual"]},
        checks=extra["checks"],
        steady_recompiles=extra["steady_recompiles"],
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 repeats")
    default_out = Path(__file__).parent / "results" / "fit_speed.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    # Sub-second samples: the median of `inner` runs each, to steady them on a noisy
    # machine. Compile and fresh-run samples take about a second each: fewer of them.
    inner = 1 if args.quick else 5
    side_repeats = 1 if args.quick else 3
    fresh_repeats = 2 if args.quick else min(repeats, 5)

    start = time.perf_counter()
    load_before = load_average()
    events = CompileEvents()
    data = make_data()
    model = make_model(0)
    print("warming up and timing the steady state...", file=sys.stderr)
    times, extra = steady_state(model, data, repeats, inner, events)
    print("compile time against epochs...", file=sys.stderr)
    compiles = compile_vs_epochs(model, data, side_repeats, events)
    floor_c = floor_compile(model, data)
    print("fresh runs...", file=sys.stderr)
    fresh = fresh_runs(data, fresh_repeats)
    fixed = fixed_cost(model, data)

    cfg = {
        **config(),
        "model": f"eqfit.models.MLP({IN_FEATURES}, 'scalar', {WIDTH}, {DEPTH})",
        "optimizer": f"optax.adam({LEARNING_RATE})",
        "loss": "eqfit.losses.mse",
        "num_samples": NUM_SAMPLES,
        "epochs": EPOCHS,
        "batch_sizes": list(BATCH_SIZES),
        "repeats": repeats,
        "inner_runs_per_sample": inner,
        "compile_repeats": side_repeats,
        "fresh_repeats": fresh_repeats,
        "compile_epochs": list(COMPILE_EPOCHS),
        "quick": args.quick,
    }
    print("\n# fit_speed\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); {cfg['model']}, "
        f"{cfg['optimizer']}, MSE, N={NUM_SAMPLES}, {EPOCHS} epochs, repeats={repeats} "
        f"(each the median of {inner} runs, except the usual loop)"
    )
    results = report(times, extra, compiles, floor_c, fresh)
    print(
        "\nHost work per `fit` call, warm (`fit(epochs=0)` back to back, median): "
        f"{fixed['epochs0_fit_s'] * 1e3:.2f} ms"
    )
    results["fixed_cost"] = fixed
    results["config"] = cfg
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
