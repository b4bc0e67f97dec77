"""Data parallel training over several devices, with `devices=` (pmap) and `mesh=` (sharding).

On a CPU this simulates 8 devices. On a machine with several GPUs, drop the config line.
Run: `python examples/data_parallel.py`
"""

from typing import Any

import jax


jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import eqfit  # noqa: E402


def main() -> None:
    key = jax.random.key(0)
    data_key, model_key, fit_key = jax.random.split(key, 3)
    x = jax.random.normal(data_key, (4096, 16))
    y = jnp.sin(x[:, 0]) + x[:, 1] * x[:, 2]
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=model_key)
    optimizer = optax.adam(1e-3)

    def train(**placement: Any) -> eqfit.FitResult:
        return eqfit.fit(
            model,
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=optimizer,
            key=fit_key,
            epochs=5,
            batch_size=128,  # split evenly over the 8 devices: 16 examples each
            **placement,
        )

    one = train()
    pmapped = train(devices=jax.devices())
    sharded = train(mesh=jax.make_mesh((len(jax.devices()),), ("batch",)))

    def gap(a: eqx.Module, b: eqx.Module) -> float:
        leaves = zip(jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(b))
        return max(float(jnp.max(jnp.abs(p - q))) for p, q in leaves)

    print(f"{len(jax.devices())} devices")
    print("final loss, one device:", float(one.history.loss[-1]))
    print("final loss, devices=  :", float(pmapped.history.loss[-1]))
    print("final loss, mesh=     :", float(sharded.history.loss[-1]))
    print("largest parameter difference from one device:")
    print("  devices=", gap(pmapped.model, eqx.filter(one.model, eqx.is_array)))
    print("  mesh=   ", gap(sharded.model, eqx.filter(one.model, eqx.is_array)))


if __name__ == "__main__":
    main()
