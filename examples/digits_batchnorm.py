"""A BatchNorm CNN on scikit-learn's digits, with validation, accuracy and early stopping.

Everything runs inside the compiled program: the state (BatchNorm's running statistics),
the validation pass in inference mode, the accuracy and the early-stopping check.
Run: `pip install -e ".[examples]" && python examples/digits_batchnorm.py`
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int
from sklearn.datasets import load_digits

import eqfit


class BatchNormCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key: Array):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(16 * 4 * 4, 10, key=k2)

    def __call__(
        self, x: Float[Array, "1 8 8"], state: eqx.nn.State
    ) -> tuple[Float[Array, " 10"], eqx.nn.State]:
        h, state = self.norm(self.conv(x), state)
        h = jax.nn.relu(h).reshape(16, 4, 2, 4, 2).mean(axis=(2, 4))  # 2x2 average pool
        return self.head(h.ravel()), state


def batched(model: BatchNormCNN, state: eqx.nn.State, x: Array) -> tuple[Array, eqx.nn.State]:
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)


def loss(
    model: BatchNormCNN, state: eqx.nn.State, x: Array, y: Int[Array, " batch"]
) -> tuple[Array, eqx.nn.State]:
    logits, state = batched(model, state, x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)), state


def accuracy(model: BatchNormCNN, state: eqx.nn.State, x: Array, y: Array) -> Array:
    logits, _ = batched(model, state, x)
    return jnp.mean(jnp.argmax(logits, axis=-1) == y)


def main() -> None:
    pixels, target = load_digits(return_X_y=True)
    images = (np.asarray(pixels) / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = np.asarray(target).astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1500], order[1500:]

    model_key, fit_key = jax.random.split(jax.random.key(0))
    model, state = eqx.nn.make_with_state(BatchNormCNN)(model_key)
    result = eqfit.fit(
        model,
        (images[train], labels[train]),
        state=state,
        loss=loss,
        metrics={"accuracy": accuracy},
        optimizer=optax.adam(3e-3),
        key=fit_key,
        epochs=40,
        batch_size=64,
        validation_split=0.1,
        early_stopping=eqfit.EarlyStopping(patience=4, monitor="val_accuracy", mode="max"),
        progress=True,
    )
    h = result.history
    print(f"ran {h.epochs} epochs ({h.stop_reason or 'all'}), best epoch {h.best_epoch}")
    print("val accuracy per epoch:", [round(v, 3) for v in h["val_accuracy"].tolist()])
    test_values = eqfit.evaluate(
        result.model,
        (images[test], labels[test]),
        loss=loss,
        metrics={"accuracy": accuracy},
        state=result.state,
        batch_size=128,
    )
    print(f"test accuracy: {test_values['accuracy']:.3f}, test loss: {test_values['loss']:.3f}")


if __name__ == "__main__":
    main()
