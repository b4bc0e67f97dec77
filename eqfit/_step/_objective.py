"""How eqfit calls the user's loss and metrics (`Objective`): with or without model state,
under a precision policy, with a key where the loss takes one; what a loss returns
(`split_output`, `aux_value`), the aux names it returns and which of its values and the
metrics' are weighted means (`find_outputs`). What it reads of their signatures, and
the notes that name a call that fails while traced, are `_signatures.py`'s.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Key, PyTree

from .._core._metric import AbstractMetric, accumulates, MetricLike
from ._labels import collecting, first_of, LabelError
from ._mean import Mean
from ._precision import Precision
from ._signatures import check_signature, dtype_shape, is_own, noting_call
from ._size import product_flops
from ._statistics import (
    arrays,
    check_batch_free,
    check_leaves,
    check_statistics,
    flat_size,
    Like,
    one_row_less,
    unflatten,
    values,
)


Metrics = Mapping[str, Callable[..., Any]]


def check_scalar(value: Any, what: str) -> Float[Array, ""]:
    """Refuses a loss or metric that is not a float scalar, giving what it returned."""
    if not isinstance(value, jax.Array) or value.shape != ():
        shape = getattr(value, "shape", None)
        got = f"an array of shape {tuple(shape)}" if shape is not None else repr(value)
        raise ValueError(
            f"{what} must return a scalar, but it returned {got}. "
            "Reduce it over the batch, e.g. with `jnp.mean`."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        if jnp.issubdtype(value.dtype, jnp.number) or value.dtype == jnp.bool_:
            if what.startswith("metric"):
                return value.astype(jnp.float32)
        raise TypeError(f"{what} must return a float scalar, got dtype {value.dtype}.")
    return value


def batch_args(batch: PyTree) -> tuple[Any, ...]:
    """How a batch is passed on: a tuple is unpacked (`loss(model, *batch)`), any other
    PyTree (a dict, say) is passed whole (`loss(model, batch)`).
    """
    return batch if isinstance(batch, tuple) else (batch,)


class Value(NamedTuple):
    """What the loss gives on a batch (`Objective.value`). Each value is a pair: a
    `Mean`'s total and weight, or a plain value and 1.
    """

    loss: Float[Array, ""]
    weight: Float[Array, ""]
    aux: Float[Array, " aux"]  # in `aux_names`' order, float32
    aux_weights: Float[Array, " aux"]
    state: PyTree  # the model state after the batch (`None` without state)
    labels: LabelError | None  # the first label out of range the loss met


class Objective(eqx.Module):
    """How to call the user's loss and metrics on a batch, with or without model state,
    under a precision policy (or none).

    A loss returns its value, or `(value, aux)` with `aux` a dict of scalars (or of
    arrays, averaged) that the run records under their names; with state, `(value,
    new_state)` or `((value, aux), new_state)`. `aux_names` are the names it returns,
    found before the run (`find_outputs`), and `means` those of `value_names` that are
    weighted means (`eqfit.Mean`).
    """

    loss: Callable[..., Any]
    metrics: tuple[tuple[str, MetricLike], ...] = ()
    stateful: bool = False
    use_key: bool = False
    aux_names: tuple[str, ...] = ()
    precision: Precision | None = None
    means: tuple[str, ...] = ()
    # Each accumulating metric's statistics of a batch, found abstractly before the run
    # (`find_statistics`): what evaluation sums them as (`width`, `quotient`).
    statistics_like: tuple[Like, ...] = eqx.field(static=True, default=())

    @property
    def width(self) -> int:
        """How many numbers evaluation sums over batches: a total and a weight of each of
        `value_names`, then the accumulating metrics' statistics (`batch_totals`)."""
        return len(self.value_names) + flat_size(self.statistics_like)

    def quotient(self, totals: Float[Array, "2 width"]) -> Float[Array, " values"]:
        """Evaluation's values from its sums over batches: each of `value_names` its
        total over its weight, then each accumulating metric's, computed from its summed
        statistics, flat (`Record.accumulated_names`).
        """
        n = len(self.value_names)
        # Weights that sum to 0 (an `eqfit.Mean`'s that cancel) give NaN, as an epoch's
        # value does, never the infinity of a total over 0.
        means = jnp.where(totals[1, :n] == 0, jnp.nan, totals[0, :n] / totals[1, :n])
        if not self.accumulating:
            return means
        summed = unflatten(totals[0, n:], self.statistics_like)
        computed = values(self.accumulating, self.statistics_like, summed)
        return jnp.concatenate([means, computed])

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The names of the metrics that are functions of a batch (`metric_values`')."""
        return tuple(name for name, fn in self.metrics if not accumulates(fn))

    @property
    def accumulating(self) -> tuple[tuple[str, Any], ...]:
        """The metrics that accumulate (`eqfit.metrics.AbstractMetric`), with their names."""
        return tuple((name, m) for name, m in self.metrics if accumulates(m))

    @property
    def value_names(self) -> tuple[str, ...]:
        """What `evaluate` reports, in order: the loss, the aux values, the metrics."""
        return ("loss", *self.aux_names, *self.metric_names)

    def _arguments(self, model: PyTree, model_state: PyTree, batch: PyTree) -> tuple[Any, ...]:
        args = batch_args(batch)
        if self.precision is not None:  # cast here, inside the step, array by array
            model = self.precision.cast(model)
            # The inputs: `x` of `(x, y, ...)`; the targets and weights stay as they are.
            # A batch passed whole (a dict) is cast whole.
            args = (self.precision.cast_batch(args[0]), *args[1:])
        return (model, model_state, *args) if self.stateful else (model, *args)

    def call(
        self, model: PyTree, model_state: PyTree, batch: PyTree, key: Key[Array, ""] | None
    ) -> tuple[Any, list[LabelError]]:
        """What the loss returns, as it returns it, and the label checks it made."""
        args = self._arguments(model, model_state, batch)
        kwargs = {"key": key} if self.use_key and key is not None else {}
        check_signature(self.loss, args, kwargs, "`loss`", self.stateful)
        with collecting() as checks, noting_call("loss", self.loss, args, self.stateful):
            out = self.loss(*args, **kwargs)
        return out, checks

    def value(
        self, model: PyTree, model_state: PyTree, batch: PyTree, key: Key[Array, ""] | None
    ) -> Value:
        """The loss and its aux values on the batch, each as a pair (`Value`), the model
        state after the batch, and the first label out of range that the loss met (see
        `eqfit._labels`).
        """
        # Read before the call: a stateful layer marks the state it is given as used up.
        dtypes = []
        if self.precision is not None:
            dtypes = [getattr(x, "dtype", None) for x in jax.tree.leaves(model_state)]
        out, checks = self.call(model, model_state, batch, key)
        value, aux, new_state = split_output(out, self.stateful)
        loss, weight = self._pair("loss", value, "`loss(model, *batch)`")
        if self.precision is not None:
            loss = loss.astype(jnp.float32)
            # The state stays in its own dtypes, whatever the cast model computed it in.
            leaves, treedef = jax.tree.flatten(new_state)
            if len(leaves) == len(dtypes):
                leaves = [
                    x.astype(d) if d is not None and eqx.is_array(x) else x
                    for x, d in zip(leaves, dtypes)
                ]
                new_state = jax.tree.unflatten(treedef, leaves)
        aux_values, aux_weights = self._aux_values(aux)
        return Value(loss, weight, aux_values, aux_weights, new_state, first_of(checks))

    def _pair(self, name: str, value: Any, what: str) -> tuple[Array, Array]:
        """A value as `(total, weight)`: a `Mean`'s, or a plain scalar's and 1. Refuses
        one whose kind changed since the run traced it (`means`).
        """
        if isinstance(value, Mean) != (name in self.means):
            kind = "an `eqfit.Mean`" if isinstance(value, Mean) else "a plain value"
            raise ValueError(
                f"{what} returned {kind} for {name!r}, but not before the run: a loss or "
                "metric must return a Mean, or not, every call."
            )
        if isinstance(value, Mean):
            total = check_scalar(value.total, what)
            return total, value.weight.astype(jnp.float32)
        return check_scalar(value, what), jnp.ones((), jnp.float32)

    def _aux_values(
        self, aux: Mapping[str, Any] | None
    ) -> tuple[Float[Array, " aux"], Float[Array, " aux"]]:
        given = () if aux is None else tuple(aux)
        if set(given) != set(self.aux_names):
            raise ValueError(
                f"`loss` returned aux values {list(given)}, but before the run it returned "
                f"{list(self.aux_names)}: a loss must return the same aux names every call."
            )
        if not self.aux_names:
            return jnp.zeros(0), jnp.zeros(0)
        assert aux is not None
        pairs = []
        for name in self.aux_names:
            value = aux[name]
            if isinstance(value, Mean) or name in self.means:
                total, weight = self._pair(name, value, f"`loss`'s aux value {name!r}")
                pairs.append((total.astype(jnp.float32), weight))
            else:
                pairs.append((jnp.mean(aux_value(name, value)).astype(jnp.float32), jnp.ones(())))
        return jnp.stack([t for t, _ in pairs]), jnp.stack([w for _, w in pairs])

    def metric_values(
        self, model: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[Float[Array, " metrics"], Float[Array, " metrics"], LabelError | None]:
        """Each metric on the batch, in order, as totals and weights (a `Mean`'s, or a
        plain value's and 1; empty vectors without metrics), and the first label out of
        range that they met.
        """
        if not self.metric_names:
            return jnp.zeros(0), jnp.zeros(0), None
        args = self._arguments(model, model_state, batch)
        totals, weights = [], []
        with collecting() as checks:
            for name, fn in self.metrics:
                if isinstance(fn, AbstractMetric):
                    continue
                check_signature(fn, args, {}, f"metric {name!r}", self.stateful)
                with noting_call(f"metrics[{name!r}]", fn, args, self.stateful):
                    value = fn(*args)
                if isinstance(value, Mean) or name in self.means:
                    total, weight = self._pair(name, value, f"metric {name!r}")
                else:
                    total, weight = check_scalar(value, f"metric {name!r}"), jnp.ones(())
                totals.append(total.astype(jnp.float32))
                weights.append(weight)
        return jnp.stack(totals), jnp.stack(weights), first_of(checks)

    def statistics(
        self, model: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[tuple[PyTree, ...], LabelError | None]:
        """The statistics of the batch of each metric that accumulates, in order: their
        arrays (`_statistics.arrays`), which the run sums; and the first label out of
        range that they met.
        """
        if not self.accumulating:
            return (), None
        args = self._arguments(model, model_state, batch)
        out = []
        with collecting() as checks:
            for name, metric in self.accumulating:
                check_signature(metric.statistics, args, {}, f"metric {name!r}", self.stateful)
                with noting_call(f"metrics[{name!r}]", metric.statistics, args, self.stateful):
                    out.append(arrays(metric.statistics(*args)))
        return tuple(out), first_of(checks)

    def find_statistics(
        self, model: PyTree, model_state: PyTree, batch: PyTree
    ) -> tuple[Like, ...]:
        """Each accumulating metric's statistics of a batch, found abstractly (nothing
        runs): shapes for its arrays, its other leaves as they are. The run keeps them,
        to make empty statistics and to put the other leaves back before `compute`.
        """

        # Remembered, as `find_outputs`' traces are: a warm `fit` traces nothing (but a
        # metric that cannot be hashed, holding arrays).
        cache_key = _STATISTICS.key(
            (self.accumulating, self.stateful, self.precision), model, model_state, batch
        )
        remembered = _STATISTICS.get(cache_key)
        if remembered is not None:
            return remembered

        def each(model: PyTree, model_state: PyTree, batch: PyTree) -> tuple[PyTree, ...]:
            args = self._arguments(model, model_state, batch)
            out = []
            with collecting():
                for name, metric in self.accumulating:
                    out.append(check_leaves(name, metric.statistics(*args)))
            return tuple(out)

        found = tuple(map(Like.of, eqx.filter_eval_shape(each, model, model_state, batch)))
        shorter = one_row_less(batch)
        if shorter is not None:  # statistics that grow with the batch are not summed ones
            fewer = tuple(map(Like.of, eqx.filter_eval_shape(each, model, model_state, shorter)))
            for (name, _), like, other in zip(self.accumulating, found, fewer):
                check_batch_free(name, like, other)
        for (name, metric), like in zip(self.accumulating, found):
            check_statistics(name, metric, like)
        _STATISTICS.put(cache_key, found)
        return found


def aux_value(name: str, value: Any) -> Array:
    """The loss's aux value `name` as an array of real numbers, which the run averages and
    records in float32: a JAX array, or a numpy or Python number (a constant). Refuses a
    complex one (float32 would drop its imaginary part), bools and PRNG keys, and what is
    not a number, naming the aux value and what it is.
    """
    what = f"`loss`'s aux value {name!r}"
    if isinstance(value, int | float | np.number | np.ndarray) and not isinstance(
        value, bool | np.bool_
    ):
        value = jnp.asarray(value)  # a numpy scalar or array, or a Python number
    if not isinstance(value, jax.Array):
        raise TypeError(
            f"{what} must be an array of numbers (a scalar, or an array that is averaged), "
            f"got {_described(value)}."
        )
    dtype = value.dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{what} is complex ({dtype_shape(value)}), but the run records its values as float32, "
            "which would drop the imaginary part: record a real value (`jnp.abs(v)`, or "
            "`v.real` and `v.imag` as two aux values)."
        )
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"{what} is a PRNG key ({dtype_shape(value)}), not a number: a key cannot be averaged "
            "and recorded. Leave it out of `aux`."
        )
    if dtype == jnp.bool_:
        raise TypeError(
            f"{what} is an array of bools ({dtype_shape(value)}): record a number, such as "
            "`v.astype(jnp.float32)`, whose average is the fraction that are true."
        )
    if not jnp.issubdtype(dtype, jnp.number):
        raise TypeError(
            f"{what} must be an array of numbers (a scalar, or an array that is averaged), "
            f"got {dtype_shape(value)}."
        )
    return value


def _described(value: Any) -> str:
    if isinstance(value, bool | np.bool_):
        return f"a bool ({value!r}): record a number, such as `float(v)`"
    return f"a {type(value).__name__}"


def split_output(out: Any, stateful: bool) -> tuple[Any, Mapping[str, Any] | None, PyTree]:
    """A loss's output as `(value, aux, new_state)`: `aux` `None` where it returned
    none, `new_state` `None` without state.
    """
    new_state = None
    if isinstance(out, list):  # told apart from a loss not reduced over its batch
        fix = (
            "`return value, new_state` (or `return (value, aux), new_state`)"
            if stateful
            else "`return value` (a scalar), or `return value, aux` (a tuple)"
        )
        parts = ", ".join(dtype_shape(x) if hasattr(x, "dtype") else type(x).__name__ for x in out)
        raise TypeError(
            f"`loss` returned a list of {len(out)} ([{parts}]), but a loss returns its value, "
            f"or its value and a dict of aux values as a tuple, not a list: {fix}."
        )
    if stateful:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                "With `state=`, `loss(model, state, *batch)` must return `(value, new_state)` "
                f"(or `((value, aux), new_state)`), got {type(out).__name__}."
            )
        out, new_state = out
    if isinstance(out, tuple):
        if len(out) == 2 and isinstance(out[1], Mapping):
            return out[0], out[1], new_state
        form = "`((value, aux), new_state)`" if stateful else "`(value, aux)`"
        raise ValueError(
            f"`loss` returned a tuple of {len(out)}, but a loss returns its value, or {form} "
            "with `aux` a dict of named values to record (`{'acc': acc}`)."
        )
    return out, None, new_state


class LossTrace(NamedTuple):
    """What a loss and metrics return, and what they compute, found before the run
    (`find_outputs`).
    """

    aux_names: tuple[str, ...]  # the loss's aux values' names
    means: tuple[str, ...]  # those of the loss, aux values and metrics that are `Mean`s
    # The loss (its model's forward pass) or a metric convolves; `None`: not traced.
    convolves: bool | None = None
    # The FLOPs of their matrix products and convolutions (`product_flops`) on a batch;
    # `None`: not traced.
    flops: float | None = None


CONVOLUTION = "conv_general_dilated"


def find_outputs(
    objective: Objective,
    model: PyTree,
    model_state: PyTree,
    batch: PyTree,
    always: bool = False,
) -> LossTrace:
    """The names of the aux values that the loss returns, which of its values and the
    metrics' are weighted means (`eqfit.Mean`), whether they convolve and the FLOPs of
    their products (`product_flops`), found by tracing them once on abstract arrays
    (nothing runs or compiles), and remembered for the same functions on arrays of the
    same shapes, so that a second `fit` traces nothing. eqfit's own losses and metrics
    return no aux values, and a `Mean` where the batch holds weights (`(x, y,
    weights)`): they are not traced unless `always`, and whether they convolve is then
    unknown (`None`).
    """
    weighted = len(batch_args(batch)) > 2
    own = is_own(objective.loss) and all(
        is_own(fn) for _, fn in objective.metrics if not accumulates(fn)
    )
    if not always and own:
        names = ("loss", *objective.metric_names) if weighted else ()
        return LossTrace((), names, None)
    # A loss or model that cannot be hashed has no key: it is traced every time.
    options = (
        objective.loss,
        objective.metrics,
        objective.stateful,
        objective.use_key,
        objective.precision,
    )
    cache_key = _OUTPUTS.key(options, model, model_state, batch)
    remembered = _OUTPUTS.get(cache_key)
    if remembered is not None:
        return remembered
    key = jax.random.key(0) if objective.use_key else None
    found: list[LossTrace] = []

    def trace(model: PyTree, model_state: PyTree, batch: PyTree) -> Any:
        out, _ = objective.call(model, model_state, batch, key)
        value, aux, _ = split_output(out, objective.stateful)
        aux = aux or {}
        means = ["loss"] if isinstance(value, Mean) else []
        means += [name for name, v in aux.items() if isinstance(v, Mean)]
        args = objective._arguments(model, model_state, batch)
        outs = [out]
        for name, fn in objective.metrics:
            if isinstance(fn, AbstractMetric):
                continue
            if is_own(fn):
                if weighted:
                    means.append(name)
                continue
            check_signature(fn, args, {}, f"metric {name!r}", objective.stateful)
            with collecting(), noting_call(f"metrics[{name!r}]", fn, args, objective.stateful):
                outs.append(fn(*args))
            if isinstance(outs[-1], Mean):
                means.append(name)
        found.append(LossTrace(tuple(aux), tuple(means)))
        return outs

    jaxpr = eqx.filter_make_jaxpr(trace)(model, model_state, batch)[0]
    outputs = found[0]._replace(
        convolves=applies(jaxpr.jaxpr, CONVOLUTION), flops=product_flops(jaxpr.jaxpr)
    )
    for name in outputs.aux_names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"`loss`'s aux values must be named by strings, got {name!r}.")
    _OUTPUTS.put(cache_key, outputs)
    return outputs


def applies(jaxpr: Any, name: str) -> bool:
    """Whether `jaxpr`, or a jaxpr inside it (a loop's body, a branch), applies the
    primitive `name`.
    """
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return True
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a closed jaxpr's own
                if hasattr(inner, "eqns") and applies(inner, name):
                    return True
    return False


class _Traced:
    """What tracing found, remembered by a hashable key of what was traced (the
    functions, the options, the arrays' shapes): the newest 64.
    """

    def __init__(self) -> None:
        self._found: dict[Any, Any] = {}

    @staticmethod
    def key(options: tuple[Any, ...], *traced: PyTree) -> tuple[Any, ...] | None:
        """What was traced as a key: the `options` as they are, the `traced` trees by
        their structure and shapes (`abstract_key`); `None` where it cannot be hashed.
        """
        parts = (*options, *map(abstract_key, traced))
        try:
            hash(parts)
        except TypeError:
            return None
        return parts

    def get(self, key: tuple[Any, ...] | None) -> Any:
        return None if key is None else self._found.get(key)

    def put(self, key: tuple[Any, ...] | None, found: Any) -> None:
        if key is None:
            return
        if len(self._found) >= 64:
            self._found.pop(next(iter(self._found)))
        self._found[key] = found


# What a loss and metrics return on arrays of given shapes (`find_outputs`), and the
# statistics of the metrics that accumulate (`Objective.find_statistics`).
_OUTPUTS = _Traced()
_STATISTICS = _Traced()


def abstract_key(tree: PyTree) -> tuple[Any, ...]:
    """`tree` as a hashable key: its structure, its arrays' shapes and dtypes, and its
    other leaves.
    """
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [
        jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x
        for x in leaves
    ]
    return (treedef, tuple(shapes))


def clone(state: PyTree) -> PyTree:
    """A new `eqx.nn.State` object with the same arrays (one a layer has not used up)."""
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, leaves)
