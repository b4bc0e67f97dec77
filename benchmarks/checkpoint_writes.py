"""What checkpoints cost a run, written each way: a 96 MiB training state checkpointed at
every epoch's end against the same run without checkpoints.

Trains `eqfit.models.MLP(1024, 1024, 4096, 1)` (8.4 M weights; with Adam's two moments a
training state of 96 MiB) with MSE on N synthetic samples at batch 256, 4 epochs of about
a second each here, four ways:

- `none`: no checkpoint, the reference;
- `background`: `checkpoint=eqfit.Checkpoint(directory, background=True)`, a checkpoint
    at every epoch's end (4 a run, in a new directory each time): the state is copied on
    the device, and a background thread takes it to the host and writes it (its arrays
    from their buffers, a CRC32 taken as they go), fsyncs and renames it while training
    goes on; `fit` returns once the last is committed;
- `in-thread`: `background=False`: the same write in the training thread at the
    checkpoint's step, the device waiting, with no copy of the state;
- `default`: `background=None`, `eqfit.Checkpoint(directory)`: chosen by the backend
    (on a CPU, the state's file written in the training thread from the state's own
    buffers, then its `fsync`, manifest and rename in a thread while training goes on).

They run in one process, interleaved (the order turned each repeat), the median of
`--repeats` repeats. Also timed alone: one checkpoint's write in the training thread
(`Checkpoints.save` of the state on the host), and the same arrays written by hand
(`np.save` of each into one file, then an `fsync`). Targets: `default` / `none` at most
1.20 on this 2-core CPU (where a writer thread shares the cores with XLA), a checkpoint's
cost to the run (`default` - `none`, per checkpoint) no more than the hand write, and
`background` / `none` 1.10 where the host's cores are free of the training (a GPU).

    python benchmarks/checkpoint_writes.py [--repeats 5] [--quick] [--out PATH]
"""

import argparse
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import (
    config,
    finish,
    load_average,
    median,
    regression_data,
    table,
)

import eqfit
from eqfit._keep._checkpoint import Checkpoints


WIDTH, FEATURES = 4096, 1024
NUM_SAMPLES, EPOCHS, BATCH_SIZE = 5120, 4, 256
TARGET = 1.20  # `default` / `none`, on a CPU
WAYS = {"none": None, "background": True, "in-thread": False, "default": None}


class _State(NamedTuple):
    """What a checkpoint holds, as `Checkpoints.save` takes it (its position's fields)."""

    params: Any
    opt_state: Any
    step: Any
    reason: Any


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def hand_loop(
    model: Any, optimizer: Any, data: tuple[jax.Array, jax.Array], scratch: Path
) -> Callable[[bool], float]:
    """The same training by hand: a `jax.jit` of an epoch (a `lax.scan` of the step over
    the batches of a `jax.random.permutation`) called once an epoch, and with `write`,
    the trained arrays and the optimizer's state written after each epoch as a user
    writes them: `jax.device_get`, `np.save` of each into one file, `fsync`. Returns
    the seconds a run takes.
    """
    x, y = data
    params, static = eqx.partition(model, eqx.is_inexact_array)
    steps = NUM_SAMPLES // BATCH_SIZE

    def loss(p: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        return mse(eqx.combine(p, static), xb, yb)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def epoch(p: Any, s: Any, key: jax.Array) -> Any:
        order = jax.random.permutation(key, NUM_SAMPLES).reshape(steps, BATCH_SIZE)

        def step(carry: Any, idx: jax.Array) -> Any:
            p, s = carry
            value, grads = jax.value_and_grad(loss)(p, x[idx], y[idx])
            updates, s = optimizer.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), value

        (p, s), losses = jax.lax.scan(step, (p, s), order)
        return p, s, losses

    def run(write: bool) -> float:
        # A new folder a run, removed after it, as eqfit's runs below have: files written
        # over in place would reuse the pages the kernel just freed, which new files of
        # a run (eqfit's or a user's) do not.
        folder = Path(tempfile.mkdtemp(prefix="hand-", dir=scratch))
        began = time.perf_counter()
        p, s = jax.tree.map(jnp.copy, params), optimizer.init(params)
        for e in range(EPOCHS):
            p, s, _ = epoch(p, s, jax.random.fold_in(jax.random.key(1), e))
            if write:
                with open(folder / f"epoch-{e}.npy", "wb") as f:
                    for leaf in jax.tree.leaves(jax.device_get((p, s))):
                        np.save(f, leaf)
                    f.flush()
                    os.fsync(f.fileno())
        jax.block_until_ready(p)
        took = time.perf_counter() - began
        shutil.rmtree(folder, ignore_errors=True)
        return took

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 1 repeat")
    default_out = Path(__file__).parent / "results" / "checkpoint_writes.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    start = time.perf_counter()
    load_before = load_average()

    x, _ = regression_data(NUM_SAMPLES, FEATURES)
    y = np.roll(x, 1, axis=1) * 0.5
    data = (jnp.asarray(x), jnp.asarray(y))
    model = eqfit.models.MLP(FEATURES, FEATURES, WIDTH, 1, key=jax.random.key(0))
    optimizer = optax.adam(1e-4)
    scratch = Path(tempfile.mkdtemp(prefix="eqfit-bench-ckpt-"))
    runs_done = 0

    def fit(way: str) -> tuple[float, eqfit.FitResult]:
        nonlocal runs_done
        runs_done += 1
        directory = scratch / f"run{runs_done}"
        policy = None if way == "none" else eqfit.Checkpoint(directory, background=WAYS[way])
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
        # In the background `fit` returns with its last write going on: waited for, untimed,
        # before the folder goes and the next run begins.
        eqfit.wait_for_checkpoints(directory)
        shutil.rmtree(directory, ignore_errors=True)
        return took, result

    def fit_time(way: str) -> float:
        return fit(way)[0]

    hand = hand_loop(model, optimizer, data, scratch)
    runs: dict[str, Callable[[], float]] = {way: functools.partial(fit_time, way) for way in WAYS}
    runs |= {"hand": lambda: hand(False), "hand + write": lambda: hand(True)}

    ways = list(WAYS)
    try:
        for way in ways:  # compile and warm each
            _, result = fit(way)
        hand(True)
        samples: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for i in range(repeats):
            turned = i % len(names)
            for name in names[turned:] + names[:turned]:
                samples[name].append(runs[name]())
        _, plain = fit("none")
        bitwise = True
        for way in ways[1:]:
            _, saved = fit(way)
            bitwise = bitwise and all(
                np.array_equal(a, b)
                for a, b in zip(
                    jax.tree.leaves(eqx.filter(plain.model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(saved.model, eqx.is_array)),
                )
            )
        # One write in the training thread, timed alone.
        params = eqx.filter(result.model, eqx.is_inexact_array)
        trained = jax.device_get((params, result.opt_state))
        state_bytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(trained))
        state = _State(*trained, step=np.int32(EPOCHS), reason=np.int32(0))
        store = Checkpoints(scratch / "alone", {"benchmark": True}, steps_per_epoch=1)
        writes, parts = [], []
        for _ in range(3):
            began = time.perf_counter()
            store.save(state)
            writes.append(time.perf_counter() - began)
        for i in range(3):  # taken apart: the state's file, then the commit
            state = state._replace(step=np.int32(EPOCHS + 1 + i))
            began = time.perf_counter()
            commit = store.begin(state)
            written = time.perf_counter()
            commit()
            parts.append((written - began, time.perf_counter() - written))
        store.close()
        # The same arrays written by hand, synchronously: `np.save` of each into one
        # file, then an `fsync`: the floor a checkpoint's cost to the run is held to.
        hand_writes = []
        for i in range(3):
            began = time.perf_counter()
            with open(scratch / f"hand{i}.npy", "wb") as f:
                for leaf in jax.tree.leaves(trained):
                    np.save(f, np.asarray(leaf))
                f.flush()
                os.fsync(f.fileno())
            hand_writes.append(time.perf_counter() - began)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    seconds = {name: median(xs) for name, xs in samples.items()}
    none = seconds["none"]
    ratios = {way: seconds[way] / none for way in ways}
    paired = {way: median([t / n for n, t in zip(samples["none"], samples[way])]) for way in ways}
    hand_ratio = seconds["hand + write"] / seconds["hand"]
    hand_paired = median([w / h for h, w in zip(samples["hand"], samples["hand + write"])])
    write = median(writes)
    modelled = (none + EPOCHS * write) / none
    cfg = {
        **config(),
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
        [
            way,
            f"{seconds[way]:.3f}",
            f"{seconds[way] / EPOCHS:.3f}",
            f"{ratios[way]:.3f}",
            f"{paired[way]:.3f}",
        ]
        for way in ways
    ]
    headers = ["case", "s per fit", "s per epoch", "against none", "paired"]
    print(table(headers, rows))
    print("\npaired: the median of each repeat's ratio to its own `none`")
    print(
        f"one write in the training thread alone: {write:.3f} s; {EPOCHS} of them in a run "
        f"of this length would make it {modelled:.3f}x the run without checkpoints"
    )
    file_part = median([p[0] for p in parts])
    commit_part = median([p[1] for p in parts])
    print(
        f"taken apart: the state's file (its arrays from their buffers, CRC32, written) "
        f"{file_part:.3f} s in the training thread; the commit (fsync, manifest, rename, "
        f"pruning) {commit_part:.3f} s, in a thread by default on the CPU"
    )
    hand_write = median(hand_writes)
    cost = (seconds["default"] - none) / EPOCHS
    hand_cost = (seconds["hand + write"] - seconds["hand"]) / EPOCHS
    print(
        f"one synchronous write by hand (np.save of the arrays, fsync): {hand_write:.3f} s "
        f"alone; in a hand loop (a jitted epoch a call) a write every epoch costs "
        f"{hand_cost:.3f} s each, the run {hand_ratio:.3f}x the loop without (paired "
        f"{hand_paired:.3f}); eqfit's `default` checkpoint costs {cost:.3f} s each, "
        f"the run {ratios['default']:.3f}x"
    )
    verdict = "within" if ratios["default"] <= TARGET else "above"
    print(f"`default` / `none` = {ratios['default']:.3f}: {verdict} the target of {TARGET}")
    print(f"results bitwise equal with and without checkpoints: {bitwise}")
    results = {
        "seconds": seconds,
        "samples": samples,
        "ratios": ratios,
        "paired_ratios": paired,
        "write_seconds": writes,
        "hand_write_seconds": hand_writes,
        "hand_loop_ratio": hand_ratio,
        "hand_loop_paired_ratio": hand_paired,
        "file_and_commit_seconds": parts,
        "default_cost_per_checkpoint_s": cost,
        "synchronous_modelled_ratio": modelled,
        "state_bytes": state_bytes,
        "bitwise_equal": bitwise,
        "target": TARGET,
        "config": cfg,
    }
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
