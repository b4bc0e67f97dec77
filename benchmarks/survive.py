"""What surviving costs: checkpoints per epoch, streaming from disk against memory, and the
peak memory of training on a memmap of several GiB.

    python benchmarks/survive.py [--repeats 5] [--gib 4] [--out PATH]
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, interleave, table, write_json

import eqfit


HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gib", type=float, default=4.0, help="size of the memmap for RSS")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "survive.json")
    args = parser.parse_args()
    results: dict[str, object] = {"config": config()}
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    optimizer = optax.adam(1e-3)
    common = dict(loss=eqfit.losses.mse, optimizer=optimizer, key=jax.random.key(1))

    # 1. Checkpoint overhead: 10 epochs of the fit_speed problem, a checkpoint after each.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 16)).astype(np.float32)
    small = (jnp.asarray(x), jnp.asarray(np.sin(x[:, 0]).astype(np.float32)))
    folder = Path(tempfile.mkdtemp())

    def plain() -> None:
        jax.block_until_ready(eqfit.fit(model, small, epochs=10, batch_size=256, **common).model)  # type: ignore[arg-type]

    def checkpointed() -> None:
        result = eqfit.fit(
            model,
            small,
            epochs=10,
            batch_size=256,
            checkpoint=folder / str(rng.integers(1 << 30)),
            **common,  # type: ignore[arg-type]
        )
        jax.block_until_ready(result.model)

    seconds = interleave(
        {"no checkpoint": plain, "checkpoint every epoch": checkpointed}, args.repeats, inner=1
    )
    per_epoch = (seconds["checkpoint every epoch"] - seconds["no checkpoint"]) / 10
    results["checkpoint"] = {"seconds": seconds, "overhead_per_epoch_s": per_epoch}
    print("1. Checkpoints: MLP 16-64-64-1 + Adam state, 10 epochs of 32 steps")
    print(table(["variant", "ms per run"], [[k, f"{v * 1e3:.1f}"] for k, v in seconds.items()]))
    print(f"overhead per checkpoint: {per_epoch * 1e3:.2f} ms\n")

    # 2. Streaming throughput: 1M samples from a memmap against the same in memory.
    n = 2**20
    big_x = rng.normal(size=(n, 16)).astype(np.float32)
    big_y = np.sin(big_x[:, 0]).astype(np.float32)
    np.save(folder / "x.npy", big_x)
    np.save(folder / "y.npy", big_y)
    mapped = (np.load(folder / "x.npy", mmap_mode="r"), np.load(folder / "y.npy", mmap_mode="r"))
    memory = (jnp.asarray(big_x), jnp.asarray(big_y))

    def in_memory() -> None:
        jax.block_until_ready(eqfit.fit(model, memory, epochs=1, batch_size=256, **common).model)  # type: ignore[arg-type]

    def streamed() -> None:
        jax.block_until_ready(eqfit.fit(model, mapped, epochs=1, batch_size=256, **common).model)  # type: ignore[arg-type]

    seconds = interleave(
        {"in memory": in_memory, "streamed from a memmap": streamed}, args.repeats, inner=1
    )
    ratio = seconds["in memory"] / seconds["streamed from a memmap"]
    results["streaming"] = {"seconds": seconds, "throughput_ratio": ratio, "samples": n}
    steps = n // 256
    print(f"2. Streaming: {n} samples x 16 features, batch 256 ({steps} steps), 1 epoch")
    rows = [[k, f"{v * 1e3:.0f}", f"{steps / v:.0f}"] for k, v in seconds.items()]
    print(table(["variant", "ms per epoch", "steps per s"], rows))
    print(f"streamed throughput / in-memory throughput: {ratio:.2f}\n")

    # 3. Peak RSS on a memmap of several GiB (a separate process, which writes it first).
    with tempfile.TemporaryDirectory() as big:
        run = subprocess.run(
            [sys.executable, str(HERE.parent / "tests" / "stream_worker.py"), big, str(args.gib)],
            capture_output=True,
            text=True,
            check=True,
        )
    numbers = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", run.stdout)}
    results["rss"] = numbers
    print(
        f"3. Peak memory training on a {numbers['file_mb'] / 1024:.1f} GiB memmap "
        "(linear model, 4096 features, batch 512, 1 epoch)"
    )
    print(
        f"RSS before: {numbers['before_mb']:.0f} MiB, peak during fit: "
        f"{numbers['peak_mb']:.0f} MiB (+{numbers['peak_mb'] - numbers['before_mb']:.0f} MiB)"
    )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
