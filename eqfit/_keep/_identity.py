"""What identifies a run for its checkpoints (`checkpoint_config`): shapes, settings and key,
not devices, so that a run may resume on others, and a checkpoint of another
configuration is refused; but one of the same run asked for fewer epochs is continued
(`grows`).
"""

from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from .._core._data import describe
from .._program._loop import Loop
from .._program._schedule import Schedule
from .._program._state import Callables
from .._step._record import Kind
from .._step._updates import identified
from ._fingerprint import FINGERPRINTS, fingerprints, without_fingerprints


def checkpoint_config(
    loop: Loop,
    state: PyTree,
    data: list[list[Any]],
    val_data: Any,
    objects: Callables,
    key: Any,
    prints: tuple[str | None, Any] = (None, None),
) -> dict[str, Any]:
    """What identifies a run for its checkpoints: shapes, settings, key; not devices, so
    that a run may resume on others. A run names its loss, or each of its updates (its
    name, its class, its loss where it has one, how often it runs). `val_data`: the
    validation arrays, or where validation streams, each set's description (a list).
    `prints`: the fingerprints of the data and of the validation data, kept with those
    of the metrics and the optimizer (`fingerprints`), which may change where the user
    allows it.
    """
    schedule = loop.schedule
    named = identified(objects.updates, _name)  # `"loss"`, and several updates' `"updates"`
    config = {
        "state": describe(state),
        "data": data,
        "validation_data": val_data if isinstance(val_data, list) else describe(val_data),
        "batch_size": schedule.batch_size,
        "passes": None if schedule.passes is None else [as_plain(v) for v in schedule.passes],
        "steps_per_epoch": None if schedule.learning else schedule.steps_per_epoch,
        "epochs": [schedule.first_epoch, schedule.epochs],
        "shuffle": loop.shuffle,
        "on_nan": loop.step.on_nan,
        "early_stopping": None if loop.early_stopping is None else repr(loop.early_stopping),
        # The metrics that accumulate after the others: a run without them reads as before.
        "metrics": [*loop.metric_names, *(name for name, _ in loop.record.accumulated)],
        "loss": named.pop("loss"),
        "key": np.asarray(jax.random.key_data(key)).tolist(),
        "ensemble": loop.members is not None,
    } | _real_model_config(loop)
    config |= named
    config |= _validation_config(loop)
    config[FINGERPRINTS] = fingerprints(objects, state.opt_state, *prints)
    return config


def _name(fn: Any) -> str | None:
    """A function by its name (`None` for none)."""
    return None if fn is None else getattr(fn, "__qualname__", type(fn).__name__)


def _validation_config(loop: Loop) -> dict[str, Any]:
    """How the run validates (`Validation.checkpoint_config`); nothing where it does not."""
    return {} if loop.validation is None else loop.validation.checkpoint_config()


def learned_config(config: dict[str, Any], schedule: Schedule, state: PyTree) -> dict[str, Any]:
    """`checkpoint_config`'s `config` once the run has learned its epoch's length (`schedule`'s)
    and `state` keeps its record by it: what a resumed run, knowing the length from its
    checkpoint, makes.
    """
    return config | {"state": describe(state), "steps_per_epoch": schedule.steps_per_epoch}


def _real_model_config(loop: Loop) -> dict[str, Any]:
    """The options of real models, where given: a run without them has the config it had
    before they were, so that its checkpoints still resume.
    """
    config: dict[str, Any] = {}
    policy = loop.step.precision
    if policy is not None:  # by its dtypes' names: one policy, however spelled
        config["precision"] = {
            "compute": str(policy.compute_dtype),
            "params": str(policy.params_dtype),
            "keep": list(policy.keep),
            "loss_scaling": policy.scales,
            "initial_scale": policy.initial_scale,
            "growth_steps": policy.growth_steps,
        }
    if loop.step.average is not None:
        config["ema"] = loop.step.average.momentum
    if loop.validation is not None and loop.validation.ema:
        config["validate_ema"] = True
    if loop.step.norms:
        config["norms"] = True
    for key, kind in (
        ("aux", Kind.AUX),
        ("hyperparams", Kind.HYPERPARAM),
        ("schedules", Kind.SCHEDULE),
    ):
        names = loop.record.names_of(kind)
        if names:
            config[key] = list(names)
    return config


def as_plain(value: Any) -> Any:
    """numpy scalars and arrays in a config, as JSON can hold them."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


# The training state's arrays with a row per epoch of the run (or, with
# `validation_every=`, per validation): those a run asked for more epochs has more rows
# of, the rows of the epochs it adds after those of a shorter run's.
_ROWS = (".step_loss", ".step_values", ".batch_sizes", ".epoch_values", ".validations")


# The state's run's first step, which checkpoints written before it was in the state
# (eqfit of 2026-12-07 and earlier) lack: their runs are continued, `first` the run's.
_FIRST = ".first"


def grows(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a checkpoint of configuration `saved` is of the run `now` asked for fewer
    epochs, which `now` continues: nothing differs but the last epoch, later now, and the
    rows of the state's record (`_ROWS`), more now. Nothing else in a run depends on how
    many epochs it has (the shuffles, the keys and the validations are counted from its
    first step), so the longer run continued equals it run from the start. A checkpoint
    of the state's earlier layout (no `first`, the record's rows the run's own epochs) is
    continued likewise, by a run of as many epochs or more.
    """
    saved, now = without_fingerprints(saved), without_fingerprints(now)  # compared apart
    differ = {k for k in set(saved) | set(now) if saved.get(k) != now.get(k)}
    older = "state" in differ and _FIRST not in {path for path, *_ in saved["state"]}
    if not ("epochs" in differ or older) or not differ <= {"epochs", "state"}:
        return False
    (first, end), (first_now, end_now) = saved["epochs"], now["epochs"]
    state_now = [d for d in now["state"] if not (older and d[0] == _FIRST)]
    if first != first_now or end > end_now or (end == end_now and not older):
        return False
    if len(saved["state"]) != len(state_now):
        return False
    for (path, shape, dtype), (path_now, shape_now, dtype_now) in zip(
        saved["state"], state_now, strict=True
    ):
        if (path, dtype) != (path_now, dtype_now) or len(shape) != len(shape_now):
            return False
        more = [a < b for a, b in zip(shape, shape_now, strict=True) if a != b]
        if more and not (path.startswith(_ROWS) and more == [True]):
            return False
    return True


def shaped_as(like: PyTree, described: list[list[Any]]) -> PyTree:
    """`like` (a run's state: on the host, or `jax.ShapeDtypeStruct`s laid out on the
    devices) with the shapes of `described` (`describe`'s of a shorter run's state, the
    same arrays with fewer rows): what that run's checkpoint reads into.
    """
    shapes = {path: tuple(shape) for path, shape, _ in described}

    def shaped(path: Any, x: Any) -> Any:
        if jax.tree_util.keystr(path) not in shapes:  # `first`, of an earlier layout
            return None
        shape = shapes[jax.tree_util.keystr(path)]
        if x.shape == shape:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=x.sharding)
        return np.zeros(shape, x.dtype)

    return jax.tree_util.tree_map_with_path(shaped, like)


def grafted(fresh: PyTree, restored: PyTree) -> PyTree:
    """`fresh`, the start of a run asked for more epochs (on the host, or laid out on the
    devices), holding `restored`, a shorter run's state: each of its arrays with fewer
    rows (`grows`) fills the first rows of `fresh`'s, whose others stay as they start
    (NaN, or 0 where no step ran); the other arrays are `restored`'s.
    """

    def graft(f: Any, r: Any) -> Any:
        if f.shape == r.shape:
            return r
        rows = tuple(slice(0, n) for n in r.shape)
        if isinstance(f, np.ndarray):
            out = f.copy()
            out[rows] = r
            return out
        return jax.jit(lambda f, r: f.at[rows].set(r), out_shardings=f.sharding)(f, r)

    return jax.tree.map(graft, fresh, restored)
