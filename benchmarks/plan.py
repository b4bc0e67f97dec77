"""What `eqfit.plan` tells before a run, checked against what the run does.

- Memory: the temporary bytes of the run's program for the MLP of 12 layers of 256 at
  batch 8192 (one SGD step an epoch), in float32, with `precision="bfloat16"`, and as the
  same update made of 8 microbatches of 1024: `fit(..., microbatches=8)` (one step) and
  `optax.MultiSteps` (8 steps).
- FLOPs: the plan's FLOPs per step against 6 x weights x batch.
- Compilation: seconds and XLA compilations of `plan`, then of a `fit` with the same
  arguments (none, if the plan's programs are the run's), against a plain first `fit`.
- Throughput: the history's samples per second against the samples trained over the
  wall time a callback sees at each epoch's end.

Run: `python benchmarks/plan.py` (writes `benchmarks/results/plan.json`).
"""

import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
from _common import CompileEvents, config, table, write_json

import eqfit


def loss(model, x, y):
    return ((jax.vmap(model)(x) - y) ** 2).mean()


def main() -> None:
    events = CompileEvents()
    key = jax.random.key(0)
    model = eqx.nn.MLP(256, 256, 256, 11, key=key)
    x = np.random.default_rng(0).normal(size=(8192, 256)).astype(np.float32)
    weights = sum(a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))

    def planned(batch_size, optimizer, precision=None, microbatches=1):
        return eqfit.plan(
            model,
            (x, x),
            loss=loss,
            optimizer=optimizer,
            key=key,
            batch_size=batch_size,
            shuffle=False,
            precision=precision,
            microbatches=microbatches,
        )

    float32 = planned(8192, optax.sgd(1e-3))
    bfloat16 = planned(8192, optax.sgd(1e-3), "bfloat16")
    microbatched = planned(8192, optax.sgd(1e-3), microbatches=8)
    accumulated = planned(1024, optax.MultiSteps(optax.sgd(1e-3), every_k_schedule=8))
    mib = 2**20
    memory_rows = [
        ["float32, batch 8192", f"{float32.memory.temporary / mib:.1f}", "1.00"],
        [
            "bfloat16, batch 8192",
            f"{bfloat16.memory.temporary / mib:.1f}",
            f"{bfloat16.memory.temporary / float32.memory.temporary:.2f}",
        ],
        [
            "float32, 8 x 1024 (microbatches=8)",
            f"{microbatched.memory.temporary / mib:.1f}",
            f"{microbatched.memory.temporary / float32.memory.temporary:.2f}",
        ],
        [
            "float32, 8 x 1024 (MultiSteps)",
            f"{accumulated.memory.temporary / mib:.1f}",
            f"{accumulated.memory.temporary / float32.memory.temporary:.2f}",
        ],
    ]
    print("MLP 256x12 at batch 8192, temporary bytes of the run's program (per device):")
    print(table(["run", "MiB", "/ float32"], memory_rows))
    ratio = float32.flops_per_step / (6 * weights * 8192)
    print(f"\nFLOPs per step {float32.flops_per_step:.4g}, 6 x weights x batch: ratio {ratio:.3f}")

    # Compilation: plan then fit, against a plain first fit (new optimizers: new programs).
    small = eqx.nn.MLP(16, 1, 64, 2, key=key)
    xs = x[:, :16].copy()
    ys = x[:, :1].copy()

    def arguments():
        return dict(loss=loss, optimizer=optax.adam(1e-3), key=key, batch_size=32, epochs=3)

    eqfit.fit(small, (xs, ys), **arguments())  # warm-up: JAX's own first-call costs
    events.reset()
    start = time.perf_counter()
    eqfit.fit(small, (xs, ys), **arguments())
    plain = time.perf_counter() - start, events.backend_compiles()
    given = arguments()
    events.reset()
    start = time.perf_counter()
    eqfit.plan(small, (xs, ys), **given)
    plan_cost = time.perf_counter() - start, events.backend_compiles()
    events.reset()
    start = time.perf_counter()
    eqfit.fit(small, (xs, ys), **given)
    after = time.perf_counter() - start, events.backend_compiles()
    compile_rows = [
        ["fit, no plan", f"{plain[0]:.3f}", str(plain[1])],
        ["plan", f"{plan_cost[0]:.3f}", str(plan_cost[1])],
        ["fit after plan", f"{after[0]:.3f}", str(after[1])],
    ]
    print("\nThe benchmark MLP 16-64-64-1, batch 32, 3 epochs, a new optimizer each:")
    print(table(["call", "seconds", "XLA compilations"], compile_rows))

    # Throughput against the wall time a callback holding each epoch's end sees.
    ends: list[float] = []

    class Clock:
        stops_training = True

        def on_epoch_end(self, epoch, logs):
            ends.append(time.perf_counter())

    wide = eqx.nn.MLP(256, 1, 512, 2, key=key)
    given = dict(loss=loss, optimizer=optax.adam(1e-3), key=key, batch_size=256)
    eqfit.fit(wide, (x, x[:, :1]), epochs=1, **given)
    history = eqfit.fit(wide, (x, x[:, :1]), epochs=5, callbacks=[Clock()], **given).history
    walls = np.diff(ends)
    measured = history.throughput["samples_per_second"][1:]
    deviation = measured / (len(x) / walls) - 1
    print("\nMLP 256-512-512-1, batch 256, 8192 samples: samples per second, history / wall")
    print(" ".join(f"{d:+.1%}" for d in deviation))

    write_json(
        Path(__file__).parent / "results" / "plan.json",
        {
            "config": config(),
            "temporary_mib": {r[0]: float(r[1]) for r in memory_rows},
            "flops_ratio_to_6WB": ratio,
            "seconds_and_compiles": {r[0]: [float(r[1]), int(r[2])] for r in compile_rows},
            "samples_per_second_deviation": deviation.tolist(),
        },
    )


if __name__ == "__main__":
    main()
