"""Classify scikit-learn's 8x8 digits (shipped with the package: no download) with a CNN.

Run: `pip install -e ".[examples]" && python examples/digits.py`
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import eqfit


def accuracy(model: eqfit.models.CNN, x: jax.Array, y: jax.Array) -> float:
    return float(jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y))


def main() -> None:
    pixels, target = load_digits(return_X_y=True)
    images = (np.asarray(pixels) / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = np.asarray(target).astype(np.int32)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(labels))
    train, test = order[:1500], order[1500:]

    key = jax.random.key(0)
    model_key, fit_key = jax.random.split(key)
    model = eqfit.models.CNN(1, (8, 8), 10, key=model_key)
    result = eqfit.fit(
        model,
        (images[train], labels[train]),
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.adam(3e-3),
        key=fit_key,
        epochs=15,
        batch_size=64,
        progress=True,
        # F1 and the confusion matrix accumulate over the whole set: a mean of per-batch
        # F1s would not be the F1 of the set.
        metrics={
            "f1": eqfit.metrics.F1(10, average="macro"),
            "confusion": eqfit.metrics.ConfusionMatrix(10),
        },
        validation_data=(images[test], labels[test]),
    )
    x_test, y_test = jnp.asarray(images[test]), jnp.asarray(labels[test])
    print("loss per epoch:", [round(v, 3) for v in result.history.loss.tolist()])
    print(f"test accuracy: {accuracy(result.model, x_test, y_test):.3f}")
    print(f"test macro F1: {result.history['val_f1'][-1]:.3f}")
    print("test confusion matrix (row: the digit, column: the prediction):")
    print(result.history["val_confusion"][-1].astype(int))
    print(f"trained in {result.history.wall_time:.2f} s, compilation included")


if __name__ == "__main__":
    main()
