"""What guarding an update against a non-finite loss costs a small step, on whatever JAX
finds (a TPU chip, a GPU, or the CPU), in one process.

The workload is `accelerator.py`'s MLP (784-512-512-10, Adam, batch 128, its 60,000 rows;
`--size tiny`: 4,096 rows and 64 hidden units), its batches gathered inside the loop from
an order made each epoch by `jax.random.permutation`. Two halves:

1. Hand loops over the same steps, each a `jit` of a `lax.scan` over epochs:
   - `scan`: a `lax.scan` over the epoch's steps (the floor);
   - `scan_barrier`: the same, the update between `jax.lax.optimization_barrier`s, as
     eqfit applies an update (guarded or not: the barriers keep the bits one);
   - `scan_cond`: the same, the update in a `lax.cond` on the loss's finiteness, as
     `optax.apply_if_finite` and eqfit's guard on the CPU do;
   - `while`, `while_nan`: a `lax.while_loop` over the steps, its condition the step
     count alone, or the count and the last loss's finiteness (eqfit's loop stops at a
     non-finite step).
2. `eqfit.fit` of the same MLP with `on_nan="raise"` (no guard: a non-finite step is
   replayed) and `on_nan="skip"` (the guard), µs a step as the slope between 2 and 20
   epochs, and whether both give the same model bit for bit.

    python benchmarks/guards.py [--size full|tiny] [--epochs 20] [--repeats 5]
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


sys.path.insert(0, str(Path(__file__).parent))
import accelerator  # noqa: E402

import eqfit  # noqa: E402


HAND = ("scan", "scan_barrier", "scan_cond", "while", "while_nan")


def hand_loop(kind: str, model: Any, data: tuple[Any, ...], shape: Any, epochs: int) -> Any:
    """The hand loop `kind` over `epochs`, compiled; called, it trains from `model`."""
    x, y = data
    optimizer = optax.adam(1e-3)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    steps = shape.rows // shape.batch

    def step(params: Any, opt_state: Any, index: Any) -> Any:
        def loss(p: Any) -> Any:
            return accelerator.classify_loss(eqx.combine(p, static), x[index], y[index])

        value, grads = jax.value_and_grad(loss)(params)

        def apply(carry: Any) -> Any:
            params, opt_state, grads = carry
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        carry = (params, opt_state, grads)
        if kind == "scan_cond":
            params, opt_state = jax.lax.cond(jnp.isfinite(value), apply, lambda c: c[:2], carry)
        elif kind == "scan_barrier":
            out = apply(jax.lax.optimization_barrier(carry))
            params, opt_state = jax.lax.optimization_barrier(out)
        else:
            params, opt_state = apply(carry)
        return params, opt_state, value

    def epoch(carry: Any, e: Any, key: Any) -> Any:
        order = jax.random.permutation(jax.random.fold_in(key, e), shape.rows)
        order = order[: steps * shape.batch].reshape(steps, shape.batch)
        if kind.startswith("scan"):

            def scanned(c: Any, index: Any) -> Any:
                *c, value = step(*c, index)
                return tuple(c), value

            return jax.lax.scan(scanned, carry, order)

        def cond(c: Any) -> Any:
            t, *_, finite = c
            return (t < steps) & finite if kind == "while_nan" else t < steps

        def body(c: Any) -> Any:
            t, params, opt_state, losses, _ = c
            params, opt_state, value = step(params, opt_state, order[t])
            return t + 1, params, opt_state, losses.at[t].set(value), jnp.isfinite(value)

        start = (0, *carry, jnp.zeros(steps, jnp.float32), True)
        _, params, opt_state, losses, _ = jax.lax.while_loop(cond, body, start)
        return (params, opt_state), losses

    def train(params: Any, key: Any) -> Any:
        run = lambda c, e: epoch(c, e, key)  # noqa: E731
        return jax.lax.scan(run, (params, optimizer.init(params)), jnp.arange(epochs))

    compiled = jax.jit(train).lower(params, jax.random.key(3)).compile()
    return lambda: jax.block_until_ready(compiled(params, jax.random.key(3)))


def fit_run(model: Any, data: tuple[Any, ...], shape: Any, epochs: int, on_nan: str) -> Any:
    def run() -> Any:
        result = eqfit.fit(
            model,
            data,
            loss=accelerator.classify_loss,
            optimizer=optax.adam(1e-3),
            key=jax.random.key(3),
            epochs=epochs,
            batch_size=shape.batch,
            drop_remainder=True,
            on_nan=on_nan,
        )
        return jax.block_until_ready(result.model)

    return run


def timed(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each run's median seconds, the runs interleaved, after one untimed call each."""
    for run in runs.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: float(np.median(s)) for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.epochs <= 2:
        parser.error("--epochs must be more than 2: a step's time is the slope from 2 epochs")
    shape = accelerator.SIZES[args.size]["mlp"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(shape.rows, accelerator.MLP_IN)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, accelerator.CLASSES, shape.rows).astype(np.int32))
    model = eqx.nn.MLP(
        accelerator.MLP_IN, accelerator.CLASSES, shape.hidden, 2, key=jax.random.key(0)
    )
    steps = shape.rows // shape.batch
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, {steps} steps an epoch")

    hand = {k: hand_loop(k, model, (x, y), shape, args.epochs) for k in HAND}
    for name, s in timed(hand, args.repeats).items():
        print(f"hand {name:13s} {1e6 * s / (args.epochs * steps):8.2f} µs a step")

    ways = {
        (e, o): fit_run(model, (x, y), shape, e, o)
        for o in ("raise", "skip")
        for e in (2, args.epochs)
    }
    seconds = timed({f"{e}/{o}": run for (e, o), run in ways.items()}, args.repeats)
    for on_nan in ("raise", "skip"):
        slope = seconds[f"{args.epochs}/{on_nan}"] - seconds[f"2/{on_nan}"]
        print(
            f"eqfit on_nan={on_nan!r:8s} {1e6 * slope / ((args.epochs - 2) * steps):8.2f} µs a step"
        )
    raised, skipped = ways[(2, "raise")](), ways[(2, "skip")]()
    same = all(
        bool((a == b).all())
        for a, b in zip(jax.tree.leaves(raised), jax.tree.leaves(skipped))
        if eqx.is_array(a)
    )
    print(f"eqfit: the guarded and unguarded runs' models equal bit for bit: {same}")


if __name__ == "__main__":
    main()
