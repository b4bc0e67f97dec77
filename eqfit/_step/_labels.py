"""Labels out of range, found inside a compiled program and reported as values.

The ready losses and metrics check their labels. Called directly on arrays they raise at
once. Inside a program that eqfit traces, the check is a value: `collecting()` gathers each
check made while the user's loss or metric is traced, the step returns them merged into
one `LabelError` (as `optax.apply_if_finite` carries its count in its state), and the host
turns it into a `ValueError` once the run is done. Nothing is kept in a module: fits in
several threads never see each other's errors. Traced anywhere else (the user's own
`jax.jit`), the check raises at run time through `eqx.error_if`.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jaxtyping import Array, Bool, Int, Shaped


# The ready functions that check labels, by number (the number is what the program
# reports; the name is found here again on the host).
CHECKERS = (
    "softmax_cross_entropy",
    "binary_cross_entropy",
    "accuracy",
    "binary_accuracy",
    "ConfusionMatrix",
    "Precision",
    "Recall",
    "F1",
    "TopKAccuracy",
    # metrax's metrics whose predictions are probabilities (`check_probabilities`).
    *(f"Metrax({name})" for name in ("AUCROC", "AUCPR", "Precision", "Recall", "FBetaScore")),
)
# `LabelError`'s `classes` of a check of labels in [0, 1], and of predictions in [0, 1].
_BINARY, _PROBABILITIES = -1, -2
_DIMS = 4  # where in a batch the label was: up to this many indices
# The entries of `LabelError.code`: whether a bad label was found (1); the checker's index
# in `CHECKERS`; its classes (`_BINARY`, `_PROBABILITIES`); the label's float32 bits; where
# it was (`_DIMS` entries: its index in the flattened batch, then the batch's shape, -1
# past its rank); the global step (-1: evaluation; -2 - i: validation set i, `in_set`).
_FOUND, _CHECKER, _CLASSES, _LABEL, _WHERE = range(5)
_STEP = _WHERE + _DIMS
_WIDTH = _STEP + 1
# Every entry of a check that found nothing, and no entry of one that found a label (as
# its label's bits, it would be -0.0, which is in range).
_NONE = int(np.iinfo(np.int32).min)


class LabelError(NamedTuple):
    """The first label out of range that a program met, as device values: one int32
    array (its entries above), all `_NONE` where none was found. Keeping the first found,
    in a loop's carry at each step, is then a select of entry by entry, which XLA makes
    in place, where an array for each entry was a select (a kernel) each.
    """

    code: Int[Array, "*members 9"]

    @staticmethod
    def of(
        found: Bool[Array, ""],
        checker: int,
        classes: int,
        label: Shaped[Array, ""],
        where: Int[Array, "4"],
        step: int,
    ) -> "LabelError":
        """The check of one batch, packed: `label` as its float32 bits."""
        bits = jax.lax.bitcast_convert_type(label.astype(jnp.float32), jnp.int32)
        step_ = jnp.asarray(step, jnp.int32)
        kind = jnp.asarray([checker, classes], jnp.int32)
        rest = jnp.concatenate([kind, bits[None], where, step_[None]])
        # `found` first and apart: XLA reads it back (the step's) without making the rest.
        first = jnp.where(found, 1, _NONE).astype(jnp.int32)[None]
        return LabelError(jnp.concatenate([first, jnp.where(found, rest, _NONE)]))

    @staticmethod
    def none() -> "LabelError":
        return LabelError(jnp.full((_WIDTH,), _NONE, jnp.int32))

    @property
    def found(self) -> Bool[Array, "*members"]:
        return self.code[..., _FOUND] != _NONE

    def at_step(self, step: Int[Array, "*members"] | int) -> "LabelError":
        """This one, met at `step` (if found)."""
        step_ = jnp.where(self.found, jnp.asarray(step, jnp.int32), _NONE)
        return LabelError(jnp.concatenate([self.code[..., :_STEP], step_[..., None]], -1))

    def in_set(self, i: int) -> "LabelError":
        """This one, met in validation set `i` (if found)."""
        return self.at_step(-2 - i)

    def found_only_where(self, keep: Bool[Array, "*members"]) -> "LabelError":
        """This one where `keep`, else one that found nothing."""
        return LabelError(jnp.where(keep[..., None], self.code, _NONE))

    def or_else(self, other: "LabelError") -> "LabelError":
        """This one if it found a bad label, else `other`: the first found is kept."""
        # Entry by entry (each is `_NONE` where the others are): in place in a loop's carry.
        return LabelError(jnp.where(self.code != _NONE, self.code, other.code))

    def then(self, other: "LabelError") -> "LabelError":
        """`or_else` for two checks of one step: its `found` entry stands apart, so that
        XLA reads the step's `found` back from theirs without making their codes.
        """
        first = jnp.where(self.found | other.found, 1, _NONE).astype(jnp.int32)[..., None]
        a, b = self.code[..., 1:], other.code[..., 1:]
        return LabelError(jnp.concatenate([first, jnp.where(a != _NONE, a, b)], -1))


_COLLECTOR: contextvars.ContextVar[list[LabelError] | None] = contextvars.ContextVar(
    "eqfit_label_checks", default=None
)


@contextlib.contextmanager
def collecting() -> Iterator[list[LabelError]]:
    """Gathers the label checks made while tracing inside the block (in this thread)."""
    found: list[LabelError] = []
    token = _COLLECTOR.set(found)
    try:
        yield found
    finally:
        _COLLECTOR.reset(token)


def first_of(found: list[LabelError]) -> LabelError | None:
    """The first bad label among the checks of one call; `None` where nothing checked
    labels (then the program carries nothing for them, and pays nothing).
    """
    if not found:
        return None
    error = found[-1]
    for check in reversed(found[:-1]):
        error = check.then(error)
    return error


def either(first: LabelError | None, then: LabelError | None) -> LabelError | None:
    """`first` if it found a bad label, else `then`; either may be `None` (no checks)."""
    if first is None or then is None:
        return then if first is None else first
    return first.then(then)


def check_labels(values: Array, y: Array, classes: int | None, name: str) -> Array:
    """`values` (logits or outputs), NaN where a label of `y` is outside `[0, classes)`
    (or, with `classes=None`, outside `[0, 1]`), the label reported as described above.
    """
    return _checked(values, y, _BINARY if classes is None else classes, name)


def check_probabilities(predictions: Array, name: str) -> Array:
    """`predictions` of a metric that takes probabilities (metrax's `AUCROC`, given
    logits: a value, not an error, without this), NaN where one is outside `[0, 1]`, and
    that one reported as a label out of range is.
    """
    return _checked(predictions, predictions, _PROBABILITIES, name)


def check_counted(values: Array, y: Array, classes: int | None, name: str) -> Bool[Array, ""]:
    """Whether counts made of `values` (logits or outputs) and the labels `y` are spoilt:
    a label out of range (checked and reported as `check_labels` does) or a NaN among
    `values`, either making them NaN. In a program, one reduction over the batch finds
    both, where `check_labels` and a NaN check after it take two, one waiting on the other.
    """
    code = _BINARY if classes is None else classes
    found = _COLLECTOR.get()
    if found is None or not isinstance(y, Tracer) or values.shape[: y.ndim] != y.shape:
        return jnp.any(jnp.isnan(_checked(values, y, code, name)))
    bad, size = _bad(y, code), max(y.size, 1)
    # Per value: its label's flat index where that label is bad, else `size` where the
    # value is NaN, else `size + 1`; the least of them tells all.
    extra = (None,) * (values.ndim - y.ndim)  # a logit per class after the label's axes
    index = jnp.arange(y.size, dtype=jnp.int32).reshape(y.shape)[(..., *extra)]
    key = jnp.where(bad[(..., *extra)], index, jnp.where(jnp.isnan(values), size, size + 1))
    least = jnp.min(key)
    _report(found, least, y, code, name)
    return least <= size


def _bad(y: Array, classes: int) -> Array:
    """Where `y` is outside `[0, classes)`, or `[0, 1]` for `_BINARY` and `_PROBABILITIES`."""
    return (y < 0) | (y >= classes) if classes > 0 else (y < 0) | (y > 1)


def _checked(values: Array, y: Array, classes: int, name: str) -> Array:
    """`check_labels`' and `check_probabilities`' check of `y`: `classes` the number of
    classes, or `_BINARY` or `_PROBABILITIES` for values in `[0, 1]`.
    """
    bad = _bad(y, classes)
    if not isinstance(y, Tracer):  # called directly, not in a program: raise now
        if bool(jnp.any(bad)):
            y_, bad_ = np.asarray(y), np.asarray(bad)
            at = np.unravel_index(int(np.argmax(bad_)), y_.shape)
            raise ValueError(message(name, classes, y_[at], tuple(map(int, at))))
        return values
    found = _COLLECTOR.get()
    if found is None:  # traced by someone else's program: fail loudly at run time
        what = "a prediction" if classes == _PROBABILITIES else "a label"
        return eqx.error_if(values, jnp.any(bad), f"`{name}`: {what} {_why(classes, name)}.")
    # The first bad label's flat index (its size if none), by one plain min-reduction,
    # which XLA compiles faster than `argmax` and `any` together.
    size = max(bad.size, 1)
    flat = jnp.min(jnp.where(bad.reshape(-1), jnp.arange(bad.size, dtype=jnp.int32), size))
    any_bad = _report(found, flat, y, classes, name)
    # NaN values: the step's loss is not finite, so its update is not applied.
    return jnp.where(any_bad, jnp.nan, values)


def _report(
    found: list[LabelError], least: Int[Array, ""], y: Array, classes: int, name: str
) -> Bool[Array, ""]:
    """Appends to `found` the check of `y` whose first bad label's flat index is `least`
    (`y.size` or more where none is bad); returns whether one is.
    """
    size = max(y.size, 1)
    any_bad = least < size
    flat = jnp.minimum(least, size - 1)
    # The flat index and the batch's shape (constants): the host finds the index in the
    # batch from them, which keeps the program small.
    shape = list(y.shape[: _DIMS - 1]) + [-1] * (_DIMS - 1 - min(y.ndim, _DIMS - 1))
    where = jnp.concatenate([flat[None].astype(jnp.int32), jnp.asarray(shape, jnp.int32)])
    checker, label = CHECKERS.index(name), y.reshape(-1)[flat]
    found.append(LabelError.of(any_bad, checker, classes, label, where, -1))
    return any_bad


def _why(classes: int, name: str) -> str:
    if classes == _PROBABILITIES:
        return (
            f"is outside [0, 1]: `{name}` takes probabilities as its predictions (logits "
            "would give another value without a word). Map the model's outputs to them in "
            "`Metrax`'s `inputs` (`lambda logits, y: {'predictions': jax.nn.sigmoid(logits), "
            "'labels': y}`)"
        )
    if classes == _BINARY:
        return "is outside [0, 1]: labels must be 0 or 1, or probabilities"
    return (
        f"is outside [0, {classes}): the model gives {classes} classes, so labels must be "
        f"integers from 0 to {classes - 1}"
    )


def message(name: str, classes: int, label: Any, where: tuple[int, ...]) -> str:
    what = "prediction" if classes == _PROBABILITIES else "label"
    return f"`{name}`: {what} {label} (at {where} of a batch) {_why(classes, name)}."


def raise_found(error: Any, ensemble: bool = False, sets: tuple[str, ...] | None = None) -> None:
    """Raises the `ValueError` for a `LabelError` read back to the host, if it found one
    (`sets`: the names of the validation sets, where they are named).
    """
    codes = np.asarray(error.code, np.int32).reshape(-1, _WIDTH)
    found = codes[:, _FOUND] != _NONE
    if not found.any():
        return
    i = int(np.argmax(found))
    code = codes[i]
    checker, classes, step = code[_CHECKER], code[_CLASSES], code[_STEP]
    label = code[_LABEL : _LABEL + 1].view(np.float32)[0]
    flat, *dims = code[_WHERE:_STEP].tolist()
    where = tuple(int(w) for w in np.unravel_index(flat, [d for d in dims if d >= 0]))
    # Class labels are integers; binary ones may be probabilities.
    value = int(label) if int(classes) > 0 else float(label)
    text = message(CHECKERS[int(checker)], int(classes), value, where)
    if int(step) >= 0:
        text += f" (Found at step {step + 1} of the run, counted from 1.)"
    elif int(step) <= -2:
        where_ = "`validation_data`" if not sets else f"the validation set {sets[-2 - step]!r}"
        text += f" (Found in {where_}.)"
    if ensemble:
        text = f"member {i}: " + text
    raise ValueError(text)


def same_shape(out: Array, y: Array, name: str) -> Array:
    """`out`, refused unless shaped as the targets `y` (in loss or metric `name`)."""
    if out.shape != y.shape:
        # Broadcasting (batch, 1) against (batch,) would silently give a (batch, batch)
        # loss; refuse it instead.
        raise ValueError(
            f"`{name}`: the model's outputs have shape {tuple(out.shape)} but `y` has "
            f"shape {tuple(y.shape)}; they must match."
        )
    return out
