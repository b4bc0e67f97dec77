"""The public `fit`: check, partition, choose source and placement, drive, return."""

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
import optax
from beartype import beartype
from jax.sharding import Mesh
from jaxtyping import Array, jaxtyped, Key, PyTree, Shaped, UInt32

from ._checkpoint import as_plain, Checkpoints, describe, Interrupt, position
from ._data import as_data, as_key, ensemble_size, is_dtype, plan_batches
from ._drive import Bar, Callback, drive, Plan
from ._early_stopping import EarlyStopping
from ._loop import Consts, Inputs, Loop, run, split_arrays, start, TrainState
from ._parallel import choose_placement, Device, OneDevice
from ._result import FitResult, make_result
from ._sources import InMemory, Loader, Memmaps, stream_plan, streamed_source
from ._step import takes_key


ArrayData = tuple[Shaped[Array | np.ndarray, "n ..."], ...]
ValidationData = tuple[Shaped[Array | np.ndarray, "n_val ..."], ...]

# How long each call of the bar path takes: the bar redraws about this often.
SECONDS_PER_CALL = 0.2


@jaxtyped(typechecker=beartype)
def fit(
    model: PyTree,
    data: ArrayData | Iterable[Any],
    *,
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation | optax.MultiSteps,
    key: Key[Array, ""] | UInt32[Array, "2"],
    epochs: int = 1,
    batch_size: int = 32,
    shuffle: bool = True,
    drop_remainder: bool = False,
    progress: bool = False,
    filter_spec: PyTree = eqx.is_inexact_array,
    opt_state: PyTree | None = None,
    state: PyTree | None = None,
    validation_data: ValidationData | None = None,
    validation_split: float | None = None,
    metrics: Mapping[str, Callable[..., Any]] | None = None,
    early_stopping: EarlyStopping | None = None,
    on_nan: Literal["raise", "stop", "skip"] = "raise",
    callbacks: Sequence[Callback] = (),
    devices: int | Sequence[Device] | None = None,
    mesh: Mesh | None = None,
    ensemble: bool = False,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
) -> FitResult:
    """Trains `model` on `data` by minibatch gradient descent, compiled end to end.

    **Arguments:**

    - `model`: any PyTree of arrays, usually an `eqx.Module`. It is not changed.
    - `data`: a tuple of numpy or JAX arrays sharing their leading (sample) axis. It is
        moved to the device once; each epoch then permutes indices, not data. Data larger
        than memory streams instead: a tuple of `np.memmap` arrays (`np.load(...,
        mmap_mode="r")`), or a re-iterable loader yielding batches as tuples of arrays.
    - `loss`: called as `loss(model, *batch)` (or `loss(model, state, *batch)` returning
        `(value, new_state)` with `state=`), returning a scalar. If it takes a keyword
        `key`, it gets a fresh key every step (for dropout and the like).
    - `optimizer`: any optax `GradientTransformation` (or `optax.MultiSteps`). Those that
        read the loss (`optax.contrib.reduce_on_plateau`) receive it as `value`.
    - `key`: a PRNG key. It drives the shuffle, the per-step keys and `validation_split`.
    - `epochs`: passes over the data.
    - `batch_size`: samples per step.
    - `shuffle`: visit the samples in a new random order each epoch.
    - `drop_remainder`: skip the last, smaller batch of each epoch instead of taking it
        as one more step.
    - `progress`: `False` runs the whole training as one call of the compiled program.
        `True` shows a tqdm bar and calls the same program in pieces; the result is the
        same, bit for bit.
    - `filter_spec`: which leaves of `model` train, as in `eqx.partition`. Leaves that
        are not floating-point arrays never train.
    - `opt_state`: an optimizer state to continue from, such as a previous result's.
    - `state`: the `eqx.nn.State` of a stateful model (BatchNorm and the like).
    - `validation_data`: a tuple like `data`, evaluated after each epoch in inference mode.
    - `validation_split`: instead, hold out this fraction of `data`, chosen from `key`.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar` (with `state=`,
        `fn(model, state, *batch)`), recorded per epoch on the training batches and on
        the validation data.
    - `early_stopping`: an [`eqfit.EarlyStopping`][], carried out on the device.
    - `on_nan`: what a NaN or infinite loss does. `"raise"`: stop, and raise
        [`eqfit.NonFiniteLossError`][] holding the last finite model. `"stop"`: stop and
        return it. `"skip"`: skip that update and go on. The check never syncs the host,
        and on finite losses all three train alike, bit for bit.
    - `callbacks`: objects with `on_epoch_end(epoch, logs)`, called on the host after
        each epoch; returning `True` stops training. With callbacks the program runs an
        epoch per call, so that they see each epoch before the next one starts.
    - `devices`: data parallel over these local devices (or the first `devices` of them)
        with `eqx.filter_pmap`. Each batch is split evenly over them, so `batch_size`
        must be a multiple of their number.
    - `mesh`: data parallel through sharding over the first axis of this
        `jax.sharding.Mesh`, which may span several processes (`jax.distributed`); then
        each process passes its own rows of `data`.
    - `ensemble`: `model` is a stack of members (every array with a leading member axis,
        as `eqx.filter_vmap` builds it), trained side by side in one program. Member `i`
        trains as it would alone with key `jax.random.split(key, members)[i]`: its own
        shuffle and per-step keys. `state` and `opt_state`, if given, are stacked too.
        With `devices=` or `mesh=`, each batch is split over the devices and every
        device holds all members.
    - `checkpoint`: a directory. Every `checkpoint_every` epochs the whole training state
        (model, optimizer state, `state`, position, history, early stopping) is written
        there, atomically, keeping the last two. Calling `fit` again with the same
        directory resumes from the newest complete checkpoint and ends with the same bits
        as an uninterrupted run; one written by another configuration is refused.
    - `checkpoint_every`: epochs between checkpoints.

    Ctrl-C stops training where the program next returns to the host (on the compiled
    path without a checkpoint, at the end of the run), writes a checkpoint if a
    directory is given, and raises `KeyboardInterrupt`. A second Ctrl-C stops at once.

    **Returns:**

    A [`eqfit.FitResult`][] with the trained `model`, the `opt_state`, the `history` and
    the model `state`.

    !!! warning "What triggers a compilation"

        The run is compiled once per model structure (with its non-array leaves), the
        arrays `filter_spec` chooses, the `loss`, `metrics` and `optimizer` objects, data
        shapes, `(epochs, batch_size, shuffle, drop_remainder)` and the other settings
        (`early_stopping`, `on_nan`, validation, `state`, `ensemble`). A new
        `optax.adam(...)` is a new object, so keep one optimizer to reuse the program; a
        new `filter_spec` function that chooses the same arrays reuses it.
    """
    began = time.perf_counter()
    key_ = as_key(key)
    if isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"`epochs` must be 0 or more, got {epochs}.")
    if checkpoint is not None and (isinstance(checkpoint_every, bool) or checkpoint_every < 1):
        raise ValueError(f"`checkpoint_every` must be at least 1, got {checkpoint_every}.")
    members = ensemble_size(model) if ensemble else None
    if members is not None and validation_split is not None:
        raise ValueError(
            "`validation_split` would hold out different samples for each member of an "
            "ensemble; pass `validation_data` instead."
        )
    if validation_data is not None and validation_split is not None:
        raise ValueError("Give `validation_data` or `validation_split`, not both.")
    placement = choose_placement(devices, mesh, batch_size)
    source, val_data = _source(data, validation_data, validation_split, key_)
    if isinstance(source, InMemory):
        num_samples = source.num_samples
        if mesh is not None and jax.process_count() > 1:
            num_samples *= jax.process_count()  # each process passed its own rows
        plan = plan_batches(num_samples, batch_size, drop_remainder)
    else:
        plan = stream_plan(source, batch_size, drop_remainder)
    if isinstance(optimizer, optax.MultiSteps):
        optimizer = optimizer.gradient_transformation()

    loop, params, consts = _configure(
        model,
        filter_spec,
        (loss, tuple((metrics or {}).items()), optimizer),
        plan=plan,
        epochs=epochs,
        shuffle=shuffle,
        validate=val_data is not None,
        on_nan=on_nan,
        members=members,
        stateful=state is not None,
        use_key=takes_key(loss),
        placement=placement,
        streamed=not isinstance(source, InMemory),
        stopping=early_stopping,
    )
    if early_stopping is not None and early_stopping.monitor not in loop.log_names:
        raise ValueError(
            f"`early_stopping.monitor` is {early_stopping.monitor!r}, which this run does "
            f"not compute; it computes {list(loop.log_names)}."
        )
    if not isinstance(source, InMemory):
        source.setup(plan, shuffle, _host_seed(key_))

    train_state, keys = _start(loop, params, opt_state, state, key_, consts)
    put = placement.put
    store, begin = None, 0
    if checkpoint is not None:
        config = _config(loop, train_state, source, val_data, loss, early_stopping, key_)
        store = Checkpoints(checkpoint, config, plan.steps_per_epoch)
        restored = store.restore(jax.device_get(train_state))
        if restored is not None:
            train_state = jax.device_put(restored)
            begin = position(train_state)
    template = Inputs(None, put(val_data, sharded=True), put(keys), put(consts))
    total = loop.total_steps
    feeds = source.feeds(begin, total, template, put)
    schedule = Plan(
        begin=begin,
        total=total,
        steps_per_epoch=plan.steps_per_epoch,
        checkpoint_every=checkpoint_every if store is not None else None,
        sync_epochs=bool(callbacks),
        seconds_per_call=SECONDS_PER_CALL if progress else None,
    )
    bar = None
    if progress:
        bar = Bar(total, min(begin, total), plan.steps_per_epoch, epochs)

    def save(s: TrainState) -> PyTree:
        return jax.device_get(placement.get(s))

    interrupt = Interrupt()
    with interrupt.deferred():
        outcome = drive(
            loop,
            placement.compile(run, donate=(1,)),
            put(train_state),
            feeds,
            schedule,
            bar=bar,
            callbacks=callbacks,
            store=store,
            interrupt=interrupt,
            save=save,
        )
    if outcome.interrupted:
        if store is not None:
            store.save(save(outcome.state))
        raise KeyboardInterrupt
    return make_result(loop, placement, outcome, consts, began)


def _configure(
    model: PyTree, filter_spec: Any, objects: tuple[Any, ...], **settings: Any
) -> tuple[Loop, list[jax.Array], Consts]:
    """Splits the model into the arrays that train and the frozen rest, takes out the
    arrays the other objects hold, and describes the run as a hashable `Loop`.
    """
    arrays, skeleton = split_arrays(model)
    trains = _trains(model, arrays, filter_spec)
    params = [a for a, t in zip(arrays, trains) if t]
    frozen = [a for a, t in zip(arrays, trains) if not t]
    object_arrays, objects_skeleton = split_arrays(objects)
    metric_names = tuple(name for name, _ in objects[1])
    loop = Loop(skeleton, trains, objects_skeleton, metric_names, **settings)
    return loop, params, Consts(frozen, object_arrays)


def _trains(model: PyTree, arrays: list[Any], filter_spec: Any) -> tuple[bool, ...]:
    """For each array of `model`: whether `filter_spec` chooses it and it is floating."""
    if callable(filter_spec) and jax.tree_util.treedef_is_leaf(jax.tree.structure(filter_spec)):
        chosen = [bool(filter_spec(a)) for a in arrays]
    else:  # a PyTree of bools or callables, as `eqx.partition` takes
        picked, _ = eqx.partition(model, filter_spec)
        none = lambda x: x is None  # noqa: E731
        leaves = jax.tree.leaves(model, is_leaf=none)
        kept = jax.tree.leaves(picked, is_leaf=none)
        chosen = [k is not None for leaf, k in zip(leaves, kept) if eqx.is_array(leaf)]
    return tuple(c and is_dtype(a.dtype, np.inexact) for a, c in zip(arrays, chosen))


# Compiled once per configuration; its outputs are new buffers, which `run` donates.
_start = OneDevice().compile(start)


def _host_seed(key: Key[Array, ""]) -> int:
    """An integer seed for the host's random choices (streamed shuffles, held-out rows)."""
    words = np.asarray(jax.random.key_data(key)).reshape(-1)
    return int.from_bytes(words.astype(np.uint32).tobytes(), "little")


def _source(
    data: Any, validation_data: Any, validation_split: float | None, key: Key[Array, ""]
) -> tuple["InMemory | Memmaps | Loader", tuple[jax.Array, ...] | None]:
    """The source of the training data, and the validation data, if any."""
    streamed = streamed_source(data)
    val = None if validation_data is None else as_data(validation_data, "validation_data")
    if streamed is None:
        arrays = as_data(data)
        if validation_split is not None:
            train_rows, val_rows = _hold_out(arrays[0].shape[0], validation_split, key)
            val = tuple(a[val_rows] for a in arrays)
            arrays = tuple(a[train_rows] for a in arrays)
        source: InMemory | Memmaps | Loader = InMemory(arrays)
    else:
        source = streamed
        if validation_split is not None:
            if not isinstance(streamed, Memmaps):
                raise ValueError(
                    "`validation_split` needs the whole data to choose rows from; a loader "
                    "yields it a batch at a time. Pass `validation_data` instead."
                )
            train_rows, val_rows = _hold_out(streamed.num_samples, validation_split, key)
            val = tuple(jax.numpy.asarray(np.asarray(a[val_rows])) for a in streamed.arrays)
            source = Memmaps(streamed.arrays, train_rows)
    if val is not None:
        shapes, val_shapes = source.sample_shapes(), [tuple(v.shape[1:]) for v in val]
        if val_shapes != shapes:
            raise ValueError(
                "`validation_data` must hold arrays like `data`'s, one sample apart: "
                f"`data`'s samples have shapes {shapes}, `validation_data`'s {val_shapes}."
            )
    return source, val


def _hold_out(n: int, fraction: float, key: Key[Array, ""]) -> tuple[np.ndarray, np.ndarray]:
    """The rows that train and the rows held out for validation, both sorted, chosen
    from `key` on the host.
    """
    held = math.ceil(fraction * n) if math.isfinite(fraction) else -1
    if not 0.0 < fraction < 1.0 or not 0 < held < n:
        raise ValueError(
            f"`validation_split` must be in (0, 1) and leave training data; got "
            f"{fraction}, which holds out {held} of {n} samples."
        )
    order = np.random.default_rng([_host_seed(key), 0x5B117]).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def _config(
    loop: Loop,
    state: TrainState,
    source: "InMemory | Memmaps | Loader",
    val_data: Any,
    loss: Any,
    early_stopping: EarlyStopping | None,
    key: Key[Array, ""],
) -> dict[str, Any]:
    """What identifies a run for its checkpoints: shapes, settings, key; not devices."""
    return {
        "state": describe(state),
        "data": source.describe(),
        "validation_data": describe(val_data),
        "plan": [as_plain(v) for v in loop.plan],
        "epochs": loop.epochs,
        "shuffle": loop.shuffle,
        "on_nan": loop.on_nan,
        "early_stopping": None if early_stopping is None else repr(early_stopping),
        "metrics": list(loop.metric_names),
        "loss": getattr(loss, "__qualname__", type(loss).__name__),
        "key": np.asarray(jax.random.key_data(key)).tolist(),
        "ensemble": loop.members is not None,
    }
