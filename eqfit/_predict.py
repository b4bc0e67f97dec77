"""`predict`: a model's outputs over data in batches, one compiled scan over the data in
memory, or over each chunk of data streamed as training streams it (memmaps, loaders).
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree, TypeCheckError

from ._core._checks import checked, reported_as
from ._core._data import (
    as_data,
    as_key,
    batch_calls,
    bucketed,
    check_alive,
    check_batch_size,
    ensemble_size,
    not_a_stack,
    num_samples,
)
from ._core._execution import Execution
from ._core._typing import ArrayTree, Data, ModelState, PRNGKey
from ._host._feeds import inference_chunks
from ._host._inference import (
    EXECUTION_HINTS,
    inference_execution,
    inference_source,
)
from ._host._loader import Loader
from ._host._sources import Memmaps
from ._program._jit import cached_jit
from ._program._state import OnDevice, Releases
from ._step._evaluate import batch_number, batch_rows
from ._step._objective import abstract_key, applies, CONVOLUTION
from ._step._precision import as_precision, Precision, PrecisionLike
from ._step._validation import refuse_sets
from .losses import outputs


# What the model returns for one example, so what `predict` returns for all of them.
Output = TypeVar("Output")


@overload
def predict(
    model: Callable[..., Output],
    x: Data,
    *,
    batch_size: int = 256,
    ensemble: bool = False,
    state: None = None,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
    execution: Execution | Literal["auto"] = "auto",
    out: ArrayTree | None = None,
) -> Output: ...
@overload
def predict(
    model: Callable[..., tuple[Output, Any]],
    x: Data,
    *,
    batch_size: int = 256,
    ensemble: bool = False,
    state: ModelState,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
    execution: Execution | Literal["auto"] = "auto",
    out: ArrayTree | None = None,
) -> Output: ...
@checked("predict", EXECUTION_HINTS)
def predict(
    model: Callable[..., Any],
    x: Data,
    *,
    batch_size: int = 256,
    ensemble: bool = False,
    state: ModelState | None = None,
    precision: PrecisionLike = None,
    key: PRNGKey | None = None,
    execution: Execution | Literal["auto"] = "auto",
    out: ArrayTree | None = None,
) -> ArrayTree:
    """Runs `model` over every example of `x`, in batches, in inference mode.

    One compiled program, a scan over full batches and one smaller last batch; or, where
    XLA compiles the forward pass worse inside a loop (one that convolves, on the CPU
    backend), programs of a few batches with no loop in them, called one after another
    from Python (as `fit`'s `execution=` runs its steps). Either way memory stays at one
    batch's activations however large `x` is, and the outputs agree to float tolerance.

    Data that `fit` streams is streamed here too, through the same reader: memmaps and
    loaders are read in chunks of batches in a background thread while the device
    computes, so the inputs are never all in memory (and with `out=`, nor the outputs).

    **Arguments:**

    - `model`: called on one example, `model(x[i])` (or `model(x[i], state)`).
    - `x`: the inputs, any of:
        - an array with a leading example axis, or any PyTree of arrays sharing it (then
            the model is called on one example's PyTree); `np.memmap` arrays
            (`np.load(..., mmap_mode="r")`) are streamed;
        - a loader: a re-iterable (a PyTorch `DataLoader`, a Grain dataset), an iterator
            or a generator of batches, read once. A batch that is a tuple (or list) is
            `(inputs, ...)`, as Keras's `predict` takes a dataset of `(x, y)`: its first
            item is the input and the rest (the labels) is ignored; any other batch (an
            array, a dict) is the input itself. So the loader that `fit` trains on
            predicts as it is; a model of several inputs takes them as a tuple inside the
            first item, `((x1, x2), y)`.
    - `batch_size`: examples per batch (a loader's batches are its own).
    - `ensemble`: `model` is a stack of members (as `fit(..., ensemble=True)` takes);
        every member predicts every example.
    - `state`: the model's `eqx.nn.State`, for a stateful model: called as `model(x[i],
        state)` under `jax.vmap` with `axis_name="batch"`, returning `(output, state)`,
        whose output is kept.
    - `precision`: as `fit`'s: the model's floating arrays and the inputs' are cast to
        its compute dtype inside the program, and floating outputs come back in its
        `params` dtype (float32).
    - `key`: for a model that takes a keyword `key`: batch `b` (counted from 0) gets
        `jax.random.fold_in(key, b)`, split over its examples. By default the model gets
        no key.
    - `execution`: as `fit`'s: [`eqfit.WholeRun`][]`()`, one program over every batch,
        or [`eqfit.PerStep`][]`(unroll)`, programs of `unroll` batches called from
        Python; by default (`"auto"`) `PerStep(1)` where the model convolves on the CPU
        backend, else `WholeRun()`.
    - `out`: where to write the outputs: a PyTree of numpy arrays shaped as they are
        (`(n, ...)`, or `(members, n, ...)`), such as an `np.memmap` opened for writing
        (`np.lib.format.open_memmap(path, mode="w+", ...)`), so that predicting over
        data larger than memory keeps a chunk's outputs at a time. By default the
        outputs are returned as JAX arrays.

    **Returns:**

    The stacked outputs, `(n, ...)`, or `(members, n, ...)` with `ensemble=True` (`out`,
    filled, where given): to a type checker, what `model` returns (without the state,
    given one). For a loader of buckets (`bucketed = True`, [`eqfit.Buckets`][]), whose
    batches' outputs differ in shape, a list of each batch's outputs in its order
    (`Buckets.order()` says which samples each holds).
    """
    refuse_sets(x, "x", "predict")
    check_alive(model=model, x=x, state=state, out=out)
    check_batch_size(batch_size)
    policy = as_precision(precision, model=model)
    members = ensemble_size(model) if ensemble else None
    key_ = None if key is None else as_key(key)
    single = _is_array(x)
    source = inference_source((x,) if single else x, "x")
    # Whether a streamed batch's first item is the input: `(x,)` read for one memmap, a
    # loader's `(x, y)`.
    first = single or isinstance(source, Loader)
    if source is None:
        x_ = as_data(x if not single else (x,), "x")
        inputs = x_[0] if single else x_
    else:
        inputs = _inputs(source.like, first)
    with reported_as("predict", "x"):
        args = (eqx.nn.inference_mode(model), inputs, state, batch_size, ensemble, policy, key_)
        with _model_called(members, model, x, state):
            chosen = inference_execution(execution, lambda: _forward_convolves(*args))
        if source is not None:
            return _predict_streamed(args, source, first, chosen, out, members)
        writer = None if out is None else _Writer(out, ensemble)  # `out` checked first
        with _model_called(members, model, x, state):
            outputs = chosen.batches(
                functools.partial(_predict, *args), functools.partial(_predict_in_calls, args)
            )
        if writer is None:
            return outputs
        writer.write(outputs).check_filled()
        return out


@contextlib.contextmanager
def _model_called(members: int | None, model: Any, x: Any, state: Any) -> Iterator[None]:
    """Where the model is called: with `ensemble=True` (`members` of them), an error
    there says that `model` may be a single model, not a stack; without, that `x`'s
    examples may be what the model cannot take (`_unsuited_examples`). (`out`'s errors
    are raised as they are, outside.)
    """
    try:
        yield
    except Exception as e:
        if members is not None:
            # A single model whose arrays happen to share their leading size passes for a
            # stack; this is where it shows.
            raise not_a_stack(members, "`predict`", e) from e
        unsuited = _unsuited_examples(model, x, state, e)
        if unsuited is not None:
            raise unsuited from e
        raise


def _unsuited_examples(model: Any, x: Any, state: Any, error: Exception) -> Exception | None:
    """Where `x` gives the model scalars (a 1-D `x`) or a PyTree (a dict batch) as its
    examples and the model itself fails on one, an error saying so; `None` otherwise (the
    model takes such examples, and failed for another reason).
    """
    if isinstance(error, TypeCheckError):  # `reported_as` names `x` already
        return None
    single, shape = _is_array(x), getattr(x, "shape", ())
    if (single and len(shape) != 1) or not (single or isinstance(x, dict | tuple)):
        return None  # examples of arrays, or a loader's batches
    leaves = jax.tree.leaves(x)
    if not leaves or not all(_is_array(a) and a.ndim > 0 for a in leaves):
        return None
    example = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), x)
    call = (lambda m, e: m(e)) if state is None else (lambda m, e: m(e, state))
    try:
        eqx.filter_eval_shape(call, eqx.nn.inference_mode(model), example)
    except Exception:
        pass
    else:
        return None
    shown = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", example)
    if single:
        what = f"`x` has shape {tuple(shape)}, so each example is a scalar"
        fix = "For examples of one feature, pass `x[:, None]`."
    else:
        what = f"`x` is a {type(x).__name__}, so each example is {shown}"
        fix = "Pass the array the model takes, or a model that takes such examples."
    return ValueError(
        f"`predict` calls the model on one example of `x` at a time, `model(x[i])`: {what}, "
        f"and the model fails on it ({type(error).__name__}: {error}). {fix}"
    )


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _inputs(batch: PyTree, first: bool) -> PyTree:
    """A streamed batch's inputs: with `first` (a loader's batch, a single memmap read
    as `(x,)`), a tuple's first item; otherwise the batch.
    """
    return batch[0] if first and isinstance(batch, tuple) else batch


def _predict_streamed(
    args: tuple[Any, ...],
    source: Memmaps | Loader,
    first: bool,
    chosen: Execution,
    out: Any,
    members: int | None,
) -> Any:
    """`predict` over streamed data: each chunk's outputs computed as it arrives (one
    program per chunk's shape), and kept or written to `out`.
    """
    model, _, state, batch_size, ensemble, policy, key = args
    parts = []
    buckets = isinstance(source, Loader) and bucketed(source.loader)
    if buckets and out is not None:
        raise ValueError(
            "`out=` takes outputs of one shape, but `x` is a loader of buckets "
            "(`bucketed`), whose batches' outputs differ in shape: leave `out` out, and "
            "take the list of each batch's outputs."
        )
    writer = None if out is None else _Writer(out, ensemble)
    with inference_chunks(source, batch_size) as chunks:
        done = Releases()
        for chunk in chunks:
            with _model_called(members, model, None, state):
                outputs = _predict_chunk(model, state, ensemble, policy, key, chosen, chunk, first)
            if writer is None:
                parts.append(outputs)
            else:
                writer.write(outputs)
            done.computed(chunk, outputs)
        done.computed()
    if writer is not None:
        writer.check_filled()
        return out
    if buckets:  # each batch's own, in the loader's order
        return parts
    return _joined(parts, ensemble)


def _predict_chunk(
    model: PyTree,
    state: PyTree,
    ensemble: bool,
    policy: Precision | None,
    key: Any,
    chosen: Execution,
    chunk: OnDevice,
    first: bool,
) -> Any:
    """The outputs of a streamed chunk's batches, as `chosen` runs them, its padding
    dropped.
    """
    x, size = _inputs(chunk.data, first), chunk.batch_size
    rows = chunk.valid * size
    args = (model, x, state, size, ensemble, policy, key)
    outputs = chosen.batches(
        functools.partial(_predict, *args, chunk.offset),
        functools.partial(_predict_in_calls, args, rows=rows, offset=chunk.offset),
    )
    if rows == num_samples(x):
        return outputs
    return jax.tree.map(lambda o: o[:, :rows] if ensemble else o[:rows], outputs)


def _joined(parts: list[Any], ensemble: bool) -> Any:
    if len(parts) == 1:
        return parts[0]
    axis = 1 if ensemble else 0
    shapes = {tuple(np.delete(np.shape(o), axis)) for p in parts for o in jax.tree.leaves(p)[:1]}
    if len(shapes) > 1:
        raise ValueError(
            f"`x`'s batches give outputs of several shapes ({sorted(shapes)} but for the "
            "examples' axis), which do not stack into one array: a loader of buckets. Give "
            "its class `bucketed = True` (as `eqfit.Buckets` has) to get a list of each "
            "batch's outputs."
        )
    return jax.tree.map(lambda *p: jnp.concatenate(p, axis=axis), *parts)


class _Writer:
    """`predict`'s outputs written into `out` (`predict`'s argument) as they come, each
    piece checked against it.
    """

    def __init__(self, out: Any, ensemble: bool):
        self.out, self.axis, self.written = out, 1 if ensemble else 0, 0
        for path, place in jax.tree_util.tree_leaves_with_path(out):
            if isinstance(place, np.ndarray) and not place.flags.writeable:
                raise ValueError(
                    f"`out{jax.tree_util.keystr(path)}` is read-only (a memmap opened with "
                    "`mode='r'`, or an array made read-only), so `predict` cannot write the "
                    "outputs into it: give a writable array, such as `np.lib.format."
                    "open_memmap(path, mode='w+', dtype=..., shape=...)`."
                )

    def write(self, outputs: Any) -> "_Writer":
        if jax.tree.structure(outputs) != jax.tree.structure(self.out):
            raise TypeError(
                f"`out` has the structure {jax.tree.structure(self.out)}, but the model's "
                f"outputs have {jax.tree.structure(outputs)}: give one array per output."
            )
        axis, start = self.axis, self.written
        rows = jax.tree.leaves(outputs)[0].shape[axis]
        for (path, place), value in zip(
            jax.tree_util.tree_leaves_with_path(self.out), jax.tree.leaves(outputs)
        ):
            value = np.asarray(value)
            where = f"`out{jax.tree_util.keystr(path)}`"
            shape = list(value.shape)
            dims = ", ".join("n" if i == axis else str(d) for i, d in enumerate(shape))
            stacked = " (with `ensemble=True`, the members' axis first)" if axis else ""
            if not isinstance(place, np.ndarray) or place.ndim != value.ndim:
                raise TypeError(
                    f"{where} must be a numpy array of {value.ndim} dimensions (an "
                    f"`np.memmap` opened for writing, say) to hold outputs of shape "
                    f"({dims}){stacked}; got {type(place).__name__} of shape "
                    f"{tuple(np.shape(place))}."
                )
            expected = shape[:axis] + [place.shape[axis]] + shape[axis + 1 :]
            if list(place.shape) != expected or start + rows > place.shape[axis]:
                raise ValueError(
                    f"{where} has shape {tuple(place.shape)}, but the outputs are "
                    f"({dims}){stacked} with n at least {start + rows} so far: give an "
                    "array of the outputs' shape."
                )
            if not np.can_cast(value.dtype, place.dtype, casting="same_kind"):
                raise TypeError(
                    f"{where} has dtype {place.dtype}, which cannot hold the outputs, of "
                    f"dtype {value.dtype}, without changing their kind: give an array of "
                    f"dtype {value.dtype} (or a wider one of its kind)."
                )
            index = (slice(None),) * axis + (slice(start, start + rows),)
            np.copyto(place[index], value, casting="same_kind")
        self.written = start + rows
        return self

    def check_filled(self) -> None:
        """Refuses an `out` that the data did not fill."""
        size = jax.tree.leaves(self.out)[0].shape[self.axis]
        if self.written != size:
            raise ValueError(
                f"`out` holds {size} examples, but `x` gave {self.written}: its rows past "
                f"{self.written} were not written. Give an array of the outputs' shape."
            )


# Whether a model's forward pass convolves, by the abstract model, inputs and options:
# traced once, not at each `predict`.
_CONVOLVES: dict[Any, bool] = {}


def _forward_convolves(
    model: PyTree,
    x: PyTree,
    state: PyTree,
    batch_size: int,
    ensemble: bool,
    policy: Precision | None,
    key: Any,
) -> bool:
    """Whether `predict`'s forward pass on these arguments convolves."""
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape[1:]), a.dtype), x)
    try:
        cache_key = (abstract_key((model, state, key)), abstract_key(one), ensemble, policy)
        hash(cache_key)
    except TypeError:  # a model that cannot be hashed: traced every time
        cache_key = None
    if cache_key is not None and cache_key in _CONVOLVES:
        return _CONVOLVES[cache_key]
    jaxpr = eqx.filter_make_jaxpr(lambda m, s, x, k: _predict_all(m, x, s, 1, ensemble, policy, k))(
        model, state, one, key
    )[0]
    convolves = applies(jaxpr.jaxpr, CONVOLUTION)
    if cache_key is not None:
        if len(_CONVOLVES) >= 64:
            _CONVOLVES.pop(next(iter(_CONVOLVES)))
        _CONVOLVES[cache_key] = convolves
    return convolves


def _predict_in_calls(
    args: tuple[Any, ...], unroll: int, rows: int | None = None, offset: Any = None
) -> Any:
    """`predict` as programs of `unroll` full batches (`_predict_some`), then one of the
    smaller last batch, called one after another; their outputs joined. For a streamed
    chunk, its first `rows` rows (whole batches), numbered from batch `offset` on.
    """
    model, x, state, batch_size, ensemble, policy, key = args
    rows = num_samples(x) if rows is None else rows
    num_full = rows // batch_size
    parts = []
    for b, count, remainder in batch_calls(rows, batch_size, unroll):
        first = np.asarray(b, np.int32)  # an array: traced, one program for every call
        out = _predict_some(
            model, x, state, batch_size, ensemble, policy, key, first, count, remainder, offset
        )
        if not remainder and b + count > num_full:  # batches past the last full one
            kept = (num_full - b) * batch_size
            out = jax.tree.map(lambda o: o[:, :kept] if ensemble else o[:kept], out)
        parts.append(out)
    return _joined(parts, ensemble)


def _forward(
    model: PyTree, state: PyTree, policy: Precision | None, key: Any, offset: Any = None
) -> Callable[[PyTree, Any], Any]:
    """The forward pass of one batch, `forward(batch, b)` (`b` the batch's number, for
    its key, counted from `offset` in a streamed chunk), in the precision policy's dtypes.
    """
    if policy is not None:
        model = policy.cast(model)

    def forward(x: PyTree, b: Any) -> Any:
        if key is None:
            batch_key = None
        else:
            batch_key = jax.random.fold_in(key, batch_number(b, offset))
        if policy is None:
            return outputs(model, x, state, batch_key)[0]
        out = outputs(model, policy.cast_batch(x), state, batch_key)[0]
        return policy.master(out)

    return forward


def _predict_all(
    model: PyTree,
    x: PyTree,
    state: PyTree,
    batch_size: int,
    ensemble: bool,
    policy: Precision | None,
    key: Any = None,
    offset: Any = None,
) -> Any:
    """The outputs of every example of `x`; of a streamed chunk's, with `offset` the
    number of its first batch (for the batches' keys).
    """
    n = num_samples(x)
    num_full, remainder = divmod(n, batch_size)

    def run(model: PyTree, state: PyTree) -> Any:
        forward = _forward(model, state, policy, key, offset)
        parts = []
        if num_full:
            full = jax.tree.map(
                lambda a: a[: num_full * batch_size].reshape(num_full, batch_size, *a.shape[1:]),
                x,
            )
            _, out = jax.lax.scan(
                lambda _, b_xb: (None, forward(b_xb[1], b_xb[0])),
                None,
                (jnp.arange(num_full), full),
            )
            parts.append(
                jax.tree.map(lambda o: o.reshape(num_full * batch_size, *o.shape[2:]), out)
            )
        if remainder:
            last = jax.tree.map(lambda a: a[num_full * batch_size :], x)
            parts.append(forward(last, num_full))
        if len(parts) == 1:
            return parts[0]
        return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)

    if ensemble:
        return eqx.filter_vmap(run)(model, state)
    return run(model, state)


# Compiled as `cached_jit` compiles, not as `eqx.filter_jit`: `eqfit.clear_cache()` frees
# their programs.
_predict = cached_jit(_predict_all)


@cached_jit
def _predict_some(
    model: PyTree,
    x: PyTree,
    state: PyTree,
    batch_size: int,
    ensemble: bool,
    policy: Precision | None,
    key: Any,
    first: Any,
    count: int,
    remainder: bool,
    offset: Any = None,
) -> Any:
    """`_predict`'s outputs of `count` full batches from batch `first` on (a batch past
    the last full one is computed on the last's rows, for the caller to drop), or with
    `remainder` of the smaller last batch, written out with no loop around them. `offset`:
    as `_predict_all`'s.
    """
    num_full = num_samples(x) // batch_size

    def run(model: PyTree, state: PyTree) -> Any:
        forward = _forward(model, state, policy, key, offset)
        if remainder:
            return forward(jax.tree.map(lambda a: a[num_full * batch_size :], x), num_full)
        parts = []
        for j in range(count):
            b = jnp.asarray(first, jnp.int32) + j
            start = jnp.minimum(b, num_full - 1) * batch_size
            parts.append(forward(jax.tree.map(lambda a: batch_rows(a, start, batch_size), x), b))
        return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)

    if ensemble:
        return eqx.filter_vmap(run)(model, state)
    return run(model, state)
