"""Speed of `eqfit.fit(..., updates=[...])` on a DCGAN, against a hand loop and a hand scan.

The model is `examples/gan.py`'s DCGAN (Equinox's `deep_convolutional_gan.ipynb` at
16x16: transposed convolutions with BatchNorm for the generator, strided convolutions
with PReLU and BatchNorm for the discriminator, one model and one BatchNorm state),
imported from there. Each step is the notebook's: the discriminator's update (Adam, b1
0.5), then the generator's on the model and state it left. The latents are part of the
data and the batches are taken in order (`shuffle=False`), so that the three ways train
the same run, and their parameters and state are checked against each other. Three ways:

1. `eqfit`: `eqfit.fit(gan, (latents, images), state=state, key=..., epochs=E,
   batch_size=32, shuffle=False, updates=[eqfit.Update("d", ...), eqfit.Update("g",
   ...)])`. Timed from the second call on, with the same model, losses and optimizer
   objects, so that nothing recompiles; nothing is subtracted.
2. `usual`: a Python `for` over epochs and batches calling one `eqx.filter_jit` step that
   does both updates, each batch sliced from the device arrays inside the step by its
   index (a device scalar made once); dispatched asynchronously, blocking once at the
   run's end.
3. `scan`: one `jax.jit` of a `lax.scan` over epochs of a `lax.scan` over the epoch's
   batches, the same step as its body.

The three are timed in one process, interleaved (the order rotated each repeat, each
preceded by one untimed run), each sample the median of 3 back-to-back runs (one run
where they take half a second or more), reported as medians over repeats: µs per step,
the ratios eqfit/usual, eqfit/scan and eqfit / min(usual, scan) (the "floor"), both as
ratios of medians and as medians of the paired ratios; the first call of each (compile
included). A JAX compile-event listener checks that the timed loop compiled nothing.
On XLA's CPU backend a convolution inside a `while` body is compiled to a naive loop
(jax issue #12868), so on a CPU the scan is expected to be several times slower than the
usual loop (`benchmarks/model_families.py` shows it for a CNN and a conv autoencoder).

    python benchmarks/gan.py [--repeats 5] [--quick] [--epochs 2] [--out PATH]
"""

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
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
    table,
    timed,
)

import eqfit


BATCH_SIZE = 32
LEARNING_RATE, B1 = 2e-4, 0.5  # the notebook's Adam
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WAYS = ("eqfit", "usual", "scan")

Run = Callable[[], Any]  # one full training run; returns (model, state) once done


def load_example() -> ModuleType:
    """examples/gan.py, as a module: its networks, losses and data. (Loaded by its path:
    `import gan` here would find this script.)"""
    spec = importlib.util.spec_from_file_location("gan_example", EXAMPLES / "gan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = load_example()


# The example's losses as `fit` calls them, with the latents in the batch: the
# discriminator's as it is, the generator's with the batch's images unused.
d_loss = EXAMPLE.discriminator_loss


def g_loss(gan: Any, state: eqx.nn.State, latents: jax.Array, images: jax.Array) -> Any:
    del images
    return EXAMPLE.generator_loss(gan, state, latents)


def adam() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE, b1=B1)


class Problem:
    """The DCGAN, its state, and `num_samples` digits with a latent each, on the device."""

    def __init__(self, num_samples: int, epochs: int):
        self.epochs = epochs
        self.model, self.state = eqx.nn.make_with_state(EXAMPLE.GAN)(jax.random.key(2003))
        images = EXAMPLE.digits()
        images = images[np.arange(num_samples) % len(images)]
        rng = np.random.default_rng(0)
        latents = rng.normal(size=(num_samples, EXAMPLE.LATENT, 1, 1)).astype(np.float32)
        self.data = (jnp.asarray(latents), jnp.asarray(images))

    @property
    def num_samples(self) -> int:
        return int(self.data[0].shape[0])

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // BATCH_SIZE

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch


# ---------------------------------------------------------------------------------------
# The three ways


def hand_step(d_opt: Any, g_opt: Any) -> Callable[..., Any]:
    """The notebook's step, both updates: each loss differentiated with respect to the
    network its update trains, that network's optimizer, the state threaded through."""

    def step(gan: Any, state: Any, opt_states: Any, z: jax.Array, x: jax.Array) -> Any:
        d_state, g_state = opt_states

        def d_objective(discriminator: Any, state: Any) -> Any:
            return d_loss(eqx.tree_at(lambda g: g.discriminator, gan, discriminator), state, z, x)

        grad = eqx.filter_value_and_grad(d_objective, has_aux=True)
        (d_value, state), grads = grad(gan.discriminator, state)
        updates, d_state = d_opt.update(grads, d_state)
        gan = eqx.tree_at(
            lambda g: g.discriminator, gan, eqx.apply_updates(gan.discriminator, updates)
        )

        def g_objective(generator: Any, state: Any) -> Any:
            return g_loss(eqx.tree_at(lambda g: g.generator, gan, generator), state, z, x)

        grad = eqx.filter_value_and_grad(g_objective, has_aux=True)
        (g_value, state), grads = grad(gan.generator, state)
        updates, g_state = g_opt.update(grads, g_state)
        gan = eqx.tree_at(lambda g: g.generator, gan, eqx.apply_updates(gan.generator, updates))
        return gan, state, (d_state, g_state), d_value + g_value

    return step


def initial_opt_states(problem: Problem, d_opt: Any, g_opt: Any) -> Any:
    gan = problem.model
    return (
        d_opt.init(eqx.filter(gan.discriminator, eqx.is_inexact_array)),
        g_opt.init(eqx.filter(gan.generator, eqx.is_inexact_array)),
    )


def make_usual(problem: Problem) -> Run:
    """Python loops over epochs and batches, one `eqx.filter_jit` step per batch."""
    d_opt, g_opt = adam(), adam()
    step = hand_step(d_opt, g_opt)
    latents, images = problem.data
    # The batch indices as device scalars, made once: a Python int would be a static
    # argument of `filter_jit` (a compile per batch), a fresh array a transfer per step.
    indices = [jnp.asarray(i * BATCH_SIZE, jnp.int32) for i in range(problem.steps_per_epoch)]

    @eqx.filter_jit
    def batch_step(gan: Any, state: Any, opt_states: Any, start: jax.Array) -> Any:
        z = jax.lax.dynamic_slice_in_dim(latents, start, BATCH_SIZE)
        x = jax.lax.dynamic_slice_in_dim(images, start, BATCH_SIZE)
        return step(gan, state, opt_states, z, x)

    def run() -> Any:
        gan, state = problem.model, problem.state
        opt_states = initial_opt_states(problem, d_opt, g_opt)
        losses = []
        for _ in range(problem.epochs):
            for start in indices:
                gan, state, opt_states, loss = batch_step(gan, state, opt_states, start)
                losses.append(loss)  # kept on the device: no sync per step
        return jax.block_until_ready((gan, state, losses))[:2]

    return run


def make_scan(problem: Problem) -> Run:
    """A jitted whole run: a `lax.scan` over epochs of a `lax.scan` over batches."""
    d_opt, g_opt = adam(), adam()
    step = hand_step(d_opt, g_opt)
    params, static = eqx.partition(problem.model, eqx.is_array)
    steps, epochs = problem.steps_per_epoch, problem.epochs
    # The epoch's batches, stacked: `(steps, batch, ...)`.
    batches = jax.tree.map(
        lambda a: a[: steps * BATCH_SIZE].reshape(steps, BATCH_SIZE, *a.shape[1:]), problem.data
    )

    @jax.jit
    def train(params: Any, state: Any, opt_states: Any, batches: Any) -> Any:
        def epoch(carry: Any, _: Any) -> Any:
            def batch(carry: Any, zx: Any) -> Any:
                params, state, opt_states = carry
                gan, state, opt_states, loss = step(
                    eqx.combine(params, static), state, opt_states, *zx
                )
                return (eqx.filter(gan, eqx.is_array), state, opt_states), loss

            return jax.lax.scan(batch, carry, batches)

        (params, state, _), losses = jax.lax.scan(
            epoch, (params, state, opt_states), None, length=epochs
        )
        return params, state, losses

    def run() -> Any:
        opt_states = initial_opt_states(problem, d_opt, g_opt)
        params_out, state, _ = jax.block_until_ready(
            train(params, problem.state, opt_states, batches)
        )
        return eqx.combine(params_out, static), state

    return run


def make_eqfit(problem: Problem) -> Run:
    updates = [
        eqfit.Update("d", d_loss, adam(), trains=lambda m: m.discriminator),
        eqfit.Update("g", g_loss, adam(), trains=lambda m: m.generator),
    ]
    key = jax.random.key(0)

    def run() -> Any:
        # `fit` reads its history back before it returns: nothing is left in flight.
        result = eqfit.fit(
            problem.model,
            problem.data,
            key=key,
            state=problem.state,
            epochs=problem.epochs,
            batch_size=BATCH_SIZE,
            shuffle=False,
            updates=updates,
        )
        return result.model, result.state

    return run


# ---------------------------------------------------------------------------------------
# Checks and timing


def max_difference(a: Any, b: Any) -> float:
    """The largest absolute difference between two PyTrees' arrays."""
    la = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(la, lb))


def measure(problem: Problem, repeats: int, inner: int, events: CompileEvents) -> dict[str, Any]:
    """First calls (and the checks on their results), then the interleaved steady state."""
    runs = {"eqfit": make_eqfit(problem), "usual": make_usual(problem), "scan": make_scan(problem)}
    first: dict[str, float] = {}
    trained: dict[str, Any] = {}
    for name, run in runs.items():
        start = time.perf_counter()
        trained[name] = run()
        first[name] = time.perf_counter() - start
    moved = max_difference(trained["usual"][0], problem.model)
    checks = {
        f"{name}_vs_usual": {
            "params_max_abs": max_difference(trained[name][0], trained["usual"][0]),
            "state_max_abs": max_difference(trained[name][1], trained["usual"][1]),
        }
        for name in ("eqfit", "scan")
    }
    checks["usual_moved_max_abs"] = moved  # how far training took the parameters
    steady: dict[str, float] = {}
    for name, run in runs.items():  # warm-up: caches, allocator, thread pools
        run()
        steady[name] = timed(run)
    # Runs of half a second or more are already averages over many steps: one a sample.
    inner = 1 if max(steady.values()) >= 0.5 else inner
    events.reset()
    samples: dict[str, list[float]] = {name: [] for name in WAYS}
    for r in range(repeats):
        for name in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
            runs[name]()  # untimed: the first run after another workload is slower
            samples[name].append(median([timed(runs[name]) for _ in range(inner)]))
    return {
        "first_call_s": first,
        "runs_s": samples,
        "inner_runs_per_sample": inner,
        "steady_recompiles": events.backend_compiles(),
        "checks": checks,
    }


def report(problem: Problem, m: dict[str, Any]) -> dict[str, Any]:
    """Prints the tables and returns the same numbers for the JSON file."""
    steps = problem.steps
    per_step = {w: median(m["runs_s"][w]) / steps * 1e6 for w in WAYS}
    floor_way = min(("usual", "scan"), key=lambda w: per_step[w])
    floors = [min(u, s) for u, s in zip(m["runs_s"]["usual"], m["runs_s"]["scan"])]

    def paired(others: list[float]) -> float:
        return median([a / b for a, b in zip(m["runs_s"]["eqfit"], others)])

    ratios = {
        "eqfit/usual": per_step["eqfit"] / per_step["usual"],
        "eqfit/scan": per_step["eqfit"] / per_step["scan"],
        "eqfit/floor": per_step["eqfit"] / per_step[floor_way],
        "scan/usual": per_step["scan"] / per_step["usual"],
        "eqfit/usual_paired": paired(m["runs_s"]["usual"]),
        "eqfit/scan_paired": paired(m["runs_s"]["scan"]),
        "eqfit/floor_paired": paired(floors),
    }
    print("\n## Steady state: µs per step (both updates; medians over repeats)\n")
    print(
        table(
            ["steps", *(f"{w} µs" for w in WAYS), "eqfit/usual", "eqfit/scan", "eqfit/floor"],
            [
                [
                    str(steps),
                    *(f"{per_step[w]:,.1f}" for w in WAYS),
                    f"{ratios['eqfit/usual']:.3f}",
                    f"{ratios['eqfit/scan']:.3f}",
                    f"{ratios['eqfit/floor']:.3f} ({floor_way})",
                ]
            ],
        )
    )
    print("\n## Ratios as medians of paired (same-repeat) ratios, and the spread of runs\n")
    spread = " ".join(
        f"{w} {min(m['runs_s'][w]) * 1e3:,.1f}–{max(m['runs_s'][w]) * 1e3:,.1f}" for w in WAYS
    )
    print(
        table(
            ["eqfit/usual", "eqfit/scan", "eqfit/floor", "min–max ms per run", "compiles timed"],
            [
                [
                    f"{ratios['eqfit/usual_paired']:.3f}",
                    f"{ratios['eqfit/scan_paired']:.3f}",
                    f"{ratios['eqfit/floor_paired']:.3f}",
                    spread,
                    str(m["steady_recompiles"]),
                ]
            ],
        )
    )
    print("\n## First call (compile included), seconds\n")
    print(table(list(WAYS), [[f"{m['first_call_s'][w]:.2f}" for w in WAYS]]))
    checks = m["checks"]
    print(
        "\nchecks (max abs difference against the usual loop's run; training moved the "
        f"parameters by up to {checks['usual_moved_max_abs']:.2e}):"
    )
    for name in ("eqfit", "scan"):
        c = checks[f"{name}_vs_usual"]
        print(f"  {name}: parameters {c['params_max_abs']:.2e}, state {c['state_max_abs']:.2e}")
    return {"us_per_step": per_step, "floor_way": floor_way, "ratios": ratios, **m}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 repeats, 256 samples")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1024, help="a multiple of 32")
    default_out = Path(__file__).parent / "results" / "gan.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    num_samples = 256 if args.quick else args.samples
    inner = 1 if args.quick else 3

    start = time.perf_counter()
    load_before = load_average()
    events = CompileEvents()
    problem = Problem(num_samples, args.epochs)
    print(f"first calls, warm-up, {repeats} repeats...", file=sys.stderr)
    measured = measure(problem, repeats, inner, events)

    example = EXAMPLE
    cfg = {
        **config(),
        "optimizers": f"optax.adam({LEARNING_RATE}, b1={B1}), twice",
        "model": f"examples/gan.py, latent {example.LATENT}, features {example.FEATURES}, "
        f"{example.SIZE}x{example.SIZE}",
        "parameters": sum(
            x.size for x in jax.tree.leaves(eqx.filter(problem.model, eqx.is_inexact_array))
        ),
        "num_samples": problem.num_samples,
        "epochs": problem.epochs,
        "steps": problem.steps,
        "batch_size": BATCH_SIZE,
        "repeats": repeats,
        "inner_runs_per_sample": inner,
        "quick": args.quick,
    }
    print("\n# gan\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); {cfg['model']}, "
        f"{cfg['parameters']:,} parameters; {cfg['optimizers']}; N={problem.num_samples}, "
        f"batch {BATCH_SIZE}, {problem.epochs} epochs ({problem.steps} steps); "
        f"repeats={repeats} (each the median of {inner} runs), ways interleaved in one process"
    )
    results: dict[str, Any] = report(problem, measured)
    results["config"] = cfg
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
