"""The public `fit`: check the inputs, partition, pick the loop, combine, return the result."""

import functools
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
from ._data import as_data, as_key, ensemble_size, plan_batches, split_keys
from ._early_stopping import EarlyStopping
from ._loop import (
    flags,
    Inputs,
    Loop,
    Outcome,
    outcome,
    Record,
    run_compiled,
    Settings,
    split_model,
    start_run,
    train,
    TrainState,
)
from ._parallel import choose_placement, Device, OneDevice, Placement
from ._progress import Callback, run_with_bar
from ._result import FitResult, make_result
from ._step import takes_key
from ._stream import stream_plan, stream_source


ArrayData = tuple[Shaped[Array | np.ndarray, "n ..."], ...]
ValidationData = tuple[Shaped[Array | np.ndarray, "n_val ..."], ...]


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
    - `progress`: `False` runs the whole training as one XLA program. `True` shows a
        tqdm bar and runs the same compiled steps in chunks; the result is the same.
    - `filter_spec`: which leaves of `model` train, as in `eqx.partition`. Leaves that
        are not floating-point arrays never train.
    - `opt_state`: an optimizer state to continue from, such as a previous result's.
    - `state`: the `eqx.nn.State` of a stateful model (BatchNorm and the like).
    - `validation_data`: a tuple like `data`, evaluated after each epoch in inference mode.
    - `validation_split`: instead, hold out this fraction of `data`, chosen from `key`.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar`, recorded per epoch on
        the training batches and on the validation data.
    - `early_stopping`: an [`eqfit.EarlyStopping`][], carried out on the device.
    - `on_nan`: what a NaN or infinite loss does. `"raise"`: stop, and raise
        [`eqfit.NonFiniteLossError`][] holding the last finite model. `"stop"`: stop and
        return it. `"skip"`: skip that update and go on. The check never syncs the host.
    - `callbacks`: objects with `on_epoch_end(epoch, logs)`, called between epochs on the
        `progress=True` path; returning `True` stops training. The compiled path runs no
        Python during training, so it takes none.
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
        (model, optimizer state, `state`, epoch, history, early stopping) is written there,
        atomically, keeping the last two. Calling `fit` again with the same directory
        resumes from the newest complete checkpoint and ends with the same bits as an
        uninterrupted run; one written by another configuration is refused. With
        `progress=False` the compiled program runs from one checkpoint to the next.
    - `checkpoint_every`: epochs between checkpoints.

    Ctrl-C stops training at the next chunk boundary (with `progress=False`: the next
    checkpoint boundary, or the end of the run without `checkpoint`), writes a checkpoint
    if a directory is given, and raises `KeyboardInterrupt`. A second Ctrl-C stops at once.

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
    start = time.perf_counter()
    source = stream_source(data, devices, mesh, ensemble, validation_split)
    data_ = as_data(data) if source is None else ()
    key_ = as_key(key)
    if isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"`epochs` must be 0 or more, got {epochs}.")
    if callbacks and not progress:
        raise ValueError(
            "`callbacks` run on the host between epochs, which only the `progress=True` "
            "path has; the compiled path runs no Python while it trains."
        )
    members = ensemble_size(model) if ensemble else None
    if members is not None and validation_split is not None:
        raise ValueError(
            "`validation_split` would hold out different samples for each member of an "
            "ensemble; pass `validation_data` instead."
        )
    data_, val_data = _validation(data_, validation_data, validation_split, key_)
    placement = choose_placement(devices, mesh, batch_size)
    if source is None:
        num_samples = data_[0].shape[0]
        if mesh is not None and jax.process_count() > 1:
            num_samples *= jax.process_count()  # each process passed its own rows
        plan = plan_batches(num_samples, batch_size, drop_remainder)
    else:
        plan = stream_plan(source, batch_size, drop_remainder)
    if isinstance(optimizer, optax.MultiSteps):
        optimizer = optimizer.gradient_transformation()

    settings = Settings(
        loss,
        tuple((metrics or {}).items()),
        stateful=state is not None,
        use_key=takes_key(loss),
        optimizer=optimizer,
        plan=plan,
        shuffle=shuffle,
        validate=val_data is not None,
        early_stopping=early_stopping,
        on_nan=on_nan,
        ensemble=ensemble,
    )
    if early_stopping is not None and early_stopping.monitor not in settings.log_names:
        raise ValueError(
            f"`early_stopping.monitor` is {early_stopping.monitor!r}, which this run does "
            f"not compute; it computes {list(settings.log_names)}."
        )
    if checkpoint is not None and (isinstance(checkpoint_every, bool) or checkpoint_every < 1):
        raise ValueError(f"`checkpoint_every` must be at least 1, got {checkpoint_every}.")
    one_program = (
        not progress
        and source is None
        and checkpoint is None
        and isinstance(placement, OneDevice)
        # A function applied to every leaf, not a tree of them (even a callable Module).
        and callable(filter_spec)
        and jax.tree_util.treedef_is_leaf(jax.tree.structure(filter_spec))
        and not any(eqx.is_array(x) for x in jax.tree.leaves((loss, settings.metrics)))
        and _hashable(settings)
    )
    if one_program:
        # The usual call, kept lean: one program from the model to the trained one. A
        # Ctrl-C during it lands when the run ends, as a deferred one would.
        run = train(
            settings, filter_spec, epochs, members, model, opt_state, state, data_, val_data, key_
        )
        model, opt_state, state, outcome_ = run
    else:
        with Interrupt().deferred() as interrupt:
            params, static = split_model(model, filter_spec)
            loop = _loop_for(settings, static, placement)
            keys, s, r = _start(loop, params, opt_state, state, key_, members, epochs)
            inputs = Inputs(data_, val_data, keys)
            store, begin = None, (0, 0)  # (epochs done, steps into the next)
            if checkpoint is not None:
                config = _config(loop, inputs, s, r, epochs, loss)
                if source is not None:
                    config["data"] = source.describe()
                store = Checkpoints(checkpoint, config)
                restored = store.restore((s, r))
                if restored is not None:
                    s, r = restored
                    begin = position(s)

            def finish(s: TrainState, r: Record) -> tuple[PyTree, PyTree, PyTree, Outcome]:
                """The trained model and the `Outcome`: queued on the device, not read."""
                params, state = loop.trained(s)
                outcome_ = _outcome(plan, on_nan, settings.validate, flags(s), r)
                return eqx.combine(params, static), s.opt_state, state, outcome_

            finished = None
            if progress or source is not None:
                # Streamed data is always trained in chunks; `progress` only shows the bar.
                # `finish` goes in as the last chunk is queued, before its results are read.
                s, r, finished = run_with_bar(
                    loop,
                    inputs,
                    s,
                    r,
                    begin,
                    epochs,
                    callbacks,
                    interrupt,
                    store,
                    checkpoint_every,
                    source,
                    show=progress,
                    then=finish,
                )
            else:
                s, r = _run_segments(loop, inputs, s, r, epochs, interrupt, store, checkpoint_every)
            if interrupt.requested:
                if store is not None:
                    store.save((s, r), *position(s))
                raise KeyboardInterrupt
            model, opt_state, state, outcome_ = finished or finish(s, r)
    return make_result(settings, model, opt_state, state, outcome_, epochs, start)


def _loop_for(settings: Settings, static: PyTree, placement: Placement) -> Loop:
    """`settings.loop(static, placement)`, the same object for the same configuration, so
    that compiled calls find it by identity rather than hashing and comparing it anew.
    """
    leaves, treedef = jax.tree.flatten(static)
    try:
        types = tuple(map(type, leaves))  # `1 == 1.0`, yet they trace differently
        return _cached_loop(settings, treedef, tuple(leaves), types, placement)
    except TypeError:  # unhashable: arrays (frozen leaves, a loss holding them) and such
        return settings.loop(static, placement)


@functools.lru_cache(maxsize=64)
def _cached_loop(
    settings: Settings,
    treedef: Any,
    leaves: tuple[Any, ...],
    types: tuple[type, ...],
    placement: Placement,
) -> Loop:
    del types
    return settings.loop(jax.tree.unflatten(treedef, leaves), placement)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:  # a loss that is a Module with a list field, say
        return False
    return True


def _running(s: TrainState, epochs: int) -> bool:
    return bool(np.any((np.asarray(s.epoch) < epochs) & ~np.asarray(s.stopped)))


def _run_segments(
    loop: Loop,
    inputs: Inputs,
    s: TrainState,
    r: Record,
    epochs: int,
    interrupt: Interrupt,
    store: Checkpoints | None,
    every: int,
) -> tuple[TrainState, Record]:
    """The compiled path: one program for the run, or one per checkpoint interval (the
    program is the same; only its traced stop epoch changes).
    """
    if store is None:  # one program for the whole run, dispatched without a sync
        return run_compiled(loop, inputs, s, r, epochs)
    while _running(s, epochs):
        stop = min(epochs, (position(s)[0] // every + 1) * every)
        s, r = run_compiled(loop, inputs, s, r, stop)
        if store is not None:
            store.save((s, r), *position(s))
        if interrupt.requested:
            break
    return s, r


def _config(
    loop: Loop, inputs: Inputs, s: TrainState, r: Record, epochs: int, loss: Any
) -> dict[str, Any]:
    """What identifies a run for its checkpoints: shapes, settings, key; not devices."""
    stopping = loop.early_stopping
    return {
        "state": describe((s, r)),
        "data": describe(inputs.data),
        "validation_data": describe(inputs.val_data),
        "plan": [as_plain(v) for v in loop.plan],
        "epochs": epochs,
        "shuffle": loop.shuffle,
        "on_nan": loop.on_nan,
        "early_stopping": None if stopping is None else repr(stopping),
        "metrics": list(loop.metric_names),
        "loss": getattr(loss, "__qualname__", type(loss).__name__),
        "key": np.asarray(jax.random.key_data(inputs.keys)).tolist(),
        "ensemble": loop.ensemble,
    }


# Done eagerly, the start's dozens of small array creations would cost milliseconds a `fit`.
_start = OneDevice().compile(start_run, static=(5, 6))
_keys = jax.jit(split_keys, static_argnums=1)
_outcome = jax.jit(outcome, static_argnums=(0, 1, 2))


def _validation(
    data: tuple[Array, ...],
    validation_data: Any,
    validation_split: float | None,
    key: Key[Array, ""],
) -> tuple[tuple[Array, ...], tuple[Array, ...] | None]:
    """Returns the training data and the validation data, if any."""
    if validation_data is not None and validation_split is not None:
        raise ValueError("Give `validation_data` or `validation_split`, not both.")
    if validation_data is not None:
        val = as_data(validation_data)
        if (
            data
            and len(val) != len(data)
            or any(v.shape[1:] != d.shape[1:] for v, d in zip(val, data))
        ):
            raise ValueError(
                "`validation_data` must hold arrays like `data`'s, one sample apart: "
                f"`data` has shapes {[tuple(a.shape) for a in data]}, "
                f"`validation_data` {[tuple(a.shape) for a in val]}."
            )
        return data, val
    if validation_split is None:
        return data, None
    n = data[0].shape[0]
    held = math.ceil(validation_split * n)
    if not 0.0 < validation_split < 1.0 or held >= n:
        raise ValueError(
            f"`validation_split` must be in (0, 1) and leave training data; got "
            f"{validation_split}, which holds out {held} of {n} samples."
        )
    order = jax.random.permutation(_keys(key, None)[1], n)
    val_index, train_index = order[:held], order[held:]
    return tuple(a[train_index] for a in data), tuple(a[val_index] for a in data)
