"""A learning-rate sweep of 8 MLPs trained side by side in one compiled program.

Each member gets its own learning rate through `optax.inject_hyperparams`: the optimizer
state is stacked like the models, and its learning rate set per member. The loss curves
go to `sweep.png` (needs matplotlib: `pip install -e ".[plot]"`).
Run: `python examples/sweep.py`
"""

import time
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqfit


def main() -> None:
    key = jax.random.key(0)
    data_key, model_key, fit_key = jax.random.split(key, 3)
    x = jax.random.normal(data_key, (2048, 16))
    y = jnp.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2]

    members = 8
    rates = jnp.logspace(-4, -1, members)
    make = lambda k: eqfit.models.MLP(16, "scalar", 64, 2, key=k)  # noqa: E731
    models = eqx.filter_vmap(make)(jax.random.split(model_key, members))
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    init = jax.vmap(optimizer.init)
    opt_state = cast(optax.InjectHyperparamsState, init(eqx.filter(models, eqx.is_inexact_array)))
    opt_state.hyperparams["learning_rate"] = rates

    start = time.perf_counter()
    result = eqfit.fit(
        models,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optimizer,
        opt_state=opt_state,
        key=fit_key,
        epochs=20,
        batch_size=64,
        ensemble=True,
    )
    print(f"{members} members trained in {time.perf_counter() - start:.2f} s")
    final = result.history.loss[-1]
    for rate, loss in zip(np.asarray(rates), final):
        print(f"  learning rate {rate:.1e}: final loss {loss:.4f}")
    print(f"best learning rate: {float(rates[int(np.argmin(final))]):.1e}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    epochs = np.arange(1, result.history.epochs + 1)
    for i, rate in enumerate(np.asarray(rates)):
        ax.plot(epochs, result.history.loss[:, i], label=f"lr={rate:.0e}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig("sweep.png", dpi=100)
    print("wrote sweep.png")


if __name__ == "__main__":
    main()
