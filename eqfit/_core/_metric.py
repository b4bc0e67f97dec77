"""`AbstractMetric`: a metric that accumulates, as `fit(..., metrics=)` takes it beside
functions of a batch; how the run sums and computes it is `_step/_statistics.py`'s.
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import Array


class AbstractMetric(eqx.Module):
    """A metric whose value is not a mean of per-batch values (an AUC, precision, recall,
    F1, a confusion matrix): each batch gives *statistics* (counts, sums), the run adds
    them up over the epoch (or over a validation set, or `eqfit.evaluate`'s data), and
    the value is computed once from the sum.

    Subclass it with two methods:

    - `statistics(self, model, *batch) -> PyTree`: a batch's statistics, called as a
        metric function is (`(model, x, y)`, `(model, x, y, weights)`, with a model
        state after the model under `fit(..., state=)`). Its arrays must *add*: the
        run sums them across steps, microbatches, devices and batches (as Keras's
        metrics' variables and metrax's `merge` do). Checked before the run: each leaf
        an array (a Python number would not be summed, and is refused; a string is
        configuration, kept as it is) of real numbers, not bools (which add as an OR);
        and, on the data's first few rows, the statistics of the two halves must sum to
        the whole's (a mean or a maximum of the batch does not).
    - `compute(self, statistics) -> Array`: the value from the summed statistics: a
        scalar (recorded, shown and monitored as any metric), or an array of any shape
        (a confusion matrix, a score per class), recorded as an array per epoch.

    Pass it in `metrics=` beside metric functions:
    `fit(..., metrics={"f1": eqfit.metrics.F1(classes=10)})`. A metrax metric is taken
    as it is: `eqfit.metrics.Metrax(metrax.AUCROC, ...)`, or the class itself.
    """

    @abc.abstractmethod
    def statistics(self, model: Any, *batch: Any) -> Any:
        """A batch's statistics.

        **Arguments:** `model`; optionally its `state`; the batch (`x, y` or
        `x, y, weights`).

        **Returns:** a PyTree whose arrays add across batches.
        """

    @abc.abstractmethod
    def compute(self, statistics: Any) -> Array:
        """The metric's value from statistics summed over batches.

        **Arguments:** `statistics`, as `statistics` returns them, summed.

        **Returns:** the value: a scalar, or an array of any shape.
        """


def is_metrax(metric: Any) -> bool:
    """Whether `metric` is a metrax (or clu) metric class, taken as it is."""
    return isinstance(metric, type) and all(
        hasattr(metric, n) for n in ("from_model_output", "merge", "compute")
    )


def adds(metric: AbstractMetric) -> bool:
    """Whether `metric`'s statistics are known to add under a batch split: eqfit's own
    (metrax's through `Metrax`, whose `merge` is checked instead); a metric of one's own
    is tried on the data before the run.
    """
    return type(metric).__module__ == "eqfit.metrics"


def accumulates(metric: Any) -> bool:
    """Whether `metrics=`'s `metric` accumulates (is not a function of a batch)."""
    return isinstance(metric, AbstractMetric)


def tried(metrics: Any) -> bool:
    """Whether any of `metrics` (`(name, metric)` pairs) accumulates and is not known to
    add (`adds`): its statistics are then tried on a few rows of the data.
    """
    return any(accumulates(m) and not adds(m) for _, m in metrics)


# A metric as the run holds it: a function of a batch, or one that accumulates.
MetricLike = Callable[..., Any] | AbstractMetric
