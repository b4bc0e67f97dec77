"""What checkpoints written in the background cost a run: a 96 MiB training state
checkpointed at every epoch's end against the same run without checkpoints.

Trains `eqfit.models.MLP(1024, 1024, 4096, 1)` (8.4 M weights; with Adam's two moments a
training state of 96 MiB) with MSE on N synthetic samples at batch 256, 4 epochs of about
a second each here, two ways:

- `none`: no checkpoint, the reference;
- `background`: `checkpoint=eqfit.Checkpoint(directory)`, a checkpoint at every epoch's
    end (4 a run, in a new directory each time): the state is copied on the device, and
    a background thread takes it to the host, serialises, hashes, fsyncs and renames it
    while training goes on; `fit` returns once the last is committed.

They run in one process, interleaved, the median of `--repeats` repeats. Also timed
alone: one checkpoint's write in the training thread (`Checkpoints.save` of the state on
the host), the work that synchronous writes would add to every epoch with the device
waiting. Target: `background` / `none` at most 1.30 on a 2-core CPU (where the writer
shares the cores with XLA), 1.10 where the host's cores are free of the training (a GPU).

    python benchmarks/checkpoint_writes.py [--repeats 5] [--quick] [--out PATH]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, median, regression_data, source_fingerprint, table, write_json

import eqfit
from eqfit._checkpoint import Checkpoints


WIDTH, FEATURES = 4096, 1024
NUM_SAMPLES, EPOCHS, BATCH_SIZE = 5120, 4, 256
TARGET = 1.30


class _State(NamedTuple):
    """What a checkpoint holds, as `Checkpoints.save` takes it (its position's fields)."""

    params: Any
    opt_state: Any
    step: Any
    reason: Any


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 1 repeat")
    default_out = Path(__file__).parent / "results" / "checkpoint_writes.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    start = time.perf_counter()
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"warning: load average {load_before[0]:.2f} before starting", file=sys.stderr)

    x, _ = regression_data(NUM_SAMPLES, FEATURES)
    y = np.roll(x, 1, axis=1) * 0.5
    data = (jnp.asarray(x), jnp.asarray(y))
    model = eqfit.models.MLP(FEATURES, FEATURES, WIDTH, 1, key=jax.random.key(0))
    optimizer = optax.adam(1e-4)
    scratch = Path(tempfile.mkdtemp(prefix="eqfit-bench-ckpt-"))
    runs_done = 0

    def fit(checkpoint: bool) -> tuple[float, eqfit.FitResult]:
        nonlocal runs_done
        runs_done += 1
        directory = scratch / f"run{runs_done}"
        policy = eqfit.Checkpoint(directory) if checkpoint else None
        began = time.perf_counter()
        result = eqfit.fit(
            model,
            data,
            loss=mse,
            optimizer=optimizer,
            key=jax.random.key(1),
            epochs=EPOCHS,
            batch_size=BATCH_SIZE,
            checkpoint=policy,
        )
        took = time.perf_counter() - began
        shutil.rmtree(directory, ignore_errors=True)
        return took, result

    try:
        for checkpoint in (False, True, False, True):  # compile and warm both
            _, result = fit(checkpoint)
        samples: dict[str, list[float]] = {"none": [], "background": []}
        for i in range(repeats):
            order = (False, True) if i % 2 == 0 else (True, False)
            for checkpoint in order:
                took, _ = fit(checkpoint)
                samples["background" if checkpoint else "none"].append(took)
        _, plain = fit(False)
        _, saved = fit(True)
        bitwise = all(
            np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(eqx.filter(plain.model, eqx.is_array)),
                jax.tree.leaves(eqx.filter(saved.model, eqx.is_array)),
            )
        )
        # One write in the training thread, as synchronous checkpoints made it.
        params = eqx.filter(result.model, eqx.is_inexact_array)
        trained = jax.device_get((params, result.opt_state))
        state_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(trained))
        state = _State(*trained, step=np.int32(EPOCHS), reason=np.int32(0))
        store = Checkpoints(scratch / "alone", {"benchmark": True}, steps_per_epoch=1)
        writes = []
        for _ in range(3):
            began = time.perf_counter()
            store.save(state)
            writes.append(time.perf_counter() - began)
        store.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    none, background = median(samples["none"]), median(samples["background"])
    ratio = background / none
    paired = median([b / n for n, b in zip(samples["none"], samples["background"])])
    write = median(writes)
    modelled = (none + EPOCHS * write) / none
    cfg = {
        **config(),
        "eqfit": eqfit.__version__,
        "eqfit_source_sha256": source_fingerprint(Path(eqfit.__file__).parent),
        "model": f"eqfit.models.MLP({FEATURES}, {FEATURES}, {WIDTH}, 1)",
        "optimizer": "optax.adam(1e-4)",
        "num_samples": NUM_SAMPLES,
        "epochs": EPOCHS,
        "batch_size": BATCH_SIZE,
        "repeats": repeats,
    }
    print("\n# checkpoint_writes\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); {cfg['model']}, "
        f"Adam, N={NUM_SAMPLES}, batch {BATCH_SIZE}, {EPOCHS} epochs; training state "
        f"{state_bytes / 2**20:.1f} MiB; a checkpoint every epoch; repeats={repeats}\n"
    )
    rows = [
        ["none", f"{none:.3f}", f"{none / EPOCHS:.3f}", "1.000"],
        ["background", f"{background:.3f}", f"{background / EPOCHS:.3f}", f"{ratio:.3f}"],
    ]
    print(table(["case", "s per fit", "s per epoch", "against none"], rows))
    print(f"\npaired ratio (median of each repeat's): {paired:.3f}")
    print(
        f"one write in the training thread: {write:.3f} s; {EPOCHS} of them in a run of "
        f"this length would make it {modelled:.3f}x the run without checkpoints"
    )
    verdict = "within" if ratio <= TARGET else "above"
    print(f"`background` / `none` = {ratio:.3f}: {verdict} the target of {TARGET}")
    print(f"results bitwise equal with and without checkpoints: {bitwise}")
    results = {
        "seconds": {"none": none, "background": background},
        "samples": samples,
        "ratio": ratio,
        "paired_ratio": paired,
        "write_seconds": writes,
        "synchronous_modelled_ratio": modelled,
        "state_bytes": state_bytes,
        "bitwise_equal": bitwise,
        "target": TARGET,
        "config": cfg,
        "total_wall_s": time.perf_counter() - start,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print(f"\ntotal wall time {results['total_wall_s']:.0f} s")
    write_json(args.out, results)


if __name__ == "__main__":
    main()
