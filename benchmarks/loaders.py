"""Training from an endless loader against the same batches held in memory.

The benchmark MLP (16-64-64-1, Adam, MSE) at batch 256 trains for a step budget
(`steps_per_epoch`) on N = 2^17 samples in order (`shuffle=False`): once from the arrays in
memory, once from an endless numpy generator yielding the same batches in the same order,
which eqfit reads in chunks in a background thread while the device trains. Both give the
same model; the figure is their throughput, timed interleaved in one process (median of
repeats, compile excluded).

    python benchmarks/loaders.py [--repeats 7] [--out PATH]
"""

import argparse
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, interleave, table, write_json

import eqfit


N, BATCH, STEPS_PER_EPOCH, EPOCHS = 2**17, 256, 256, 8  # 2048 steps: four passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "loaders.json"
    )
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 16)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=16).astype(np.float32) / 4).astype(np.float32)
    memory = (jnp.asarray(x), jnp.asarray(y))
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    common = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=jax.random.key(1),
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        shuffle=False,
    )

    def endless() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in itertools.cycle(range(0, N, BATCH)):
            yield x[start : start + BATCH], y[start : start + BATCH]

    def run(data: Callable[[], object], **extra: object) -> Callable[[], eqfit.FitResult]:
        return lambda: eqfit.fit(model, data(), **common, **extra)  # type: ignore[arg-type]

    in_memory = run(lambda: memory, batch_size=BATCH)
    loader = run(endless)
    difference = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(in_memory().model), jax.tree.leaves(loader().model))
    )
    seconds = interleave(
        {"in memory": lambda: in_memory(), "endless loader": lambda: loader()},
        args.repeats,
        inner=1,
    )
    steps = EPOCHS * STEPS_PER_EPOCH
    ratio = seconds["in memory"] / seconds["endless loader"]
    print("\n# loaders\n")
    print(f"benchmark MLP, batch {BATCH}, {steps} steps over N = {N}, median of {args.repeats}\n")
    rows = [[k, f"{v * 1e3:.0f}", f"{steps / v:,.0f}"] for k, v in seconds.items()]
    print(table(["data", "ms per run", "steps/s"], rows))
    print(f"\nloader throughput / in-memory throughput: {ratio:.3f}")
    print(f"largest parameter difference between the two: {difference:.1e}")
    write_json(
        args.out,
        {"config": config(), "seconds": seconds, "throughput_ratio": ratio, "max_diff": difference},
    )


if __name__ == "__main__":
    main()
