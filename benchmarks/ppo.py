"""PureJaxRL's PPO through `eqfit.fit` (no dataset, an update of one's own) against the
same iterations as one hand-written `jit(lax.scan)`, PureJaxRL's own form.

Both run `examples/ppo.py`'s `ppo_iteration` (PureJaxRL's `_update_step`: a rollout of 4
gymnax CartPole-v1 environments for 128 steps, GAE, 4 epochs of 4 minibatches of Adam)
from the same network and the same keys:

1. `eqfit`: `examples/ppo.py`'s `train`, `eqfit.fit(network, updates=[PPO(...)],
   steps_per_epoch=..., epochs=..., key=key)`, whose update's `init` gets the key
   `fold_in(fold_in(key, 3), 0)`.
2. `hand`: `eqx.filter_jit` of `start` with that key, then a `lax.scan` of
   `ppo_iteration` over every iteration.

The returns of each iteration (the sum of the returns of the episodes that ended over
their number) and the final networks are compared. The run time is each way's second
and later calls, interleaved in one process (`_common.interleave`); the first call,
compile included, is timed in fresh processes, the two ways alternating, as a user meets
it. Needs gymnax (`pip install -e ".[rl]"`).

    python benchmarks/ppo.py [--repeats 3] [--firsts 3] [--quick] [--out PATH]
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import equinox as eqx
import jax
import numpy as np
from _common import config, finish, interleave, load_average, median, table


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example() -> ModuleType:
    """examples/ppo.py, as a module (by its path: `import ppo` would find this script)."""
    spec = importlib.util.spec_from_file_location("ppo_example", EXAMPLES / "ppo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EX = load_example()


def fit_run(iterations: int) -> Any:
    """`fit`'s run of `iterations` PPO iterations, in one epoch."""
    result = EX.train(seeds=1, epochs=1, steps_per_epoch=iterations)
    jax.block_until_ready(result.model)
    return result


def keys() -> tuple[Any, Any]:
    """The network's key and `fit`'s, as `train` splits them."""
    network_key, key = jax.random.split(jax.random.key(0))
    return network_key, key


@eqx.filter_jit
def hand_program(network: Any, key: Any, iterations: int) -> Any:
    """PureJaxRL's `train`: the runner made, then a scan of the iterations."""
    runner = EX.start(eqx.filter(network, eqx.is_inexact_array), key)

    def body(carry: Any, _: None) -> Any:
        network, runner = carry
        network, runner, figures = EX.ppo_iteration(network, runner)
        return (network, runner), figures

    (network, runner), figures = jax.lax.scan(body, (network, runner), None, iterations)
    return network, figures


def hand_run(iterations: int) -> Any:
    network_key, key = keys()
    init_key = jax.random.fold_in(jax.random.fold_in(key, 3), 0)  # as `fit` gives `init`
    out = hand_program(EX.networks(network_key), init_key, iterations)
    jax.block_until_ready(out)
    return out


def first_call(way: str, iterations: int) -> None:
    """In a fresh process: the first call's seconds, compile included, as JSON."""
    began = time.perf_counter()
    (fit_run if way == "eqfit" else hand_run)(iterations)
    print(json.dumps({"way": way, "seconds": time.perf_counter() - began}))


def firsts(iterations: int, pairs: int) -> dict[str, list[float]]:
    """First calls in fresh processes, the two ways alternating (the order swapped each
    pair)."""
    seconds: dict[str, list[float]] = {"eqfit": [], "hand": []}
    for i in range(pairs):
        for way in ("eqfit", "hand") if i % 2 == 0 else ("hand", "eqfit"):
            out = subprocess.run(
                [sys.executable, __file__, "--first", way, "--iterations", str(iterations)],
                capture_output=True,
                text=True,
                check=True,
            )
            seconds[way].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--firsts", type=int, default=3, help="pairs of fresh processes")
    parser.add_argument("--iterations", type=int, default=EX.NUM_UPDATES)
    parser.add_argument("--quick", action="store_true", help="a smoke test: 48 iterations")
    parser.add_argument("--first", choices=("eqfit", "hand"), help=argparse.SUPPRESS)
    default_out = Path(__file__).parent / "results" / "ppo.json"
    parser.add_argument("--out", type=Path, default=default_out, help="JSON output path")
    args = parser.parse_args()
    iterations = 48 if args.quick else args.iterations
    if args.first is not None:
        first_call(args.first, iterations)
        return
    load_before = load_average()
    began = time.perf_counter()
    # The same run both ways: the returns of every iteration, and the final network.
    result = fit_run(iterations)
    network, figures = hand_run(iterations)
    with np.errstate(invalid="ignore"):
        hand_returns = np.asarray(figures["returns"]) / np.asarray(figures["episodes"])
    fit_returns = result.history.step_values["ppo_return"].reshape(-1)
    same_returns = bool(np.array_equal(fit_returns, hand_returns, equal_nan=True))
    differences = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(
            jax.tree.leaves(eqx.filter(result.model, eqx.is_inexact_array)),
            jax.tree.leaves(eqx.filter(network, eqx.is_inexact_array)),
        )
    ]
    print(f"first calls in fresh processes, {args.firsts} pairs...", file=sys.stderr)
    first = firsts(iterations, args.firsts)
    print(f"run times, {args.repeats} repeats...", file=sys.stderr)
    runs = interleave(
        {"eqfit": lambda: fit_run(iterations), "hand": lambda: hand_run(iterations)},
        args.repeats,
        inner=1,
    )
    first_ratio = median([a / b for a, b in zip(first["eqfit"], first["hand"])])
    rows = [
        [
            "run (second call on)",
            f"{runs['eqfit']:.3f} s",
            f"{runs['hand']:.3f} s",
            f"{runs['eqfit'] / runs['hand']:.3f}",
        ],
        [
            "first call (fresh process)",
            f"{median(first['eqfit']):.2f} s",
            f"{median(first['hand']):.2f} s",
            f"{first_ratio:.3f} (median of pairs)",
        ],
    ]
    print(f"\n# ppo: {iterations} iterations of PureJaxRL's PPO on CartPole-v1\n")
    print(table(["", "eqfit", "hand jit(lax.scan)", "eqfit / hand"], rows))
    print(
        f"\nreturns equal in every iteration: {same_returns}; final networks' largest "
        f"difference {max(differences):.3g}; the run's mean return over its episodes "
        f"{result.history['ppo_return'][-1]:.1f}"
    )
    results = {
        "iterations": iterations,
        "run_seconds": runs,
        "run_ratio": runs["eqfit"] / runs["hand"],
        "first_call_seconds": first,
        "first_call_ratio_median_of_pairs": first_ratio,
        "same_returns": same_returns,
        "largest_network_difference": max(differences),
        "config": config(),
    }
    finish(args.out, results, began, load_before)


if __name__ == "__main__":
    main()
