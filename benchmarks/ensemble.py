"""16 members of the benchmark MLP trained side by side in one program, against one member
alone and against a Python loop over the 16.

MLP 16-64-64-1, Adam, N=8192, 5 epochs, at batch 32 (where a small model leaves most of
the hardware idle) and 256.

    python benchmarks/ensemble.py [--repeats 5] [--members 16] [--out PATH]
"""

import argparse
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
from _common import config, interleave, table, write_json

import eqfit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--members", type=int, default=16)
    out = Path(__file__).parent / "results" / "ensemble.json"
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 16)).astype(np.float32)
    data = (jax.numpy.asarray(x), jax.numpy.asarray(np.sin(x[:, 0]).astype(np.float32)))
    keys = jax.random.split(jax.random.key(0), args.members)
    make = lambda k: eqfit.models.MLP(16, "scalar", 64, 2, key=k)  # noqa: E731
    members = eqx.filter_vmap(make)(keys)
    single = make(keys[0])
    optimizer = optax.adam(1e-3)
    results: dict[str, object] = {"config": config(), "members": args.members}
    for batch_size in (32, 256):
        results[str(batch_size)] = measure(
            single, members, make, keys, data, optimizer, batch_size, args
        )
    write_json(args.out, results)


def measure(single, members, make, keys, data, optimizer, batch_size, args):  # noqa: ANN001, ANN201
    common = dict(loss=eqfit.losses.mse, optimizer=optimizer, epochs=5, batch_size=batch_size)

    def one() -> None:
        jax.block_until_ready(eqfit.fit(single, data, key=keys[0], **common).model)  # type: ignore[arg-type]

    def ensemble() -> None:
        result = eqfit.fit(members, data, key=keys[0], ensemble=True, **common)  # type: ignore[arg-type]
        jax.block_until_ready(result.model)

    def python_loop() -> None:
        for k in keys:
            jax.block_until_ready(eqfit.fit(make(k), data, key=k, **common).model)  # type: ignore[arg-type]

    seconds = interleave(
        {
            "1 member": one,
            f"{args.members} members, one program": ensemble,
            f"{args.members} members, a Python loop": python_loop,
        },
        args.repeats,
        inner=1,
    )
    base = seconds["1 member"]
    rows = [[name, f"{s * 1e3:.1f}", f"{s / base:.2f}"] for name, s in seconds.items()]
    print(f"\nMLP 16-64-64-1, Adam, batch {batch_size}, N=8192, 5 epochs; median of {args.repeats}")
    print(table(["variant", "ms per run", "× one member"], rows))
    return seconds


if __name__ == "__main__":
    main()
