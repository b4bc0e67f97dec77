"""`fit`'s arguments checked, all of them, before any data is read or program compiled.

`check_options` refuses what cannot be (counts, combinations, a monitored value the run
will not compute, devices that are not there, a key that is not one) and returns the
checked `Options`, which every later phase reads instead of the raw arguments.
"""

import dataclasses
import math
import signal
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Key

from .._core._auto_microbatches import as_microbatches, AutoMicrobatches
from .._core._checks import as_int, as_real, as_steps, check_whole
from .._core._data import as_key, check_alive, ensemble_size
from .._core._early_stopping import EarlyStopping
from .._core._execution import Execution
from .._core._policy import as_signals, Profile
from .._step._average import as_average, Average
from .._step._precision import as_precision, Precision
from .._step._record import LOSS, NORMS, record_for, SCALING
from .._step._remat import as_remat, Remat
from .._step._updates import loss_info
from .._step._validation import refuse_sets, Validation, ValidationSets
from ._callables import as_schedules, callables, check_no_data, trained_filter
from ._parallel import choose_placement, Device, Placement
from ._sharding import resolve
from ._state import Callables


DEFAULT_BATCH_SIZE = 32
# Steps are counted in 32-bit integers on the device, and a batch's rows too.
MAX_COUNT = 2**31 - 1

OnNan = Literal["raise", "stop", "skip"]


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What each step does besides its loss and optimizer: `on_nan=`, `precision=`,
    `ema=`, `norms=`, `microbatches=`, `remat=`. Hashable: the run's static description
    holds it whole.
    """

    on_nan: OnNan = "raise"
    precision: Precision | None = None
    average: Average | None = None  # `ema=`
    norms: bool = False
    microbatches: int = 1  # each batch computed in this many parts, one after another
    # The policy each `eqfit.Update`'s forward pass is checkpointed by (its own `remat=`
    # over it); `None`: not checkpointed.
    remat: Remat | None = None
    # `False`: `fit` was given no data (`data=None`): its updates make their own (a
    # rollout's), and each gets `batch=None`.
    batch: bool = True
    # A non-finite step is applied as any other (no `cond` around its update), the run
    # stops after it, and its last finite state is replayed (`_replay`): set by `fit`
    # where the run can be replayed (`replays`).
    replays: bool = False

    def __post_init__(self) -> None:
        if self.on_nan not in ("raise", "stop", "skip"):
            raise ValueError(f"`on_nan` must be 'raise', 'stop' or 'skip', got {self.on_nan!r}.")
        check_whole("microbatches", self.microbatches, 1)

    @property
    def scales(self) -> bool:
        """Whether the loss is scaled (float16), so the run records the loss scale."""
        return self.precision is not None and self.precision.scales


@dataclasses.dataclass(frozen=True)
class Options:
    """`fit`'s checked arguments, but for the model, the data and the checkpoints (a
    concern of their own, `_keep/_keeping.py`'s `Keeping`, made from these).
    """

    key: Key[Array, ""]
    epochs: int
    initial_epoch: int
    steps_per_epoch: int | None
    batch_size: int  # for arrays and memmaps; a loader's own size overrides the default
    batch_size_given: bool
    shuffle: bool
    drop_remainder: bool
    progress: bool | Literal["bar", "lines"]
    members: int | None  # an ensemble's size
    stateful: bool
    validation_split: float | None
    validation: Validation | None
    early_stopping: EarlyStopping | None
    callbacks: tuple[Any, ...]
    placement: Placement
    # What the run calls: the metrics and the updates (`loss=` and `optimizer=` one).
    objects: Callables
    filter_spec: Any  # what trains (`trains=` made a filter spec)
    step: StepOptions = StepOptions()
    peak_flops: float | None = None  # of one device, given
    signals: tuple[signal.Signals, ...] = ()  # besides SIGINT, those that stop training
    schedules: tuple[tuple[str, Callable[[Any], Any]], ...] = ()
    profile: Profile | None = None  # checked against the run's steps by `check_profile`
    execution: Execution | Literal["auto"] = "auto"  # checked against the run by `choose`
    log_every: int | None = None  # tell the callbacks the training values every n steps
    # `microbatches="auto"`: `step.microbatches` is chosen once the run is built.
    auto_microbatches: AutoMicrobatches | None = None


EARLY_STOPPING = "`early_stopping.monitor`"


def monitor_hint(monitor: str, validation: Validation | None, step: StepOptions) -> str:
    """Why a run with these options cannot compute the value `monitor`, and which option
    would, in a sentence; empty where it may (as the loss's aux value, say), which only
    the run's record tells (`_build.check_monitor`).
    """
    sets = None if validation is None else validation.sets
    if monitor.startswith("val_") and sets is None:
        return " Give `validation_data` or `validation_split` to compute validation values."
    if sets and monitor.startswith("val_") and not monitor.startswith(_set_prefixes(sets)):
        return (
            " With named validation sets each set's values are `val_<set>_...` (such as "
            f"{f'val_{sets[0]}_loss'!r}), and there is no plain `val_loss`."
        )
    if monitor in [c.name for c in NORMS] and not step.norms:
        return " Give `norms=True` to record the gradient and update norms."
    if monitor in [c.name for c in SCALING] and not step.scales:
        return ' Only float16 (`precision="float16"`) scales the loss.'
    return ""


def refuse_array_monitor(monitor: str, names: tuple[str, ...], what: str) -> None:
    """Refuses a monitored value that is an array each epoch (a confusion matrix, recorded
    as its entries `monitor/i/j` among `names`): a monitored value is one number.
    """
    entries = [n for n in names if n.startswith(monitor + "/")]
    if entries:
        raise ValueError(
            f"{what} is {monitor!r}, a value that is an array each epoch (recorded as its "
            f"{len(entries)} entries, {entries[0]!r} to {entries[-1]!r}), but a monitored "
            f"value is one number: monitor one entry, such as {entries[-1]!r}, or a metric "
            "of one number."
        )


def refuse_impossible_monitor(
    monitor: str, options: "Options", names: tuple[str, ...], what: str
) -> None:
    """Refuses, before any data is read, a monitored value that no run with these
    options computes (`monitor_hint`); `names`: the values known to be computed so far.
    """
    hint = monitor_hint(monitor, options.validation, options.step)
    if hint:
        raise ValueError(
            f"{what} is {monitor!r}, which this run does not compute; it computes "
            f"{list(names)}.{hint}"
        )


def _set_prefixes(sets: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"val_{s}_" for s in sets)


def check_options(
    *,
    model: Any,
    key: Any,
    epochs: Any,
    initial_epoch: Any,
    steps_per_epoch: Any,
    batch_size: Any,
    shuffle: bool,
    drop_remainder: bool,
    progress: bool | Literal["bar", "lines"],
    on_nan: OnNan,
    state: Any,
    validation_data: Any,
    validation_split: Any,
    metrics: Any,
    early_stopping: EarlyStopping | None,
    callbacks: Sequence[Any],
    devices: int | Sequence[Device] | None,
    mesh: Mesh | None,
    shard: Any,
    ensemble: bool,
    precision: Any,
    ema: Any,
    validate_ema: bool,
    norms: Any,
    microbatches: Any,
    remat: Any,
    peak_flops: Any,
    signals: Any,
    schedules: Any,
    profile: Any,
    execution: Execution | Literal["auto"],
    validation_freq: Any,
    log_every: Any,
    validation_every: Any,
    data: Any,
    opt_state: Any,
    loss: Any,
    optimizer: Any,
    updates: Any,
    trains: Any,
    filter_spec: Any,
) -> Options:
    """Checks every argument of `fit` that can be checked without its data, each concern
    where it is made (`StepOptions`, `Validation.of`, ...). `fit` passes
    each of its arguments by name: the defaults are its own, stated there only.

    **Returns:**

    The checked `Options`.

    **Raises:**

    `TypeError` or `ValueError`, naming the argument, what it must be and what it is.
    """
    refuse_sets(data, "data", "fit")
    _check_alive(model, data, validation_data, opt_state, state)
    epochs, initial_epoch, steps_per_epoch, batch_size = _counts(
        epochs, initial_epoch, steps_per_epoch, batch_size
    )
    members = ensemble_size(model) if ensemble else None
    average = as_average(ema)
    validation = Validation.of(
        validation_data,
        validation_split,
        validation_freq,
        validation_every,
        validate_ema,
        average,
        members,
        (initial_epoch, epochs),
    )
    if data is None:
        check_no_data(
            updates, steps_per_epoch, batch_size, validation is not None, metrics, mesh, devices
        )
        batch_size, shuffle = 1, False  # one step a row of `no_data`'s
    scheduled = as_schedules(schedules)
    microbatches, auto_microbatches = as_microbatches(microbatches)
    options = Options(
        log_every=as_steps("log_every", log_every, "tell the callbacks the training values"),
        key=as_key(key),
        epochs=epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch,
        batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
        batch_size_given=batch_size is not None,
        shuffle=shuffle,
        drop_remainder=drop_remainder,
        progress=_progress(progress),
        members=members,
        stateful=state is not None,
        validation_split=validation_split,
        validation=validation,
        early_stopping=early_stopping,
        callbacks=_callbacks(callbacks),
        # The batch's split over the devices is checked once the batch size is known.
        placement=choose_placement(devices, mesh, None, _layout(model, mesh, shard, ensemble)),
        step=StepOptions(
            on_nan,
            as_precision(precision, model=model),
            average,
            bool(norms),
            as_int(microbatches),
            remat=as_remat(remat),
            batch=data is not None,
        ),
        peak_flops=_peak_flops(peak_flops),
        signals=as_signals(signals),
        schedules=scheduled,
        profile=_profile(profile),
        execution=execution,
        objects=callables(loss, optimizer, updates, metrics, scheduled),
        filter_spec=trained_filter(model, trains, filter_spec, updates),
        auto_microbatches=auto_microbatches,
    )
    _refuse_impossible_monitors(options, tuple(metrics or ()))
    return options


def _counts(
    epochs: Any, initial_epoch: Any, steps_per_epoch: Any, batch_size: Any
) -> tuple[int, int, int | None, int | None]:
    """`epochs`, `initial_epoch`, `steps_per_epoch` and `batch_size` as integers (numpy
    integer scalars are integers, as arithmetic on arrays gives them), refusing counts
    that cannot be or that a run cannot count.
    """
    epochs, initial_epoch, steps_per_epoch, batch_size = map(
        as_int, (epochs, initial_epoch, steps_per_epoch, batch_size)
    )
    check_whole("epochs", epochs, 0)
    check_whole("initial_epoch", initial_epoch, 0)
    if epochs < initial_epoch:
        raise ValueError(
            f"`epochs`={epochs} is the number of the last epoch, but `initial_epoch`="
            f"{initial_epoch} epochs are done already; give `epochs` >= {initial_epoch}."
        )
    if steps_per_epoch is not None:
        check_whole("steps_per_epoch", steps_per_epoch, 1)
        if epochs * steps_per_epoch > MAX_COUNT:
            raise ValueError(
                f"`epochs`={epochs} of `steps_per_epoch`={steps_per_epoch} steps each is "
                f"{epochs * steps_per_epoch} steps, more than the 2**31 - 1 a run can count; "
                "train for fewer."
            )
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be at least 1, got {batch_size!r}.")
        if batch_size > MAX_COUNT:
            raise ValueError(
                f"`batch_size` must be below 2**31 (rows are counted in 32-bit integers on "
                f"the device), got {batch_size}."
            )
    return epochs, initial_epoch, steps_per_epoch, batch_size


def _check_alive(model: Any, data: Any, validation_data: Any, opt_state: Any, state: Any) -> None:
    """Refuses arrays that were deleted or donated (`check_alive`) among `fit`'s."""
    # Named validation sets are no PyTree: each is checked by its name.
    if isinstance(validation_data, ValidationSets):
        validation_data = dict(validation_data)
    check_alive(
        model=model, data=data, validation_data=validation_data, opt_state=opt_state, state=state
    )


def _progress(progress: Any) -> bool | Literal["bar", "lines"]:
    if not isinstance(progress, bool | str) or progress not in (True, False, "bar", "lines"):
        raise ValueError(f"`progress` must be True, False, 'bar' or 'lines', got {progress!r}.")
    return progress


def _callbacks(callbacks: Sequence[Any]) -> tuple[Any, ...]:
    """`callbacks` as a tuple, refusing one with no `on_epoch_end`."""
    callbacks = tuple(callbacks)
    for i, callback in enumerate(callbacks):
        if not callable(getattr(callback, "on_epoch_end", None)):
            raise TypeError(
                f"`callbacks[{i}]` must have a method `on_epoch_end(epoch, logs)`, got a "
                f"{type(callback).__name__}."
            )
    return callbacks


def _profile(profile: Any) -> Profile | None:
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(
            "`profile` must be an `eqfit.Profile(directory, start_step, steps)`, got a "
            f"{type(profile).__name__}."
        )
    return profile


def _refuse_impossible_monitors(options: Options, metric_names: tuple[str, ...]) -> None:
    """Refuses early stopping's monitored value where no run with these options computes
    it (`known_values`); `keep_best`'s is refused so where its concern is made.
    """
    known = known_values(options, metric_names)
    if options.early_stopping is not None:
        monitor = options.early_stopping.monitor
        refuse_impossible_monitor(monitor, options, known, EARLY_STOPPING)


def known_values(options: Options, metric_names: tuple[str, ...]) -> tuple[str, ...]:
    """The values a run with these options computes, as far as they are known before the
    loss is traced (its aux values) and the optimizer's state made (its injected
    hyperparameters), checked as the run's record will be.
    """
    val_sets = None if options.validation is None else options.validation.sets
    # The one loss's update, its aux values and hyperparameters not known yet.
    schedules = tuple(name for name, _ in options.schedules)
    loss = loss_info("", (), (LOSS.name,), schedules=schedules)
    return record_for(
        updates=(loss,),
        metric_names=metric_names,
        norms=options.step.norms,
        scales=options.step.scales,
        val_sets=val_sets,
    ).log_names(val_sets)


# Below this no device eqfit runs on computes: a smaller `peak_flops` is a unit slip
# (`989` meant as TFLOP/s), which would make the MFU a million or more times too large.
_LEAST_PEAK_FLOPS = 1e9


def _peak_flops(peak_flops: Any) -> float | None:
    """`peak_flops` as a float, refused unless one device's plausible peak FLOP/s."""
    if peak_flops is None:
        return None
    peak = as_real(peak_flops)
    example = "such as `989e12` for an H100 in bfloat16"
    if peak is None:
        raise TypeError(
            f"`peak_flops` must be one device's peak FLOP/s, a number ({example}), got "
            f"{peak_flops!r}."
        )
    if not (math.isfinite(peak) and peak > 0):
        raise ValueError(
            "`peak_flops` must be one device's peak FLOP/s, a finite number above 0 "
            f"({example}), got {peak_flops!r}."
        )
    if peak < _LEAST_PEAK_FLOPS:
        raise ValueError(
            f"`peak_flops` is {peak_flops!r}, but it counts one device's peak in FLOP/s, "
            f"not TFLOP/s: no device computes below {_LEAST_PEAK_FLOPS:.0e} FLOP/s. For "
            f"{peak:g} TFLOP/s give `peak_flops={peak:g}e12`."
        )
    return peak


def _layout(model: Any, mesh: Mesh | None, shard: Any, ensemble: bool) -> tuple[Any, ...] | None:
    """The `PartitionSpec` of each array of `model` that `shard` asks for, checked against
    the arrays and the mesh (`None` without `shard`).
    """
    if shard is None:
        return None
    if mesh is None:
        raise ValueError(
            "`shard=` lays the model's arrays out over a mesh: give `mesh=` too (a "
            "`jax.sharding.Mesh`, whose first axis also splits the batch)."
        )
    if ensemble:
        raise ValueError(
            "`shard=` with `ensemble=True`: an ensemble's arrays carry a leading member axis "
            "that the layout rules do not see; train the members one by one, or the "
            "ensemble without `shard=`."
        )
    specs = resolve(model, mesh, shard)
    return tuple(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
