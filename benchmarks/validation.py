"""Validation and early stopping inside the compiled program, against a hand-written scan
that does the same validation after each epoch.

MLP 16-64-64-1, Adam, N=8192 training and 2048 validation samples, batch 256, 10 epochs,
`EarlyStopping(patience=100)` (it tracks the best epoch every epoch but never stops, so
both sides do the same work).

    python benchmarks/validation.py [--repeats 7] [--out PATH]
"""

import argparse
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import config, interleave, table, write_json

import eqfit


EPOCHS, BATCH = 10, 256


def hand_written(model: Any, optimizer: Any, train: Any, val: Any, key: jax.Array) -> Any:
    """`jax.jit` of a scan over epochs: shuffle, a scan over batches, a batched validation
    pass and the early-stopping bookkeeping, written out plainly."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x, y = train
    xv, yv = val
    n, steps = x.shape[0], x.shape[0] // BATCH

    def loss(p: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        m = eqx.combine(p, static)
        return jnp.mean((jax.vmap(m)(xb) - yb) ** 2)

    @jax.jit
    def run(params: Any, key: jax.Array) -> Any:
        opt_state = optimizer.init(params)

        def epoch(carry: Any, e: jax.Array) -> Any:
            params, opt_state, best, wait = carry
            bits = jax.random.bits(jax.random.fold_in(key, e), (2, n))
            order = jax.lax.sort((bits[0], bits[1], jnp.arange(n, dtype=jnp.uint32)), num_keys=2)[2]

            def step(carry: Any, idx: jax.Array) -> Any:
                params, opt_state = carry
                value, grads = jax.value_and_grad(loss)(params, x[idx], y[idx])
                updates, opt_state = optimizer.update(grads, opt_state, params)
                return (eqx.apply_updates(params, updates), opt_state), value

            (params, opt_state), losses = jax.lax.scan(
                step, (params, opt_state), order.reshape(steps, BATCH)
            )
            vb = xv.reshape(-1, BATCH, xv.shape[1]), yv.reshape(-1, BATCH)
            val_sum, _ = jax.lax.scan(
                lambda s, b: (s + loss(params, *b) * BATCH, None), jnp.zeros(()), vb
            )
            val_loss = val_sum / xv.shape[0]
            improved = val_loss < best
            best = jnp.where(improved, val_loss, best)
            wait = jnp.where(improved, 0, wait + 1)
            return (params, opt_state, best, wait), (losses, val_loss)

        carry = (params, opt_state, jnp.inf, 0)
        return jax.lax.scan(epoch, carry, jnp.arange(EPOCHS))

    return lambda: jax.block_until_ready(run(params, key))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    out = Path(__file__).parent / "results" / "validation.json"
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192 + 2048, 16)).astype(np.float32)
    y = np.sin(x[:, 0] + x[:, 1]).astype(np.float32)
    train = (jnp.asarray(x[:8192]), jnp.asarray(y[:8192]))
    val = (jnp.asarray(x[8192:]), jnp.asarray(y[8192:]))
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=jax.random.key(0))
    optimizer = optax.adam(1e-3)
    stopping = eqfit.EarlyStopping(patience=100)

    def eqfit_run(validate: bool) -> None:
        extra = {"validation_data": val, "early_stopping": stopping} if validate else {}
        result = eqfit.fit(
            model,
            train,
            loss=eqfit.losses.mse,
            optimizer=optimizer,
            key=jax.random.key(1),
            epochs=EPOCHS,
            batch_size=BATCH,
            **extra,  # type: ignore[arg-type]
        )
        jax.block_until_ready(result.model)

    variants = {
        "eqfit: validation + early stopping": lambda: eqfit_run(True),
        "hand-written scan: same validation": hand_written(
            model, optimizer, train, val, jax.random.key(1)
        ),
        "eqfit: no validation": lambda: eqfit_run(False),
    }
    seconds = interleave(variants, args.repeats)
    base = seconds["hand-written scan: same validation"]
    rows = [[name, f"{s * 1e3:.2f}", f"{s / base:.3f}"] for name, s in seconds.items()]
    print(
        f"MLP 16-64-64-1, Adam, batch {BATCH}, N=8192 + 2048 validation, {EPOCHS} epochs; "
        f"median of {args.repeats}"
    )
    print(table(["variant", "ms per run", "× hand-written"], rows))
    write_json(args.out, {"config": config(), "seconds": seconds, "repeats": args.repeats})


if __name__ == "__main__":
    main()
