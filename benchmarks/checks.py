"""What the runtime type checks cost: a small, already compiled `fit`, with jaxtyping's
checks on and off, in one process, interleaved.

The check of `fit`'s arguments (jaxtyping with beartype) runs once per call, on the host,
before any device work; it is off with `JAXTYPING_DISABLE=1` in the environment or
`jaxtyping.config.update("jaxtyping_disable", True)`. Prints the median time per call of
each, their difference (the check's cost) and their ratio.

    python benchmarks/checks.py [--calls 300] [--out PATH]
"""

import argparse
import time
from pathlib import Path

import jax
import jaxtyping
import numpy as np
import optax
from _common import config, median, write_json

import eqfit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "checks.json"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype(np.float32)
    data = (jax.numpy.asarray(x), jax.numpy.asarray(np.sin(x[:, 0])))
    model = eqfit.models.MLP(16, "scalar", 32, 2, key=jax.random.key(0))
    optimizer = optax.adam(1e-3)
    key = jax.random.key(1)

    def one_fit() -> float:
        start = time.perf_counter()
        result = eqfit.fit(
            model, data, loss=eqfit.losses.mse, optimizer=optimizer, key=key, batch_size=64
        )
        jax.block_until_ready(result)
        return time.perf_counter() - start

    one_fit()  # compiles
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.calls):
        on = i % 2 == 0
        jaxtyping.config.update("jaxtyping_disable", not on)
        times[on].append(one_fit())
    jaxtyping.config.update("jaxtyping_disable", False)
    with_checks, without = median(times[True]), median(times[False])
    row = {
        "fit_with_checks_ms": with_checks * 1e3,
        "fit_without_checks_ms": without * 1e3,
        "check_cost_us": (with_checks - without) * 1e6,
        "ratio": with_checks / without,
    }
    print("| `fit` (4 steps, compiled) | median ms |\n| --- | --- |")
    print(f"| checks on | {row['fit_with_checks_ms']:.3f} |")
    print(f"| checks off | {row['fit_without_checks_ms']:.3f} |")
    print(f"\nThe check costs {row['check_cost_us']:.0f} µs per call ({row['ratio']:.3f}x).")
    write_json(args.out, {"config": config(), "calls": args.calls, **row})


if __name__ == "__main__":
    main()
