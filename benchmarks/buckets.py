"""Sequences of many lengths: the same GRU and data trained (a) padded to the longest
length, one shape, as arrays in memory through `fit`; (b) in 4 buckets through `fit`
(`eqfit.Buckets`); (c) the hand loop of (b): a Python loop of one jitted step per batch
(`eqfit.Update.apply` under `eqx.filter_jit`, `fit`'s own step) over the same batches.
Timed in one process, interleaved (`_common.interleave`).

Problem: 512 sequences of lengths drawn from a log-normal (median about 40, 3 to 256),
3 features, a GRU of 32 units and a linear head predicting a value at each position,
trained with Adam on a masked `eqfit.Mean` (the real tokens' mean squared error), batch
32, 2 epochs. Buckets at the lengths' quartiles rounded up to 8 (and the longest).

The targets: (b) at most 1.05x (c), and the speed-up of (b) over (a).

    python benchmarks/buckets.py [--repeats 5] [--quick] [--out PATH]
"""

import argparse
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, finish, interleave, load_average, table

import eqfit


class GRU(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(3, 32, key=k1)
        self.head = eqx.nn.Linear(32, 1, key=k2)

    def __call__(self, xs: jax.Array) -> jax.Array:
        def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = self.cell(x, h)
            return h, self.head(h)[0]

        return jax.lax.scan(step, jnp.zeros(32), xs)[1]


def masked_loss(model: GRU, x: jax.Array, y: jax.Array, mask: jax.Array) -> eqfit.Mean:
    return eqfit.Mean.of((jax.vmap(model)(x) - y) ** 2, mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/buckets.json"))
    args = parser.parse_args()
    started, load = time.perf_counter(), load_average()
    rng = np.random.default_rng(0)
    n, batch, epochs = (128 if args.quick else 512), 32, 2
    lengths = np.clip(rng.lognormal(np.log(40), 0.7, n).astype(int), 3, 256)
    xs = [rng.normal(size=(k, 3)).astype(np.float32) for k in lengths]
    ys = [(np.cumsum(x[:, 0]) / 8).astype(np.float32) for x in xs]
    quartiles = np.quantile(lengths, [0.25, 0.5, 0.75])
    bounds = sorted({*(int(-(-q // 8) * 8) for q in quartiles), int(lengths.max())})
    key = jax.random.key(0)
    model, optimizer = GRU(jax.random.key(1)), optax.adam(1e-3)
    buckets = eqfit.Buckets((xs, ys), lengths=bounds, batch_size=batch, key=key)
    # (a): every sequence padded to the longest, one array each, shuffled by `fit`.
    longest = eqfit.Buckets((xs, ys), lengths=[bounds[-1]], batch_size=n, shuffle=False)
    padded = next(iter(longest))
    kwargs = dict(loss=masked_loss, optimizer=optimizer, key=key, epochs=epochs)

    def padded_fit() -> None:
        eqfit.fit(model, padded, batch_size=batch, **kwargs)

    def bucketed_fit() -> None:
        eqfit.fit(model, buckets, **kwargs)

    update = eqfit.Update("u", masked_loss, optimizer)
    step = eqx.filter_jit(
        lambda m, s, b: update.apply(m, s, b, model_state=None, key=jax.random.key(0))
    )

    def hand_loop() -> None:
        trained, state = model, update.init(eqx.filter(model, eqx.is_inexact_array))
        for epoch in range(epochs):
            buckets.set_epoch(epoch)
            for b in buckets:
                out = step(trained, state, b)
                trained, state = out.model, out.state
        jax.block_until_ready(trained)

    runs = {
        "(a) padded to the longest, fit": padded_fit,
        "(b) 4 buckets, fit": bucketed_fit,
        "(c) 4 buckets, hand loop": hand_loop,
    }
    times = interleave(runs, args.repeats, inner=1)
    real = int(lengths.sum())
    print(f"\n{n} sequences, {real} tokens, buckets {bounds}, batch {batch}, {epochs} epochs")
    rows = [[name, f"{s * 1e3:.0f}", f"{s / times['(c) 4 buckets, hand loop']:.3f}"]
            for name, s in times.items()]  # fmt: skip
    print(table(["variant", "ms (median)", "/ (c)"], rows))
    speedup = times["(a) padded to the longest, fit"] / times["(b) 4 buckets, fit"]
    print(f"(b) is {speedup:.2f}x faster than (a)")
    results = {"config": config(), "seconds": times, "buckets": bounds, "tokens": real}
    finish(args.out, results, started, load)


if __name__ == "__main__":
    main()
