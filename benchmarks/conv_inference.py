"""Inference of a small CNN on the CPU: `fit`'s validation pass, `eqfit.evaluate` and
`eqfit.predict`, against a Python loop of one jitted function per batch (the floor).

The CNN is `model_families.py`'s: `Conv2d` 1->32->32, 3x3, padding 1, relu, then a head,
in two variants: `pool` (a mean over the 16x16 pixels, then a `Linear` to 10 classes, the
CNN of model_families.py) and `flat` (a `Linear` over the flattened 32*16*16 maps to 10).
16x16 one-channel random images, random labels in 10 classes,
`eqfit.losses.softmax_cross_entropy`, batch 32, `optax.adam(1e-3)`; 1,024 training and
1,024 validation images (256 each with `--quick`). Four checks per head, each a ratio of
medians of runs timed in one process, interleaved (`_common.interleave`: A B A B, the
order rotated each repeat, each sample the median of back-to-back runs):

1. `evaluate`: `eqfit.evaluate(model, (xv, yv), loss=..., batch_size=32)` against a
   Python loop over the batches calling one `eqx.filter_jit` function that slices the
   batch (by a device scalar index) and returns its loss times its size; the values
   stacked and summed once, read back at the end.
2. `predict`: `eqfit.predict(model, xv, batch_size=32)` against a Python loop of a
   jitted `jax.vmap(model)` per batch, the outputs concatenated, blocked on at the end.
3. `validation`: what validation adds to `fit` (`epochs=2`, the same key and objects
   every call): `fit(..., validation_data=(xv, yv))` minus the same `fit` without it,
   against the floor of check 1 times the epochs.
4. `fit + validation`: `fit` with validation against the usual loop: a Python `for` over
   epochs and batches calling one jitted train step (the epoch's permutation made on the
   device, each batch sliced inside the step), then check 1's Python-loop validation
   every epoch; nothing read back until the end.

The issue's target for every ratio is at most 1.10. The first call of each (compile
included) is timed apart, and a JAX compile-event listener counts what the timed runs
compiled. The machine's load average is printed before and after.

    python benchmarks/conv_inference.py [--repeats 5] [--quick] [--heads pool,flat] [--out PATH]
"""

import argparse
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
from _common import (
    CompileEvents,
    config,
    finish,
    interleave,
    load_average,
    table,
    timed,
    TRACE_EVENT,
)
from model_families import CNN, images

import eqfit


LEARNING_RATE = 1e-3
BATCH_SIZE = 32
EPOCHS = 2
IMAGE = 16
CLASSES = 10
TARGET = 1.10
LOSS = eqfit.losses.softmax_cross_entropy
HEADS = ("pool", "flat")

Data = tuple[jax.Array, jax.Array]
Run = Callable[[], Any]  # blocks until the device is done


class FlatCNN(eqx.Module):
    """Two 3x3 convolutions 1->32->32 with relu, a `Linear` over the flattened maps."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 32, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(32, 32, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(32 * IMAGE * IMAGE, CLASSES, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
        return self.head(h.reshape(-1))


def make_model(head: str) -> Any:
    key = jax.random.key(0)
    return CNN(key) if head == "pool" else FlatCNN(key)


def dataset(n: int, seed: int) -> Data:
    """`n` random images and random labels, on the device."""
    y = np.random.default_rng(seed + 100).integers(0, CLASSES, n).astype(np.int32)
    return jnp.asarray(images(n, seed)), jnp.asarray(y)


def batch_of(a: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, i * BATCH_SIZE, BATCH_SIZE)


# ---------------------------------------------------------------------------------------
# The floors: a Python loop of one jitted function per batch


@eqx.filter_jit
def batch_loss(model: Any, x: jax.Array, y: jax.Array, i: jax.Array) -> jax.Array:
    """The loss of batch `i` times its size."""
    return LOSS(model, batch_of(x, i), batch_of(y, i)) * BATCH_SIZE


@eqx.filter_jit
def batch_forward(model: Any, x: jax.Array, i: jax.Array) -> jax.Array:
    return jax.vmap(model)(batch_of(x, i))


def indices(n: int) -> list[jax.Array]:
    """The batch indices as device scalars, made once: a Python int would be a static
    argument of `filter_jit` (a compile per batch), a fresh array a transfer per call.
    """
    return [jnp.asarray(i, jnp.int32) for i in range(n // BATCH_SIZE)]


def loop_loss(model: Any, val: Data, batches: list[jax.Array]) -> jax.Array:
    """The mean validation loss, left on the device."""
    xv, yv = val
    values = [batch_loss(model, xv, yv, i) for i in batches]
    return jnp.sum(jnp.stack(values)) / xv.shape[0]


def make_evaluate_floor(model: Any, val: Data) -> Run:
    batches = indices(val[0].shape[0])
    return lambda: float(loop_loss(model, val, batches))


def make_predict_floor(model: Any, val: Data) -> Run:
    xv = val[0]
    batches = indices(xv.shape[0])

    def run() -> jax.Array:
        out = jnp.concatenate([batch_forward(model, xv, i) for i in batches])
        return jax.block_until_ready(out)

    return run


def make_usual(model: Any, train: Data, val: Data, optimizer: Any) -> Run:
    """The usual loop, with the floor's validation after every epoch."""
    x, y = train
    n = x.shape[0]
    steps = indices(n)
    val_batches = indices(val[0].shape[0])
    key = jax.random.key(0)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @jax.jit
    def shuffle(key: jax.Array, e: int) -> jax.Array:
        order = jax.random.permutation(jax.random.fold_in(key, e), n)
        return order[: len(steps) * BATCH_SIZE]

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, order: jax.Array, i: jax.Array) -> Any:
        idx = batch_of(order, i)
        loss, grads = eqx.filter_value_and_grad(LOSS)(model, x[idx], y[idx])
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    def run() -> Any:
        m, s = model, opt_state
        losses, val_losses = [], []
        for e in range(EPOCHS):
            order = shuffle(key, e)
            for i in steps:
                m, s, loss = step(m, s, order, i)
                losses.append(loss)  # kept on the device: no sync per step
            val_losses.append(loop_loss(m, val, val_batches))
        return jax.block_until_ready((m, s, losses, val_losses))

    return run


# ---------------------------------------------------------------------------------------
# eqfit


def make_fit(model: Any, train: Data, val: Data | None, optimizer: Any) -> Run:
    key = jax.random.key(0)

    def run() -> eqfit.FitResult:
        # `fit` reads its history back before it returns: nothing is left in flight.
        return eqfit.fit(
            model,
            train,
            loss=LOSS,
            optimizer=optimizer,
            key=key,
            epochs=EPOCHS,
            batch_size=BATCH_SIZE,
            validation_data=val,
        )

    return run


def execution_of(model: Any, train: Data, val: Data | None, optimizer: Any) -> str:
    """How `fit` runs these steps, by `eqfit.plan` (after the first call: cached)."""
    plan = eqfit.plan(
        model,
        train,
        loss=LOSS,
        optimizer=optimizer,
        key=jax.random.key(0),
        epochs=EPOCHS,
        batch_size=BATCH_SIZE,
        validation_data=val,
    )
    return plan.execution.describe()


# ---------------------------------------------------------------------------------------
# Timing


def measure(
    head: str, train: Data, val: Data, repeats: int, inner: int, events: CompileEvents
) -> dict[str, Any]:
    model = make_model(head)
    xv, yv = val
    inference: dict[str, Run] = {
        "evaluate": lambda: eqfit.evaluate(model, (xv, yv), loss=LOSS, batch_size=BATCH_SIZE),
        "evaluate_floor": make_evaluate_floor(model, val),
        "predict": lambda: jax.block_until_ready(eqfit.predict(model, xv, batch_size=BATCH_SIZE)),
        "predict_floor": make_predict_floor(model, val),
    }
    # Each its own optimizer object, kept for every call, so that nothing recompiles.
    fit_val_opt, fit_opt = optax.adam(LEARNING_RATE), optax.adam(LEARNING_RATE)
    fits: dict[str, Run] = {
        "fit_val": make_fit(model, train, val, fit_val_opt),
        "fit": make_fit(model, train, None, fit_opt),
        "usual_val": make_usual(model, train, val, optax.adam(LEARNING_RATE)),
    }
    first: dict[str, float] = {}
    first_compiles: dict[str, int] = {}
    for name, run in {**inference, **fits}.items():
        events.reset()
        first[name] = timed(run)
        first_compiles[name] = events.backend_compiles()
    # The same numbers both ways: the validation loss, and the predictions.
    loss_eqfit = inference["evaluate"]()["loss"]
    loss_floor = inference["evaluate_floor"]()
    predict_diff = float(jnp.max(jnp.abs(inference["predict"]() - inference["predict_floor"]())))
    # A second call of `evaluate`: what a fresh call costs once compiled.
    events.reset()
    second_evaluate = timed(inference["evaluate"])
    second_compiles = events.backend_compiles()
    execution = {
        "fit_val": execution_of(model, train, val, fit_val_opt),
        "fit": execution_of(model, train, None, fit_opt),
    }
    print(f"  {head}: first calls done; timing inference...", file=sys.stderr)
    events.reset()
    inference_s = interleave(inference, repeats, inner)
    inference_compiles = events.backend_compiles()
    inference_traces = events.count.get(TRACE_EVENT, 0)
    print(f"  {head}: timing fits...", file=sys.stderr)
    events.reset()
    # A fit runs for a second or more: one run a sample.
    fits_s = interleave(fits, repeats, inner=1)
    fits_compiles = events.backend_compiles()
    fits_traces = events.count.get(TRACE_EVENT, 0)
    return {
        "parameters": sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))),
        "first_call_s": first,
        "first_call_compiles": first_compiles,
        "evaluate_second_call_s": second_evaluate,
        "evaluate_second_call_compiles": second_compiles,
        "execution": execution,
        "agree": {
            "evaluate_loss": loss_eqfit,
            "floor_loss": loss_floor,
            "predict_max_abs_diff": predict_diff,
        },
        "seconds": {**inference_s, **fits_s},
        "timed_compiles": {"inference": inference_compiles, "fits": fits_compiles},
        "timed_traces": {"inference": inference_traces, "fits": fits_traces},
    }


# ---------------------------------------------------------------------------------------
# Report


def checks(m: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each check's eqfit ms, floor ms and ratio."""
    s = {k: v * 1e3 for k, v in m["seconds"].items()}
    added = s["fit_val"] - s["fit"]
    floor = s["evaluate_floor"] * EPOCHS
    pairs = {
        "evaluate": (s["evaluate"], s["evaluate_floor"]),
        "predict": (s["predict"], s["predict_floor"]),
        "validation": (added, floor),
        "fit + validation": (s["fit_val"], s["usual_val"]),
    }
    return {k: {"ms": a, "floor_ms": b, "ratio": a / b} for k, (a, b) in pairs.items()}


WHAT = {
    "evaluate": "eqfit.evaluate / loop of jitted batch loss",
    "predict": "eqfit.predict / loop of jitted vmap(model)",
    "validation": f"(fit with - without validation) / {EPOCHS} x evaluate floor",
    "fit + validation": "fit with validation / usual loop with loop validation",
}


def report(heads: list[str], measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    rows, fit_rows, first_rows = [], [], []
    for head in heads:
        m = measured[head]
        c = checks(m)
        results[head] = {**m, "checks": c}
        for name, v in c.items():
            rows.append(
                [
                    head,
                    name,
                    f"{v['ms']:,.1f}",
                    f"{v['floor_ms']:,.1f}",
                    f"{v['ratio']:.3f}",
                    f"≤ {TARGET:.2f}",
                    "yes" if v["ratio"] <= TARGET else "NO",
                ]
            )
        s = m["seconds"]
        fit_rows.append(
            [
                head,
                f"{s['fit_val'] * 1e3:,.1f}",
                f"{s['fit'] * 1e3:,.1f}",
                f"{s['usual_val'] * 1e3:,.1f}",
                m["execution"]["fit_val"],
                f"{m['timed_compiles']['inference']} / {m['timed_compiles']['fits']}",
                f"{m['timed_traces']['inference']} / {m['timed_traces']['fits']}",
            ]
        )
        f = m["first_call_s"]
        first_rows.append(
            [head]
            + [f"{f[k]:.2f} ({m['first_call_compiles'][k]})" for k in f]
            + [f"{m['evaluate_second_call_s'] * 1e3:,.1f} ({m['evaluate_second_call_compiles']})"]
        )
    print("\n## Checks: steady ms (medians over repeats) and ratios to the floor\n")
    print("\n".join(f"- {k}: {v}" for k, v in WHAT.items()) + "\n")
    header = ["head", "check", "eqfit ms", "floor ms", "ratio", "target", "meets"]
    print(table(header, rows))
    print(f"\n## The fits ({EPOCHS} epochs), ms, and what the timed runs compiled\n")
    header = ["head", "fit + val ms", "fit ms", "usual + val ms", "fit's execution"]
    print(table([*header, "compiles inf / fits", "traces inf / fits"], fit_rows))
    print("\n## First calls (compile included), s (XLA compiles)\n")
    names = list(measured[heads[0]]["first_call_s"])
    print(table(["head", *names, "evaluate 2nd call ms"], first_rows))
    print("\n## The same numbers: validation loss (eqfit, floor), predict's max |difference|\n")
    agree_rows = [
        [
            head,
            f"{a['evaluate_loss']:.6f}",
            f"{a['floor_loss']:.6f}",
            f"{a['predict_max_abs_diff']:.2e}",
        ]
        for head in heads
        for a in [measured[head]["agree"]]
    ]
    print(table(["head", "evaluate loss", "floor loss", "predict max diff"], agree_rows))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 2 repeats, 256 images per set"
    )
    parser.add_argument("--heads", default=",".join(HEADS), help=f"comma-separated, of {HEADS}")
    default_out = Path(__file__).parent / "results" / "conv_inference.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    heads = [h for h in args.heads.split(",") if h]
    unknown = set(heads) - set(HEADS)
    if unknown or not heads:
        parser.error(f"unknown heads {sorted(unknown)}; choose from {HEADS}")
    repeats = 2 if args.quick else args.repeats
    inner = 1 if args.quick else 3
    n = 256 if args.quick else 1024

    load_before = load_average()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}")
    start = time.perf_counter()
    events = CompileEvents()
    train, val = dataset(n, 0), dataset(n, 1)
    measured = {}
    for head in heads:
        print(f"{head}: first calls, then {repeats} repeats...", file=sys.stderr)
        measured[head] = measure(head, train, val, repeats, inner, events)

    cfg = {
        **config(),
        "optimizer": f"optax.adam({LEARNING_RATE})",
        "batch_size": BATCH_SIZE,
        "epochs": EPOCHS,
        "train_images": n,
        "validation_images": n,
        "repeats": repeats,
        "inner_runs_per_sample": {"inference": inner, "fits": 1},
        "heads": heads,
        "quick": args.quick,
    }
    print("\n# conv_inference\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); eqfit from "
        f"{cfg['eqfit_path']}; {n} training and {n} validation images 16x16, batch "
        f"{BATCH_SIZE}, {cfg['optimizer']}; repeats={repeats} (inference samples the median "
        f"of {inner} runs, fits of 1), interleaved in one process"
    )
    results: dict[str, Any] = {"heads": report(heads, measured)}
    results["config"] = cfg
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
