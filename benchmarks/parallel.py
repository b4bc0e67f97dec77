"""The price of the parallel paths on one real device, and a run over 8 simulated devices.

On simulated CPU devices speed means little (they share the same cores), so the figure
that matters here is the overhead: `devices=[d]` (filter_pmap) and `mesh=` over one
device, against the plain compiled path, same model and data (fit_speed's MLP, batch 256).

    python benchmarks/parallel.py [--repeats 7] [--out PATH]
"""

import argparse
import os
from pathlib import Path

import jax


jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import config, interleave, table, write_json  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import eqfit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    out = Path(__file__).parent / "results" / "parallel.json"
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 16)).astype(np.float32)
    y = np.sin(x[:, 0]).astype(np.float32)
    data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    optimizer = optax.adam(1e-3)
    one = jax.devices()[0]

    def run(**extra: object) -> eqfit.FitResult:
        result = eqfit.fit(
            model,
            data,
            loss=eqfit.losses.mse,
            optimizer=optimizer,
            key=jax.random.key(1),
            epochs=5,
            batch_size=256,
            **extra,  # type: ignore[arg-type]
        )
        jax.block_until_ready(result.model)
        return result

    variants = {
        "plain": lambda: run(),
        "devices=[1 device]": lambda: run(devices=[one]),
        "mesh= (1 device)": lambda: run(mesh=Mesh(np.array([one]), ("batch",))),
        "devices=8 (simulated)": lambda: run(devices=8),
        "mesh= (8 simulated)": lambda: run(mesh=jax.make_mesh((8,), ("batch",))),
    }
    seconds = interleave(variants, args.repeats)
    steps = 5 * 32
    base = seconds["plain"]
    rows = [
        [name, f"{s * 1e3:.2f}", f"{s / steps * 1e6:.1f}", f"{s / base:.3f}"]
        for name, s in seconds.items()
    ]
    print(
        "MLP 16-64-64-1, Adam, batch 256, N=8192, 5 epochs (160 steps), "
        f"{os.cpu_count()} CPU cores, median of {args.repeats}"
    )
    print(table(["variant", "ms per run", "µs per step", "× plain"], rows))
    write_json(args.out, {"config": config(), "seconds": seconds, "repeats": args.repeats})


if __name__ == "__main__":
    main()
