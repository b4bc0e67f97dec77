"""A GRU tells clockwise spirals from anticlockwise ones, trained from an endless loader.

In the spirit of Equinox's RNN example, written for eqfit: the data never ends (each batch
is drawn afresh), so the training is a step budget, `steps_per_epoch`, and validation on
a fixed held-out set runs after every epoch of that many steps.
Run: `python examples/spirals_gru.py`
"""

from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

import eqfit


LENGTH, HIDDEN = 24, 16


def spirals(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` noisy spirals of `LENGTH` points each, and 1 for the anticlockwise ones."""
    turn = np.linspace(0.0, 3 * np.pi, LENGTH)
    start = rng.uniform(0, 2 * np.pi, (n, 1))
    radius = np.linspace(0.2, 1.0, LENGTH) * rng.uniform(0.8, 1.2, (n, 1))
    labels = rng.integers(0, 2, n)
    direction = np.where(labels == 1, 1.0, -1.0)[:, None]
    angle = start + direction * turn
    points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=-1)
    points += 0.05 * rng.normal(size=points.shape)
    return points.astype(np.float32), labels.astype(np.int32)


def endless_batches(seed: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """New spirals for every batch, for ever: no epochs of its own."""
    rng = np.random.default_rng(seed)
    while True:
        yield spirals(rng, batch_size)


class SpiralClassifier(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key: Array):
        cell_key, head_key = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(2, HIDDEN, key=cell_key)
        self.head = eqx.nn.Linear(HIDDEN, 2, key=head_key)

    def __call__(self, points: Float[Array, "length 2"]) -> Float[Array, "2"]:
        def step(hidden: Array, point: Array) -> tuple[Array, None]:
            return self.cell(point, hidden), None

        hidden, _ = jax.lax.scan(step, jnp.zeros(HIDDEN), points)
        return self.head(hidden)


def main() -> None:
    key = jax.random.key(0)
    model_key, fit_key = jax.random.split(key)
    validation = spirals(np.random.default_rng(1), 512)

    result = eqfit.fit(
        SpiralClassifier(model_key),
        endless_batches(seed=2, batch_size=32),
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.adam(3e-3),
        key=fit_key,
        epochs=8,
        steps_per_epoch=50,  # an epoch is 50 steps of the endless stream
        validation_data=validation,
        metrics={"accuracy": eqfit.metrics.accuracy},
    )
    for epoch, loss, accuracy in zip(
        result.history.epoch, result.history.loss, result.history["val_accuracy"]
    ):
        print(f"epoch {epoch}: loss {loss:.3f}, validation accuracy {accuracy:.3f}")
    print(f"final validation accuracy: {result.history['val_accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
