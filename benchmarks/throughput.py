"""Throughput as it happened: each epoch's `epoch_seconds` against a hand-written reference,
for epochs short enough that one call of eqfit's program holds several, and long enough
to get a call each.

Cases (Adam(1e-3), a new shuffle every epoch):

- `mlp`: the benchmark MLP 16->64->64->1 (`fit_speed.py`'s), MSE, N=8192, batch 32: 256
  steps of tens of µs an epoch, 20 epochs.
- `mlp_short`: the same with `steps_per_epoch=16`: 80 epochs, dozens in a call.
- `mlp_validated`: `mlp` with 2^20 validation samples evaluated every other epoch
  (`validation_freq=2`): epochs of two costs, long enough on average for a call each.
- `vae`: a VAE of MLPs, 784->256->2x16 and 16->256->784, Bernoulli likelihood, its key
  drawn per step, N=2048, batch 128: 16 steps of milliseconds an epoch, 12 epochs.

Each case is planned (`eqfit.plan`) and fitted once, so that the timed fits compile
nothing and know their speed (calls of about half a second from the first). Then, in
turn, `--repeats` times: one `fit`, timed on the host from the call to its return, and
the reference, a hand-written `jax.jit` of a `lax.scan` over passes over the data, each
shuffled once (eqfit's shuffle) and a `lax.scan` over its steps (the same model,
optimizer and batches), `--reference-epochs` passes in one call timed on the host, so
that its dispatch counts for little: its time per epoch (a pass's over the epochs in it)
is what each epoch's device work takes. A validation's cost is that of a `fit`
validating every epoch over one that never does, timed on the host, per epoch.

Reported per case: calls per fit and epochs per call; the median of eqfit's epoch
seconds and the reference's, and their ratio; the 10th to 90th percentile and the
extremes of each epoch's seconds over the reference (every epoch of every repeat: each
epoch's own figure, not its share of a call); the sum of each fit's epoch seconds over
its wall time; and the largest MFU of any epoch, against the FLOP/s of a 2048x2048
float32 matmul measured here (the most this device gives, so no epoch may pass 1). Last,
what timing each epoch from inside the program would cost: the `mlp` reference with an
`io_callback` that reads the host's clock at each epoch's end, against it without.

    python benchmarks/throughput.py [--repeats 5] [--quick] [--cases mlp,vae] [--out PATH]

It runs against any eqfit on `PYTHONPATH` (calls are counted as its `Throughput` records
them), so an older one's figures print the same way.
"""

import argparse
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
    config,
    load_average,
    median,
    regression_data,
    table,
    write_json,
)
from jax.experimental import io_callback

import eqfit
import eqfit._host._observers
from eqfit._core._data import epoch_order, shuffle_seed


CASES = ("mlp", "mlp_short", "mlp_validated", "vae")


class Case:
    """A run to time: the model, data, `fit`'s arguments, and the reference's pieces."""

    def __init__(
        self,
        model: Any,
        data: tuple[jax.Array, ...],
        loss: Callable[..., Any],
        batch_size: int,
        epochs: int,
        steps_per_epoch: int | None = None,
        val_data: tuple[jax.Array, ...] | None = None,
    ):
        self.model, self.data, self.loss = model, data, loss
        self.batch_size, self.epochs = batch_size, epochs
        n = data[0].shape[0]
        self.steps = steps_per_epoch or n // batch_size
        self.val_data = val_data
        self.optimizer = optax.adam(1e-3)
        self.arguments: dict[str, Any] = dict(
            loss=loss,
            optimizer=self.optimizer,
            key=jax.random.key(1),
            epochs=epochs,
            batch_size=batch_size,
        )
        if steps_per_epoch is not None:
            self.arguments["steps_per_epoch"] = steps_per_epoch
        if val_data is not None:
            self.arguments.update(validation_data=val_data, validation_freq=2)


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return eqfit.losses.mse(model, x, y)


class VAE(eqx.Module):
    encoder: eqx.nn.MLP
    decoder: eqx.nn.MLP
    latent: int = eqx.field(static=True)

    def __init__(self, features: int, width: int, latent: int, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.encoder = eqx.nn.MLP(features, 2 * latent, width, 1, key=k1)
        self.decoder = eqx.nn.MLP(latent, features, width, 1, key=k2)
        self.latent = latent


def vae_loss(model: VAE, x: jax.Array, *, key: jax.Array) -> jax.Array:
    """The negative ELBO per sample, a Bernoulli likelihood of the pixels."""

    def one(x: jax.Array, key: jax.Array) -> jax.Array:
        mean, log_var = jnp.split(model.encoder(x), 2)
        z = mean + jnp.exp(0.5 * log_var) * jax.random.normal(key, mean.shape)
        logits = model.decoder(z)
        nll = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, x))
        kl = 0.5 * jnp.sum(jnp.exp(log_var) + mean**2 - 1.0 - log_var)
        return nll + kl

    return jnp.mean(jax.vmap(one)(x, jax.random.split(key, x.shape[0])))


def make_case(name: str) -> Case:
    if name == "vae":
        rng = np.random.default_rng(0)
        x = jnp.asarray((rng.random((2048, 784)) < 0.3).astype(np.float32))
        return Case(VAE(784, 256, 16, key=jax.random.key(0)), (x,), vae_loss, 128, 12)
    x, y = regression_data(8192, 16)
    data = (jnp.asarray(x), jnp.asarray(y))
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    if name == "mlp":
        return Case(model, data, mse, 32, 20)
    if name == "mlp_validated":
        vx, vy = regression_data(2**20, 16, seed=1)
        return Case(model, data, mse, 32, 20, val_data=(jnp.asarray(vx), jnp.asarray(vy)))
    return Case(model, data, mse, 32, 80, steps_per_epoch=16)


def make_reference(case: Case, epochs: int, clock: bool = False) -> Callable[[], Any]:
    """`epochs` passes of the case's steps in one jitted scan, as a function that runs
    them and waits (its `epochs`: the epochs they hold). With `clock`, each pass ends
    by reading the host's clock through an `io_callback` (the epoch's loss its operand,
    the reading kept in the output), as a program that timed its own epochs would.
    """
    params, static = eqx.partition(case.model, eqx.is_inexact_array)
    opt_state = case.optimizer.init(params)
    n, b = case.data[0].shape[0], case.batch_size
    # Shorter epochs than a pass over the data share its shuffle, as eqfit's do: the
    # reference runs whole passes, `per_pass` epochs each.
    steps = n // b
    per_pass = steps // case.steps
    takes_key = case.loss is vae_loss

    def loss(p: Any, batch: tuple[jax.Array, ...], key: jax.Array) -> jax.Array:
        model = eqx.combine(p, static)
        return case.loss(model, *batch, key=key) if takes_key else case.loss(model, *batch)

    @jax.jit
    def train(p: Any, opt_state: Any, key: jax.Array) -> Any:
        seed = shuffle_seed(key)

        def epoch(carry: Any, e: jax.Array) -> Any:
            order = epoch_order(seed, e, n, True)[: steps * b].reshape(steps, b)

            def step(carry: Any, i: jax.Array) -> Any:
                p, opt_state = carry
                batch = tuple(a[order[i]] for a in case.data)
                value, grads = jax.value_and_grad(loss)(p, batch, jax.random.fold_in(key, i))
                updates, opt_state = case.optimizer.update(grads, opt_state, p)
                return (optax.apply_updates(p, updates), opt_state), value

            carry, losses = jax.lax.scan(step, carry, jnp.arange(steps))
            if not clock:
                return carry, losses
            read = io_callback(_now, jax.ShapeDtypeStruct((), jnp.float32), losses[-1])
            return carry, (losses, read)

        return jax.lax.scan(epoch, (p, opt_state), jnp.arange(epochs))

    def run_train() -> Any:
        return jax.block_until_ready(train(params, opt_state, jax.random.key(1)))

    run_train.epochs = epochs * per_pass  # pyright: ignore

    return run_train


def _now(after: Any) -> np.ndarray:
    del after
    return np.float32(time.perf_counter() % 1000)


def callback_cost(repeats: int) -> dict[str, float]:
    """The `mlp` case's hand-written run of 20 passes with and without a host callback at
    each pass's end, interleaved: the median seconds of each, and their ratio.
    """
    case = make_case("mlp")
    runs = {"plain": make_reference(case, 20), "clock": make_reference(case, 20, clock=True)}
    for run in runs.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats):
        for name in list(runs)[i % 2 :] + list(runs)[: i % 2]:
            samples[name].append(_timed(runs[name]))
    plain, clocked = median(samples["plain"]), median(samples["clock"])
    paired = median([c / p for c, p in zip(samples["clock"], samples["plain"])])
    return {"plain_s": plain, "clock_s": clocked, "ratio": clocked / plain, "paired": paired}


def matmul_flops() -> float:
    """FLOP/s of a 2048x2048 float32 matmul here, the best of 5: the device's most."""
    a = jnp.ones((2048, 2048), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(a))
    best = min(_timed(lambda: jax.block_until_ready(f(a))) for _ in range(5))
    return 2 * 2048**3 / best


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class CallCounter:
    """Counts the calls that ran steps, as eqfit's `Throughput` records them."""

    def __init__(self) -> None:
        self.calls = 0
        throughput = eqfit._host._observers.Throughput
        original = throughput.record

        def record(inner: Any, begin: int, end: int, seconds: float) -> None:
            self.calls += end > begin
            original(inner, begin, end, seconds)

        throughput.record = record  # pyright: ignore


def measure(name: str, repeats: int, reference_epochs: int, peak: float, counter: CallCounter):
    case = make_case(name)
    arguments = dict(case.arguments, peak_flops=peak)
    eqfit.plan(case.model, case.data, **arguments)
    eqfit.fit(case.model, case.data, **arguments)  # its speed measured: calls of ~0.5 s
    run_train = make_reference(case, reference_epochs)
    run_train()
    # Validation's cost, without a clock of eqfit's: a fit that validates every epoch
    # against one that never does, timed on the host, over the epochs.
    every = dict(arguments, validation_freq=1)
    never = {k: v for k, v in arguments.items() if k not in ("validation_data", "validation_freq")}
    if case.val_data is not None:
        for a in (every, never):
            eqfit.plan(case.model, case.data, **a)
            eqfit.fit(case.model, case.data, **a)
    fits: list[dict[str, Any]] = []
    train_s, val_s = [], []
    for _ in range(repeats):
        before = counter.calls
        start = time.perf_counter()
        history = eqfit.fit(case.model, case.data, **arguments).history
        wall = time.perf_counter() - start
        figures = history.throughput
        fits.append(
            {
                "wall_s": wall,
                "calls": counter.calls - before if counter.calls >= 0 else None,
                "epoch_seconds": figures["epoch_seconds"].tolist(),
                "mfu": figures["mfu"].tolist() if "mfu" in figures else None,
            }
        )
        train_s.append(_timed(run_train) / run_train.epochs)  # pyright: ignore
        if case.val_data is not None:
            walls = [
                _timed(lambda a=a: eqfit.fit(case.model, case.data, **a)) for a in (every, never)
            ]
            val_s.append((walls[0] - walls[1]) / case.epochs)
    return case, fits, train_s, val_s


def summarise(name: str, case: Case, fits: list[dict], train_s: list[float], val_s: list[float]):
    seconds = np.array([f["epoch_seconds"] for f in fits])  # (repeats, epochs)
    train = median(train_s)
    if val_s:  # epochs 2, 4, ... validate
        validates = (np.arange(1, case.epochs + 1) % 2) == 0
        reference = np.where(validates, train + median(val_s), train)
    else:
        reference = np.full(case.epochs, train)
    ratios = (seconds / reference).reshape(-1)
    mfu = [m for f in fits if f["mfu"] is not None for m in f["mfu"]]
    calls = [f["calls"] for f in fits if f["calls"] is not None]
    return {
        "case": name,
        "steps_per_epoch": case.steps,
        "epochs": case.epochs,
        "calls_per_fit": median(calls) if calls else None,
        "eqfit_epoch_s_median": float(np.median(seconds)),
        "reference_epoch_s": float(np.median(reference)),
        "reference_train_epoch_s": train,
        "reference_val_s": median(val_s) if val_s else None,
        "ratio_median": float(np.median(ratios)),
        "ratio_p10": float(np.percentile(ratios, 10)),
        "ratio_p90": float(np.percentile(ratios, 90)),
        "ratio_min": float(ratios.min()),
        "ratio_max": float(ratios.max()),
        "sum_over_wall": median([float(np.sum(f["epoch_seconds"])) / f["wall_s"] for f in fits]),
        "max_mfu": max(mfu) if mfu else None,
        "validated_over_trained": float(np.median(seconds[:, 1::2]) / np.median(seconds[:, 2::2]))
        if val_s
        else None,
        "fits": fits,
        "reference_train_s": train_s,
        "reference_val_s_all": val_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed fits per case")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 repeats")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    parser.add_argument("--reference-epochs", type=int, default=8, help="passes per reference call")
    default_out = Path(__file__).parent / "results" / "throughput.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    start = time.perf_counter()
    load_before = load_average()
    peak = matmul_flops()
    counter = CallCounter()
    rows, results = [], []
    for name in args.cases.split(","):
        print(f"{name}...", file=sys.stderr)
        case, fits, train_s, val_s = measure(name, repeats, args.reference_epochs, peak, counter)
        s = summarise(name, case, fits, train_s, val_s)
        results.append(s)
        per_call = "-" if not s["calls_per_fit"] else f"{s['epochs'] / s['calls_per_fit']:.1f}"
        rows.append(
            [
                name,
                str(s["steps_per_epoch"]),
                "-" if s["calls_per_fit"] is None else f"{s['calls_per_fit']:.0f}",
                per_call,
                f"{s['eqfit_epoch_s_median'] * 1e3:.2f}",
                f"{s['reference_epoch_s'] * 1e3:.2f}",
                f"{s['ratio_median']:.3f}",
                f"{s['ratio_p10']:.2f}-{s['ratio_p90']:.2f}",
                f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}",
                f"{s['sum_over_wall']:.3f}",
                "-" if s["max_mfu"] is None else f"{s['max_mfu']:.3f}",
            ]
        )
    cfg = {
        **config(),
        "repeats": repeats,
        "reference_epochs": args.reference_epochs,
        "peak_flops": peak,
    }
    print("\n# throughput\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs), eqfit from "
        f"{cfg['eqfit_path']}; {repeats} fits per case; peak {peak / 1e9:.1f} GFLOP/s "
        "(a 2048x2048 float32 matmul)\n"
    )
    header = [
        "case",
        "steps/epoch",
        "calls/fit",
        "epochs/call",
        "epoch ms",
        "reference ms",
        "ratio",
        "p10-p90",
        "min-max",
        "Σ epochs / wall",
        "max MFU",
    ]
    print(table(header, rows))
    for s in results:
        if s["validated_over_trained"] is not None:
            reference = (s["reference_train_epoch_s"] + s["reference_val_s"]) / s[
                "reference_train_epoch_s"
            ]
            print(
                f"\n{s['case']}: a validated epoch over one that is not, median: "
                f"{s['validated_over_trained']:.2f} (reference {reference:.2f})"
            )
    cost = callback_cost(max(7, repeats))
    print(
        "\nA host callback at each epoch's end of the hand-written `mlp` run (20 epochs, "
        f"interleaved): {cost['clock_s'] * 1e3:.1f} ms against {cost['plain_s'] * 1e3:.1f} ms "
        f"without, {cost['ratio']:.3f}x (paired {cost['paired']:.3f}x): eqfit reads no clock "
        "inside its program."
    )
    elapsed = time.perf_counter() - start
    print(
        f"\ntotal wall time {elapsed:.0f} s; 1-min load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    write_json(
        args.out,
        {
            "cases": results,
            "callback_cost": cost,
            "config": cfg,
            "total_wall_s": elapsed,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
    )


if __name__ == "__main__":
    main()
