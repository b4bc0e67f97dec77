"""What each feature for real models costs: `eqfit.fit` against the same loop by hand.

Trains an MLP 16->128->128->1 with Adam(1e-3) and MSE on N=8192 synthetic samples for 5
epochs at batch 256 (160 steps), a new shuffle every epoch, in six cases:

- `plain`: no feature, the reference;
- `bf16`: `precision="bfloat16"`;
- `ema`: `ema=0.99`;
- `norms`: `norms=True`;
- `aux`: a loss that returns `(mse, {"mae": mean absolute error})`;
- `all`: the four together.

Each case runs two ways: `eqfit.fit(...)`, and a hand-written `jax.jit` of a `lax.scan`
over epochs of a `lax.scan` over batches doing the same work (eqfit's shuffle; the
parameters and the batch cast to bfloat16 inside the loss; the moving average in the
scan's carry; `optax.tree.norm` of the gradients and the updates, stacked per step; the
aux values from `eqx.filter_value_and_grad(has_aux=True)`, stacked per step). Reported:
eqfit / hand-written per case, and each case against `plain` on either side.

All twelve variants run in one process, interleaved, each pair of a case's two variants
side by side; nothing recompiles in the timed loop (a JAX compile-event listener counts).
A case that `eqfit.fit` refuses is reported and left out, so that the hand-written side
can be measured on its own.

    python benchmarks/real_models.py [--repeats 7] [--quick] [--cases ema,norms] [--out PATH]
"""

import argparse
import sys
import time
import traceback
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
    load_average,
    median,
    regression_data,
    table,
    timed,
)

import eqfit
from eqfit._core._data import epoch_order, shuffle_seed


IN_FEATURES, WIDTH, DEPTH = 16, 128, 2
LEARNING_RATE = 1e-3
NUM_SAMPLES = 8192
EPOCHS = 5
BATCH_SIZE = 256
EMA = 0.99  # over 160 steps; 0.999 would leave most of the average at the start (warned)
FEATURES = ("bf16", "ema", "norms", "aux")
CASES: dict[str, tuple[str, ...]] = {
    "plain": (),
    "bf16": ("bf16",),
    "ema": ("ema",),
    "norms": ("norms",),
    "aux": ("aux",),
    "all": FEATURES,
}
SIDES = ("eqfit", "hand")

Data = tuple[jax.Array, jax.Array]
Run = Callable[[], Any]  # one full training run; blocks until the device is done


def make_data(seed: int = 0) -> Data:
    x, y = regression_data(NUM_SAMPLES, IN_FEATURES, seed)
    return jnp.asarray(x), jnp.asarray(y)


def make_model(seed: int) -> eqfit.models.MLP:
    return eqfit.models.MLP(IN_FEATURES, "scalar", WIDTH, DEPTH, key=jax.random.key(seed))


# ---------------------------------------------------------------------------------------
# The losses, the same functions on both sides


def mse(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def mse_with_aux(model: Any, x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """The loss and its mean absolute error, from the one forward pass."""
    error = jax.vmap(model)(x) - y
    return jnp.mean(error**2), {"mae": jnp.mean(jnp.abs(error))}


# ---------------------------------------------------------------------------------------
# eqfit


def fit_options(features: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {"loss": mse_with_aux if "aux" in features else mse}
    if "bf16" in features:
        options["precision"] = "bfloat16"
    if "ema" in features:
        options["ema"] = EMA
    if "norms" in features:
        options["norms"] = True
    return options


def make_eqfit(
    model: Any, data: Data, features: tuple[str, ...], key: jax.Array
) -> Callable[[], eqfit.FitResult]:
    """One `eqfit.fit` of the case, timed as the call alone: it returns only once its
    program has finished (see `fit_speed.py`).
    """
    optimizer = optax.adam(LEARNING_RATE)  # its own object: its own compiled program
    options = fit_options(features)

    def run() -> eqfit.FitResult:
        return eqfit.fit(
            model,
            data,
            optimizer=optimizer,
            key=key,
            epochs=EPOCHS,
            batch_size=BATCH_SIZE,
            **options,
        )

    return run


# ---------------------------------------------------------------------------------------
# The same work by hand


def to_bfloat16(tree: Any) -> Any:
    """Each floating array cast to bfloat16; any other leaf as it is."""

    def cast(a: Any) -> Any:
        return a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a

    return jax.tree.map(cast, tree)


def make_hand(model: Any, data: Data, features: tuple[str, ...], key: jax.Array) -> Run:
    """A jitted whole run of the case, written plainly with `eqx.partition`/`combine`.

    The run returns `((params, opt_state, average), per_step)`: `per_step` holds each step's
    loss, and the norms and aux values the case records, each `(epochs, steps)`.
    """
    optimizer = optax.adam(LEARNING_RATE)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    bf16, ema, norms, aux = (f in features for f in FEATURES)
    loss = mse_with_aux if aux else mse
    steps = NUM_SAMPLES // BATCH_SIZE  # the batch divides N: no remainder step
    x, y = data

    def objective(p: Any, xb: jax.Array, yb: jax.Array) -> Any:
        if bf16:  # cast inside the differentiated function: the gradients come back float32
            p, xb, yb = to_bfloat16((p, xb, yb))
        return loss(eqx.combine(p, static), xb, yb)

    def gather(a: jax.Array, idx: jax.Array) -> jax.Array:
        # A permutation's indices: in bounds and unique, as eqfit's `take` promises.
        return a.at[idx].get(mode="promise_in_bounds", unique_indices=True)

    @jax.jit
    def train(p: Any, opt_state: Any, x: jax.Array, y: jax.Array, key: jax.Array) -> Any:
        def epoch(carry: Any, e: jax.Array) -> Any:
            def step(carry: Any, idx: jax.Array) -> Any:
                p, opt_state, average = carry
                grad_fn = eqx.filter_value_and_grad(objective, has_aux=aux)
                out, grads = grad_fn(p, gather(x, idx), gather(y, idx))
                value, values = out if aux else (out, {})
                updates, opt_state = optimizer.update(grads, opt_state, p)
                p = optax.apply_updates(p, updates)
                record = {"loss": value, **values}
                if ema:
                    average = jax.tree.map(lambda a, w: EMA * a + (1 - EMA) * w, average, p)
                if norms:
                    record["grad_norm"] = optax.tree.norm(grads)
                    record["update_norm"] = optax.tree.norm(updates)
                record = jax.tree.map(lambda v: jnp.mean(v.astype(jnp.float32)), record)
                return (p, opt_state, average), record

            order = epoch_order(shuffle_seed(key), e, NUM_SAMPLES, True)
            return jax.lax.scan(step, carry, order.reshape(steps, BATCH_SIZE))

        average = p if ema else None
        return jax.lax.scan(epoch, (p, opt_state, average), jnp.arange(EPOCHS))

    return lambda: jax.block_until_ready(train(params, opt_state, x, y, key))


# ---------------------------------------------------------------------------------------
# Checks that both sides did the same work


def max_abs(a: Any, b: Any) -> float:
    diffs = jax.tree.map(lambda u, v: jnp.max(jnp.abs(u - v)), a, b)
    return float(max(jax.tree.leaves(diffs)))


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def compare(model: Any, features: tuple[str, ...], result: eqfit.FitResult, hand: Any) -> dict:
    """How far eqfit's result is from the hand-written run's: the trained parameters, the
    average, and each recorded value, per epoch (its mean) and per step.
    """
    (params, _, average), per_step = hand
    history = result.history
    out: dict[str, Any] = {
        "params_max_abs": max_abs(eqx.filter(result.model, eqx.is_inexact_array), params)
    }
    if "ema" in features:
        out["ema_max_abs"] = max_abs(eqx.filter(result.ema_model, eqx.is_inexact_array), average)
    for name, values in per_step.items():
        # One batch size throughout, so an epoch's value is the plain mean of its steps.
        out[f"{name}_epoch_max_rel"] = max_rel(history[name], np.mean(values, axis=1))
        steps = history.step_loss if name == "loss" else history.step_values[name]
        out[f"{name}_step_max_rel"] = max_rel(steps, values)
    return out


# ---------------------------------------------------------------------------------------
# Steady state


def variant(case: str, side: str) -> str:
    return f"{case}/{side}"


def steady_state(
    runs: dict[str, Run], repeats: int, inner: int, events: CompileEvents
) -> tuple[dict[str, list[float]], int]:
    """Interleaved timings, as in `fit_speed.py`: each repeat runs every variant once
    untimed, then `inner` rounds of every variant in turn, and keeps each variant's median.
    The order rotates by one case each repeat; a case's two variants stay side by side,
    so that each paired ratio compares runs that saw the same state of the machine.
    """
    cases = list(dict.fromkeys(name.split("/")[0] for name in runs))
    times: dict[str, list[float]] = {name: [] for name in runs}
    events.reset()
    for r in range(repeats):
        rotated = cases[r % len(cases) :] + cases[: r % len(cases)]
        order = [variant(c, s) for c in rotated for s in SIDES if variant(c, s) in runs]
        for name in order:
            runs[name]()
        samples: dict[str, list[float]] = {name: [] for name in order}
        for _ in range(inner):
            for name in order:
                samples[name].append(timed(runs[name]))
        for name in order:
            times[name].append(median(samples[name]))
        print(f"  steady state: repeat {r + 1}/{repeats}", file=sys.stderr)
    return times, events.backend_compiles()


# ---------------------------------------------------------------------------------------
# Report


def ratio(times: dict[str, list[float]], a: str, b: str) -> dict[str, float] | None:
    if a not in times or b not in times:
        return None
    return {
        "of_medians": median(times[a]) / median(times[b]),
        "paired_median": median([x / y for x, y in zip(times[a], times[b])]),
    }


def cell(r: dict[str, float] | None) -> str:
    return "—" if r is None else f"{r['of_medians']:.3f} ({r['paired_median']:.3f})"


def report(
    times: dict[str, list[float]],
    first: dict[str, float],
    failed: dict[str, str],
    cases: list[str],
) -> dict[str, Any]:
    steps = EPOCHS * (NUM_SAMPLES // BATCH_SIZE)
    results: dict[str, Any] = {"steady": {}, "ratios": {}}
    rows = []
    for case in cases:
        for side in SIDES:
            name = variant(case, side)
            if name not in times:
                rows.append([case, side, "failed", "", "", ""])
                continue
            m = median(times[name])
            results["steady"][name] = {
                "median_s": m,
                "us_per_step": m / steps * 1e6,
                "steps_per_s": steps / m,
                "first_call_s": first[name],
                "runs_s": times[name],
            }
            rows.append(
                [
                    case,
                    side,
                    f"{m * 1e3:.2f}",
                    f"{m / steps * 1e6:.1f}",
                    f"{steps / m:,.0f}",
                    f"{first[name] * 1e3:,.0f}",
                ]
            )
    print("\n## Steady state (median of repeats, compile excluded)\n")
    header = ["case", "side", "ms/run", "µs/step", "steps/s", "first call ms"]
    print(table(header, rows))

    rows = []
    for case in cases:
        against_hand = ratio(times, variant(case, "eqfit"), variant(case, "hand"))
        eqfit_cost = ratio(times, variant(case, "eqfit"), variant("plain", "eqfit"))
        hand_cost = ratio(times, variant(case, "hand"), variant("plain", "hand"))
        results["ratios"][case] = {
            "eqfit/hand": against_hand,
            "eqfit/eqfit_plain": eqfit_cost,
            "hand/hand_plain": hand_cost,
        }
        rows.append([case, cell(against_hand), cell(eqfit_cost), cell(hand_cost)])
    print("\n## Ratios: of medians (median of paired runs)\n")
    print("(eqfit / hand-written: target at most 1.05; the cost of a case: against `plain`)\n")
    header = ["case", "eqfit / hand-written", "eqfit / eqfit plain", "hand / hand plain"]
    print(table(header, rows))
    for name, error in failed.items():
        print(f"\n{name} failed, left out: {error}")
    results["failed"] = failed
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 repeats")
    default_out = Path(__file__).parent / "results" / "real_models.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help="comma-separated cases to run (plain always runs: it is the reference)",
    )
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; the cases are {list(CASES)}")
    cases = {c: f for c, f in CASES.items() if c == "plain" or c in args.cases.split(",")}
    inner = 1 if args.quick else 3

    start = time.perf_counter()
    load_before = load_average()
    events = CompileEvents()
    data = make_data()
    model = make_model(0)
    key = jax.random.key(0)

    print("compiling and warming up...", file=sys.stderr)
    runs: dict[str, Run] = {}
    first: dict[str, float] = {}
    failed: dict[str, str] = {}
    outputs: dict[str, Any] = {}
    for case, features in cases.items():
        makers = {"eqfit": make_eqfit, "hand": make_hand}
        for side, make in makers.items():
            name = variant(case, side)
            run = make(model, data, features, key)
            try:
                begin = time.perf_counter()
                outputs[name] = run()
                first[name] = time.perf_counter() - begin
            except Exception as e:  # the feature may not be there yet: say so, go on
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                traceback.print_exc(limit=-2, file=sys.stderr)
                continue
            run()  # a second warm-up: caches, allocator
            runs[name] = run

    checks: dict[str, Any] = {}
    for case, features in cases.items():
        a, b = variant(case, "eqfit"), variant(case, "hand")
        if a in outputs and b in outputs:
            try:
                checks[case] = compare(model, features, outputs[a], outputs[b])
            except Exception as e:  # a check of an API still in the making
                checks[case] = {"error": f"{type(e).__name__}: {e}"}

    print("timing the steady state...", file=sys.stderr)
    times, recompiles = steady_state(runs, repeats, inner, events)

    cfg = {
        **config(),
        "model": f"eqfit.models.MLP({IN_FEATURES}, 'scalar', {WIDTH}, {DEPTH})",
        "optimizer": f"optax.adam({LEARNING_RATE})",
        "loss": "mse; mse with {'mae': mean absolute error} as aux",
        "ema": EMA,
        "num_samples": NUM_SAMPLES,
        "epochs": EPOCHS,
        "batch_size": BATCH_SIZE,
        "repeats": repeats,
        "inner_runs_per_sample": inner,
        "quick": args.quick,
        "cases": list(cases),
    }
    steps = EPOCHS * (NUM_SAMPLES // BATCH_SIZE)
    print("\n# real_models\n")
    print(
        f"JAX {cfg['jax']} on {cfg['device']} ({cfg['cpu_count']} CPUs); {cfg['model']}, "
        f"{cfg['optimizer']}, N={NUM_SAMPLES}, batch {BATCH_SIZE}, {EPOCHS} epochs "
        f"({steps} steps), ema={EMA}; repeats={repeats}, each the median of {inner} runs"
    )
    results = report(times, first, failed, list(cases))

    print("\n## Checks\n")
    print(f"XLA compilations during the timed steady state: {recompiles}")
    for case, c in checks.items():
        print(
            f"{case}: "
            + ", ".join(
                f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()
            )
        )
    results.update(checks=checks, steady_recompiles=recompiles, config=cfg)
    finish(args.out, results, start, load_before)


if __name__ == "__main__":
    main()
