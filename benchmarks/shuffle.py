"""What shuffling costs: eqfit's keyed bijection against sorts, and in training.

1. One epoch's order at N = 2^13, 2^16, 2^20 and 2^24 (and 2^20 + 1, where the cipher's
   domain is not N and it cycle-walks): eqfit's `epoch_order` (a generalised Feistel
   cipher, O(N)) against `jax.random.permutation` (what a hand-written loop uses, two
   sorts) and a sort of two 32-bit random keys per sample (eqfit's shuffle before).
   All jitted, fed a new epoch number each call, timed interleaved in one process.
2. Training with the shuffle: one epoch of the benchmark MLP on N = 2^20 samples, batch
   256, with `shuffle=True` against `shuffle=False` (the same steps on rows in order),
   interleaved, median of repeats.

    python benchmarks/shuffle.py [--repeats 7] [--quick] [--training-only] [--out PATH]
"""

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, interleave, median, table, write_json

import eqfit
from eqfit._core._data import epoch_order, shuffle_seed


Shuffle = Callable[[jax.Array, jax.Array], jax.Array]
SIZES = (2**13, 2**16, 2**20, 2**20 + 1, 2**24)


def make_shuffles(n: int) -> dict[str, Shuffle]:
    """The jitted shuffles, each `(key, epoch) -> a permutation of range(n)`."""

    @jax.jit
    def eqfit_order(key: jax.Array, epoch: jax.Array) -> jax.Array:
        return epoch_order(shuffle_seed(key), epoch, n, True)

    @jax.jit
    def permutation(key: jax.Array, epoch: jax.Array) -> jax.Array:
        return jax.random.permutation(jax.random.fold_in(key, epoch), n)

    @jax.jit
    def two_key_sort(key: jax.Array, epoch: jax.Array) -> jax.Array:
        bits = jax.random.bits(jax.random.fold_in(key, epoch), (2, n))
        index = jnp.arange(n, dtype=jnp.uint32)
        return jax.lax.sort((bits[0], bits[1], index), num_keys=2)[2]

    return {
        "eqfit (Feistel)": eqfit_order,
        "jax.random.permutation": permutation,
        "2-key sort (eqfit before)": two_key_sort,
    }


def time_calls(fn: Shuffle, key: jax.Array, epochs: list[jax.Array]) -> float:
    """Seconds per call over `epochs`, each call waited for, as an epoch would wait."""
    start = time.perf_counter()
    for e in epochs:
        fn(key, e).block_until_ready()
    return (time.perf_counter() - start) / len(epochs)


def shuffles(repeats: int) -> dict[int, dict[str, dict[str, float]]]:
    key = jax.random.key(0)
    results: dict[int, dict[str, dict[str, float]]] = {}
    for n in SIZES:
        fns = make_shuffles(n)
        calls = max(1, min(20, 2**20 // n * 4))  # many calls of small ones, one of huge
        epochs = [jnp.asarray(e) for e in range(calls)]
        first: dict[str, float] = {}
        for name, fn in fns.items():
            start = time.perf_counter()
            out = np.asarray(fn(key, epochs[0]))
            first[name] = time.perf_counter() - start
            if not (np.bincount(out, minlength=n) == 1).all():
                raise AssertionError(f"{name} at n={n} is not a permutation")
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        rounds = repeats if n <= 2**20 + 1 else max(2, repeats // 3)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(time_calls(fns[name], key, epochs))
        base = median(times["jax.random.permutation"])
        results[n] = {
            name: {
                "median_ms": median(ts) * 1e3,
                "min_ms": min(ts) * 1e3,
                "max_ms": max(ts) * 1e3,
                "vs_permutation": median(ts) / base,
                "first_call_ms": first[name] * 1e3,
            }
            for name, ts in times.items()
        }
        print(f"  shuffles at n={n}: done", flush=True)
    return results


def training(repeats: int) -> dict[str, float]:
    """One epoch on 2^20 samples, batch 256, shuffled against in order."""
    rng = np.random.default_rng(0)
    n = 2**20
    x = rng.normal(size=(n, 16)).astype(np.float32)
    data = (jnp.asarray(x), jnp.asarray(np.sin(x[:, 0]).astype(np.float32)))
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    common = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=jax.random.key(1),
        epochs=1,
        batch_size=256,
    )

    def run(shuffle: bool) -> Callable[[], None]:
        return lambda: jax.block_until_ready(
            eqfit.fit(model, data, shuffle=shuffle, **common).model  # type: ignore[arg-type]
        )

    seconds = interleave({"shuffled": run(True), "in order": run(False)}, repeats, inner=1)
    return {**seconds, "ratio": seconds["shuffled"] / seconds["in order"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 repeats")
    parser.add_argument("--training-only", action="store_true", help="part 2 only")
    default_out = Path(__file__).parent / "results" / "shuffle.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    load_before = os.getloadavg()

    by_size = {} if args.training_only else shuffles(repeats)
    print("  training...", flush=True)
    train = training(repeats)

    print("\n# shuffle\n")
    print(f"JAX {jax.__version__} on {jax.devices()[0]}; median of {repeats} repeats\n")
    rows = []
    for n, by_name in by_size.items():
        for name, r in by_name.items():
            rows.append(
                [
                    str(n),
                    name,
                    f"{r['median_ms']:.3f}",
                    f"{r['vs_permutation']:.3f}",
                    f"{1 / r['vs_permutation']:.0f}x",
                    f"{r['first_call_ms']:.0f}",
                ]
            )
    header = ["n", "shuffle", "ms/call", "/ permutation", "faster", "first call ms"]
    print(table(header, rows))
    print(
        "\nOne epoch of the benchmark MLP, N = 2^20, batch 256: "
        f"shuffled {train['shuffled'] * 1e3:.0f} ms, in order {train['in order'] * 1e3:.0f} ms, "
        f"ratio {train['ratio']:.3f}"
    )
    cfg = {
        **config(),
        "repeats": repeats,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    write_json(args.out, {"config": cfg, "shuffles": by_size, "training": train})


if __name__ == "__main__":
    main()
