"""Speed of `eqfit.fit` per model family, against a hand-written scan and the usual loop.

For five small model families, each trained with `optax.adam(1e-3)` on synthetic (or, for
the transformer, Python's own documentation) data with a new shuffle every epoch, it
measures the steady time per training step three ways:

1. `eqfit`: `eqfit.fit(model, (x, y), loss=..., optimizer=optax.adam(1e-3), key=...,
   epochs=E, batch_size=B)`: the whole run as one XLA program. Timed from the second
   call on, with the same model and optimizer objects, so that nothing recompiles;
   nothing is subtracted (its host work per call is in the time).
2. `scan`: a hand-written `jax.jit` of a `lax.scan` over epochs of a `lax.scan` over the
   epoch's batches, shuffled by `jax.random.permutation` each epoch, each batch gathered
   inside the scan; `eqx.partition`/`combine`, the same loss function.
3. `usual`: a Python `for` over epochs and batches calling one `eqx.filter_jit` step; the
   epoch's permutation made on the device, and each batch sliced from the device arrays
   by its index inside the jitted step (the index a device scalar made once, no numpy
   slicing on the host); dispatched asynchronously, blocking once at the run's end.

The families (all float32, batch 32, one epoch unless said):

- `mlp`: `eqfit.models.MLP(16, "scalar", 64, 2)`, MSE, N=8192, 5 epochs (the benchmarks'
  MLP, as in fit_speed.py).
- `cnn`: `Conv2d` 1->32->32, 3x3, padding 1, relu, a mean over the 16x16 pixels and a
  `Linear` to 10 classes; softmax cross-entropy; N=1024 random images, random labels.
- `gru`: `SpiralClassifier` of examples/spirals_gru.py (a `GRUCell` 2->16 scanned over 24
  points, a `Linear` to 2 classes), imported from there; N=2048 spirals, 4 epochs.
- `transformer`: `TransformerLM` of examples/transformer_lm.py, imported from there, at a
  smaller size (context 32, width 32, 4 heads, 2 layers, 96 characters), its own
  next-character loss; N=2048 windows of the Python Language Reference.
- `autoencoder`: a DCGAN-sized pair of conv nets trained as one loss: a conv autoencoder
  on 16x16 images, the encoder a DCGAN discriminator's body (`Conv2d` 1->32->64, 4x4,
  stride 2, leaky relu) and the decoder a DCGAN generator's (`ConvTranspose2d`
  64->32->1, 4x4, stride 2, relu then tanh); MSE against tanh of the input image (in
  the decoder's range); N=1024 random images.

The three ways of a family are timed in one process, interleaved (A B C, the order
rotated each repeat, each preceded by one untimed run), each sample the median of 3
back-to-back runs (one run for a family whose runs take half a second or more), reported as
medians over repeats: µs per step and the ratios eqfit/scan, eqfit/usual and eqfit /
min(scan, usual), the "floor". The first call of each way (compile included) is timed
apart, before the warm-up. A JAX compile-event listener checks that the timed loop
compiled nothing. On XLA's CPU backend a convolution inside a `while` body is compiled to
a naive loop (jax issue #12868), so on a CPU the two conv families are expected to run
several times slower in `eqfit` and `scan` than in the usual loop.

With `--guards`, only eqfit, two ways: as `fit` chooses (no NaN guard where a non-finite
step can be replayed; on a CPU, a small step's operations ordered for memory: the table
says which) against with the guard's `cond` around each update (`guard=True`, XLA's
default order), interleaved: `default/guard`, the ratio of medians.

    python benchmarks/model_families.py [--repeats 5] [--quick] [--families cnn,gru]
        [--guards] [--out PATH]
"""

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    interleave,
    load_average,
    median,
    regression_data,
    table,
    timed,
)

import eqfit


LEARNING_RATE = 1e-3
BATCH_SIZE = 32
IMAGE = 16  # images are IMAGE x IMAGE, one channel
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

Data = tuple[jax.Array, jax.Array]
Loss = Callable[..., jax.Array]
Run = Callable[[], Any]  # one full training run; blocks until the device is done


def import_examples() -> tuple[ModuleType, ModuleType]:
    """examples/spirals_gru.py and examples/transformer_lm.py, as modules.

    The transformer example asks JAX for 8 simulated CPU devices as it is imported; the
    setting is put back before JAX starts, so that every way here runs on one device.
    Its model reads its sizes from module globals when built: they are made smaller here.
    """
    sys.path.insert(0, str(EXAMPLES))
    devices = jax.config.jax_num_cpu_devices
    import spirals_gru
    import transformer_lm

    jax.config.update("jax_num_cpu_devices", devices)
    transformer_lm.CONTEXT, transformer_lm.WIDTH = 32, 32
    transformer_lm.HEADS, transformer_lm.LAYERS = 4, 2
    return spirals_gru, transformer_lm


# ---------------------------------------------------------------------------------------
# The families


class CNN(eqx.Module):
    """Two 3x3 convolutions 1->32->32 with relu, a mean over the pixels, 10 logits."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 32, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(32, 32, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(32, 10, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
        return self.head(jnp.mean(h, axis=(1, 2)))


class ConvAutoencoder(eqx.Module):
    """A DCGAN discriminator's conv body as the encoder, a generator's as the decoder."""

    down1: eqx.nn.Conv2d
    down2: eqx.nn.Conv2d
    up1: eqx.nn.ConvTranspose2d
    up2: eqx.nn.ConvTranspose2d

    def __init__(self, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.down1 = eqx.nn.Conv2d(1, 32, 4, stride=2, padding=1, key=k1)  # 16 -> 8
        self.down2 = eqx.nn.Conv2d(32, 64, 4, stride=2, padding=1, key=k2)  # 8 -> 4
        self.up1 = eqx.nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1, key=k3)  # 4 -> 8
        self.up2 = eqx.nn.ConvTranspose2d(32, 1, 4, stride=2, padding=1, key=k4)  # 8 -> 16

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.leaky_relu(self.down2(jax.nn.leaky_relu(self.down1(x), 0.2)), 0.2)
        return jnp.tanh(self.up2(jax.nn.relu(self.up1(h))))


@dataclass
class Family:
    name: str
    description: str
    model: Any
    data: Data
    loss: Loss
    epochs: int

    @property
    def num_samples(self) -> int:
        return int(self.data[0].shape[0])

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // BATCH_SIZE  # every N here divides by 32: no remainder

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch


def images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 1, IMAGE, IMAGE)).astype(np.float32)


def make_families(gru: ModuleType, lm: ModuleType, names: list[str], quick: bool) -> list[Family]:
    """The families named, their data on the device. Sized so that a steady run of each
    way takes from about 50 ms to 3 s on a 2-core CPU (a quarter of the conv families',
    the GRU's and the transformer's data with `--quick`).
    """
    key = jax.random.key(0)
    scale = 4 if quick else 1

    def mlp() -> Family:
        x, y = regression_data(8192, 16, seed=0)
        model = eqfit.models.MLP(16, "scalar", 64, 2, key=key)
        return Family("mlp", "MLP 16-64-64-1, MSE", model, (x, y), eqfit.losses.mse, 5)

    def cnn() -> Family:
        n = 1024 // scale
        y = np.random.default_rng(1).integers(0, 10, n).astype(np.int32)
        desc = "Conv2d 1-32-32 3x3, mean-pool, Linear 10; 16x16; softmax CE"
        loss = eqfit.losses.softmax_cross_entropy
        return Family("cnn", desc, CNN(key), (images(n, 0), y), loss, 1)

    def spirals() -> Family:
        x, y = gru.spirals(np.random.default_rng(0), 2048 // scale)
        desc = f"GRUCell 2-{gru.HIDDEN} over {gru.LENGTH} points, Linear 2; softmax CE"
        model = gru.SpiralClassifier(key)
        return Family("gru", desc, model, (x, y), eqfit.losses.softmax_cross_entropy, 4)

    def transformer() -> Family:
        x, y = lm.windows(lm.encode(lm.load_text()), stride=lm.CONTEXT)
        n = 2048 // scale
        desc = (
            f"TransformerLM ctx {lm.CONTEXT}, width {lm.WIDTH}, {lm.HEADS} heads, "
            f"{lm.LAYERS} layers; next-char CE"
        )
        return Family("transformer", desc, lm.TransformerLM(key), (x[:n], y[:n]), lm.loss, 1)

    def autoencoder() -> Family:
        x = images(1024 // scale, 2)
        desc = "conv autoencoder: Conv2d 1-32-64 4x4/2, ConvT 64-32-1; MSE"
        model = ConvAutoencoder(key)
        return Family("autoencoder", desc, model, (x, np.tanh(x)), eqfit.losses.mse, 1)

    builders: dict[str, Callable[[], Family]] = dict(
        mlp=mlp, cnn=cnn, gru=spirals, transformer=transformer, autoencoder=autoencoder
    )
    families = []
    for name in names:
        family = builders[name]()
        family.data = (jnp.asarray(family.data[0]), jnp.asarray(family.data[1]))
        families.append(family)
    return families


FAMILIES = ("mlp", "cnn", "gru", "transformer", "autoencoder")


# ---------------------------------------------------------------------------------------
# The three ways


def make_scan(family: Family, optimizer: optax.GradientTransformation) -> Run:
    """A jitted whole run: a `lax.scan` over epochs of a `lax.scan` over batches."""
    params, static = eqx.partition(family.model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    n, steps, epochs = family.num_samples, family.steps_per_epoch, family.epochs
    x, y = family.data
    key = jax.random.key(0)

    def loss_fn(p: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        return family.loss(eqx.combine(p, static), xb, yb)

    @jax.jit
    def train(p: Any, opt_state: Any, x: jax.Array, y: jax.Array, key: jax.Array) -> Any:
        def epoch(carry: Any, e: jax.Array) -> Any:
            def step(carry: Any, idx: jax.Array) -> Any:
                p, opt_state = carry
                loss, grads = jax.value_and_grad(loss_fn)(p, x[idx], y[idx])
                updates, opt_state = optimizer.update(grads, opt_state, p)
                return (optax.apply_updates(p, updates), opt_state), loss

            order = jax.random.permutation(jax.random.fold_in(key, e), n)
            return jax.lax.scan(step, carry, order[: steps * BATCH_SIZE].reshape(steps, -1))

        return jax.lax.scan(epoch, (p, opt_state), jnp.arange(epochs))

    return lambda: jax.block_until_ready(train(params, opt_state, x, y, key))


def make_usual(family: Family, optimizer: optax.GradientTransformation) -> Run:
    """Python loops over epochs and batches, one `eqx.filter_jit` step per batch."""
    n, steps, epochs = family.num_samples, family.steps_per_epoch, family.epochs
    x, y = family.data
    key = jax.random.key(0)
    model = family.model
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    # The batch indices as device scalars, made once: a Python int would be a static
    # argument of `filter_jit` (a compile per batch), a fresh array a transfer per step.
    indices = [jnp.asarray(i, jnp.int32) for i in range(steps)]

    @jax.jit
    def shuffle(key: jax.Array, e: int) -> jax.Array:
        order = jax.random.permutation(jax.random.fold_in(key, e), n)
        return order[: steps * BATCH_SIZE].reshape(steps, BATCH_SIZE)

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, order: jax.Array, i: jax.Array) -> Any:
        idx = order[i]
        loss, grads = eqx.filter_value_and_grad(family.loss)(model, x[idx], y[idx])
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    def run() -> Any:
        m, s = model, opt_state
        losses = []
        for e in range(epochs):
            order = shuffle(key, e)
            for i in indices:
                m, s, loss = step(m, s, order, i)
                losses.append(loss)  # kept on the device: no sync per step
        return jax.block_until_ready((m, s, losses))

    return run


def make_eqfit(
    family: Family, optimizer: optax.GradientTransformation, execution: Any = "auto"
) -> Run:
    key = jax.random.key(0)

    def run() -> eqfit.FitResult:
        # `fit` reads its history back before it returns: nothing is left in flight.
        return eqfit.fit(
            family.model,
            family.data,
            loss=family.loss,
            optimizer=optimizer,
            key=key,
            epochs=family.epochs,
            batch_size=BATCH_SIZE,
            execution=execution,
        )

    return run


WAYS = ("eqfit", "scan", "usual")


def make_runs(family: Family) -> dict[str, Run]:
    """The three ways, each with its own `optax.adam` object, kept for every call."""
    return {
        "eqfit": make_eqfit(family, optax.adam(LEARNING_RATE)),
        "scan": make_scan(family, optax.adam(LEARNING_RATE)),
        "usual": make_usual(family, optax.adam(LEARNING_RATE)),
    }


# ---------------------------------------------------------------------------------------
# Timing


def measure(family: Family, repeats: int, inner: int, events: CompileEvents) -> dict[str, Any]:
    """First calls, then the interleaved steady state, of one family's three ways."""
    runs = make_runs(family)
    first: dict[str, float] = {}
    for name, run in runs.items():
        first[name] = timed(run)
    steady: dict[str, float] = {}
    for name, run in runs.items():  # warm-up: caches, allocator, thread pools
        run()
        steady[name] = timed(run)
    # Runs of half a second or more are already averages over many steps: one a sample.
    inner = 1 if max(steady.values()) >= 0.5 else inner
    events.reset()
    samples: dict[str, list[float]] = {name: [] for name in WAYS}
    for r in range(repeats):
        order = list(WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)])
        for name in order:
            runs[name]()  # untimed: the first run after another workload is slower
            samples[name].append(median([timed(runs[name]) for _ in range(inner)]))
    recompiles = events.backend_compiles()
    print(f"  {family.name}: done", file=sys.stderr)
    return {
        "first_call_s": first,
        "runs_s": samples,
        "inner_runs_per_sample": inner,
        "steady_recompiles": recompiles,
    }


# ---------------------------------------------------------------------------------------
# The NaN guard (`--guards`)


def measure_guards(families: list[Family], repeats: int, inner: int) -> dict[str, Any]:
    """Each family as `fit` runs it by default (no NaN guard where a non-finite step can
    be replayed; on a CPU, a small step's operations ordered for memory) against with the
    guard (`guard=True`, XLA's default order), interleaved; prints the table and returns
    the numbers.
    """
    results, rows = {}, []
    for family in families:
        planned = eqfit.plan(
            family.model,
            family.data,
            loss=family.loss,
            optimizer=optax.adam(LEARNING_RATE),
            key=jax.random.key(0),
            epochs=family.epochs,
            batch_size=BATCH_SIZE,
        )
        chosen = planned.execution
        if isinstance(chosen, eqfit.PerStep):
            guarded: Any = eqfit.PerStep(chosen.unroll, guard=True)
        else:
            guarded = eqfit.WholeRun(guard=True)
        runs = {
            "default": make_eqfit(family, optax.adam(LEARNING_RATE)),
            "guard": make_eqfit(family, optax.adam(LEARNING_RATE), guarded),
        }
        medians = interleave(runs, repeats, inner)
        per_step = {way: us(seconds, family.steps) for way, seconds in medians.items()}
        small = "small step" in planned.execution_why
        ratio = per_step["default"] / per_step["guard"]
        results[family.name] = {
            "us_per_step": per_step,
            "default/guard": ratio,
            "ordered_for_memory": small,
            "execution_why": planned.execution_why,
        }
        cells = [f"{per_step['default']:,.1f}", f"{per_step['guard']:,.1f}", f"{ratio:.3f}"]
        rows.append([family.name, "yes" if small else "no", *cells])
        print(f"  {family.name}: done", file=sys.stderr)
    print("\n## The NaN guard (`--guards`): µs per step, as `fit` chooses and with the guard\n")
    header = ["family", "ordered for memory", "default µs", "guard µs", "default/guard"]
    print(table(header, rows))
    return results


# ---------------------------------------------------------------------------------------
# Report


def us(seconds: float, steps: int) -> float:
    return seconds / steps * 1e6


def report(families: list[Family], measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prints the tables and returns the same numbers for the JSON file."""
    results: dict[str, Any] = {}
    rows, ratio_rows, first_rows = [], [], []
    for family in families:
        m = measured[family.name]
        steps = family.steps
        per_step = {w: us(median(m["runs_s"][w]), steps) for w in WAYS}
        floor_way = min(("scan", "usual"), key=lambda w: per_step[w])

        def paired(b: str) -> float:
            return median([a / c for a, c in zip(m["runs_s"]["eqfit"], m["runs_s"][b])])

        # The floor, repeat by repeat: the faster of the two baselines in each repeat.
        floors = [min(s, u) for s, u in zip(m["runs_s"]["scan"], m["runs_s"]["usual"])]
        ratios = {
            "eqfit/scan": per_step["eqfit"] / per_step["scan"],
            "eqfit/usual": per_step["eqfit"] / per_step["usual"],
            "eqfit/floor": per_step["eqfit"] / per_step[floor_way],
            "eqfit/scan_paired": paired("scan"),
            "eqfit/usual_paired": paired("usual"),
            "eqfit/floor_paired": median([a / f for a, f in zip(m["runs_s"]["eqfit"], floors)]),
        }
        results[family.name] = {
            "description": family.description,
            "num_samples": family.num_samples,
            "batch_size": BATCH_SIZE,
            "epochs": family.epochs,
            "steps": steps,
            "parameters": sum(
                x.size for x in jax.tree.leaves(eqx.filter(family.model, eqx.is_inexact_array))
            ),
            "us_per_step": per_step,
            "floor_way": floor_way,
            "ratios": ratios,
            **m,
        }
        rows.append(
            [
                family.name,
                str(steps),
                *(f"{per_step[w]:,.1f}" for w in WAYS),
                f"{ratios['eqfit/scan']:.3f}",
                f"{ratios['eqfit/usual']:.3f}",
                f"{ratios['eqfit/floor']:.3f} ({floor_way})",
            ]
        )
        ratio_rows.append(
            [
                family.name,
                f"{ratios['eqfit/scan_paired']:.3f}",
                f"{ratios['eqfit/usual_paired']:.3f}",
                f"{ratios['eqfit/floor_paired']:.3f}",
                " ".join(
                    f"{w} {min(m['runs_s'][w]) * 1e3:,.1f}–{max(m['runs_s'][w]) * 1e3:,.1f}"
                    for w in WAYS
                ),
                str(m["steady_recompiles"]),
            ]
        )
        first_rows.append(
            [family.name, *(f"{m['first_call_s'][w]:.2f}" for w in WAYS)]
            + [f"{median(m['runs_s'][w]) * 1e3:,.1f}" for w in WAYS]
        )

    print("\n## Families\n")
    print(
        table(
            ["family", "what", "params", "N", "epochs", "steps"],
            [
                [
                    f.name,
                    f.description,
                    f"{results[f.name]['parameters']:,}",
                    str(f.num_samples),
                    str(f.epochs),
                    str(f.steps),
                ]
                for f in families
            ],
        )
    )
    print("\n## Steady state: µs per step (medians over repeats) and ratios of medians\n")
    print("(floor = min(scan, usual); eqfit must eventually be ≤ 1.05× it)\n")
    header = ["family", "steps", "eqfit µs", "scan µs", "usual µs", "eqfit/scan"]
    print(table([*header, "eqfit/usual", "eqfit/floor"], rows))
    print("\n## Ratios as medians of paired (same-repeat) ratios, and the spread of runs\n")
    header = ["family", "eqfit/scan", "eqfit/usual", "eqfit/floor", "min–max ms per run"]
    print(table([*header, "compiles timed"], ratio_rows))
    print("\n## First call (compile included), seconds, against a steady run, ms\n")
    header = ["family", "eqfit first s", "scan first s", "usual first s"]
    print(table([*header, "eqfit ms", "scan ms", "usual ms"], first_rows))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 2 repeats, quarter-size data"
    )
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help=f"comma-separated, of {FAMILIES}"
    )
    parser.add_argument(
        "--guards",
        action="store_true",
        help="only eqfit as `fit` chooses against with the NaN guard (`guard=True`)",
    )
    default_out = Path(__file__).parent / "results" / "model_families.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    names = [n for n in args.families.split(",") if n]
    unknown = set(names) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; choose from {FAMILIES}")
    repeats = 2 if args.quick else args.repeats
    # Each sample the median of `inner` back-to-back runs (1 for runs of 0.5 s or more).
    inner = 1 if args.quick else 3

    gru, lm = import_examples()  # before JAX starts: see there
    start = time.perf_counter()
    load_before = load_average()
    events = CompileEvents()
    families = make_families(gru, lm, names, args.quick)
    if args.guards:
        guards = measure_guards(families, repeats, inner)
        results = {"guards": guards, "config": {**config(), "repeats": repeats}}
        finish(args.out, results, start, load_before)
        return
    measured = {}
    for family in families:
        print(f"{family.name}: first calls, warm-up, {repeats} repeats...", file=sys.stderr)
        measured[family.name] = measure(family, repeats, inner, events)

    cfg = {
        **config(),
        "optimizer": f"optax.adam({LEARNING_RATE})",
        "batch_size": BATCH_SIZE,
        "repeats": repeats,
        "inner_runs_per_sample": inner,
        "families": names,
        "quick": args.quick,
    }
    print("\n# model_families\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); {cfg['optimizer']}, "
        f"batch {BATCH_SIZE}, repeats={repeats} (each the median of {inner} runs, "
        "1 for families whose runs take 0.5 s or more), "
        "ways interleaved in one process"
    )
    results: dict[str, Any] = {"families": report(families, measured)}
    results["config"] = cfg
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
