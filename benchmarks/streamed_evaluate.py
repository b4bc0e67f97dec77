"""`eqfit.evaluate` and `eqfit.predict` over a memmap larger than a GiB, against hand loops
that slice the memmap and call a jitted evaluation: time and peak resident memory.

The data: 3,000,000 rows of 128 float32 features (1.43 GiB) and a float32 target, written
once to `.npy` files in a temporary folder and opened with `np.load(mmap_mode="r")`; a
smaller set with `--quick`. The model: `eqfit.models.MLP(128, "scalar", 32, 1)`, the loss
`eqfit.losses.mse`, batch 256. Variants, timed in one process, interleaved
(`_common.interleave`, A B A B with the order rotated each repeat):

1. `eqfit.evaluate(model, (x, y), loss=mse, batch_size=256)` on the memmaps.
2. The floor, `hand, chunked`: a Python loop over slices of 128 batches of the memmaps
   (`np.asarray(x[i:j])`, about eqfit's chunk of 32 MiB), each given to one `jax.jit`
   function that scans the loss over the slice's batches and returns their sum; the
   sums added on the device, read back once at the end. The last, smaller slice and
   batch are computed by the same function at their own shapes.
3. `hand, per batch`: a Python loop of a jitted loss per batch of 256, as a first hand
   loop is written.
4. `eqfit.predict(model, x, batch_size=256, out=...)` into a memmap opened for writing,
   against `hand predict`: a loop over the same slices calling a jitted `lax.map` of
   `jax.vmap(model)` over the slice's batches of 256 (the same work in the same batches),
   each slice's outputs written to a memmap.

5. With `--fit`, what a streamed validation set costs `fit`: two epochs on 8,192 rows of the
   same problem with `validation_data` the first 500,000 rows (244 MiB), as memmaps of
   their own against the same rows as arrays in memory (which the program holds).

Peak memory is the process's resident set (`VmHWM`, reset by writing 5 to
`/proc/self/clear_refs` before each measured run) above its resident size before the
run, in MiB, each variant run on memmaps opened afresh (a mapping's pages touched count
in the process's memory until it drops them; eqfit drops each chunk's once it is done).
The issue's targets: `evaluate` at most 1.10x the hand loop's time, and at most 0.5 GiB
above the process's memory before the call.

    python benchmarks/streamed_evaluate.py [--repeats 5] [--quick] [--fit] [--out PATH]
"""

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, finish, interleave, load_average, table

import eqfit


BATCH, FEATURES, SLICE = 256, 128, 128 * 256


def resident_mib() -> tuple[float, float]:
    """The process's resident set now and its peak since the last reset, in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return (int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024)


def peak_above(fn: Any, folder: Path) -> float:
    """MiB of resident memory that `fn(x, y)` added at its peak, on memmaps opened anew."""
    x, y = (np.load(folder / f"{name}.npy", mmap_mode="r") for name in "xy")
    Path("/proc/self/clear_refs").write_text("5")
    before, _ = resident_mib()
    fn(x, y)
    _, peak = resident_mib()
    return peak - before


def write_data(folder: Path, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The memmaps, written a block at a time (the whole never in memory)."""
    x = np.lib.format.open_memmap(folder / "x.npy", "w+", np.float32, (rows, FEATURES))
    y = np.lib.format.open_memmap(folder / "y.npy", "w+", np.float32, (rows,))
    rng = np.random.default_rng(0)
    w = rng.normal(size=FEATURES).astype(np.float32)
    for i in range(0, rows, 2**18):
        block = rng.normal(size=(min(2**18, rows - i), FEATURES)).astype(np.float32)
        x[i : i + len(block)] = block
        y[i : i + len(block)] = np.sin(block @ w / 4)
    x.flush()
    y.flush()
    del x, y
    return (
        np.load(folder / "x.npy", mmap_mode="r"),
        np.load(folder / "y.npy", mmap_mode="r"),
    )


def fit_runs(folder: Path, x: np.ndarray, y: np.ndarray, rows: int) -> dict[str, Any]:
    """`fit` for two epochs on 8,192 rows, validated on `rows` rows as memmaps of their own
    files, and as the same rows in memory.
    """
    np.save(folder / "xv.npy", np.asarray(x[:rows]))
    np.save(folder / "yv.npy", np.asarray(y[:rows]))
    streamed = tuple(np.load(folder / f"{n}v.npy", mmap_mode="r") for n in "xy")
    in_memory = (np.load(folder / "xv.npy"), np.load(folder / "yv.npy"))
    train = (np.asarray(x[-8192:]), np.asarray(y[-8192:]))
    model = eqfit.models.MLP(FEATURES, "scalar", 32, 1, key=jax.random.key(0))
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.adam(1e-3), key=jax.random.key(1))

    def run(validation: Any) -> Any:
        return lambda: eqfit.fit(
            model, train, validation_data=validation, epochs=2, batch_size=BATCH, **kwargs
        )

    return {"fit, memmap validation": run(streamed), "fit, validation in memory": run(in_memory)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fit", action="store_true", help="also time fit's validation")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/streamed_evaluate.json")
    )
    args = parser.parse_args()
    rows = 100_000 if args.quick else 3_000_000
    started, load = time.perf_counter(), load_average()
    folder = Path(tempfile.mkdtemp(prefix="eqfit-streamed-"))
    x, y = write_data(folder, rows)
    model = eqfit.models.MLP(FEATURES, "scalar", 32, 1, key=jax.random.key(0))
    loss = eqfit.losses.mse
    # The hand loops jit over the model's arrays, its static part closed over.
    params, static = eqx.partition(eqx.nn.inference_mode(model), eqx.is_inexact_array)

    @jax.jit
    def slice_sum(params: Any, xs: jax.Array, ys: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        full = xs.shape[0] // BATCH

        def add(total: jax.Array, batch: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            return total + loss(model, *batch) * BATCH, None

        shaped = (
            xs[: full * BATCH].reshape(full, BATCH, FEATURES),
            ys[: full * BATCH].reshape(full, BATCH),
        )
        total, _ = jax.lax.scan(add, jnp.zeros(()), shaped)
        if xs.shape[0] > full * BATCH:
            rest = xs.shape[0] - full * BATCH
            total = total + loss(model, xs[full * BATCH :], ys[full * BATCH :]) * rest
        return total

    @jax.jit
    def batch_sum(params: Any, xs: jax.Array, ys: jax.Array) -> jax.Array:
        return loss(eqx.combine(params, static), xs, ys) * xs.shape[0]

    @jax.jit
    def forward(params: Any, xs: jax.Array) -> jax.Array:
        model = jax.vmap(eqx.combine(params, static))
        full = xs.shape[0] // BATCH
        out = jax.lax.map(model, xs[: full * BATCH].reshape(full, BATCH, FEATURES))
        out = out.reshape(full * BATCH)
        if xs.shape[0] > full * BATCH:
            out = jnp.concatenate([out, model(xs[full * BATCH :])])
        return out

    def hand_chunked(x: np.ndarray = x, y: np.ndarray = y) -> float:
        total = jnp.zeros(())
        for i in range(0, rows, SLICE):
            total = total + slice_sum(
                params, np.asarray(x[i : i + SLICE]), np.asarray(y[i : i + SLICE])
            )
        return float(total) / rows

    def hand_per_batch(x: np.ndarray = x, y: np.ndarray = y) -> float:
        total = jnp.zeros(())
        for i in range(0, rows, BATCH):
            total = total + batch_sum(
                params, np.asarray(x[i : i + BATCH]), np.asarray(y[i : i + BATCH])
            )
        return float(total) / rows

    def with_eqfit(x: np.ndarray = x, y: np.ndarray = y) -> float:
        return eqfit.evaluate(model, (x, y), loss=loss, batch_size=BATCH)["loss"]

    out_eqfit = np.lib.format.open_memmap(folder / "p.npy", "w+", np.float32, (rows,))
    out_hand = np.lib.format.open_memmap(folder / "q.npy", "w+", np.float32, (rows,))

    def predict_eqfit(x: np.ndarray = x, y: np.ndarray = y) -> None:
        eqfit.predict(model, x, batch_size=BATCH, out=out_eqfit)

    def predict_hand(x: np.ndarray = x, y: np.ndarray = y) -> None:
        for i in range(0, rows, SLICE):
            out_hand[i : i + SLICE] = np.asarray(forward(params, np.asarray(x[i : i + SLICE])))

    values = {"eqfit": with_eqfit(), "hand, chunked": hand_chunked()}
    predict_eqfit()
    predict_hand()
    print(f"evaluate: eqfit {values['eqfit']:.6f}, hand {values['hand, chunked']:.6f}")
    print(f"predict: largest difference {np.abs(out_eqfit - out_hand).max():.2e}")
    # Memory first, each variant's first measured run after its warm-up above.
    peaks = {
        "eqfit": peak_above(with_eqfit, folder),
        "hand, chunked": peak_above(hand_chunked, folder),
        "eqfit predict": peak_above(predict_eqfit, folder),
        "hand predict": peak_above(predict_hand, folder),
    }
    runs = {"eqfit": with_eqfit, "hand, chunked": hand_chunked, "eqfit predict": predict_eqfit}
    runs["hand predict"] = predict_hand
    if args.quick or rows <= 1_000_000:
        runs["hand, per batch"] = hand_per_batch
        peaks["hand, per batch"] = peak_above(hand_per_batch, folder)
    floor = {"eqfit": "hand, chunked", "eqfit predict": "hand predict"}
    if args.fit:
        runs |= fit_runs(folder, x, y, min(rows, 500_000))
        floor["fit, memmap validation"] = "fit, validation in memory"
    times = interleave(runs, args.repeats, inner=1)
    rows_out = []
    for name, seconds in times.items():
        ratio = f"{seconds / times[floor[name]]:.3f}" if name in floor else ""
        peak = f"{peaks[name]:.0f}" if name in peaks else ""
        rows_out.append([name, f"{seconds:.3f}", ratio, peak])
    gib = rows * (FEATURES + 1) * 4 / 2**30
    print(f"\n{rows} rows, {gib:.2f} GiB of memmaps, batch {BATCH}, {args.repeats} repeats")
    print(table(["variant", "s (median)", "/ its hand loop", "peak MiB above"], rows_out))
    results = {
        "config": config(),
        "rows": rows,
        "gib": gib,
        "seconds": times,
        "peak_mib": peaks,
        "ratios": {name: times[name] / times[base] for name, base in floor.items()},
    }
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    finish(args.out, results, started, load)


if __name__ == "__main__":
    main()
