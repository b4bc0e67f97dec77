"""What a layout costs: training speed of `examples/transformer_lm.py`'s model under each
placement, and checkpoint save and restore, `state.eqx` against Orbax.

1. Steps per second of the example's model (116k parameters, batch 64, context 64,
   AdamW) on one device, and over 8 simulated CPU devices: `mesh=` data parallel (every
   array replicated), `shard=fsdp("data")`, and the example's `(2, 4)` tensor-parallel
   rules. Each configuration is fitted once to compile, then timed over `--repeats` fits
   of `--steps` steps, alternating configurations; the figure is the median. On a CPU the
   8 devices share its cores: the table shows what a layout costs, not a speed-up.
2. Checkpoints of a state of 1 MiB and 64 MiB (four float32 arrays split over the 8
   devices): save and restore seconds, medians of `--repeats` after a first save, and the
   peak resident memory of the process before the first save and after the last restore,
   each format and size in a fresh process of its own.

    python benchmarks/sharding.py [--repeats 5] [--steps 100] [--out PATH]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple


HERE = Path(__file__).parent
ROOT = HERE.parent
SIZES = {"1 MiB": 2**20, "64 MiB": 64 * 2**20}
PLACEMENTS = ("one device", "mesh (data parallel)", "fsdp", "(2, 4) tensor parallel")


def training(repeats: int, steps: int) -> dict[str, Any]:
    """Seconds per step of each placement, in this process (8 simulated devices)."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    import eqfit

    sys.path.insert(0, str(ROOT / "examples"))
    import transformer_lm as lm

    tokens = lm.encode(lm.load_text())
    x, y = lm.windows(tokens, stride=lm.CONTEXT // 2)
    model = lm.TransformerLM(jax.random.key(0))
    data_parallel = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    fsdp_mesh, fsdp = lm.layout("fsdp")
    tp_mesh, tp = lm.layout("tp")
    settings = {
        "one device": {},
        "mesh (data parallel)": {"mesh": data_parallel},
        "fsdp": {"mesh": fsdp_mesh, "shard": fsdp},
        "(2, 4) tensor parallel": {"mesh": tp_mesh, "shard": tp},
    }
    optimizer = optax.adamw(1e-3)  # one object: every fit after the first compiles nothing

    def fit(placement: str) -> float:
        began = time.perf_counter()
        result = eqfit.fit(
            model,
            (x, y),
            loss=lm.loss,
            optimizer=optimizer,
            key=jax.random.key(1),
            epochs=1,
            steps_per_epoch=steps,
            batch_size=64,
            **settings[placement],
        )
        jax.block_until_ready(eqx.filter(result.model, eqx.is_array))
        return time.perf_counter() - began

    for placement in PLACEMENTS:
        fit(placement)  # compiles
    times: dict[str, list[float]] = {p: [] for p in PLACEMENTS}
    for _ in range(repeats):
        for placement in PLACEMENTS:
            times[placement].append(fit(placement))
    one = statistics.median(times["one device"])
    return {
        p: {
            "seconds": statistics.median(t),
            "steps_per_second": steps / statistics.median(t),
            "time_over_one_device": statistics.median(t) / one,
        }
        for p, t in times.items()
    }


class State(NamedTuple):
    arrays: list[Any]
    step: Any
    reason: Any


def checkpoint_worker(kind: str, size: int, repeats: int) -> dict[str, Any]:
    """One format and size in this process: save and restore seconds, peak memory."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from eqfit._keep._checkpoint import Checkpoints
    from eqfit._keep._orbax import ShardedCheckpoints

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    rows = size // (4 * 4 * 1024)
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(rows, 1024)).astype(np.float32) for _ in range(4)]
    replicated = NamedSharding(mesh, P())
    # What `position` reads (`step`, `reason`) beside the arrays, as a training state has.
    state = State(
        [jax.device_put(a, sharding) for a in arrays],
        jax.device_put(np.int32(0), replicated),
        jax.device_put(np.int32(0), replicated),
    )
    like = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    saves, restores = [], []
    before = _peak_rss_mib()  # the state built, nothing saved yet
    with tempfile.TemporaryDirectory() as directory:
        for i in range(repeats + 1):
            began = time.perf_counter()
            if kind == "orbax":
                store = ShardedCheckpoints(directory, {"run": 1}, 10)
                store.save(state)
            else:
                store = Checkpoints(directory, {"run": 1}, 10)
                store.save(jax.device_get(state))
            saved = time.perf_counter()
            store.close()
            if kind == "orbax":
                store = ShardedCheckpoints(directory, {"run": 1}, 10)
                restored = store.restore(like)
            else:
                store = Checkpoints(directory, {"run": 1}, 10)
                placed = jax.tree.map(lambda a: a.sharding, state)
                restored = jax.device_put(store.restore(jax.device_get(state)), placed)
            jax.block_until_ready(restored)
            done = time.perf_counter()
            store.close()
            if i:  # the first save imports and sets up
                saves.append(saved - began)
                restores.append(done - saved)
    return {
        "save": statistics.median(saves),
        "restore": statistics.median(restores),
        "peak_rss_before_mib": before,
        "peak_rss_after_mib": _peak_rss_mib(),
    }


def _peak_rss_mib() -> float:
    """The process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def checkpoints(repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for label, size in SIZES.items():
        for kind in ("state.eqx", "orbax"):
            out = subprocess.run(
                [sys.executable, __file__, "--worker", kind, "--size", str(size)]
                + ["--repeats", str(repeats)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            ).stdout
            results[f"{label} {kind}"] = json.loads(out.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "sharding.json")
    parser.add_argument("--worker", choices=("state.eqx", "orbax"))
    parser.add_argument("--size", type=int)
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if args.worker:
        print(json.dumps(checkpoint_worker(args.worker, args.size, args.repeats)))
        return
    train = training(args.repeats, args.steps)
    print(f"\nTraining, {args.steps} steps per fit, median of {args.repeats}", end=" ")
    print(f"(JAX {jax.__version__}, CPU)")
    print("| placement | steps/s | time / one device |\n| --- | --- | --- |")
    for placement, row in train.items():
        print(
            f"| {placement} | {row['steps_per_second']:.1f} | {row['time_over_one_device']:.2f} |"
        )
    saved = checkpoints(args.repeats)
    print(f"\nCheckpoints over 8 devices, median of {args.repeats}")
    print("| state | format | save (s) | restore (s) | peak RSS before, after (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in saved.items():
        label, kind = name.rsplit(" ", 1)
        rss = f"{row['peak_rss_before_mib']:.0f}, {row['peak_rss_after_mib']:.0f}"
        print(f"| {label} | {kind} | {row['save']:.3f} | {row['restore']:.3f} | {rss} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "training": train,
                "checkpoints": saved,
                "steps": args.steps,
                "repeats": args.repeats,
                "jax": jax.__version__,
                "load_average": os.getloadavg(),
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
