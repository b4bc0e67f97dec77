"""What `fit(..., validation_every=n)` costs: validation after every n-th step, against
the same validations made at epochs' ends (epochs of n steps, `steps_per_epoch=n`), timed
in one process, interleaved (`_common.interleave`).

Problem: the benchmark MLP 16->64->64->1 with Adam and `losses.mse` on N = 8192 samples,
batch 32 (256 steps a pass), 1,280 steps, validated on 2048 samples every 128 steps (10
validations; `--quick`: 2048 samples, every 32 steps), with `EarlyStopping(patience=100)`
judging each (it never stops, so both sides do the same work). Each side runs the same
steps on the same batches and the same validations: (a) `epochs=10,
steps_per_epoch=128`, validated at each epoch's end; (b) `epochs=5` (a pass each) with
`validation_every=128`. On the compiled path (one call), with the bar (`progress=True`,
to `os.devnull`), and with the validation set a memmap (streamed: the host validates at
each of those steps).

The target: (b) at most about 1.05x (a), the floor the issue names (no host sync beyond
what validation at an epoch's end costs).

    python benchmarks/validation_every.py [--repeats 7] [--quick] [--out PATH]
"""

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from _common import config, finish, interleave, load_average, regression_data, table

import eqfit


BATCH = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/validation_every.json")
    )
    args = parser.parse_args()
    started, load = time.perf_counter(), load_average()
    n = 2048 if args.quick else 8192
    x, y = regression_data(n + 2048, 16)
    train, val = (x[:n], y[:n]), (x[n:], y[n:])
    folder = Path(tempfile.mkdtemp())
    np.save(folder / "xv.npy", np.asarray(val[0]))
    np.save(folder / "yv.npy", np.asarray(val[1]))
    memmaps = tuple(np.load(folder / f"{a}.npy", mmap_mode="r") for a in ("xv", "yv"))
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    optimizer, key = optax.adam(1e-3), jax.random.key(1)
    # Validated twice a pass: each side stops at the same steps (an epoch's end of (b)
    # is a validation's step too).
    per_pass = -(-n // BATCH)
    steps, every = 5 * per_pass, per_pass // 2

    def run(each_n: bool, progress: bool, val_data: Any) -> Any:
        timing = (
            dict(epochs=steps // per_pass, validation_every=every)
            if each_n
            else dict(epochs=steps // every, steps_per_epoch=every)
        )

        def fit() -> None:
            with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
                eqfit.fit(
                    model,
                    train,
                    loss=eqfit.losses.mse,
                    optimizer=optimizer,
                    key=key,
                    batch_size=BATCH,
                    validation_data=val_data,
                    early_stopping=eqfit.EarlyStopping(patience=100),
                    progress=progress,
                    **timing,
                )

        return fit

    runs = {}
    for way, progress, val_data in (
        ("compiled", False, val),
        ("bar", True, val),
        ("memmap", False, memmaps),
    ):
        runs[f"{way}, epoch ends"] = run(False, progress, val_data)
        runs[f"{way}, validation_every"] = run(True, progress, val_data)
    times = interleave(runs, args.repeats)
    rows = []
    for name, seconds in times.items():
        base = times[name.split(",")[0] + ", epoch ends"]
        rows.append([name, f"{seconds * 1e3:.1f}", f"{seconds / base:.3f}"])
    print(f"\n{n} samples, batch {BATCH}, {steps} steps, validated every {every}")
    print(table(["variant", "ms (median)", "/ at epoch ends"], rows))
    results = {"config": config(), "seconds": times}
    finish(args.out, results, started, load)


if __name__ == "__main__":
    main()
