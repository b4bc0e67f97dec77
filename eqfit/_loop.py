"""The compiled multi-epoch loop, and the chunked runner that the progress bar drives."""

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, Key, PyTree, UInt32

from ._data import BatchPlan, Data, epoch_order, is_dtype, split_keys, ValData
from ._early_stopping import EarlyStopping
from ._evaluate import evaluate_batches
from ._parallel import OneDevice, Placement, Pmap
from ._step import Objective, Step


Keys = Key[Array, "2"]  # (shuffle key, step key)
OnNan = Literal["raise", "stop", "skip"]


class TrainState(eqx.Module):
    """Everything the loop carries from step to step, all arrays."""

    params: PyTree
    opt_state: PyTree
    model_state: PyTree
    epoch: Int[Array, ""]  # epochs completed
    step: Int[Array, ""]  # full batches done in the current epoch
    stopped: Bool[Array, ""]
    nan_step: Int[Array, ""]  # the first global step whose loss was not finite, or -1
    best_value: Float[Array, ""]
    best_epoch: Int[Array, ""]
    wait: Int[Array, ""]  # epochs since the best one
    best_params: PyTree  # kept only for EarlyStopping(restore_best=True)
    best_model_state: PyTree


def flags(s: TrainState) -> tuple[Array, Array, Array, Array]:
    """What `outcome` needs of the final state."""
    return s.epoch, s.nan_step, s.best_epoch, s.stopped


class Record(eqx.Module):
    """What the loop writes down, preallocated for the whole run."""

    step_loss: Float[Array, "epochs steps"]
    step_metrics: Float[Array, "epochs steps metrics"]
    val: Float[Array, "epochs values"]  # [val_loss, *val_metrics] after each epoch


def log_names(metric_names: tuple[str, ...], validate: bool) -> tuple[str, ...]:
    names = ("loss", *metric_names)
    return names + tuple(f"val_{n}" for n in names) if validate else names


def split_model(model: PyTree, filter_spec: Any) -> tuple[PyTree, PyTree]:
    """The leaves that train (floating-point arrays chosen by `filter_spec`), and the rest,
    frozen arrays included, which the step closes over.
    """
    params, static = eqx.partition(model, filter_spec)
    if filter_spec is not eqx.is_inexact_array:
        params, frozen = eqx.partition(params, eqx.is_inexact_array)
        static = eqx.combine(frozen, static)
    return params, static


class Loop(eqx.Module):
    """A run's static description. It holds no arrays beyond any frozen ones of the model,
    so it is usually a static argument of the compiled programs (`Placement.compile`).
    """

    step: Step
    plan: BatchPlan
    shuffle: bool
    placement: Placement = OneDevice()
    validate: bool = False
    early_stopping: EarlyStopping | None = None
    on_nan: OnNan = "raise"
    ensemble: bool = False  # state, record and keys carry a leading member axis

    def per_member(self, fn: Callable) -> Callable:
        """`fn(keys, s, r, *rest)`, vmapped over the members when training an ensemble.

        Members share the data but each has its own keys, so its own shuffle and dropout:
        member i trains exactly as it would alone, side by side in one program.
        """
        return jax.vmap(fn) if self.ensemble else fn

    # -- names and sizes

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.step.objective.metrics)

    @property
    def log_names(self) -> tuple[str, ...]:
        """The per-epoch values, in the order of the vector `end_epoch` computes."""
        return log_names(self.metric_names, self.validate)

    # -- the state at the start

    def start(
        self, params: PyTree, opt_state: PyTree, model_state: PyTree, epochs: int
    ) -> tuple[TrainState, Record]:
        """The optimizer's state (unless given) and the loop's, per member for an ensemble."""

        def start(params: PyTree, opt_state: PyTree, model_state: PyTree):
            if opt_state is None:
                opt_state = self.step.optimizer.init(params)
            return self.init(params, opt_state, model_state, epochs)

        if self.ensemble:
            in_axes = (0, None if opt_state is None else 0, 0)
            return jax.vmap(start, in_axes=in_axes)(params, opt_state, model_state)
        return start(params, opt_state, model_state)

    def init(
        self, params: PyTree, opt_state: PyTree, model_state: PyTree, epochs: int
    ) -> tuple[TrainState, Record]:
        keep_best = self.early_stopping is not None and self.early_stopping.restore_best
        maximise = self.early_stopping is not None and self.early_stopping.mode == "max"
        state = TrainState(
            params=params,
            opt_state=opt_state,
            model_state=model_state,
            epoch=jnp.asarray(0, jnp.int32),
            step=jnp.asarray(0, jnp.int32),
            stopped=jnp.asarray(False),
            nan_step=jnp.asarray(-1, jnp.int32),
            best_value=jnp.asarray(-jnp.inf if maximise else jnp.inf, jnp.float32),
            best_epoch=jnp.asarray(-1, jnp.int32),
            wait=jnp.asarray(0, jnp.int32),
            best_params=params if keep_best else None,
            best_model_state=model_state if keep_best else None,
        )
        steps, metrics = self.plan.steps_per_epoch, len(self.metric_names)
        epochs = max(epochs, 1)  # a row to trace the loop with, even for zero epochs
        record = Record(
            step_loss=jnp.zeros((epochs, steps)),
            step_metrics=jnp.zeros((epochs, steps, metrics)),
            val=jnp.zeros((epochs, 1 + metrics if self.validate else 0)),
        )
        return state, record

    # -- one epoch, in pieces the chunked runner can call apart

    def order(self, keys: Keys, epoch: Int[Array, ""]) -> UInt32[Array, " n"]:
        return epoch_order(keys[0], epoch, self.plan.num_samples, self.shuffle)

    def _step_at(
        self, step: Step, s: TrainState, r: Record, batch: Any, keys: Keys, j: Any
    ) -> tuple[TrainState, Record, Bool[Array, ""]]:
        """Step `j` of the current epoch, recorded; also whether its loss was finite."""
        # One key per global step, so a step's key does not depend on how the run is
        # cut into chunks or checkpoints.
        t = s.epoch * self.plan.steps_per_epoch + j
        params, opt_state, model_state, loss, metrics, finite = step(
            s.params, s.opt_state, s.model_state, batch, jax.random.fold_in(keys[1], t)
        )
        s = dataclasses.replace(s, params=params, opt_state=opt_state, model_state=model_state)
        r = dataclasses.replace(
            r,
            step_loss=r.step_loss.at[s.epoch, j].set(loss),
            step_metrics=r.step_metrics.at[s.epoch, j].set(metrics),
        )
        return s, r, finite

    def _note_finite(self, s: TrainState, finite: Bool[Array, ""], j: Any) -> TrainState:
        """What `on_nan` makes of step `j`'s loss being finite or not."""
        t = s.epoch * self.plan.steps_per_epoch + j
        return dataclasses.replace(
            s,
            nan_step=jnp.where(~finite & (s.nan_step < 0), t, s.nan_step),
            stopped=s.stopped | (~finite if self.on_nan != "skip" else False),
        )

    def run_steps(
        self,
        s: TrainState,
        r: Record,
        data: Data,
        order: UInt32[Array, " n"],
        keys: Keys,
        start: Any,
        stop: Any,
        offset: Any = 0,
    ) -> tuple[TrainState, Record]:
        """Full batches `start` to `stop` of the current epoch, or until stopped.

        Batch j takes rows `order[(j - offset) * batch_size :][:batch_size]` of `data`:
        in memory `data` is the whole dataset and `offset` 0; streamed, `data` is a chunk
        whose first batch is batch `offset` of the epoch.

        A step whose loss is not finite must leave the state as it was. Guarding every
        update with a branch costs a fixed fraction of a microsecond a step, 1 to 2% of a
        small model's step on a CPU. So when a non-finite loss ends the run (`on_nan` is
        "raise" or "stop") and the state is small (`_REPLAY_MAX_BYTES`), the steps run
        unguarded, in passes: a pass runs to its end, or stops just after a non-finite
        loss; then the state from the pass's start is taken up again, the steps before
        that one run again (the same program on the same inputs, so the same values; a
        loss's side effects, such as `jax.debug.print`, happen twice for them), and the
        run stops there. The price is a copy of the state kept during each pass. The
        guard stays for a large state, for "skip" (a bad batch that recurs would replay
        every epoch) and for an ensemble (members that replay would hold up the others).
        """
        size = self.plan.batch_size
        if self.plan.num_full == 0 or order.shape[-1] < size:
            return s, r  # not one full batch here (in the data, or in this streamed chunk)

        def one(step: Step, s: TrainState, r: Record, j: Any) -> Any:
            index = jax.lax.dynamic_slice_in_dim(order, (j - offset) * size, size)
            batch = self.placement.full_batch(data, index)
            s, r, finite = self._step_at(step, s, r, batch, keys, j)
            return dataclasses.replace(s, step=j + 1), r, finite

        start = jnp.asarray(start, jnp.int32)
        guarded = self.on_nan == "skip" or self.ensemble
        if guarded or _state_bytes(s) > _REPLAY_MAX_BYTES:

            def cond(carry: tuple[Any, TrainState, Record]) -> Bool[Array, ""]:
                j, s, _ = carry
                return (j < stop) & ~s.stopped

            def body(carry: tuple[Any, TrainState, Record]) -> tuple[Any, TrainState, Record]:
                j, s, r = carry
                s, r, finite = one(self.step, s, r, j)
                return j + 1, self._note_finite(s, finite, j), r

            _, s, r = jax.lax.while_loop(cond, body, (start, s, r))
            return s, r

        unguarded = dataclasses.replace(self.step, guard=False)

        def run_until_not_finite(s: TrainState, r: Record, a: Any, b: Any) -> Any:
            def cond(carry: tuple[Any, TrainState, Record, Any]) -> Bool[Array, ""]:
                j, _, _, bad = carry
                return (j < b) & ~bad

            def body(carry: tuple[Any, TrainState, Record, Any]) -> Any:
                j, s, r, _ = carry
                s, r, finite = one(unguarded, s, r, j)
                return j + 1, s, r, ~finite

            return jax.lax.while_loop(cond, body, (a, s, r, jnp.asarray(False)))

        # A pass runs steps [a, b). `k` is -1, or the non-finite step that a pass replays
        # up to (then b == k). Reaching k stops the run, so no pass follows a replay.
        def more(carry: Any) -> Bool[Array, ""]:
            a, _, k, s, _ = carry
            return ((a < stop) | (k >= 0)) & ~s.stopped

        def one_pass(carry: Any) -> Any:
            a, b, k, s0, r = carry
            j, s, r, bad = run_until_not_finite(s0, r, a, b)
            # `bad`: step j - 1's loss was not finite and the state after it is spoiled.
            s = optax.tree.where(bad, s0, s)
            # A replay that reached step k: `s` is the state just before it; stop there.
            at_k = ~bad & (k >= 0)
            noted = self._note_finite(dataclasses.replace(s, step=k + 1), jnp.asarray(False), k)
            s = optax.tree.where(at_k, noted, s)
            k = jnp.where(bad, j - 1, -1)
            return jnp.where(bad, a, b), jnp.where(bad, k, stop), k, s, r

        minus_one = jnp.asarray(-1, jnp.int32)
        _, _, _, s, r = jax.lax.while_loop(more, one_pass, (start, stop, minus_one, s, r))
        return s, r

    def end_epoch(
        self,
        s: TrainState,
        r: Record,
        data: Data,
        val_data: ValData | None,
        order: UInt32[Array, " n"],
        keys: Keys,
        offset: Any = 0,
    ) -> tuple[TrainState, Record, Float[Array, " logs"]]:
        """The remainder step, then validation and early stopping. Nothing if stopped.

        The remainder is never split over devices (it need not divide evenly), so its
        step has no cross-device mean.
        """
        plan = self.plan

        def skip(s: TrainState, r: Record) -> tuple[TrainState, Record]:
            return s, r

        def remainder(s: TrainState, r: Record) -> tuple[TrainState, Record]:
            start = (plan.num_full - offset) * plan.batch_size
            index = jax.lax.dynamic_slice_in_dim(order, start, plan.remainder)
            batch = self.placement.remainder_batch(data, index)
            step = dataclasses.replace(self.step, axis_name=None)
            s, r, finite = self._step_at(step, s, r, batch, keys, plan.num_full)
            return self._note_finite(s, finite, plan.num_full), r

        def close(s: TrainState, r: Record) -> tuple[TrainState, Record]:
            return self._close_epoch(s, r, val_data)

        if plan.remainder:
            s, r = jax.lax.cond(s.stopped, skip, remainder, s, r)
        s, r = jax.lax.cond(s.stopped, skip, close, s, r)
        return s, r, self.logs(s, r)

    def _close_epoch(
        self, s: TrainState, r: Record, val_data: ValData | None
    ) -> tuple[TrainState, Record]:
        e = s.epoch
        if self.validate:
            assert val_data is not None
            model = eqx.combine(s.params, self.step.static)
            values = evaluate_batches(
                self.step.objective, model, s.model_state, val_data, self.plan.batch_size
            )
            r = dataclasses.replace(r, val=r.val.at[e].set(values))
        s = dataclasses.replace(s, epoch=e + 1, step=jnp.zeros_like(s.step))
        stopping = self.early_stopping
        if stopping is None:
            return s, r
        value = self.epoch_logs(r, e)[self.log_names.index(stopping.monitor)]
        sign = 1.0 if stopping.mode == "min" else -1.0
        improved = sign * (s.best_value - value) > stopping.min_delta
        wait = jnp.where(improved, 0, s.wait + 1)
        s = dataclasses.replace(
            s,
            best_value=jnp.where(improved, value, s.best_value),
            best_epoch=jnp.where(improved, e, s.best_epoch),
            wait=wait,
            stopped=wait >= stopping.patience,
            best_params=(
                optax.tree.where(improved, s.params, s.best_params)
                if stopping.restore_best
                else None
            ),
            best_model_state=(
                optax.tree.where(improved, s.model_state, s.best_model_state)
                if stopping.restore_best
                else None
            ),
        )
        return s, r

    def epoch_logs(self, r: Record, e: Int[Array, ""]) -> Float[Array, " logs"]:
        """Epoch `e`'s values, in the order of `log_names`."""
        w = self.plan.weights()
        # Full float32 precision: on GPUs a default-precision dot may round through TF32.
        loss = jnp.dot(w, r.step_loss[e], precision=jax.lax.Precision.HIGHEST)
        metrics = jnp.dot(w, r.step_metrics[e], precision=jax.lax.Precision.HIGHEST)
        train = jnp.concatenate([loss[None], metrics])
        return jnp.concatenate([train, r.val[e]]) if self.validate else train

    def logs(self, s: TrainState, r: Record) -> Float[Array, " logs"]:
        """The last finished epoch's values, then `[stopped, epoch]` for the host."""
        last = jnp.maximum(s.epoch - 1, 0)
        flags = jnp.stack([s.stopped, s.epoch]).astype(jnp.float32)
        return jnp.concatenate([self.epoch_logs(r, last), flags])

    def all_logs(self, s: TrainState, r: Record) -> Float[Array, "epochs logs"]:
        """Every epoch's values, each row followed by `[stopped, epochs done]` now."""
        rows = jax.vmap(lambda e: self.epoch_logs(r, e))(jnp.arange(r.step_loss.shape[0]))
        flags = jnp.stack([s.stopped, s.epoch]).astype(jnp.float32)
        return jnp.concatenate([rows, jnp.broadcast_to(flags, (rows.shape[0], 2))], axis=1)

    def trained(self, s: TrainState) -> tuple[PyTree, PyTree]:
        """The trained parameters and model state: the best epoch's if early stopping
        restores it (and found one), else the last.
        """
        if self.early_stopping is None or not self.early_stopping.restore_best:
            return s.params, s.model_state

        def pick(s: TrainState) -> tuple[PyTree, PyTree]:
            found = s.best_epoch >= 0
            params = optax.tree.where(found, s.best_params, s.params)
            return params, optax.tree.where(found, s.best_model_state, s.model_state)

        return jax.vmap(pick)(s) if self.ensemble else pick(s)

    def run_epoch(
        self, s: TrainState, r: Record, data: Data, val_data: ValData | None, keys: Keys
    ) -> tuple[TrainState, Record]:
        order = self.order(keys, s.epoch)
        s, r = self.run_steps(s, r, data, order, keys, s.step, self.plan.num_full)
        s, r, _ = self.end_epoch(s, r, data, val_data, order, keys)
        return s, r


# Below this many bytes of training state (parameters, optimizer and model state, and any
# best-epoch copies), `run_steps` may run its steps unguarded and replay them from a copy
# after a non-finite loss; above it, it guards each step and keeps no copy.
_REPLAY_MAX_BYTES = 64 * 2**20


def _state_bytes(s: TrainState) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s) if eqx.is_array(x))


class Settings(NamedTuple):
    """Everything a run's program depends on but the model and the placement.

    Quick to hash, so the one-program path (`train`) takes it as a static argument and
    builds the `Loop` while tracing, rather than building and hashing one every call.
    """

    loss: Callable[..., Any]
    metrics: tuple[tuple[str, Callable[..., Any]], ...]
    stateful: bool
    use_key: bool
    optimizer: optax.GradientTransformation
    plan: BatchPlan
    shuffle: bool
    validate: bool
    early_stopping: EarlyStopping | None
    on_nan: OnNan
    ensemble: bool

    @property
    def log_names(self) -> tuple[str, ...]:
        return log_names(tuple(name for name, _ in self.metrics), self.validate)

    def loop(self, static: PyTree, placement: Placement = OneDevice()) -> Loop:
        axis_name = placement.axis_name if isinstance(placement, Pmap) else None
        objective = Objective(self.loss, self.metrics, self.stateful, self.use_key)
        return Loop(
            Step(static, objective, self.optimizer, axis_name),
            self.plan,
            self.shuffle,
            placement,
            self.validate,
            self.early_stopping,
            self.on_nan,
            self.ensemble,
        )


class Outcome(NamedTuple):
    """What the host reads back after a run, worked out on the device so that the host
    has little left to do once it has waited, and packed in two arrays so that reading
    it is two transfers. One row per member: a single model is an ensemble of one.
    """

    # [epochs run (one cut short by a non-finite loss counts), the first non-finite step
    # of the run or -1, the best epoch by the early-stopping monitor or -1, stopped]
    flags: Int[Array, "members 4"]
    # Each epoch's step losses, then its `log_names` values; NaN where nothing ran.
    table: Float[Array, "members epochs steps_and_logs"]


def outcome(
    plan: BatchPlan,
    on_nan: OnNan,
    validate: bool,
    flags: tuple[Array, Array, Array, Array],
    r: Record,
) -> Outcome:
    """The `Outcome` of a run from its state's `(epoch, nan_step, best_epoch, stopped)`
    and its record. (Not the whole `Settings`: a loss that holds arrays cannot be hashed.)

    Training values weight each step by its batch size, as `Loop.epoch_logs` does for
    early stopping (both at full float32 precision).
    """
    epoch_count, nan_step, best, stopped = (jnp.reshape(x, (-1,)) for x in flags)
    members, steps = epoch_count.shape[0], plan.steps_per_epoch
    step_loss = r.step_loss.reshape(members, -1, steps)
    step_metrics = r.step_metrics.reshape(members, *step_loss.shape[1:], -1)
    by_nan = (nan_step >= 0) & (on_nan != "skip")
    ran = epoch_count + (by_nan & (nan_step // steps >= epoch_count))
    epoch = jnp.arange(step_loss.shape[1])[None, :, None]
    lost = by_nan[:, None, None] & (epoch * steps + jnp.arange(steps) > nan_step[:, None, None])
    ran_epoch = epoch < ran[:, None, None]
    losses = jnp.where(ran_epoch & ~lost, step_loss, jnp.nan)
    train = jnp.concatenate([losses[..., None], step_metrics], axis=-1)
    values = jnp.einsum("mesk,s->mek", train, plan.weights(), precision=jax.lax.Precision.HIGHEST)
    if validate:
        values = jnp.concatenate([values, r.val.reshape(members, *r.val.shape[-2:])], axis=-1)
    values = jnp.where(ran_epoch, values, jnp.nan)
    flags_ = jnp.stack([ran, nan_step, best, stopped.astype(ran.dtype)], axis=-1)
    return Outcome(flags_, jnp.concatenate([losses, values], axis=-1))


class Inputs(eqx.Module):
    """The arrays a run reads but never changes (never donated)."""

    data: Data
    val_data: ValData | None
    keys: Key[Array, "*replicas 2"]  # a leading device axis under pmap

    def place(self, p: Placement) -> "Inputs":
        """Moves everything to the placement's layout: the data split, the rest copied."""
        if isinstance(p, OneDevice):
            return self  # nothing to move; and no Module to rebuild on the hot path
        return Inputs(
            p.put(self.data, sharded=True), p.put(self.val_data, sharded=True), p.put(self.keys)
        )


# Every compiled function below takes the loop first: `Placement.compile` makes it a
# static argument, hashed rather than flattened on each call.


def _run_epochs(
    loop: Loop, inputs: Inputs, s: TrainState, r: Record, stop_epoch: Int[Array, ""]
) -> tuple[TrainState, Record]:
    def run(keys: Keys, s: TrainState, r: Record) -> tuple[TrainState, Record]:
        def cond(carry: tuple[TrainState, Record]) -> Bool[Array, ""]:
            s, _ = carry
            return (s.epoch < stop_epoch) & ~s.stopped

        def body(carry: tuple[TrainState, Record]) -> tuple[TrainState, Record]:
            return loop.run_epoch(*carry, inputs.data, inputs.val_data, keys)

        return jax.lax.while_loop(cond, body, (s, r))

    return loop.per_member(run)(inputs.keys, s, r)


def run_compiled(
    loop: Loop, inputs: Inputs, s: TrainState, r: Record, stop_epoch: int
) -> tuple[TrainState, Record]:
    """Epochs up to `stop_epoch` (or until stopped) as one program: a loop over epochs of
    a loop over batches.
    """
    p = loop.placement
    run = p.compile(_run_epochs)
    stop = p.put(np.asarray(stop_epoch, np.int32))
    return p.get(run(p.put(loop), inputs.place(p), p.put(s), p.put(r), stop))


def start_run(
    loop: Loop,
    params: PyTree,
    opt_state: PyTree,
    model_state: PyTree,
    key: Key[Array, ""],
    members: int | None,
    epochs: int,
) -> tuple[Array, TrainState, Record]:
    """The (shuffle, step) keys and `Loop.start`: how every run begins."""
    keys, _ = split_keys(key, members)
    return keys, *loop.start(params, opt_state, model_state, epochs)


def _train(
    settings: Settings,
    treedef: Any,
    static_leaves: tuple[Any, ...],
    leaf_types: tuple[type, ...],  # only a key: `1 == 1.0`, yet they trace differently
    trains: tuple[bool, ...],
    epochs: int,
    members: int | None,
    arrays: list[Array],
    opt_state: PyTree,
    model_state: PyTree,
    data: Data,
    val_data: ValData | None,
    key: Key[Array, ""],
) -> tuple[list[Array], PyTree, PyTree, Outcome]:
    # As `eqx.partition` would split it: `None` where the other side has the leaf.
    picked = _unflatten(treedef, static_leaves, [a if t else None for a, t in zip(arrays, trains)])
    params = eqx.filter(picked, eqx.is_array)
    static = _unflatten(treedef, static_leaves, [None if t else a for a, t in zip(arrays, trains)])
    loop = settings.loop(static)
    keys, s, r = start_run(loop, params, opt_state, model_state, key, members, epochs)
    stop = jnp.asarray(epochs, jnp.int32)
    s, r = _run_epochs(loop, Inputs(data, val_data, keys), s, r, stop)
    params, model_state = loop.trained(s)
    trained = [leaf for leaf in jax.tree.leaves(params) if eqx.is_array(leaf)]
    return (
        trained,
        model_state,
        s.opt_state,
        outcome(settings.plan, settings.on_nan, settings.validate, flags(s), r),
    )


_train_jit = jax.jit(_train, static_argnums=(0, 1, 2, 3, 4, 5, 6))


def train(
    settings: Settings,
    filter_spec: Callable[[Any], Any],
    epochs: int,
    members: int | None,
    model: PyTree,
    opt_state: PyTree | None,
    model_state: PyTree,
    data: Data,
    val_data: ValData | None,
    key: Key[Array, ""],
) -> tuple[PyTree, PyTree, PyTree, Outcome]:
    """A whole run on one device, from the model to the trained one, as one program: the
    keys, the optimizer's first state, every epoch, `Loop.trained` and the `Outcome`.

    Most `fit` calls take this path, so its host work is kept to a minimum: the model is
    flattened once, its arrays are the dynamic arguments of a plain `jax.jit`, and its
    structure, other leaves, which arrays train (by `filter_spec`, a callable: compared by
    what it chose, so a new lambda each call does not recompile) and the settings are
    static ones. The `Loop` is built while tracing. The settings must hold no arrays.

    **Returns:**

    The trained model, the optimizer state, the model state and the `Outcome`.
    """
    leaves, treedef = jax.tree.flatten(model)
    static_leaves = tuple(None if eqx.is_array(leaf) else leaf for leaf in leaves)
    arrays = [leaf for leaf in leaves if eqx.is_array(leaf)]
    trains = tuple(bool(filter_spec(a)) and is_dtype(a.dtype, jnp.inexact) for a in arrays)
    leaf_types = tuple(map(type, static_leaves))
    static = (settings, treedef, static_leaves, leaf_types, trains, epochs, members)
    out = _train_jit(*static, arrays, opt_state, model_state, data, val_data, key)
    trained, model_state, opt_state, outcome_ = out
    # Only the trained arrays come back: the frozen ones are the caller's, untouched.
    it = iter(trained)
    arrays = [next(it) if t else a for a, t in zip(arrays, trains)]
    return _unflatten(treedef, static_leaves, arrays), opt_state, model_state, outcome_


def _unflatten(treedef: Any, static_leaves: tuple[Any, ...], arrays: list[Any]) -> PyTree:
    """The inverse of `train`'s split of a model's leaves: `None` in `static_leaves` marks
    an array's place (it is never a leaf itself), filled in order from `arrays`.
    """
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if x is None else x for x in static_leaves])


# The chunked runner. A chunk is a range of full batches inside one epoch; the epoch's
# remainder step, validation, early stopping and the next epoch's order are one more call.
# Bounds are traced, so every chunk length shares one compilation. Except under pmap, the
# state and record, always the last two arguments, are donated between calls. They come
# from a compiled start (`fit`'s `_start`), whose outputs are new buffers even where they
# equal its inputs, or from a checkpoint: never the caller's arrays (a test holds to it).
# Between calls the host runs no JAX operation of its own: bounds go in as numpy arrays,
# since building a JAX array (`jnp.asarray`) or indexing one waits for the device to
# finish every chunk already queued, and the bar would then cost a sync per chunk.


def _first_order(loop: Loop, inputs: Inputs, s: TrainState) -> UInt32[Array, "*members n"]:
    return loop.per_member(lambda keys, s: loop.order(keys, s.epoch))(inputs.keys, s)


def _chunk(
    loop: Loop,
    inputs: Inputs,
    order: UInt32[Array, "*members n"],
    bounds: Int[Array, "3"],
    s: TrainState,
    r: Record,
) -> tuple[TrainState, Record, Float[Array, "*members"]]:
    start, stop, offset = bounds[0], bounds[1], bounds[2]
    steps = jnp.arange(loop.plan.steps_per_epoch)
    ran = (steps >= start) & (steps < stop)

    def run(keys: Keys, s: TrainState, r: Record, order: UInt32[Array, " n"]):
        e = s.epoch
        s, r = loop.run_steps(s, r, inputs.data, order, keys, start, stop, offset)
        return s, r, jnp.sum(jnp.where(ran, r.step_loss[e], 0.0))

    return loop.per_member(run)(inputs.keys, s, r, order)


def _epoch_end(
    loop: Loop,
    inputs: Inputs,
    order: UInt32[Array, "*members n"],
    offset: Int[Array, ""],
    s: TrainState,
    r: Record,
) -> tuple[TrainState, Record, Float[Array, "*members logs"], Float[Array, "*members"]]:
    """The epoch's end: its values (`Loop.logs`) and its remainder step's loss (or 0)."""

    def run(keys: Keys, s: TrainState, r: Record, order: UInt32[Array, " n"]):
        e = s.epoch
        s, r, logs = loop.end_epoch(s, r, inputs.data, inputs.val_data, order, keys, offset)
        remainder_loss = r.step_loss[e, loop.plan.num_full] if loop.plan.remainder else 0.0
        return s, r, logs, jnp.asarray(remainder_loss, jnp.float32)

    return loop.per_member(run)(inputs.keys, s, r, order)


class Progress:
    """What the chunked runner tells the host as results arrive."""

    def on_steps(self, epoch: int, steps: int, loss_sum: float) -> None:
        """`steps` more steps of `epoch` finished, their losses summing to `loss_sum`."""

    def on_epoch(self, epoch: int, logs: dict[str, float]) -> bool:
        """Epoch `epoch` finished with these values. Return `True` to stop training."""
        return False

    def interrupted(self) -> bool:
        """Whether to stop at this chunk boundary (Ctrl-C)."""
        return False

    def save(self, s: TrainState, r: Record) -> None:
        """Called at each checkpoint boundary with the state there."""

    def queued_last(self, s: TrainState, r: Record) -> None:
        """The run's last piece is queued and ends in `s` and `r`; its results are read
        next. Work on the final state queued now runs on the device while they are.
        """


def _epochs_chunk(
    loop: Loop, inputs: Inputs, stop_epoch: Int[Array, ""], s: TrainState, r: Record
) -> tuple[TrainState, Record, Float[Array, "*members epochs logs"]]:
    s, r = _run_epochs(loop, inputs, s, r, stop_epoch)
    return s, r, loop.per_member(loop.all_logs)(s, r)


def run_chunked(
    loop: Loop,
    inputs: Inputs,
    s: TrainState,
    r: Record,
    begin: tuple[int, int],
    num_epochs: int,
    progress: Progress,
    sync_epochs: bool,
    checkpoint_every: int | None = None,
    seconds_per_chunk: float = 0.2,
) -> tuple[TrainState, Record]:
    """The same run as `run_compiled`, in chunks, reporting to `progress`.

    A chunk is either a range of full batches inside one epoch (then the epoch's remainder
    step, validation and early stopping are one more call), or, once an epoch is quicker
    than a chunk should be, several whole epochs through the compiled program itself.
    Bounds are traced, so every chunk length shares one compilation, and each piece runs
    the same arithmetic as `run_compiled`: the results are equal bit for bit.

    The run starts at `begin`, `(epochs done, steps into the next)`: given, not read from
    `s`, so that nothing waits for the start's program. Chunk i+1 is dispatched before
    chunk i's results are read, so the host updates the bar while the device works. With
    `sync_epochs` (callbacks that may stop training) each epoch's values are read before
    the next epoch is dispatched. Chunks adapt to take about `seconds_per_chunk` each.
    Every `checkpoint_every` epochs the state goes to `progress.save`; a chunk never
    crosses that boundary.
    """
    plan, p = loop.plan, loop.placement
    first_order = p.compile(_first_order)
    chunk = p.compile(_chunk, donate=(4, 5))
    epoch_end = p.compile(_epoch_end, donate=(4, 5))
    epochs_chunk = p.compile(_epochs_chunk, donate=(3, 4))

    first_epoch, first_step = begin
    loop, inputs, s, r = p.put(loop), inputs.place(p), p.put(s), p.put(r)
    pending: list[Callable[[], bool]] = []
    # Steps in the first chunk: a quick first redraw, or one whole short epoch, which is
    # one call instead of three; later chunks adapt to the measured speed.
    size = plan.steps_per_epoch if plan.steps_per_epoch <= 64 else 8
    clock, steps_since = time.perf_counter(), 0
    num_logs = len(loop.log_names)

    def report() -> bool:
        """Reads what has finished; `True` if training should stop."""
        nonlocal clock, steps_since, size
        stop = progress.interrupted()
        for read in pending:
            stop = read() or stop
        pending.clear()
        now = time.perf_counter()
        seconds_per_step = (now - clock) / max(steps_since, 1)
        clock, steps_since = now, 0
        size = max(1, int(seconds_per_chunk / max(seconds_per_step, 1e-7)))
        return stop

    def steps_done(epoch: int, steps: int, loss_sum: Array) -> Callable[[], bool]:
        def read() -> bool:
            # Waits for that chunk only. An ensemble reports its members' mean.
            progress.on_steps(epoch, steps, float(p.host(loss_sum).mean()))
            return False

        return read

    def epoch_done(epoch: int, logs: Array) -> Callable[[], bool]:
        def read() -> bool:
            members = p.host(logs).reshape(-1, num_logs + 2)
            values = members.mean(axis=0).tolist()
            stopped, done = bool(members[:, -2].all()), int(members[:, -1].max())
            if done <= epoch:  # stopped before this epoch ended: nothing to log
                return True
            wants_stop = progress.on_epoch(epoch, dict(zip(loop.log_names, values[:-2])))
            return stopped or wants_stop

        return read

    def epochs_done(first: int, last: int, logs: Array) -> Callable[[], bool]:
        def read() -> bool:
            # logs: (members, epochs, values + [stopped, epochs done]).
            table = p.host(logs).reshape(-1, r.step_loss.shape[-2], num_logs + 2)
            done, stopped = int(table[:, first, -1].max()), bool(table[:, first, -2].all())
            ran = min(last, done) - first
            if ran > 0:
                rows = table[:, first : first + ran, :num_logs].mean(axis=0).tolist()
                # Whole epochs ran in one call: the bar moves by all of them at once,
                # showing the last one's loss (one redraw: this runs as the run ends).
                steps = ran * plan.steps_per_epoch
                progress.on_steps(first + ran - 1, steps, rows[-1][0] * steps)
                for epoch, values in enumerate(rows, start=first):
                    if progress.on_epoch(epoch, dict(zip(loop.log_names, values))):
                        return True
            return stopped or done < last

        return read

    epoch, order = first_epoch, None
    while epoch < num_epochs:
        whole_epochs = size // plan.steps_per_epoch
        if whole_epochs >= 1 and (epoch > first_epoch or first_step == 0) and not sync_epochs:
            stop = min(num_epochs, epoch + whole_epochs)
            if checkpoint_every:
                stop = min(stop, (epoch // checkpoint_every + 1) * checkpoint_every)
            s, r, logs = epochs_chunk(loop, inputs, p.put(np.asarray(stop, np.int32)), s, r)
            steps_since += (stop - epoch) * plan.steps_per_epoch
            if report():
                return p.get((s, r))
            pending.append(epochs_done(epoch, stop, logs))
            epoch, order = stop, None
            if checkpoint_every and epoch % checkpoint_every == 0:
                progress.save(*p.get((s, r)))
            continue
        if order is None:
            order = first_order(loop, inputs, s)
        start = first_step if epoch == first_epoch else 0
        for low, end in _ranges(start, plan.num_full, lambda: size):
            bounds = p.put(np.asarray([low, end, 0], np.int32))
            s, r, loss_sum = chunk(loop, inputs, order, bounds, s, r)
            steps_since += end - low
            if report():
                return p.get((s, r))
            pending.append(steps_done(epoch, end - low, loss_sum))
        offset = p.put(np.asarray(0, np.int32))
        s, r, logs, remainder_loss = epoch_end(loop, inputs, order, offset, s, r)
        order = None  # the next epoch's order, made only if that epoch runs in steps
        if plan.remainder:
            steps_since += 1
            if report():
                return p.get((s, r))
            pending.append(steps_done(epoch, 1, remainder_loss))
        pending.append(epoch_done(epoch, logs))
        if sync_epochs and report():
            return p.get((s, r))
        epoch += 1
        if checkpoint_every and epoch % checkpoint_every == 0:
            progress.save(*p.get((s, r)))
    s, r = p.get((s, r))
    progress.queued_last(s, r)
    report()
    return s, r


def _ranges(start: int, total: int, size: Callable[[], int]) -> Iterator[tuple[int, int]]:
    while start < total:
        stop = min(total, start + size())
        yield start, stop
        start = stop
