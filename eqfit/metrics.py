"""Ready metrics. The functions, each `metric(model, x, y) -> scalar` on a batch,
vmapping the model, are means over the batch's examples: given a batch `(x, y, weights)`,
each returns the weighted mean as an `eqfit.Mean`, as `eqfit.losses` do (a mask over each
sequence's positions, with a label per sequence, weighs each sequence 1 or 0, as there).

The classes accumulate (`AbstractMetric`): a batch gives counts, the run sums them over
the epoch (or the validation set, or `eqfit.evaluate`'s data) and computes the value once.
Precision, recall, F1, an AUC and a confusion matrix must be computed so: the mean of
per-batch F1s (or AUCs) is not the F1 of the epoch. `ConfusionMatrix`, `Precision`,
`Recall`, `F1` and `TopKAccuracy` are eqfit's; metrax's metrics are taken as they are
(`Metrax`).

Pass them to `fit(..., metrics={"accuracy": eqfit.metrics.accuracy})` and read them back
from the history by the same name, with `"val_"` in front for the validation data. With
`fit(..., state=)` they are called `metric(model, state, x, y)`, which they take too (the
model called as `model(x[i], state)` under `jax.vmap` with `axis_name="batch"`); the new
state is dropped.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, jaxtyped, PyTree, Shaped

from ._core._checks import as_int
from ._core._metric import AbstractMetric as AbstractMetric, is_metrax
from ._step._labels import check_counted, check_labels, check_probabilities, CHECKERS, same_shape
from ._step._mean import Mean
from .losses import check_weights, Model, outputs, reduce, split_state, State


@overload
def accuracy(model: Model, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def accuracy(model: Model, state: State, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def accuracy(model: Model, x: Any, y: Any, weights: Any, /) -> Any: ...  # an `eqfit.Mean`
@overload
def accuracy(model: Model, state: State, x: Any, y: Any, weights: Any, /) -> Mean: ...
def accuracy(model: Model, *args: Any) -> Any:
    """The fraction of examples whose largest logit is at the integer label `y`.

    **Arguments:** `model`, returning logits `(classes,)` for one example; optionally its
    `state`; `x`; `y`; optionally `weights` per example or per label.

    **Returns:** the accuracy over the batch, in [0, 1] (an `eqfit.Mean` with `weights`).
    """
    state, x, y, weights = split_state(args, "accuracy")
    return _accuracy(model, state, x, y, weights)


@jaxtyped(typechecker=beartype)
def _accuracy(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Int[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
) -> Any:
    logits, _ = outputs(model, x, state)
    logits = check_labels(logits, y, logits.shape[-1], "accuracy")
    return reduce(jnp.argmax(logits, axis=-1) == y, weights, "accuracy")


@overload
def binary_accuracy(model: Model, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def binary_accuracy(model: Model, state: State, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def binary_accuracy(model: Model, x: Any, y: Any, weights: Any, /) -> Any: ...  # an `eqfit.Mean`
@overload
def binary_accuracy(model: Model, state: State, x: Any, y: Any, weights: Any, /) -> Mean: ...
def binary_accuracy(model: Model, *args: Any) -> Any:
    """The fraction of outputs whose logit has the sign of the 0/1 label `y`.

    **Arguments:** `model`, returning logits shaped like one row of `y`; optionally its
    `state`; `x`; `y`; optionally `weights` per example or per label.

    **Returns:** the accuracy over the batch and every output, in [0, 1] (an `eqfit.Mean`
    with `weights`).
    """
    state, x, y, weights = split_state(args, "binary_accuracy")
    return _binary_accuracy(model, state, x, y, weights)


@jaxtyped(typechecker=beartype)
def _binary_accuracy(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Int[Array, "batch ..."] | Bool[Array, "batch ..."] | Float[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
) -> Any:
    logits, _ = outputs(model, x, state)
    logits = check_labels(same_shape(logits, y, "binary_accuracy"), y, None, "binary_accuracy")
    return reduce((logits > 0) == (y > 0.5), weights, "binary_accuracy")


@overload
def mae(model: Model, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def mae(model: Model, state: State, x: Any, y: Any, /) -> Float[Array, ""]: ...
@overload
def mae(model: Model, x: Any, y: Any, weights: Any, /) -> Any: ...  # an `eqfit.Mean`
@overload
def mae(model: Model, state: State, x: Any, y: Any, weights: Any, /) -> Mean: ...
def mae(model: Model, *args: Any) -> Any:
    """Mean absolute error.

    **Arguments:** `model`, returning an output shaped like one row of `y`; optionally its
    `state`; `x`; `y`; optionally `weights` per example or per label.

    **Returns:** `mean(|model(x_i) - y_i|)` over the batch and every output (an
    `eqfit.Mean` with `weights`).
    """
    state, x, y, weights = split_state(args, "mae")
    return _mae(model, state, x, y, weights)


@jaxtyped(typechecker=beartype)
def _mae(
    model: Model,
    state: State | None,
    x: PyTree[Shaped[Array, "batch ..."]],
    y: Float[Array, "batch ..."],
    weights: Shaped[Array, "batch ..."] | None,
) -> Any:
    out, _ = outputs(model, x, state)
    return reduce(jnp.abs(same_shape(out, y, "mae") - y), weights, "mae")


def _confusion(name: str, classes: int, model: Model, args: tuple[Any, ...]) -> Array:
    """The batch's confusion counts `(classes, classes)`: row the label, column the
    predicted class (the largest logit; with `classes=2` and one logit per example, its
    sign), each example counted as its weight (1 without weights).
    """
    state, x, y, weights = split_state(args, name)
    logits, _ = outputs(model, x, state)
    if logits.ndim == y.ndim or (logits.shape[-1] == 1 and classes == 2):
        if classes != 2:
            raise ValueError(
                f"`{name}`: the model gives one output per example (shape "
                f"{tuple(logits.shape)}), a binary classifier's logit, but `classes` is "
                f"{classes}: give a logit per class, or `classes=2`."
            )
        logit = logits.reshape(y.shape)
        spoilt = check_counted(logit, y, None, name)
        predicted = (logit > 0).astype(jnp.int32)
        labels = (y > 0.5).astype(jnp.int32)
    else:
        if logits.shape[-1] != classes:
            raise ValueError(
                f"`{name}`: the model gives {logits.shape[-1]} logits per example (shape "
                f"{tuple(logits.shape)}), but `classes` is {classes}."
            )
        _class_labels(y, name, classes)
        spoilt = check_counted(logits, y, classes, name)
        predicted = jnp.argmax(logits, axis=-1)
        labels = y.astype(jnp.int32)
    w = _each_label(weights, labels.shape, name).reshape(-1)
    # A product of one-hot matrices, not a scatter: a matmul on every accelerator.
    true = jax.nn.one_hot(labels.reshape(-1), classes, dtype=jnp.float32)
    pred = jax.nn.one_hot(predicted.reshape(-1), classes, dtype=jnp.float32)
    counts = jnp.einsum("n,ni,nj->ij", w, true, pred, precision=jax.lax.Precision.HIGHEST)
    # NaN outputs, or a label out of range, count as NaN, not as the class `argmax`
    # happens to give them.
    return jnp.where(spoilt, jnp.nan, counts)


def _class_labels(y: Array, name: str, classes: int) -> None:
    """Refuses labels `y` that are not class indices by their dtype (floats), as
    `accuracy` does: a fractional label would be cut to an integer, and counted.
    """
    if not (jnp.issubdtype(y.dtype, jnp.integer) or y.dtype == jnp.bool_):
        raise TypeError(
            f"`{name}`: the labels `y` must be integer class indices, from 0 to "
            f"{classes - 1}, as `accuracy`'s and `softmax_cross_entropy`'s are; got dtype "
            f"{y.dtype}, whose fractions are no class (a label 0.7 would be cut to class 0, "
            "or match none). Give integer labels (`y.astype(np.int32)`)."
        )


def _each_label(weights: Array | None, shape: tuple[int, ...], name: str) -> Array:
    """Each label's weight, float32 of the labels' `shape`: 1 without `weights`; else
    theirs, per example or per label (`check_weights`), spread over the axes they leave.
    """
    if weights is None:
        return jnp.ones(shape, jnp.float32)
    w = check_weights(weights, shape, name).astype(jnp.float32)
    return jnp.broadcast_to(w.reshape(w.shape + (1,) * (len(shape) - w.ndim)), shape)


class ConfusionMatrix(AbstractMetric):
    """The confusion matrix over the epoch (or the validation set): entry `[i, j]`
    counts the examples of label `i` predicted as class `j` (as scikit-learn's), each
    counted as its weight with a batch `(x, y, weights)`. The prediction is the largest
    logit; with `classes=2` and one logit per example, its sign.

    Recorded as an array `(classes, classes)` per epoch (`history["cm"]`); left out of
    the bar and the log lines.

    **Arguments:**

    - `classes`: the number of classes.
    - `normalize`: `"true"` divides each row by its sum (each class's recall on the
        diagonal), `"pred"` each column, `"all"` the whole; `None` (the default) keeps
        counts.
    """

    classes: int = eqx.field(static=True, converter=as_int)
    normalize: Literal["true", "pred", "all"] | None = eqx.field(static=True, default=None)

    def __check_init__(self) -> None:
        _check_classes("ConfusionMatrix", self.classes)
        if self.normalize not in ("true", "pred", "all", None):
            raise ValueError(
                "`ConfusionMatrix`'s `normalize` must be 'true' (each row), 'pred' (each "
                f"column), 'all' or None (counts), got {self.normalize!r}."
            )

    def statistics(self, model: Any, *batch: Any) -> Array:
        return _confusion("ConfusionMatrix", self.classes, model, batch)

    def compute(self, statistics: Array) -> Array:
        counts = statistics
        if self.normalize is None:
            return counts
        axis = {"true": 1, "pred": 0, "all": None}[self.normalize]
        total = jnp.sum(counts, axis=axis, keepdims=axis is not None)
        return jnp.where(total == 0, 0.0, counts / jnp.where(total == 0, 1.0, total))


def _check_classes(name: str, classes: Any) -> None:
    """Refuses a `classes` that is not a whole number, 2 or more."""
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise ValueError(
            f"`{name}`'s `classes` must be the number of classes, a whole number, 2 or more; "
            f"got {classes!r}."
        )


Average = Literal["binary", "macro", "micro"] | None


class _Scores(AbstractMetric):
    """Precision, recall or F1 from the epoch's confusion counts."""

    classes: int = eqx.field(static=True, default=2, converter=as_int)
    average: Average = eqx.field(static=True, default="binary")

    def __check_init__(self) -> None:
        _check_classes(type(self).__name__, self.classes)
        if self.average not in ("binary", "macro", "micro", None):
            raise ValueError(
                f"`average` must be 'binary', 'macro', 'micro' or None, got {self.average!r}."
            )
        if self.average == "binary" and self.classes != 2:
            raise ValueError(
                f"`average='binary'` scores class 1 of two, but `classes` is {self.classes}: "
                "give `average='macro'` (the mean over classes), 'micro', or None (one "
                "score per class)."
            )

    def statistics(self, model: Any, *batch: Any) -> Array:
        return _confusion(type(self).__name__, self.classes, model, batch)

    def compute(self, statistics: Array) -> Array:
        counts = statistics
        tp = jnp.diagonal(counts)
        predicted = jnp.sum(counts, axis=0)  # tp + fp
        actual = jnp.sum(counts, axis=1)  # tp + fn
        if self.average == "micro":
            tp, predicted, actual = jnp.sum(tp), jnp.sum(predicted), jnp.sum(actual)
        scores = self._score(tp, predicted, actual)
        if self.average == "binary":
            return scores[1]
        if self.average == "macro":
            return jnp.mean(scores)
        return scores

    def _score(self, tp: Array, predicted: Array, actual: Array) -> Array:
        raise NotImplementedError


def _ratio(a: Array, b: Array) -> Array:
    """`a / b`, 0 where `b` is 0 (scikit-learn's `zero_division=0`)."""
    return jnp.where(b == 0, 0.0, a / jnp.where(b == 0, 1.0, b))


class Precision(_Scores):
    """Precision, `tp / (tp + fp)`, from the counts of the whole epoch (or validation
    set), 0 where nothing was predicted positive (scikit-learn's `zero_division=0`).

    **Arguments:**

    - `classes`: the number of classes (default 2). The prediction is the largest logit;
        with `classes=2` and one logit per example, its sign.
    - `average`: `"binary"` (the default, with 2 classes): class 1's; `"macro"`: the
        mean over classes; `"micro"`: from the counts of every class together; `None`:
        one per class, recorded as an array per epoch.
    """

    def _score(self, tp: Array, predicted: Array, actual: Array) -> Array:
        return _ratio(tp, predicted)


class Recall(_Scores):
    """Recall, `tp / (tp + fn)`, from the counts of the whole epoch (or validation
    set), 0 for a class with no examples. Arguments as `Precision`'s.
    """

    def _score(self, tp: Array, predicted: Array, actual: Array) -> Array:
        return _ratio(tp, actual)


class F1(_Scores):
    """F1, `2 tp / (2 tp + fp + fn)`, from the counts of the whole epoch (or validation
    set), 0 for a class never predicted nor present. Arguments as `Precision`'s.
    """

    def _score(self, tp: Array, predicted: Array, actual: Array) -> Array:
        return _ratio(2 * tp, predicted + actual)


class TopKAccuracy(AbstractMetric):
    """The fraction of examples whose label is among the `k` largest logits, over the
    epoch (or the validation set): the hits and the examples counted, each as its weight
    with a batch `(x, y, weights)`, and divided once.

    **Arguments:**

    - `k`: how many of the largest logits count (`k=1` is `accuracy`).
    """

    k: int = eqx.field(static=True)

    def __check_init__(self) -> None:
        k = self.k
        whole = not isinstance(k, bool) and isinstance(k, int | np.integer)
        if not whole or k < 1:
            raise (ValueError if whole else TypeError)(
                "`TopKAccuracy`'s `k` must be a whole number, 1 or more (how many of the "
                f"largest logits count; 1 is `accuracy`), got {k!r}."
            )

    def statistics(self, model: Any, *batch: Any) -> dict[str, Array]:
        state, x, y, weights = split_state(batch, "TopKAccuracy")
        logits, _ = outputs(model, x, state)
        classes = logits.shape[-1]
        if self.k > classes:
            raise ValueError(
                f"`TopKAccuracy`'s `k` is {self.k}, but the model gives {classes} logits per "
                f"example (shape {tuple(logits.shape)}): every label would be among the top "
                f"{self.k}. Give `k` of at most {classes}."
            )
        _class_labels(y, "TopKAccuracy", classes)
        logits = check_labels(logits, y, classes, "TopKAccuracy")
        top = jax.lax.top_k(logits, self.k)[1]
        hit = jnp.any(top == y[..., None], axis=-1).astype(jnp.float32)
        w = _each_label(weights, hit.shape, "TopKAccuracy")
        return {"hits": jnp.sum(w * hit), "count": jnp.sum(w)}

    def compute(self, statistics: dict[str, Array]) -> Array:
        return statistics["hits"] / statistics["count"]


class Metrax(AbstractMetric):
    """A metrax metric (`pip install "eqfit[metrax]"`), taken as it is: each batch's
    statistics are `metric.from_model_output(**inputs(outputs, y))`, summed as its
    `merge` sums them, and its value is its `compute`.

    `fit(..., metrics={"auc": eqfit.metrics.Metrax(metrax.AUCROC, lambda logits, y:
    {"predictions": jax.nn.sigmoid(logits[:, 0]), "labels": y})})`. A metrax class given
    in `metrics=` itself is taken as `Metrax(cls)`.

    **Arguments:**

    - `metric`: the metrax metric class (`metrax.AUCROC`, `metrax.Precision`, ...). Its
        `merge` must add its arrays, as metrax's do.
    - `inputs`: `inputs(outputs, y)`, with `outputs` the model's on the batch (vmapped),
        returning the keyword arguments of `from_model_output`. Default:
        `{"predictions": outputs, "labels": y}`. A batch with weights (`(x, y, weights)`;
        an `eqfit.Buckets` batch's mask, one weight per sequence where `y` is a label per
        sequence) adds them as `"sample_weights"`, and is refused for a metric that takes
        none (metrax's `Precision`: the rows of weight 0 would count); an
        `inputs(outputs, y, weights)` of three arguments is given them, to use as it will.
        `predictions` and `labels` whose shapes would broadcast into one neither has
        (`(n, 1)` and `(n,)`) are refused; so are predictions outside [0, 1] for a
        metric that takes probabilities (`AUCROC`, `AUCPR`, `Precision`, `Recall`,
        `FBetaScore`), as labels out of range are.
    - `**options`: more keyword arguments of `from_model_output`, the same for every
        batch (`num_thresholds=100`, `threshold=0.3`).
    """

    metric: type = eqx.field(static=True)
    inputs: Callable[..., dict[str, Any]] | None = eqx.field(static=True, default=None)
    options: tuple[tuple[str, Any], ...] = eqx.field(static=True, default=())

    def __init__(
        self,
        metric: type,
        inputs: Callable[..., dict[str, Any]] | None = None,
        **options: Any,
    ):
        if not (isinstance(metric, type) and hasattr(metric, "from_model_output")):
            raise TypeError(
                "`Metrax` takes a metrax metric class (`metrax.AUCROC`, with "
                f"`from_model_output`, `merge` and `compute`), got {metric!r}."
            )
        self.metric = metric
        self.inputs = inputs
        self.options = tuple(sorted(options.items()))

    def statistics(self, model: Any, *batch: Any) -> Any:
        name = f"Metrax({self.metric.__name__})"
        state, x, y, weights = split_state(batch, name)
        out, _ = outputs(model, x, state)
        if self.inputs is not None and (weights is None or _takes_three(self.inputs)):
            kwargs = self._mapped(name, out, (y,) if weights is None else (y, weights))
        else:
            kwargs = {"predictions": out, "labels": y}
            if self.inputs is not None:
                kwargs = self._mapped(name, out, (y,))
            if weights is not None:
                kwargs = self._weighted(kwargs, weights, name)
        kwargs = _checked_inputs(name, self.inputs is None, kwargs)
        try:
            return self.metric.from_model_output(**kwargs, **dict(self.options))
        except (TypeError, ValueError) as e:
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(_metrax_failed(name, self.metric, kwargs, e)) from e

    def _mapped(self, name: str, out: Any, rest: tuple[Any, ...]) -> dict[str, Any]:
        """`inputs(outputs, y[, weights])`, refused unless it takes those arguments and
        returns a mapping of keyword arguments.
        """
        assert self.inputs is not None
        given = "outputs, y" + (", weights" if len(rest) == 2 else "")
        try:
            inspect.signature(self.inputs).bind(out, *rest)
        except TypeError:
            raise TypeError(
                f"`{name}`'s `inputs` is called `inputs({given})` on each batch, but it takes "
                f"{inspect.signature(self.inputs)}: make it take ({given})."
            ) from None
        except ValueError:  # a builtin without a signature: called as it is
            pass
        kwargs = self.inputs(out, *rest)
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"`{name}`'s `inputs` must return the keyword arguments of "
                f"`{self.metric.__name__}.from_model_output` as a dict (such as "
                f"`{{'predictions': ..., 'labels': y}}`), got a {type(kwargs).__name__}."
            )
        return dict(kwargs)

    def _weighted(self, kwargs: dict[str, Any], weights: Array, name: str) -> dict[str, Any]:
        """`kwargs` with the batch's weights as `sample_weights`, where `inputs` takes no
        weights (or is the default): refused where the metric takes none, or `inputs` gave
        its own, rather than counting the rows of weight 0 (padding) or dropping some.
        """
        try:
            parameters = inspect.signature(self.metric.from_model_output).parameters
        except (TypeError, ValueError):
            parameters = {"sample_weights": None}
        if "sample_weights" not in parameters:
            raise TypeError(
                f"`{name}`: the batches hold weights after `y` (an `eqfit.Buckets` batch's "
                f"mask, say), but `{self.metric.__name__}.from_model_output` takes no "
                "`sample_weights`, so its counts would take in the rows of weight 0 (a "
                "bucket's padding). Use `eqfit.metrics.Precision`, `Recall` or `F1`, which "
                "weigh each example, or give `inputs(outputs, y, weights)` that uses them."
            )
        if "sample_weights" in kwargs:
            raise TypeError(
                f"`{name}`: `inputs` gives `sample_weights` of its own, but the batches hold "
                "weights too (an `eqfit.Buckets` batch's mask, say): give `inputs(outputs, "
                "y, weights)` and combine them."
            )
        return {**kwargs, "sample_weights": weights}

    def compute(self, statistics: Any) -> Array:
        return statistics.compute()


def _metrax_failed(name: str, metric: type, kwargs: dict[str, Any], error: Exception) -> str:
    """Why metrax refused a batch's inputs, with what it was given and what would do."""
    shapes = ", ".join(f"{k}={_described(v)}" for k, v in kwargs.items())
    text = (
        f"`{name}`: `{metric.__name__}.from_model_output({shapes})` failed: "
        f"{str(error).rstrip('.')}. Map the "
        "model's outputs to what it takes with `Metrax(metric, inputs=lambda outputs, y: "
        "{...})`."
    )
    predictions, labels = kwargs.get("predictions"), kwargs.get("labels")
    several = getattr(predictions, "ndim", 0) > getattr(labels, "ndim", 0)
    if metric.__name__ in ("Precision", "Recall") and several:
        text += (
            f" metrax's {metric.__name__} scores binary predictions, one probability per "
            f"label; for several classes use `eqfit.metrics.{metric.__name__}(classes, "
            "average=...)`."
        )
    return text


def _described(x: Any) -> str:
    shape = getattr(x, "shape", None)
    return f"{x.dtype}{list(shape)}" if shape is not None else repr(x)


def _checked_inputs(name: str, default: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A metrax metric's inputs, refused where its `predictions` and `labels` would
    broadcast into a shape neither has (outputs `(n, 1)` against labels `(n,)`: a
    `(n, n)` of every pair), and checked to be probabilities (`check_probabilities`)
    where the metric takes them.
    """
    predictions, labels = kwargs.get("predictions"), kwargs.get("labels")
    shapes = [getattr(a, "shape", None) for a in (predictions, labels)]
    if shapes[0] is not None and shapes[1] is not None:
        _refuse_broadcast(name, default, tuple(shapes[0]), tuple(shapes[1]))
    if name in CHECKERS and predictions is not None:
        kwargs = {**kwargs, "predictions": check_probabilities(predictions, name)}
    return kwargs


def _refuse_broadcast(
    name: str, default: bool, predictions: tuple[int, ...], labels: tuple[int, ...]
) -> None:
    """`_checked_inputs`' refusal of shapes that broadcast into one neither has."""
    try:
        both = tuple(jnp.broadcast_shapes(predictions, labels))
    except ValueError:  # metrax says so itself
        return
    if both in (predictions, labels):
        return
    mapped = "by default, the model's outputs and `y`" if default else "as `inputs` maps them"
    raise ValueError(
        f"`{name}`: its `predictions` have shape {predictions} and its `labels` {labels} "
        f"({mapped}): metrax would broadcast them into {both}, every prediction against "
        "every label. Give them one shape, through `eqfit.metrics.Metrax(metric, inputs)`: "
        "`lambda outputs, y: {'predictions': outputs[:, 0], 'labels': y}`."
    )


def _takes_three(fn: Callable[..., Any]) -> bool:
    """Whether `fn` can be called with three positional arguments (as if so, where its
    signature is not known).
    """
    try:
        inspect.signature(fn).bind(None, None, None)
    except ValueError:
        return True
    except TypeError:
        return False
    return True


def _taken(metrics: Any) -> dict[str, Any]:
    """`metrics=` as `fit` and `evaluate` take it: a metrax metric class as
    `Metrax(cls)`, anything else as it is.
    """
    return {name: Metrax(m) if is_metrax(m) else m for name, m in dict(metrics or {}).items()}
