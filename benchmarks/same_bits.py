"""Same bits before and after a change: trains eleven configurations that cover `fit`'s paths
and saves every array of their results (the history's values and per-step values, the
step losses, the model, the optimizer state, the average) to an npz; run it in two
checkouts and compare the files. A refactor that says "no change in behaviour" shows it
this way: every array equal, dtype and NaNs included.

    PYTHONPATH=../before python benchmarks/same_bits.py save before.npz  # the old code
    PYTHONPATH=. python benchmarks/same_bits.py save after.npz
    python benchmarks/same_bits.py compare before.npz after.npz

`save --guard off` runs those of them that can be replayed with `guard=False` (the
updates applied with no `cond` around them: `eqfit.WholeRun`'s `guard`), and `--guard
on` the same ones with `guard=True` (the `cond`); by default each runs as `fit`
chooses. Compared with each other, every array must be equal too.

The configurations: one loss with `ema=`, `norms=` and validation; `inject_hyperparams`;
three updates (two built-in, one every third step, and one of the user's own) with norms
and validation; a weighted-mean loss with batches of weight 0 and validation;
`microbatches=4`; `PerStep(2)`; `devices=8`; a mesh of 8 with `shard=`; a convolutional
net with a metric; bfloat16; an ensemble of three members with two updates.
"""

import argparse
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqfit


jax.config.update("jax_num_cpu_devices", 8)  # before any device is touched


_rng = np.random.default_rng(0)
X = _rng.normal(size=(100, 5)).astype(np.float32)
Y = (X @ _rng.normal(size=(5, 1))).astype(np.float32)
W = (_rng.uniform(size=100) > 0.3).astype(np.float32)
W[32:48] = 0  # a batch of weight 0
IMAGES = _rng.normal(size=(64, 1, 8, 8)).astype(np.float32)
LABELS = _rng.integers(0, 3, size=64).astype(np.int32)


class Pair(eqx.Module):
    a: eqx.nn.MLP
    b: eqx.nn.Linear


def pair() -> Pair:
    k1, k2 = jax.random.split(jax.random.key(1))
    return Pair(eqx.nn.MLP(5, 1, 16, 2, key=k1), eqx.nn.Linear(5, 1, key=k2))


def fits_a(m: Pair, x: Any, y: Any) -> Any:
    return jnp.mean((jax.vmap(m.a)(x) - y) ** 2), {"b": jnp.mean(jax.vmap(m.b)(x))}


def follows_a(m: Pair, x: Any, y: Any) -> Any:
    return jnp.mean((jax.vmap(m.b)(x) - jax.vmap(m.a)(x)) ** 2)


def masked(m: Pair, x: Any, y: Any, w: Any) -> eqfit.Mean:
    err = jnp.sum((jax.vmap(m.a)(x) - y) ** 2, axis=1)
    return eqfit.Mean(jnp.sum(w * err), jnp.sum(w))


class Shrink(eqfit.AbstractUpdate):
    """An update of one's own: `b` shrunk a little each step, counting its steps."""

    name: str = "shrink"

    def init(self, params: Any) -> Any:
        return jnp.zeros((), jnp.float32)

    def apply(self, model: Any, state: Any, batch: Any, *, model_state: Any, key: Any) -> Any:
        b = jax.tree.map(lambda x: x * 0.99, model.b)
        model = eqx.tree_at(lambda m: m.b, model, b)
        return eqfit.Applied(model, state + 1, model_state, {"n": state})


def configurations(guard: bool | None = None) -> dict[str, Callable[[], eqfit.FitResult[Any]]]:
    common: dict[str, Any] = dict(key=jax.random.key(0), batch_size=16)
    # `--guard`: the runs that can be replayed without the updates' `cond`, with it or
    # without (`execution=...(guard=...)`), which must give the same bits either way.
    whole: dict[str, Any] = {}
    if guard is not None:
        whole = dict(execution=eqfit.WholeRun(guard=guard))
    val = (X[:20], Y[:20])
    cnn = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 4, 3, key=jax.random.key(2)),
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(144, 3, key=jax.random.key(3)),
        ]
    )

    def updates(every: int = 3) -> list[eqfit.AbstractUpdate]:
        return [
            eqfit.Update("a", fits_a, optax.adam(1e-2), trains=lambda m: m.a),
            eqfit.Update("b", follows_a, optax.sgd(0.1), trains=lambda m: m.b, every=every),
            Shrink(trains=lambda m: m.b),
        ]

    adam = optax.adam(1e-2)
    return {
        "one": lambda: eqfit.fit(
            pair(),
            (X, Y),
            loss=fits_a,
            optimizer=adam,
            epochs=3,
            ema=0.9,
            norms=True,
            validation_data=val,
            **whole,
            **common,
        ),
        "inject": lambda: eqfit.fit(
            pair(),
            (X, Y),
            loss=fits_a,
            epochs=2,
            **whole,
            **common,
            optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        ),
        "updates": lambda: eqfit.fit(
            pair(),
            (X, Y),
            updates=updates(),
            epochs=3,
            norms=True,
            validation_data=val,
            **whole,
            **common,
        ),
        "mean": lambda: eqfit.fit(
            pair(),
            (X, Y, W),
            loss=masked,
            optimizer=adam,
            epochs=3,
            validation_data=(X[:20], Y[:20], W[:20]),
            **whole,
            **common,
        ),
        "microbatches": lambda: eqfit.fit(
            pair(),
            (X, Y, W),
            loss=masked,
            optimizer=adam,
            epochs=2,
            microbatches=4,
            **whole,
            **common,
        ),
        "per_step": lambda: eqfit.fit(
            pair(),
            (X, Y),
            loss=fits_a,
            optimizer=adam,
            epochs=2,
            execution=eqfit.PerStep(2, guard=guard),
            **common,
        ),
        "devices": lambda: eqfit.fit(
            pair(),
            (X[:96], Y[:96]),
            loss=fits_a,
            optimizer=adam,
            epochs=2,
            devices=8,
            **common,
        ),
        "mesh": lambda: eqfit.fit(
            pair(),
            (X[:96], Y[:96]),
            loss=fits_a,
            optimizer=adam,
            epochs=2,
            mesh=jax.make_mesh((8,), ("batch",)),
            shard=eqfit.sharding.fsdp("batch", min_bytes=0),
            **whole,
            **common,
        ),
        "cnn": lambda: eqfit.fit(
            cnn,
            (IMAGES, LABELS),
            loss=eqfit.losses.softmax_cross_entropy,
            optimizer=optax.adam(1e-3),
            epochs=2,
            metrics={"acc": eqfit.metrics.accuracy},
            **({} if guard is None else dict(execution=eqfit.PerStep(guard=guard))),
            **common,
        ),
        "bfloat16": lambda: eqfit.fit(
            pair(),
            (X, Y),
            loss=fits_a,
            optimizer=adam,
            epochs=2,
            precision="bfloat16",
            **common,
        ),
        "ensemble": lambda: eqfit.fit(
            eqx.filter_vmap(lambda k: pair())(jax.random.split(jax.random.key(3), 3)),
            (X, Y),
            updates=updates()[::2],
            epochs=2,
            ensemble=True,
            **common,
        ),
    }


def save(path: str, guard: bool | None = None) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name, run in configurations(guard).items():
        result = run()
        history = result.history
        found = {f"values/{k}": v for k, v in history.values.items()}
        found |= {f"step/{k}": v for k, v in history.step_values.items()}
        found["step_loss"] = history.step_loss
        average = None if result.ema_model is None else eqx.filter(result.ema_model, eqx.is_array)
        parts = (("model", eqx.filter(result.model, eqx.is_array)), ("opt", result.opt_state))
        for part, tree in (*parts, ("ema", average)):
            for i, leaf in enumerate(jax.tree.leaves(tree)):
                found[f"{part}/{i}"] = np.asarray(leaf)
        arrays |= {f"{name}:{k}": np.asarray(v) for k, v in found.items()}
    np.savez(path, **arrays)
    print(f"{len(arrays)} arrays of {len(configurations())} configurations in {path}")


def compare(a: str, b: str) -> int:
    first, second = np.load(a), np.load(b)
    if set(first) != set(second):
        print(f"different arrays: {sorted(set(first) ^ set(second))}")
        return 1
    differ = [
        k
        for k in first
        if first[k].dtype != second[k].dtype
        or not np.array_equal(first[k], second[k], equal_nan=True)
    ]
    print(f"{len(first)} arrays compared; {len(differ)} differ{': ' if differ else ''}", end="")
    print(", ".join(differ))
    return 1 if differ else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    saving = commands.add_parser("save")
    saving.add_argument("out")
    saving.add_argument(
        "--guard",
        choices=("on", "off"),
        help="run those that can be replayed with `guard=True` (a `cond` around the "
        "updates) or `guard=False` (none); by default, as `fit` chooses",
    )
    both = commands.add_parser("compare")
    both.add_argument("a")
    both.add_argument("b")
    args = parser.parse_args()
    if args.command == "save":
        save(args.out, None if args.guard is None else args.guard == "on")
    else:
        sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
