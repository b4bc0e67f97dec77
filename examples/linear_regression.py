"""The first seed article's example, through eqfit: linear regression by minibatch SGD.

Run: `python examples/linear_regression.py`
"""

import time

import jax
import jax.numpy as jnp
import optax

import eqfit


def main() -> None:
    key = jax.random.key(0)
    data_key, noise_key, model_key, fit_key = jax.random.split(key, 4)
    x = jax.random.normal(data_key, (1000, 10))
    y = jnp.sum(x, axis=1) + 0.1 * jax.random.normal(noise_key, (1000,))

    model = eqfit.models.LinearRegression(10, key=model_key)
    optimizer = optax.sgd(0.01)
    for progress in (False, True):
        start = time.perf_counter()
        result = eqfit.fit(
            model,
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=optimizer,
            key=fit_key,
            epochs=10,
            batch_size=32,
            progress=progress,
        )
        seconds = time.perf_counter() - start
        # Both paths run the same compiled program: only the first fit compiles it.
        note = "the bar, same program: nothing compiled" if progress else "compiles the run"
        print(f"progress={progress}: {seconds:.3f} s ({note})")

    print("learned weights (true: all 1):", jnp.round(result.model.weight[0], 3))
    print("learned bias (true: 0):", round(float(result.model.bias[0]), 3))
    print("loss per epoch:", [round(v, 4) for v in result.history.loss.tolist()])


if __name__ == "__main__":
    main()
