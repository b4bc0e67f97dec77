"""Memory over many fits: 200 fits in one process, each with a new `optax.adam(lr)`.

A new optimizer object is a new configuration, so each fit compiles new programs. eqfit
keeps its compiled programs in a bounded cache, so the process's memory (RSS) and its
count of memory mappings (each compiled program's code lives in mappings of its own) stop
growing once the cache is full. Printed every 20 fits.

    python benchmarks/many_fits.py [--fits 200] [--out PATH]
"""

import argparse
import time
from pathlib import Path

import jax
import numpy as np
import optax
from _common import config, write_json

import eqfit


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=200)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "many_fits.json"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 16)).astype(np.float32)
    data = (jax.numpy.asarray(x), jax.numpy.asarray(np.sin(x[:, 0])))
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    rows = []
    start = time.perf_counter()
    print("| fits | RSS MB | mappings | seconds |\n| --- | --- | --- | --- |")
    for i in range(1, args.fits + 1):
        rate = float(10 ** rng.uniform(-4, -2))
        eqfit.fit(
            model,
            data,
            loss=eqfit.losses.mse,
            optimizer=optax.adam(rate),
            key=jax.random.key(i),
            epochs=2,
            batch_size=64,
        )
        if i % 20 == 0:
            row = {"fits": i, "rss_mb": rss_mb(), "mappings": mappings()}
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            print(f"| {i} | {row['rss_mb']:.0f} | {row['mappings']} | {row['seconds']:.0f} |")
    write_json(args.out, {"config": config(), "rows": rows})


if __name__ == "__main__":
    main()
