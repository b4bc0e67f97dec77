"""The public `fit`: check, partition, choose source and placement, drive, return."""

import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Key, PyTree

from ._checkpoint import as_plain, Checkpoints, describe, Interrupt, position
from ._checks import checked, reported_as
from ._data import (
    as_data,
    as_key,
    check_batch_size,
    ensemble_size,
    is_dtype,
    num_samples,
    plan_batches,
    sample_shapes,
)
from ._drive import Bar, Callback, drive, Plan
from ._early_stopping import EarlyStopping
from ._loop import Consts, Inputs, Loop, run_program, split_arrays, start_program, TrainState
from ._parallel import choose_placement, Device
from ._result import FitResult, make_result, TrainingInterrupted
from ._sources import InMemory, Loader, Memmaps, streamed_source
from ._step import takes_key
from ._typing import (
    Arrays,
    FilterSpec,
    Loss,
    Metrics,
    Model,
    ModelState,
    Optimizer,
    OptState,
    PathLike,
    PRNGKey,
)
from .losses import LABEL_ERRORS, raise_label_errors


# `data` takes arrays, PyTrees of them, memmaps, loaders and generators: too many kinds for
# one runtime annotation (a PyTree check would flatten a generator), so it is checked by
# eqfit itself (`_data.check_data`, `_sources`), which names what is wrong.
Data = object

# How long each call of the program takes: with the bar, it redraws this often; without,
# calls end at epochs' ends, and a Ctrl-C waits for at most about two of them.
SECONDS_PER_BAR_CALL = 0.2
SECONDS_PER_CALL = 0.5
DEFAULT_BATCH_SIZE = 32


@checked("fit", {"key": "a single PRNG key such as `jax.random.key(0)`"})
def fit(
    model: Model,
    data: Data,
    *,
    loss: Loss,
    optimizer: Optimizer,
    key: PRNGKey,
    epochs: int = 1,
    batch_size: int | None = None,
    steps_per_epoch: int | None = None,
    initial_epoch: int = 0,
    shuffle: bool = True,
    drop_remainder: bool = False,
    progress: bool = False,
    filter_spec: FilterSpec = eqx.is_inexact_array,
    opt_state: OptState | None = None,
    state: ModelState | None = None,
    validation_data: Arrays | None = None,
    validation_split: float | None = None,
    metrics: Metrics | None = None,
    early_stopping: EarlyStopping | None = None,
    on_nan: Literal["raise", "stop", "skip"] = "raise",
    callbacks: Sequence[Callback] = (),
    devices: int | Sequence[Device] | None = None,
    mesh: Mesh | None = None,
    ensemble: bool = False,
    checkpoint: PathLike | None = None,
    checkpoint_every: int = 1,
) -> FitResult[Model]:
    """Trains `model` on `data` by minibatch gradient descent, compiled end to end.

    **Main arguments:**

    - `model`: any PyTree of arrays, usually an `eqx.Module`. It is not changed; the
        trained one comes back as `result.model`, of the same type.
    - `data`: the training data, any of:
        - a tuple of numpy or JAX arrays sharing their leading (sample) axis, `(x, y)`,
            unpacked into `loss(model, *batch)`; or another PyTree of such arrays (a dict,
            say), passed whole as `loss(model, batch)`. It goes to the device once; each
            pass then permutes indices, not data;
        - the same with `np.memmap` arrays (`np.load(..., mmap_mode="r")`), for data
            larger than memory: read in chunks while the device trains;
        - a loader: a re-iterable yielding batches (a PyTorch `DataLoader`, a Grain
            dataset), iterated anew for each pass; or an iterator or generator, used once
            (an endless one needs `steps_per_epoch`).
    - `loss`: called as `loss(model, *batch)` (or `loss(model, state, *batch)` returning
        `(value, new_state)` with `state=`), returning a scalar. If it takes a keyword
        `key`, it gets a fresh key every step (for dropout and the like).
    - `optimizer`: any optax `GradientTransformation` (or `optax.MultiSteps`). Those that
        read the loss (`optax.contrib.reduce_on_plateau`) receive it as `value`.
    - `key`: a PRNG key, `jax.random.key(seed)`. It drives the shuffle, the per-step keys
        and `validation_split`.
    - `epochs`: the number of the last epoch, counted from 1: how many epochs to train,
        or with `initial_epoch`, where to stop.
    - `batch_size`: samples per step; by default 32, or a loader's own.

    **Other arguments:**

    *How the data is gone through:*

    - `steps_per_epoch`: optimizer steps per epoch. By default an epoch is a pass over the
        data. Given, the data is a continuing sequence of passes (each sample once per
        pass, shuffled anew) cut into epochs of this many steps: the history, validation,
        metrics, early stopping, checkpoints, callbacks and the bar all go by it.
    - `initial_epoch`: epochs already trained, when continuing a run with its `opt_state`:
        the shuffles, per-step keys and epoch numbers go on from there, so that 5 epochs
        and then epochs 6 to 10 train as 10 epochs would.
    - `shuffle`: visit the samples in a new random order each pass.
    - `drop_remainder`: skip the last, smaller batch of each pass instead of taking it
        as one more step.

    *What trains, and from where:*

    - `filter_spec`: which leaves of `model` train, as in `eqx.partition`. Leaves that
        are not floating-point arrays never train.
    - `opt_state`: an optimizer state to continue from, such as a previous result's.
    - `state`: the `eqx.nn.State` of a stateful model (BatchNorm and the like).

    *What is measured, and when to stop:*

    - `validation_data`: data like `data`'s (arrays in memory), evaluated after each epoch
        in inference mode.
    - `validation_split`: instead, hold out this fraction of `data`'s samples (arrays or
        memmaps), chosen from `key`.
    - `metrics`: `{name: fn}`, each `fn(model, *batch) -> scalar` (with `state=`,
        `fn(model, state, *batch)`), recorded per epoch on the training batches and on
        the validation data.
    - `early_stopping`: an [`eqfit.EarlyStopping`][], carried out on the device.
    - `on_nan`: what a NaN or infinite loss does. `"raise"`: stop, and raise
        [`eqfit.NonFiniteLossError`][] holding the last finite model. `"stop"`: stop and
        return it. `"skip"`: skip that update and go on. The check never syncs the host,
        and on finite losses all three train alike, bit for bit.

    *What the host sees:*

    - `progress`: `False` runs the training in a few long calls of the compiled program.
        `True` shows a tqdm bar and calls the same program in shorter pieces; the result
        is the same, bit for bit.
    - `callbacks`: objects with `on_epoch_end(epoch, logs)` (epochs counted from 1), called
        on the host after each epoch; returning `True` stops training.
        [`eqfit.callbacks`][] has ready ones for logs (CSV, TensorBoard).

    *Where it runs:*

    - `devices`: data parallel over these local devices (or the first `devices` of them)
        with `eqx.filter_pmap`. Each batch is split evenly over them, so `batch_size`
        must be a multiple of their number.
    - `mesh`: data parallel through sharding over the first axis of this
        `jax.sharding.Mesh`, which may span several processes (`jax.distributed`); then
        each process passes its own rows of `data`.
    - `ensemble`: `model` is a stack of members (every array with a leading member axis,
        as `eqx.filter_vmap` builds it), trained side by side in one program. Member `i`
        trains as it would alone with key `jax.random.split(key, members)[i]`. `state` and
        `opt_state`, if given, are stacked too.

    *What survives:*

    - `checkpoint`: a directory. Every `checkpoint_every` epochs the whole training state
        is written there, atomically, keeping the last two. Calling `fit` again with the
        same directory resumes from the newest good checkpoint and ends with the same
        bits as an uninterrupted run; one written by another configuration is refused.
    - `checkpoint_every`: epochs between checkpoints.

    **Returns:**

    A [`eqfit.FitResult`][] with the trained `model`, the `opt_state`, the `history` and
    the model `state`.

    **Raises:**

    - `TypeError`, `ValueError`: a bad argument, named, before anything is compiled.
    - [`eqfit.NonFiniteLossError`][]: a NaN or infinite loss with `on_nan="raise"`.
    - [`eqfit.TrainingInterrupted`][]: Ctrl-C, which stops training at the next epoch's
        end (writing a checkpoint if there is a directory). A second Ctrl-C stops at
        once.
    - [`eqfit.CheckpointError`][]: a checkpoint could not be written.

    Each of the last three holds what was trained as `.result`.
    """
    began = time.perf_counter()
    key_ = as_key(key)
    _check_counts(epochs, initial_epoch, steps_per_epoch, batch_size, checkpoint_every)
    members = ensemble_size(model) if ensemble else None
    if members is not None and validation_split is not None:
        raise ValueError(
            "`validation_split` would hold out different samples for each member of an "
            "ensemble; pass `validation_data` instead."
        )
    if validation_data is not None and validation_split is not None:
        raise ValueError("Give `validation_data` or `validation_split`, not both.")
    source, val_data = _source(data, validation_data, validation_split, key_, steps_per_epoch)
    if isinstance(source, Loader):
        if drop_remainder:
            raise ValueError(
                "`drop_remainder=True` with a loader: a loader makes its own batches, so drop "
                "its smaller last batch there (PyTorch: `DataLoader(..., drop_last=True)`)."
            )
        if batch_size is not None and batch_size != source.batch_size:
            raise ValueError(
                f"`batch_size`={batch_size}, but the loader yields batches of "
                f"{source.batch_size}: leave `batch_size` out, or set it to the loader's."
            )
        size, passes = source.batch_size, None
        per_epoch = steps_per_epoch or source.length
        assert per_epoch is not None
    else:
        n = source.num_samples
        if mesh is not None and jax.process_count() > 1:
            n *= jax.process_count()  # each process passed its own rows
        size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        passes = plan_batches(n, size, drop_remainder)
        per_epoch = steps_per_epoch or passes.steps_per_pass
    placement = choose_placement(devices, mesh, size)
    _check_total(epochs, per_epoch)
    if isinstance(optimizer, optax.MultiSteps):
        optimizer = optimizer.gradient_transformation()

    loop, params, consts = _configure(
        model,
        filter_spec,
        (loss, tuple((metrics or {}).items()), optimizer),
        batch_size=size,
        passes=passes if isinstance(source, InMemory) else None,
        steps_per_epoch=per_epoch,
        epochs=epochs,
        first_epoch=initial_epoch,
        full_batch_size=size,
        shuffle=shuffle,
        validate=val_data is not None,
        on_nan=on_nan,
        members=members,
        stateful=state is not None,
        use_key=takes_key(loss),
        placement=placement,
        stopping=early_stopping,
    )
    if early_stopping is not None and early_stopping.monitor not in loop.log_names:
        raise ValueError(
            f"`early_stopping.monitor` is {early_stopping.monitor!r}, which this run does "
            f"not compute; it computes {list(loop.log_names)}."
        )
    if isinstance(source, Memmaps):
        assert passes is not None
        source.setup(passes, shuffle, _host_seed(key_))
    elif isinstance(source, Loader):
        source.set_chunk_size()

    if opt_state is not None:
        _check_opt_state(loop, params, opt_state, optimizer)
    labels_before = len(LABEL_ERRORS)
    train_state, keys = start_program(loop)(params, opt_state, state, key_, consts)
    put = placement.put
    store, begin = None, loop.begin
    if checkpoint is not None:
        config = _config(loop, train_state, source, val_data, loss, key_)
        writer = jax.process_index() == 0  # one process writes; all read
        store = Checkpoints(checkpoint, config, per_epoch, writer=writer)
    try:
        if store is not None:
            restored = store.restore(jax.device_get(train_state))
            if restored is not None:
                train_state = jax.device_put(restored)
                begin = position(train_state)
        template = Inputs(None, put(val_data, sharded=True), put(keys), put(consts))
        total = loop.total_steps
        schedule = Plan(
            begin=begin,
            total=total,
            steps_per_epoch=per_epoch,
            seconds_per_call=SECONDS_PER_BAR_CALL if progress else SECONDS_PER_CALL,
            whole_epochs=not progress,
            checkpoint_every=checkpoint_every if store is not None else None,
            epoch_calls=bool(callbacks),
            sync_epochs=any(getattr(c, "stops_training", True) for c in callbacks),
        )
        bar = None
        if progress:
            bar = Bar(total - loop.begin, begin - loop.begin, per_epoch, initial_epoch, epochs)

        def save(s: TrainState) -> PyTree:
            return jax.device_get(placement.get(s))

        interrupt = Interrupt()
        with interrupt.deferred(), reported_as("fit", "data"):
            outcome = drive(
                loop,
                run_program,
                put(train_state),
                source.feeds(begin, total, template, put),
                schedule,
                bar=bar,
                callbacks=callbacks,
                store=store,
                interrupt=interrupt,
                save=save,
            )
            if outcome.failure is not None:
                result = make_result(loop, placement, outcome, consts, began, raises=False)
                outcome.failure.result = result  # type: ignore[attr-defined]
                raise outcome.failure
            if outcome.interrupted:
                if store is not None:
                    store.save(save(outcome.state))
                result = make_result(loop, placement, outcome, consts, began, raises=False)
                raise TrainingInterrupted(result)
            if len(LABEL_ERRORS) > labels_before:
                result = make_result(loop, placement, outcome, consts, began, raises=False)
                try:
                    raise_label_errors(labels_before)
                except ValueError as e:
                    e.result = result  # type: ignore[attr-defined]
                    raise
    finally:
        if store is not None:
            store.close()
    return make_result(loop, placement, outcome, consts, began)


def _check_counts(
    epochs: int,
    initial_epoch: int,
    steps_per_epoch: int | None,
    batch_size: int | None,
    checkpoint_every: int,
) -> None:
    """Refuses counts that cannot be: negative epochs, epochs before `initial_epoch`..."""

    def whole(name: str, value: Any, least: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"`{name}` must be an integer of {least} or more, got {value!r}.")

    whole("epochs", epochs, 0)
    whole("initial_epoch", initial_epoch, 0)
    if epochs < initial_epoch:
        raise ValueError(
            f"`epochs`={epochs} is the number of the last epoch, but `initial_epoch`="
            f"{initial_epoch} epochs are done already; give `epochs` >= {initial_epoch}."
        )
    if steps_per_epoch is not None:
        whole("steps_per_epoch", steps_per_epoch, 1)
    if batch_size is not None:
        check_batch_size(batch_size)
    whole("checkpoint_every", checkpoint_every, 1)


def _check_opt_state(
    loop: Loop, params: list[jax.Array], opt_state: PyTree, optimizer: Any
) -> None:
    """Refuses an `opt_state` that is not the optimizer's state for these parameters."""
    init = optimizer.init if loop.members is None else jax.vmap(optimizer.init)
    expected = jax.eval_shape(init, loop.params_tree(params))
    given = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), opt_state)
    if jax.tree.structure(expected) != jax.tree.structure(given) or jax.tree.leaves(
        expected
    ) != jax.tree.leaves(given):
        raise ValueError(
            "`opt_state` is not this optimizer's state for the arrays that train: expected "
            f"{_summary(expected)}, got {_summary(given)}. Pass the `opt_state` of a result "
            "trained with the same optimizer (and `filter_spec`), or none."
        )


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def _summary(state: PyTree) -> str:
    """An optimizer state in a line: its outer types and its arrays."""
    kinds = (
        f"({', '.join(type(s).__name__ for s in state)})"
        if isinstance(state, tuple) and not hasattr(state, "_fields")
        else type(state).__name__
    )
    leaves = jax.tree.leaves(state)
    shapes = ", ".join(f"{x.dtype}{list(x.shape)}" for x in leaves[:4])
    more = ", ..." if len(leaves) > 4 else ""
    return f"{kinds} of {len(leaves)} arrays [{shapes}{more}]"


def _check_total(epochs: int, steps_per_epoch: int) -> None:
    """Steps are counted in 32-bit integers on the device."""
    if epochs * steps_per_epoch >= 2**31:
        raise ValueError(
            f"`epochs`={epochs} of {steps_per_epoch} steps each is {epochs * steps_per_epoch} "
            "steps, more than the 2**31 - 1 a run can count; train for fewer."
        )


def _configure(
    model: PyTree, filter_spec: Any, objects: tuple[Any, ...], **settings: Any
) -> tuple[Loop, list[jax.Array], Consts]:
    """Splits the model into the arrays that train and the frozen rest, takes out the
    arrays the other objects hold, and describes the run as a hashable `Loop`.
    """
    arrays, skeleton = split_arrays(model)
    trains = _trains(model, arrays, filter_spec)
    if not any(trains):
        raise ValueError(
            "`model` has no floating-point arrays that `filter_spec` chooses to train, so "
            f"training would change nothing (its arrays: {describe(model)[:6]})."
        )
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


def _host_seed(key: Key[Array, ""]) -> int:
    """An integer seed for the host's random choices (streamed shuffles, held-out rows)."""
    words = np.asarray(jax.random.key_data(key)).reshape(-1)
    return int.from_bytes(words.astype(np.uint32).tobytes(), "little")


def _source(
    data: Any,
    validation_data: Any,
    validation_split: float | None,
    key: Key[Array, ""],
    steps_per_epoch: int | None,
) -> tuple["InMemory | Memmaps | Loader", PyTree | None]:
    """The source of the training data, and the validation data, if any."""
    streamed = streamed_source(data, steps_per_epoch)
    val = None if validation_data is None else as_data(validation_data, "validation_data")
    if streamed is None:
        arrays = as_data(data)
        if validation_split is not None:
            train_rows, val_rows = _hold_out(num_samples(arrays), validation_split, key)
            val = jax.tree.map(lambda a: a[val_rows], arrays)
            arrays = jax.tree.map(lambda a: a[train_rows], arrays)
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
            val = jax.tree.map(lambda a: jax.numpy.asarray(np.asarray(a[val_rows])), streamed.data)
            source = Memmaps(streamed.data, train_rows)
    if val is not None:
        like = source.data if isinstance(source, (InMemory, Memmaps)) else source.first
        if sample_shapes(val) != sample_shapes(like):
            raise ValueError(
                "`validation_data` must hold arrays like `data`'s, one sample apart: "
                f"`data`'s samples have {sample_shapes(like)}, `validation_data`'s "
                f"{sample_shapes(val)} (path, shape of one sample, dtype)."
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
    key: Key[Array, ""],
) -> dict[str, Any]:
    """What identifies a run for its checkpoints: shapes, settings, key; not devices."""
    return {
        "state": describe(state),
        "data": source.describe(),
        "validation_data": describe(val_data),
        "batch_size": loop.batch_size,
        "passes": None if loop.passes is None else [as_plain(v) for v in loop.passes],
        "steps_per_epoch": loop.steps_per_epoch,
        "epochs": [loop.first_epoch, loop.epochs],
        "shuffle": loop.shuffle,
        "on_nan": loop.on_nan,
        "early_stopping": None if loop.stopping is None else repr(loop.stopping),
        "metrics": list(loop.metric_names),
        "loss": getattr(loss, "__qualname__", type(loss).__name__),
        "key": np.asarray(jax.random.key_data(key)).tolist(),
        "ensemble": loop.members is not None,
    }
