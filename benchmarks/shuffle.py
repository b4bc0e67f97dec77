"""Cost of one epoch's shuffle: `jax.random.permutation` against eqfit's `epoch_order`.

Both are jitted and fed a new epoch number each call, as in training, and are timed
interleaved in one process (median of repeats after a warm-up). A third row, a sort of
one 32-bit random key per sample, shows what the second key of `epoch_order` costs.

    python benchmarks/shuffle.py [--n 8192] [--repeats 21] [--quick] [--out PATH]
"""

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from _common import config, median, source_fingerprint, table, write_json

import eqfit
from eqfit._data import epoch_order


Shuffle = Callable[[jax.Array, jax.Array], jax.Array]


def make_shuffles(n: int) -> dict[str, Shuffle]:
    """The jitted shuffles, each `(key, epoch) -> a permutation of range(n)`."""

    @jax.jit
    def permutation(key: jax.Array, epoch: jax.Array) -> jax.Array:
        # Two rounds of sorting inside, to make ties vanishingly rare.
        return jax.random.permutation(jax.random.fold_in(key, epoch), n)

    @jax.jit
    def eqfit_order(key: jax.Array, epoch: jax.Array) -> jax.Array:
        return epoch_order(key, epoch, n, True)

    @jax.jit
    def one_key_sort(key: jax.Array, epoch: jax.Array) -> jax.Array:
        # Ties among 32-bit keys (about n^2 / 2^33 of them) keep the original order.
        bits = jax.random.bits(jax.random.fold_in(key, epoch), (n,))
        return jax.lax.sort_key_val(bits, jnp.arange(n, dtype=jnp.uint32))[1]

    return {
        "jax.random.permutation": permutation,
        "eqfit epoch_order (2-key sort)": eqfit_order,
        "1-key sort (32-bit), reference": one_key_sort,
    }


def time_calls(fn: Shuffle, key: jax.Array, epochs: list[jax.Array]) -> float:
    """Seconds per call over `epochs`, each call waited for, as an epoch would wait."""
    start = time.perf_counter()
    for e in epochs:
        fn(key, e).block_until_ready()
    return (time.perf_counter() - start) / len(epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192, help="samples to shuffle")
    parser.add_argument("--repeats", type=int, default=21, help="timed repeats (median)")
    parser.add_argument("--calls", type=int, default=10, help="calls averaged per repeat")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 3 repeats")
    default_out = Path(__file__).parent / "results" / "shuffle.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats

    load_before = os.getloadavg()
    key = jax.random.key(0)
    shuffles = make_shuffles(args.n)
    # Device arrays made up front, so the timed loop dispatches nothing but the shuffle.
    epochs = [jnp.asarray(e) for e in range(args.calls)]

    checks: dict[str, bool] = {}
    compile_s: dict[str, float] = {}
    for name, fn in shuffles.items():
        t0 = time.perf_counter()
        out = fn(key, epochs[0]).block_until_ready()
        compile_s[name] = time.perf_counter() - t0
        checks[name] = bool(jnp.all(jnp.sort(out) == jnp.arange(args.n, dtype=out.dtype)))
        time_calls(fn, key, epochs)  # warm-up

    times: dict[str, list[float]] = {name: [] for name in shuffles}
    names = list(shuffles)
    for r in range(repeats):
        # Interleaved, A B C A B C ..., the order rotated each repeat.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(time_calls(shuffles[name], key, epochs))

    cfg = {
        **config(),
        "eqfit": eqfit.__version__,
        "eqfit_path": str(Path(eqfit.__file__).parent),
        "eqfit_source_sha256": source_fingerprint(Path(eqfit.__file__).parent),
        "n": args.n,
        "repeats": repeats,
        "calls_per_repeat": args.calls,
        "quick": args.quick,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    base = median(times["jax.random.permutation"])
    rows, results = [], {}
    for name, ts in times.items():
        m = median(ts)
        results[name] = {
            "median_ms": m * 1e3,
            "min_ms": min(ts) * 1e3,
            "max_ms": max(ts) * 1e3,
            "vs_permutation": m / base,
            "first_call_ms": compile_s[name] * 1e3,
            "is_permutation": checks[name],
            "runs_ms": [t * 1e3 for t in ts],
        }
        rows.append(
            [
                name,
                f"{m * 1e3:.3f}",
                f"{min(ts) * 1e3:.3f}–{max(ts) * 1e3:.3f}",
                f"{m / base:.2f}",
                f"{compile_s[name] * 1e3:.0f}",
                "yes" if checks[name] else "NO",
            ]
        )
    print("\n# shuffle\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); n={args.n}, "
        f"median of {repeats} repeats of {args.calls} calls each, jitted, interleaved\n"
    )
    header = ["shuffle", "ms/call", "min–max ms", "vs permutation", "first call ms", "perm?"]
    print(table(header, rows))
    print(f"\n1-min load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    write_json(args.out, {"config": cfg, "results": results})


if __name__ == "__main__":
    main()
