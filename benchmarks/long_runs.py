"""A run's cost per step at every length: `fit` at 100, 1,000 and 10,000 epochs of 128
steps, each recorded value in turn, against a hand `jit(lax.scan)` that stacks the same
per-step values, timed in one process, interleaved (`_common.interleave`).

Problem: the issue's, an `eqx.nn.MLP(8, "scalar", 16, 2)` with binary cross-entropy on
4,096 rows, batch 32 (128 steps an epoch), Adam, unshuffled on both sides (the record's
cost is what is measured, not the shuffle's). Cases, each against its own floor:

- `loss`: nothing recorded but the loss; the floor stacks each step's loss.
- `aux`: the loss returns `(loss, {"acc": ...})`; the floor stacks the loss and the aux.
- `metric`: a batch function, `metrics={"p": precision}`; the floor calls it beside the
  loss on the step's batch and stacks both.
- `stateful`: `metrics={"p": eqfit.metrics.Precision()}`, whose counts add up over the
  epoch; the floor adds the same counts in its carry.
- `norms`: `norms=True`; the floor stacks the loss and both global norms.
- `schedules`: `schedules={"lr": schedule}` for `optax.adam(schedule)`; the floor stacks the
  loss and the schedule at the optimizer's count.
- `log_every`: `log_every=100` with a callback that keeps what it is told; the floor
  stacks the loss. A second floor, `told`, is the same hand scan that also tells a
  callback of the same kind (`Keeps.on_train_batch_end`) each 100th step and the mean loss
  of the 100 steps before it, from inside the scan (an ordered `jax.debug.callback`): its
  ratio is printed besides, the first floor's stays the table's.
- `validation_every`: `validation_every=640` (every 5 epochs) on 512 held-out rows; the
  floor validates in a `lax.cond` every 640 steps, in batches of 32, and keeps each.
- `ensemble`: 4 members (`ensemble=True`) with an aux value; the floor vmaps the run.
- `updates`: the aux loss as `updates=[eqfit.Update("m", ...)]`; the floor as `aux`.
- `bar`: the aux loss with `progress=True` (to `os.devnull`); the floor as `aux`.
- `per_step`: the aux loss with `execution=eqfit.PerStep()`: a program of one step called
  again and again. The hand scan is not the way it runs: its own floor is the usual loop
  (`usual_run`), a `jax.jit` step called from Python for each batch, keeping each step's
  loss and aux; both ratios are printed. It stops at `--per-step-epochs` (1,000 by
  default: 10,000 would take ten minutes a run on a CPU).

Each case prints µs per step at each length, the ratio to its floor, and the longest
length's cost per step over the shortest's (the aim: within 1.10x, and within 1.05x the
floor). `--memory` also runs the aux case's longest run in a fresh process and compares
its resident memory with `eqfit.plan`'s figure.

`--cpus 1` runs the whole process, both sides, on one CPU (`os.sched_setaffinity`): on a
small shared machine whose timings swing by tens of percent between runs, its ratios
repeat; it measures the steps without XLA's thread pool handing small kernels to another
core, so give its figures beside the default's, not for them.

    python benchmarks/long_runs.py [--epochs 100 1000 10000] [--cases aux ...]
        [--repeats 3] [--memory] [--quick] [--cpus N] [--out PATH]
"""

import argparse
import contextlib
import functools
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, finish, interleave, Keeps, load_average, table

import eqfit


N, FEATURES, BATCH, VAL = 4096, 8, 32, 512
STEPS = N // BATCH  # 128 an epoch
MEMBERS = 4
VAL_EVERY = 5 * STEPS
LOG_EVERY = 100
SCHEDULE = optax.cosine_decay_schedule(1e-3, 100_000)


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N + VAL, FEATURES)).astype(np.float32)
    y = (x @ rng.normal(size=FEATURES) > 0).astype(np.float32)
    return x[:N], y[:N], x[N:], y[N:]


def bce(model: Any, x: Any, y: Any) -> Any:
    return optax.sigmoid_binary_cross_entropy(jax.vmap(model)(x), y).mean()


def bce_aux(model: Any, x: Any, y: Any) -> Any:
    logits = jax.vmap(model)(x)
    acc = ((logits > 0) == (y > 0.5)).mean()
    return optax.sigmoid_binary_cross_entropy(logits, y).mean(), {"acc": acc}


def precision(model: Any, x: Any, y: Any) -> Any:
    predicted = jax.vmap(model)(x) > 0
    hits = jnp.sum(predicted & (y > 0.5))
    return hits / jnp.maximum(jnp.sum(predicted), 1)


def counts(model: Any, x: Any, y: Any) -> Any:
    """What `eqfit.metrics.Precision` adds up for a binary logit: the confusion counts."""
    predicted = (jax.vmap(model)(x) > 0).astype(jnp.int32)
    labels = (y > 0.5).astype(jnp.int32)
    true = jax.nn.one_hot(labels, 2, dtype=jnp.float32)
    pred = jax.nn.one_hot(predicted, 2, dtype=jnp.float32)
    return true.T @ pred


# -- The floor: a hand `jit(lax.scan)` over epochs of a `lax.scan` over steps.


def hand_run(
    case: str, epochs: int, optimizer: Any, static: Any, told: Keeps | None = None
) -> Callable[..., Any]:
    """The hand scan of `case`, jitted for `epochs`: `run(params, x, y, xv, yv)` returns
    the trained parameters and every per-step value, stacked `(epochs, steps, k)`. With
    `told`, it also tells `told.on_train_batch_end` each `LOG_EVERY`-th step's global
    number and the mean loss of the steps since the last, as the scan reaches it.
    """
    aux = case not in ("loss", "log_every", "validation_every")

    def step_values(params: Any, opt_state: Any, xb: Any, yb: Any) -> Any:
        model = eqx.combine(params, static)
        loss_fn = bce_aux if aux else bce

        def value(p: Any) -> Any:
            out = loss_fn(eqx.combine(p, static), xb, yb)
            return out if aux else (out, {})

        (loss, extra), grads = jax.value_and_grad(value, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        recorded = [loss, *extra.values()]
        if case == "metric":
            recorded = [loss, precision(model, xb, yb)]
        if case == "norms":
            recorded += [optax.global_norm(grads), optax.global_norm(updates)]
        if case == "schedules":
            recorded.append(SCHEDULE(opt_state[0].count - 1))
        stats = counts(model, xb, yb) if case == "stateful" else None
        return optax.apply_updates(params, updates), opt_state, jnp.stack(recorded), stats

    def tell(step: Any, mean: Any) -> None:
        assert told is not None
        told.on_train_batch_end(int(step), {"loss": float(mean)})

    def telling(window: Any, t: Any, loss: Any) -> Any:
        """The window's losses summed, told and restarted at each `LOG_EVERY`-th step."""
        window = window + loss
        due = t % LOG_EVERY == 0
        jax.lax.cond(
            due,
            lambda: jax.debug.callback(tell, t, window / LOG_EVERY, ordered=True),
            lambda: None,
        )
        return jnp.where(due, jnp.float32(0), window)

    def run(params: Any, x: Any, y: Any, xv: Any, yv: Any) -> Any:
        def validate(params: Any) -> Any:
            def batch(total: Any, i: Any) -> Any:
                xb = jax.lax.dynamic_slice_in_dim(xv, i * BATCH, BATCH)
                yb = jax.lax.dynamic_slice_in_dim(yv, i * BATCH, BATCH)
                return total + bce(eqx.combine(params, static), xb, yb) * BATCH, None

            total, _ = jax.lax.scan(batch, jnp.float32(0), jnp.arange(VAL // BATCH))
            return total / VAL

        def epoch(carry: Any, e: Any) -> Any:
            def step(carry: Any, i: Any) -> Any:
                params, opt_state, stats, validations, window = carry
                xb = jax.lax.dynamic_slice_in_dim(x, i * BATCH, BATCH)
                yb = jax.lax.dynamic_slice_in_dim(y, i * BATCH, BATCH)
                params, opt_state, recorded, batch_stats = step_values(params, opt_state, xb, yb)
                if batch_stats is not None:
                    stats = stats + batch_stats
                if told is not None:
                    window = telling(window, e * STEPS + i + 1, recorded[0])
                if case == "validation_every":
                    t = e * STEPS + i + 1
                    due = t % VAL_EVERY == 0
                    loss = jax.lax.cond(due, validate, lambda p: jnp.float32(jnp.nan), params)
                    validations = jax.lax.dynamic_update_index_in_dim(
                        validations,
                        jnp.where(due, loss, validations[t // VAL_EVERY - 1]),
                        jnp.maximum(t // VAL_EVERY - 1, 0),
                        0,
                    )
                return (params, opt_state, stats, validations, window), recorded

            params, opt_state, _, validations, window = carry
            fresh = jnp.zeros((2, 2))
            carry, recorded = jax.lax.scan(
                step, (params, opt_state, fresh, validations, window), jnp.arange(STEPS)
            )
            params, opt_state, stats, validations, window = carry
            value = stats[1, 1] / jnp.maximum(stats[:, 1].sum(), 1)  # the epoch's precision
            return (params, opt_state, None, validations, window), (recorded, value)

        validations = jnp.full(max(epochs * STEPS // VAL_EVERY, 1), jnp.nan)
        window = None if told is None else jnp.float32(0)  # the losses since the last told
        carry = (params, optimizer.init(params), None, validations, window)
        carry, outs = jax.lax.scan(epoch, carry, jnp.arange(epochs))
        return carry[0], carry[3], outs

    if case == "ensemble":
        return jax.jit(jax.vmap(run, in_axes=(0, None, None, None, None)))
    return jax.jit(run)


def usual_run(epochs: int, optimizer: Any, static: Any) -> Callable[..., Any]:
    """`PerStep`'s floor, the usual loop: a `jax.jit` step of the aux loss called from
    Python for each batch, its carry donated, the same unshuffled batches sliced on the
    device by a step counter that the carry holds (so that no call moves anything from
    the host), each step's loss and aux written in place into buffers of the run's
    `(epochs, steps)`. `run(params, x, y)` returns the trained parameters and the two
    buffers.
    """

    @functools.partial(jax.jit, donate_argnums=0)
    def step(carry: Any, x: Any, y: Any) -> Any:
        params, opt_state, t, losses, accs = carry
        i = t % STEPS
        xb = jax.lax.dynamic_slice_in_dim(x, i * BATCH, BATCH)
        yb = jax.lax.dynamic_slice_in_dim(y, i * BATCH, BATCH)

        def value(p: Any) -> Any:
            return bce_aux(eqx.combine(p, static), xb, yb)

        (loss, extra), grads = jax.value_and_grad(value, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        e = t // STEPS
        losses = losses.at[e, i].set(loss)
        accs = accs.at[e, i].set(extra["acc"])
        return optax.apply_updates(params, updates), opt_state, t + 1, losses, accs

    @jax.jit
    def start(params: Any) -> Any:
        zeros = jnp.zeros((epochs, STEPS), jnp.float32)
        # Copies: the steps donate the carry, and `params` is used again.
        copied = jax.tree.map(jnp.copy, params)
        return copied, optimizer.init(params), jnp.int32(0), zeros, zeros

    def run(params: Any, x: Any, y: Any) -> Any:
        carry = start(params)
        for _ in range(epochs * STEPS):
            carry = step(carry, x, y)
        return carry[0], carry[3], carry[4]

    return run


# -- eqfit's side.


def fit_kwargs(case: str, optimizer: Any, keeps: Keeps) -> dict[str, Any]:
    aux_loss: dict[str, Any] = {"loss": bce_aux, "optimizer": optimizer}
    return {
        "loss": {"loss": bce, "optimizer": optimizer},
        "aux": aux_loss,
        "metric": {"loss": bce, "optimizer": optimizer, "metrics": {"p": precision}},
        "stateful": {
            "loss": bce,
            "optimizer": optimizer,
            "metrics": {"p": eqfit.metrics.Precision()},
        },
        "norms": aux_loss | {"norms": True},
        "schedules": aux_loss | {"schedules": {"lr": SCHEDULE}},
        "log_every": {
            "loss": bce,
            "optimizer": optimizer,
            "log_every": LOG_EVERY,
            "callbacks": [keeps],
        },
        "validation_every": {
            "loss": bce,
            "optimizer": optimizer,
            "validation_every": VAL_EVERY,
        },
        "ensemble": aux_loss | {"ensemble": True},
        "updates": {"updates": [eqfit.Update("m", bce_aux, optimizer)]},
        "bar": aux_loss | {"progress": True},
        "per_step": aux_loss | {"execution": eqfit.PerStep()},
    }[case]


CASES = (
    "loss",
    "aux",
    "metric",
    "stateful",
    "norms",
    "schedules",
    "log_every",
    "validation_every",
    "ensemble",
    "updates",
    "bar",
    "per_step",
)


def models(case: str) -> Any:
    def one(key: Any) -> Any:
        return eqx.nn.MLP(FEATURES, "scalar", 16, 2, key=key)

    if case == "ensemble":
        return eqx.filter_vmap(one)(jax.random.split(jax.random.key(0), MEMBERS))
    return one(jax.random.key(0))


def variants(case: str, epochs: int) -> dict[str, Callable[[], Any]]:
    x, y, xv, yv = data()
    model = models(case)
    schedule = case == "schedules"
    optimizer = optax.adam(SCHEDULE if schedule else 1e-3)
    keeps = Keeps()
    kwargs = fit_kwargs(case, optimizer, keeps)
    validation = {"validation_data": (xv, yv)} if case == "validation_every" else {}
    key = jax.random.key(1)

    def fit() -> None:
        with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            result = eqfit.fit(
                model,
                (x, y),
                key=key,
                epochs=epochs,
                batch_size=BATCH,
                shuffle=False,
                **validation,
                **kwargs,
            )
        jax.block_until_ready(result.model)
        keeps.told.clear()

    params, static = eqx.partition(model, eqx.is_inexact_array)
    run = hand_run(case, epochs, optimizer, static)
    arrays = tuple(map(jnp.asarray, (x, y, xv, yv)))

    def hand() -> None:
        jax.block_until_ready(run(params, *arrays))

    runs = {"eqfit": fit, "hand": hand}
    if case == "log_every":  # the second floor: the hand scan tells a callback too
        told = Keeps()
        run_told = hand_run(case, epochs, optimizer, static, told)

        def hand_told() -> None:
            jax.block_until_ready(run_told(params, *arrays))
            jax.effects_barrier()  # every callback made
            told.told.clear()

        runs["told"] = hand_told
    if case == "per_step":  # its own floor: the usual loop
        loop = usual_run(epochs, optimizer, static)

        def usual() -> None:
            jax.block_until_ready(loop(params, *arrays[:2]))

        runs["usual"] = usual
    return runs


def measure(cases: list[str], lengths: list[int], per_step: int, repeats: int) -> list[dict]:
    results = []
    for case in cases:
        for epochs in lengths:
            if case == "per_step" and epochs > per_step:
                continue
            inner = 1 if epochs >= 1000 else 3
            times = interleave(variants(case, epochs), repeats, inner=inner)
            steps = epochs * STEPS
            row = {
                "case": case,
                "epochs": epochs,
                "steps": steps,
                "eqfit_us": times["eqfit"] / steps * 1e6,
                "hand_us": times["hand"] / steps * 1e6,
            }
            row["ratio"] = row["eqfit_us"] / row["hand_us"]
            extra = ""
            if "told" in times:  # the second floor (`log_every`'s)
                row["told_us"] = times["told"] / steps * 1e6
                row["told_ratio"] = row["eqfit_us"] / row["told_us"]
                extra = (
                    f"; hand telling a callback {row['told_us']:7.2f}, "
                    f"ratio {row['told_ratio']:.3f}"
                )
            if "usual" in times:  # `per_step`'s own floor
                row["usual_us"] = times["usual"] / steps * 1e6
                row["usual_ratio"] = row["eqfit_us"] / row["usual_us"]
                extra = f"; usual loop {row['usual_us']:7.2f}, ratio {row['usual_ratio']:.3f}"
            print(
                f"{case:>16} {epochs:>6} epochs: eqfit {row['eqfit_us']:7.2f} us a step, "
                f"hand {row['hand_us']:7.2f}, ratio {row['ratio']:.3f}{extra}",
                flush=True,
            )
            results.append(row)
    return results


def growth(results: list[dict], lengths: list[int]) -> list[list[str]]:
    """Each case's row of the table: µs per step at each length, and the growth;
    `per_step`'s also against the usual loop (its own floor), in a row of its own.
    """
    rows = []
    for case in dict.fromkeys(r["case"] for r in results):
        mine = [r for r in results if r["case"] == case]
        at = {r["epochs"]: r for r in mine}
        floors = [("hand", "ratio", case)]
        if "usual_us" in mine[0]:
            floors.append(("usual", "usual_ratio", f"{case} (vs usual loop)"))
        for floor, ratio, name in floors:
            cells = [
                f"{at[e]['eqfit_us']:.2f} / {at[e][floor + '_us']:.2f} ({at[e][ratio]:.3f})"
                if e in at
                else "-"
                for e in lengths
            ]
            grown = mine[-1]["eqfit_us"] / mine[0]["eqfit_us"]
            worst = max(r[ratio] for r in mine)
            rows.append([name, *cells, f"{grown:.3f}", f"{worst:.3f}"])
    return rows


def told_lines(results: list[dict]) -> list[str]:
    """The second floor's ratios (`log_every` against the hand scan that tells a
    callback each n-th step), a line per length.
    """
    return [
        f"{r['case']} at {r['epochs']:,} epochs against the hand scan telling a callback: "
        f"eqfit {r['eqfit_us']:.2f} / {r['told_us']:.2f} us a step ({r['told_ratio']:.3f})"
        for r in results
        if "told_us" in r
    ]


MEMORY_CHILD = """
import json, resource, sys
sys.path.insert(0, "benchmarks")
import jax, optax, eqfit
import long_runs as lr
x, y, _, _ = lr.data()
epochs = int(sys.argv[1])
model, optimizer = lr.models("aux"), optax.adam(1e-3)
kwargs = dict(loss=lr.bce_aux, optimizer=optimizer, key=jax.random.key(1), batch_size=lr.BATCH,
              shuffle=False)
small = eqfit.fit(model, (x, y), epochs=1, **kwargs)  # the runtime, warm, and a program
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
plan = eqfit.plan(model, (x, y), epochs=epochs, **kwargs)
result = eqfit.fit(model, (x, y), epochs=epochs, **kwargs)
jax.block_until_ready(result.model)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
history = sum(a.nbytes for a in [result.history.step_loss, *result.history.step_values.values()])
print(json.dumps({"epochs": epochs, "peak_growth": after - before, "plan_total": plan.memory.total,
                  "plan_argument": plan.memory.argument, "history_bytes": history}))
"""


def memory(epochs: int) -> dict[str, Any]:
    """The aux case's run of `epochs` in a fresh process: how much its peak resident
    memory grew over a warm one-epoch run's, against the plan's bytes.
    """
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(epochs)],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        f"memory at {epochs} epochs: peak resident grew {figures['peak_growth'] / 2**20:.1f} MiB; "
        f"the plan says {figures['plan_total'] / 2**20:.1f} MiB (arguments "
        f"{figures['plan_argument'] / 2**20:.1f}); the history's step arrays "
        f"{figures['history_bytes'] / 2**20:.1f} MiB"
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--per-step-epochs", type=int, default=1000)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--quick", action="store_true", help="10 and 100 epochs, 1 repeat")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/long_runs.json"))
    parser.add_argument("--cpus", type=int, default=None, help="run on this many CPUs only")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.repeats, args.per_step_epochs = [10, 100], 1, 10
    if args.cpus is not None:  # before JAX starts its backend, which sizes its threads by it
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    started, load = time.perf_counter(), load_average()
    results = measure(args.cases, args.epochs, args.per_step_epochs, args.repeats)
    header = ["case", *(f"{e:,} epochs: eqfit / floor us (ratio)" for e in args.epochs)]
    print()
    print(table([*header, "longest / shortest", "worst ratio"], growth(results, args.epochs)))
    for line in told_lines(results):
        print(line)
    payload: dict[str, Any] = {"config": config(), "args": vars(args) | {"out": str(args.out)}}
    payload["results"] = results
    if args.memory:
        payload["memory"] = memory(max(args.epochs))
    payload["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finish(args.out, payload, started, load)


if __name__ == "__main__":
    main()
