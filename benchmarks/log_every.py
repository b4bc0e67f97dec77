"""What `fit(..., log_every=n)` costs a run: the same `fit` with and without it, timed in
one process, interleaved (`_common.interleave`).

Problem: `fit_speed.py`'s, the benchmark MLP 16->64->64->1 with Adam and `losses.mse` on
N = 8192 samples, batch 32 (256 steps an epoch), 5 epochs, a metric (`metrics.mae`) and a
callback that keeps what it is told (`on_train_batch_end` and `on_epoch_end`, with
`stops_training = False`). Variants: without `log_every`, with `log_every=100` and with
`log_every=10` (the compiled path: one call of the program), and the same three with the
bar (`progress=True`, written to `os.devnull`: calls of about half a second).

The target is no measurable cost: the values are reduced from the record at each call's
end, inside the program, and read with the call's report.

    python benchmarks/log_every.py [--repeats 7] [--quick] [--out PATH]
"""

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import jax
import optax
from _common import config, finish, interleave, Keeps, load_average, regression_data, table

import eqfit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/log_every.json"))
    args = parser.parse_args()
    started, load = time.perf_counter(), load_average()
    x, y = regression_data(2048 if args.quick else 8192, 16)
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    optimizer, key = optax.adam(1e-3), jax.random.key(1)

    def run(every: int | None, progress: bool) -> Any:
        def fit() -> None:
            with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
                eqfit.fit(
                    model,
                    (x, y),
                    loss=eqfit.losses.mse,
                    optimizer=optimizer,
                    key=key,
                    epochs=5,
                    batch_size=32,
                    metrics={"mae": eqfit.metrics.mae},
                    callbacks=[Keeps()],
                    log_every=every,
                    progress=progress,
                )

        return fit

    runs = {}
    for progress in (False, True):
        for every in (None, 100, 10):
            runs[f"{'bar' if progress else 'compiled'}, log_every={every}"] = run(every, progress)
    times = interleave(runs, args.repeats)
    rows = []
    for name, seconds in times.items():
        base = times[name.split(",")[0] + ", log_every=None"]
        rows.append([name, f"{seconds * 1e3:.1f}", f"{seconds / base:.3f}"])
    print(f"\n{len(x)} samples, batch 32, 5 epochs, {args.repeats} repeats")
    print(table(["variant", "ms (median)", "/ without log_every"], rows))
    results = {"config": config(), "seconds": times}
    finish(args.out, results, started, load)


if __name__ == "__main__":
    main()
