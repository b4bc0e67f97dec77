"""Metrics that accumulate against functions of a batch doing the same arithmetic.

An accumulating metric sums its statistics over the epoch and computes its value once;
the function of a batch computes the same statistics and the value every step, and the
epoch averages the values (the wrong value, for these metrics: what it costs is the
point here). Each pair runs the same training and validation otherwise.

- digits: scikit-learn's digits tiled 4x (7,188 images of 64 pixels, 10 classes), MLP
  64-128-128-10, Adam, batch 128, 5 epochs, validation on 600 more; macro F1, precision
  and recall (eqfit's) against `lambda m, x, y: f1.compute(f1.statistics(m, x, y))` each.
- auc: the same images as 5 and over against the rest, one logit, metrax's AUC-ROC (200
  thresholds) against its `compute(from_model_output(...))` on each batch.

    python benchmarks/accumulating.py [--repeats 9] [--out PATH]
"""

import argparse
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import metrax
import numpy as np
import optax
from _common import config, interleave, load_average, table, write_json
from sklearn.datasets import load_digits

import eqfit
from eqfit.metrics import F1, Metrax, Precision, Recall


EPOCHS, BATCH = 5, 128


def per_batch(metric: eqfit.metrics.AbstractMetric) -> Any:
    """`metric` as a function of each batch: its statistics and value every step."""
    return lambda model, x, y: metric.compute(metric.statistics(model, x, y))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/accumulating.json"))
    args = parser.parse_args()
    load = load_average()

    pixels, target = load_digits(return_X_y=True)
    x = np.tile((pixels / 16.0).astype(np.float32), (4, 1))
    y = np.tile(target.astype(np.int32), 4)
    train, val = (x[: 7188 - 600], y[: 7188 - 600]), (x[-600:], y[-600:])
    binary = (train[0], (train[1] >= 5).astype(np.int32)), (val[0], (val[1] >= 5).astype(np.int32))
    optimizer = optax.adam(1e-3)

    def run(data: Any, validation: Any, out: Any, loss: Any, metrics: dict[str, Any]) -> Any:
        model = eqx.nn.MLP(64, out, 128, 2, key=jax.random.key(0))

        def go() -> None:
            result = eqfit.fit(
                model, data, loss=loss, optimizer=optimizer, metrics=metrics, epochs=EPOCHS,
                batch_size=BATCH, validation_data=validation, key=jax.random.key(1),
            )  # fmt: skip
            jax.block_until_ready(result.model)

        return go

    scores = {
        "f1": F1(10, "macro"),
        "precision": Precision(10, "macro"),
        "recall": Recall(10, "macro"),
    }
    ce = eqfit.losses.softmax_cross_entropy
    probabilities = lambda logits, y: {"predictions": jax.nn.sigmoid(logits), "labels": y}  # noqa: E731
    auc = Metrax(metrax.AUCROC, probabilities)
    bce = eqfit.losses.binary_cross_entropy
    variants = {
        "digits: accumulating": run(train, val, 10, ce, scores),
        "digits: per batch": run(train, val, 10, ce, {k: per_batch(m) for k, m in scores.items()}),
        "digits: no metrics": run(train, val, 10, ce, {}),
        "auc: accumulating": run(*binary, "scalar", bce, {"auc": auc}),
        "auc: per batch": run(*binary, "scalar", bce, {"auc": per_batch(auc)}),
        "auc: no metrics": run(*binary, "scalar", bce, {}),
    }
    seconds = interleave(variants, args.repeats)
    rows = []
    for name, s in seconds.items():
        workload = name.split(":")[0]
        base = seconds[f"{workload}: per batch"]
        rows.append([name, f"{s * 1e3:.2f}", f"{s / base:.3f}"])
    print(
        f"MLP 64-128-128, Adam, batch {BATCH}, {len(train[1])} + {len(val[1])} validation, "
        f"{EPOCHS} epochs, whole fits (compiled programs cached); median of {args.repeats}"
    )
    print(table(["variant", "ms per fit", "× per batch"], rows))
    write_json(
        args.out,
        {"config": config(), "seconds": seconds, "repeats": args.repeats, "load": load},
    )


if __name__ == "__main__":
    main()
