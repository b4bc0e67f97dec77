"""What a step records, declared once: each value's name, where it comes from, and how an
epoch reduces it.

A `Record` is the run's list of `Column`s. The step writes its values by name
(`Record.pack`); the epoch's values are each column reduced as it says
(`Record.epoch_values`); the history, the loggers, the bar and the plan read the same
names. Recording one more value is one `Column` here, written by name where it is computed.
"""

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key

from ._statistics import entry_names
from ._validation import check_unique, validation_names


class Reduce(enum.Enum):
    """How an epoch reduces a column over its steps."""

    # Weighted by each step's batch size, over the steps whose loss was finite: the mean
    # over samples, as one full-batch pass would average a per-sample mean.
    BATCH_MEAN = "mean over samples"
    # The same over the steps whose update was applied (not skipped by the loss scale).
    APPLIED_MEAN = "mean over applied steps"
    SUM = "sum over steps"
    LAST = "the epoch's last step's"


class Kind(enum.Enum):
    """Where a column's value comes from: what a message calls it."""

    LOSS = "the loss"
    AUX = "`loss`'s aux value"
    METRIC = "the metric"
    NORM = "the norms (`norms=True`)"
    SCALE = "the loss scaling (float16)"
    HYPERPARAM = "the optimizer's injected hyperparameter"
    SCHEDULE = "the schedule"
    UPDATE = "an update's value (`eqfit.AbstractUpdate`)"
    WEIGHT = "a weighted mean's weight (`eqfit.Mean`)"


class Column(NamedTuple):
    """One value a step records."""

    name: str
    kind: Kind
    reduce: Reduce
    # A nonzero value marks a step whose update was not applied (`Reduce.APPLIED_MEAN`).
    skips: bool = False
    # NaN on the steps where it is not computed (an update's, with `every` above 1): the
    # epoch reduces it over the steps where it is.
    sometimes: bool = False
    # A weighted mean (`eqfit.Mean`): the column of its step weights (`Kind.WEIGHT`),
    # which the epoch weighs its steps by, not their batch sizes.
    weight: str | None = None
    # `Reduce.APPLIED_MEAN`'s: the one column (`skips`) that marks the steps it leaves
    # out (an update's own skipped steps); `None`: every such column.
    skipped_by: str | None = None


def column_name(update: str | None, value: str) -> str:
    """The history's name of the value `value` that the update named `update` records
    (`d_loss`, `d_acc`, `d_grad_norm`); `value` itself for `fit`'s one loss (`None`, or
    its unnamed update's `""`). The one place such a name is made.
    """
    return f"{update}_{value}" if update else value


def weight_name(name: str) -> str:
    """The name of the column of the step weights of the weighted mean `name`."""
    return f"{name}:weight"


def weight_column(name: str) -> Column:
    """The column of the step weights of the weighted mean `name`: not in the history."""
    return Column(weight_name(name), Kind.WEIGHT, Reduce.SUM)


LOSS = Column("loss", Kind.LOSS, Reduce.BATCH_MEAN)
GRAD_NORM = Column("grad_norm", Kind.NORM, Reduce.APPLIED_MEAN)
UPDATE_NORM = Column("update_norm", Kind.NORM, Reduce.APPLIED_MEAN)
LOSS_SCALE = Column("loss_scale", Kind.SCALE, Reduce.LAST)
SKIPPED_STEPS = Column("skipped_steps", Kind.SCALE, Reduce.SUM, skips=True)
NORMS = (GRAD_NORM, UPDATE_NORM)
SCALING = (LOSS_SCALE, SKIPPED_STEPS)

# What the history names itself, besides the loss's aux values and the metrics.
BUILT_IN = tuple(c.name for c in (LOSS, *NORMS, *SCALING))

# The throughput figures each epoch's `logs` hold besides its values, as `History.throughput`
# keeps them (`Throughput.NAMES`): always, and where the step's FLOPs are known.
THROUGHPUT_TIMES = ("epoch_seconds", "steps_per_second", "samples_per_second")
THROUGHPUT_COSTS = ("flops_per_second", "mfu")
# And where the run writes checkpoints: the seconds training waited at the epoch's.
CHECKPOINT_BLOCKED = "checkpoint_blocked_seconds"
THROUGHPUT_FIGURES = (*THROUGHPUT_TIMES, *THROUGHPUT_COSTS, CHECKPOINT_BLOCKED)

# Names no aux value, metric or schedule may take: the history's own, the epoch's number
# (the CSV's first column, `History.to_dict()`'s `"epoch"`) and the throughput figures,
# which would overwrite it (or be overwritten) in the logs that callbacks and the
# loggers see. And every name beginning `val_`, validation's.
RESERVED = (*BUILT_IN, "epoch", *THROUGHPUT_FIGURES)


def reserved_for(name: str) -> str | None:
    """What the run records under `name`, if it is reserved (`RESERVED`, or `val_...`),
    in words; else `None`.
    """
    if name.startswith("val_"):
        return "validation's values (`val_loss`, `val_<metric>`, `val_<set>_loss`)"
    if name == "epoch":
        return "the epoch's number (the CSV's first column, `History.to_dict()`'s)"
    if name in THROUGHPUT_FIGURES:
        return "a throughput figure (`History.throughput`, in each epoch's `logs`)"
    if name in BUILT_IN:
        return f"the history's built-in {name!r}"
    return None


def reserved_names() -> str:
    """The reserved names, for messages."""
    return f"{', '.join(map(repr, RESERVED))} and every name beginning 'val_'"


@dataclasses.dataclass(frozen=True)
class Record:
    """The values each step records besides its loss, in the order of the training
    state's `step_values` columns.
    """

    columns: tuple[Column, ...] = ()
    # The metrics that accumulate (`eqfit.metrics.AbstractMetric`): each one's name and
    # its value's shape. Not columns: the run sums their statistics over the epoch and
    # records the value once, flat, after the columns (`entry_names`).
    accumulated: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def accumulated_names(self) -> tuple[str, ...]:
        """The accumulating metrics' values, flat, as an epoch records them (`cm/0/1`)."""
        return tuple(n for name, shape in self.accumulated for n in entry_names(name, shape))

    @property
    def arrays(self) -> dict[str, tuple[int, ...]]:
        """The values that are arrays (not scalars), by name, with their shapes."""
        return {name: shape for name, shape in self.accumulated if shape}

    def array_values(
        self, val_sets: tuple[str, ...] | None
    ) -> tuple[tuple[str, tuple[int, ...], tuple[str, ...]], ...]:
        """Each value that is an array, as an epoch records it and as validation does:
        its name, its shape and its entries' names among `log_names` (`grouped`'s).
        """
        out = []
        for name, shape in self.arrays.items():
            entries = entry_names(name, shape)
            out.append((name, shape, entries))
            for s in () if val_sets is None else (val_sets or ("",)):
                sets = (s,) if s else ()
                base = validation_names(sets, (), (name,))[1]
                out.append((base, shape, validation_names(sets, (), entries)[1:]))
        return tuple(out)

    @property
    def names(self) -> tuple[str, ...]:
        """The step's values' names, besides the loss, weights included (`pack`'s)."""
        return tuple(c.name for c in self.columns)

    @property
    def shown(self) -> tuple[str, ...]:
        """The step's values' names that the history and the logs hold: not weights."""
        return tuple(c.name for c in self.columns if c.kind is not Kind.WEIGHT)

    @property
    def means(self) -> tuple[str, ...]:
        """The values that are weighted means (`eqfit.Mean`), the loss among them."""
        return tuple(
            c.name.removesuffix(weight_name("")) for c in self.columns if c.kind is Kind.WEIGHT
        )

    def names_of(self, kind: Kind) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.kind is kind)

    def has(self, column: Column) -> bool:
        return column in self.columns

    def val_names(self, val_sets: tuple[str, ...] | None) -> tuple[str, ...]:
        """The validation values' names: none without validation (`val_sets` `None`),
        else of one unnamed set (`()`) or of each named set.
        """
        if val_sets is None:
            return ()
        metrics = (*self.names_of(Kind.METRIC), *self.accumulated_names)
        return validation_names(val_sets, self.names_of(Kind.AUX), metrics)

    def log_names(self, val_sets: tuple[str, ...] | None) -> tuple[str, ...]:
        """The values each epoch records, in order: the loss and the steps' values, then
        the validation values (`val_names`).
        """
        return (LOSS.name, *self.shown, *self.accumulated_names, *self.val_names(val_sets))

    def pack(self, values: Mapping[str, Any]) -> Float[Array, " values"]:
        """The step's values, written by name, as one float32 vector in `columns`' order."""
        if set(values) != set(self.names):
            raise AssertionError(
                f"eqfit's step recorded {sorted(values)}, but the run declares {self.names}."
            )
        if not self.columns:
            return jnp.zeros(0, jnp.float32)
        return jnp.concatenate(
            [jnp.asarray(values[name], jnp.float32).reshape(-1) for name in self.names]
        )

    def epoch_values(
        self,
        step_loss: Float[Array, " steps"],
        values: Float[Array, " steps values"],
        sizes: Int[Array, " steps"],
    ) -> Float[Array, " logs"]:
        """The epoch's values from the record of its steps (NaN loss and size 0 where no
        step ran): the loss, then each column as it reduces.

        Each step weighs as its share of the epoch's samples. Steps skipped for a
        non-finite loss (`on_nan="skip"`) trained nothing and are left out; NaN (0 / 0)
        if no step counts.
        """
        counts = jnp.isfinite(step_loss)  # NaN where no step ran, so this is false there too
        all_sizes = sizes.astype(jnp.float32)
        where = {c.name: i for i, c in enumerate(self.columns)}
        # Full float32 precision: on GPUs a default-precision dot may round through TF32.
        precision = jax.lax.Precision.HIGHEST

        def mean(w: Array, value: Array) -> Array:  # NaN (0 / 0) if no step counts
            # A step of weight 0 recorded NaN (0 / 0) and adds nothing; a negative
            # weight counts as it is (a weighted mean's sum over sum).
            return jnp.dot(w / jnp.sum(w), jnp.where(w != 0, value, 0.0), precision=precision)

        loss_weight = weight_name(LOSS.name)
        if loss_weight in where:  # a weighted mean: the sum of totals over that of weights
            loss = mean(jnp.where(counts, values[:, where[loss_weight]], 0.0), step_loss)[None]
        else:
            loss = mean(jnp.where(counts, all_sizes, 0.0), step_loss)[None]
        if not self.columns:
            return loss
        weights = jnp.where(counts, all_sizes, 0.0)
        weights = weights / jnp.sum(weights)
        by_samples = [
            i
            for i, c in enumerate(self.columns)
            if c.reduce is Reduce.BATCH_MEAN and not c.sometimes and c.weight is None
        ]
        out: list[Any] = [None] * len(self.columns)
        if by_samples:
            # One product for all of them (a slice where they lead, as the aux values and
            # metrics do).
            if by_samples == list(range(len(by_samples))):
                block = values[:, : len(by_samples)]
            else:
                block = values[:, np.asarray(by_samples, np.int32)]
            means = jnp.dot(weights, jnp.where(counts[:, None], block, 0.0), precision=precision)
            for j, i in enumerate(by_samples):
                out[i] = means[j : j + 1]
        ran = all_sizes > 0
        applied = counts
        for i, column in enumerate(self.columns):
            if column.skips:
                applied = applied & (values[:, i] == 0)
        by_one = {  # the steps an update applied, by its column of skipped steps
            c.skipped_by: counts & (values[:, where[c.skipped_by]] == 0)
            for c in self.columns
            if c.skipped_by is not None
        }
        for i, column in enumerate(self.columns):
            value = values[:, i]
            # Where it was computed, for a column computed on some steps only.
            here = ~jnp.isnan(value) if column.sometimes else True
            if column.kind is Kind.WEIGHT:
                continue  # not in the history: it weighs its mean's steps
            if column.weight is not None:
                w = jnp.where(counts & here, values[:, where[column.weight]], 0.0)
                out[i] = mean(w, value)[None]
            elif column.reduce is Reduce.BATCH_MEAN and column.sometimes:
                out[i] = mean(jnp.where(counts & here, all_sizes, 0.0), value)[None]
            elif column.reduce is Reduce.APPLIED_MEAN:
                its = applied if column.skipped_by is None else by_one[column.skipped_by]
                out[i] = mean(jnp.where(its & here, all_sizes, 0.0), value)[None]
            elif column.reduce is Reduce.SUM:
                out[i] = jnp.sum(jnp.where(ran & here, value, 0.0))[None]
            elif column.reduce is Reduce.LAST:
                last = jnp.argmax(jnp.where(ran & here, jnp.arange(value.shape[0]), -1))
                out[i] = value[last][None]
        return jnp.concatenate([loss, *[o for o in out if o is not None]])


class UpdateInfo(NamedTuple):
    """One of the run's updates as the run knows it, static: its name, how often it runs,
    which of the trained arrays it trains, and what it records, by its own names
    (`"loss"`, `"acc"`); `column` gives each its history's name. `fit`'s `loss=` and
    `optimizer=` are one, unnamed, whose differences are fields made once where its info
    is (`_updates.loss_info`): its values keep their own names (`name` `""`), it gets the
    step's key as it is (`keyed`), its state is the run's whole (`whole`), and its loss is
    the step's (`step_loss`).
    """

    name: str
    every: int
    picks: tuple[bool, ...]  # for each array that trains, in order
    # A loss's (`eqfit.Update`): its values are its loss and aux values (validated, and
    # normed with `norms=True`); else an update of the user's own, and the values its
    # `apply` records.
    loss: bool
    values: tuple[str, ...]
    hyperparams: tuple[str, ...] = ()  # its optimizer's injected ones (`learning_rate`)
    means: tuple[str, ...] = ()  # those of `values` that are weighted means (`eqfit.Mean`)
    # Those of `values` that validation computes: a loss's update's every value; an
    # update of the user's own, those its `loss` method returns (none without one).
    validated: tuple[str, ...] = ()
    # The schedules (`fit(..., schedules=)`) it records at its optimizer's count: a
    # loss's update's, all of them; an update of the user's own holds no optimizer.
    schedules: tuple[str, ...] = ()
    # It gets a key of its own each step (the step's folded with its place among the
    # updates); `False`: the step's key as it is (`fit`'s one loss).
    keyed: bool = True
    # Its state (its optimizer's, its loss scale) is the run's whole, not an entry of a
    # dict by its name (`fit`'s one loss: `result.opt_state` is its optimizer's).
    whole: bool = False
    # Its loss is the step's (`history.loss`), outside the record, and its other values
    # are the run's own, checked as `fit`'s `loss`'s are (`check_names`); else its values
    # are checked as an update's (`check_update_names`).
    step_loss: bool = False

    def column(self, value: str) -> str:
        """The history's name of its value `value` (`d_loss`)."""
        return column_name(self.name, value)

    def turn_key(self, key: Key[Array, ""], i: int) -> Key[Array, ""]:
        """Its key at a step of key `key`, as the `i`-th of the run's updates."""
        return jax.random.fold_in(key, i) if self.keyed else key

    @property
    def named(self) -> str | None:
        """Its name, `None` for the unnamed update (`fit`'s one loss)."""
        return self.name or None

    def said(self, message: str) -> str:
        """`message` about it, naming it where it is named."""
        return message if self.named is None else f"Update {self.name!r}: {message}"

    @property
    def aux_names(self) -> tuple[str, ...]:
        """A loss's update's aux values' names, by its own names."""
        return self.values[1:] if self.loss else ()


def record_for(
    *,
    updates: tuple[UpdateInfo, ...],
    metric_names: tuple[str, ...] = (),
    metric_means: tuple[str, ...] = (),
    norms: bool = False,
    scales: bool = False,
    val_sets: tuple[str, ...] | None = None,
    accumulated: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> Record:
    """The run's record, of its `updates` (`fit`'s one loss among them, unnamed): each
    update's validated values (a loss's: its loss and aux values, means over samples, as
    the metrics are), the metrics (those in `metric_means` weighted means), the values of
    the user's updates, the norms of the loss updates and their loss scaling (float16's),
    then their optimizers' injected hyperparameters and the schedules (each the epoch's
    last step's). An update's values take its name (`d_loss`), and on the steps it is not
    due (`every` above 1) they are NaN; the unnamed update's keep their own, and its loss
    is the step's, outside the record. Refuses two values of one name, and a name that
    the run keeps for itself, naming both.
    """
    columns_of = metric_names  # the metrics that are functions of a batch: columns
    metric_names = (*metric_names, *(name for name, _ in accumulated))  # every metric
    check_names(metric_names=metric_names)
    unnamed = [u for u in updates if u.step_loss]
    for u in unnamed:  # `fit`'s one loss: its names checked as the loss's, schedules' and so on
        check_names(u.aux_names, metric_names, u.hyperparams, u.schedules)
    # Each update's columns with its name, by kind, in the order they are recorded.
    aux: list[tuple[Column, str]] = []
    own: list[tuple[Column, str]] = []
    norm: list[tuple[Column, str]] = []
    hyper: list[tuple[Column, str]] = []
    for u in updates:
        sometimes = u.every > 1
        for n in u.values:  # validated values are the loss's, as a loss's aux values
            if u.step_loss and n == LOSS.name:
                continue  # the step's loss itself
            kind = Kind.AUX if n in u.validated else Kind.UPDATE
            column = Column(u.column(n), kind, Reduce.BATCH_MEAN, sometimes=sometimes)
            (aux if kind is Kind.AUX else own).append((column, u.name))
        # Its own skipped steps (float16's) mark the steps its norms leave out.
        skips = u.column(SKIPPED_STEPS.name) if scales and u.loss else None
        if norms and u.loss:
            norm += [
                (
                    Column(
                        u.column(c.name),
                        Kind.NORM,
                        Reduce.APPLIED_MEAN,
                        sometimes=sometimes,
                        skipped_by=skips,
                    ),
                    u.name,
                )
                for c in NORMS
            ]
        if skips is not None:
            norm += [
                (c._replace(name=u.column(c.name), sometimes=sometimes), u.name) for c in SCALING
            ]
        hyper += [
            (Column(u.column(n), Kind.HYPERPARAM, Reduce.LAST, sometimes=sometimes), u.name)
            for n in u.hyperparams
        ]
        hyper += [
            (Column(u.column(n), Kind.SCHEDULE, Reduce.LAST, sometimes=sometimes), u.name)
            for n in u.schedules
        ]
    named = {u.name for u in updates if not u.step_loss}
    columns = [(c.name, u) for c, u in aux + own + norm + hyper if u in named]
    check_update_names(columns, metric_names)
    # A weighted mean's steps weigh by the weights it returns: a column of them each.
    means = {u.column(n) for u in updates for n in u.means} | set(metric_means)

    def weighted(columns: list[Column]) -> list[Column]:
        return [c._replace(weight=weight_name(c.name)) if c.name in means else c for c in columns]

    losses, owns = weighted([c for c, _ in aux]), weighted([c for c, _ in own])
    metrics = weighted([Column(n, Kind.METRIC, Reduce.BATCH_MEAN) for n in columns_of])
    # The unnamed update's loss (outside the record) weighs by a column all the same.
    weights = [weight_column(LOSS.name) for u in unnamed if LOSS.name in u.means]
    weights += [weight_column(c.name) for c in losses + metrics + owns if c.weight is not None]
    record = Record(
        tuple(losses + metrics + owns + [c for c, _ in norm + hyper] + weights), accumulated
    )
    if val_sets is not None:
        aux_names = record.names_of(Kind.AUX)
        check_unique((LOSS.name, *record.names), val_sets, aux_names, metric_names)
    return record


def check_names(
    aux_names: tuple[str, ...] = (),
    metric_names: tuple[str, ...] = (),
    hyperparams: tuple[str, ...] = (),
    schedule_names: tuple[str, ...] = (),
) -> None:
    """Every check that two recorded values would take one name (but validation's,
    `check_unique`): a metric, an aux value or a schedule named as a built-in history
    entry; an aux value named as a metric; an injected hyperparameter or a schedule named
    as any of these.
    """
    for name in metric_names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"`metrics` must map names (strings) to functions; got {name!r}.")
        what = reserved_for(name)
        if what is not None:
            raise ValueError(
                f"`metrics` has a metric {name!r}, a name the run gives to {what}; rename "
                f"it. Reserved: {reserved_names()}."
            )
    for name in schedule_names:
        what = reserved_for(name)
        if what is not None:
            raise ValueError(
                f"`schedules` has a schedule {name!r}, a name the run gives to {what}; "
                f"rename it. Reserved: {reserved_names()}."
            )
        if name in metric_names:
            raise ValueError(
                f"`schedules` has a schedule {name!r}, and `metrics` has a metric {name!r}: "
                "the history would hold both under one name; rename one."
            )
    for name in aux_names:
        if name in metric_names:
            raise ValueError(
                f"`loss` returns an aux value {name!r}, and `metrics` has a metric "
                f"{name!r}: the history would hold both under one name; rename one."
            )
        what = reserved_for(name)
        if what is not None:
            raise ValueError(
                f"`loss` returns an aux value {name!r}, a name the run gives to {what}; "
                f"rename it. Reserved: {reserved_names()}."
            )
    taken = {name: reserved_for(name) or "" for name in RESERVED}
    taken |= {name: f"{Kind.AUX.value} {name!r}" for name in aux_names}
    taken |= {name: f"{Kind.METRIC.value} {name!r}" for name in metric_names}
    for name in hyperparams:  # the optimizer's names cannot be changed; the others can
        if name in taken or name.startswith("val_"):
            raise ValueError(
                f"The optimizer's `inject_hyperparams` state holds a hyperparameter {name!r}, "
                "which the run records under that name, and so is "
                f"{taken.get(name) or reserved_for(name)}: rename it."
            )
        taken[name] = f"{Kind.HYPERPARAM.value} {name!r} (`inject_hyperparams`)"
    for name in schedule_names:  # built-in names were refused above
        if name in taken:
            raise ValueError(
                f"`schedules` has a schedule {name!r}, which collides with {taken[name]} in "
                "the history; rename the schedule (or leave it out: an injected "
                "hyperparameter is recorded by itself)."
            )


def check_update_names(columns: Sequence[tuple[str, str]], metric_names: Sequence[str]) -> None:
    """Refuses an update's recorded name (each `(name, update)` of `columns`) that the
    history keeps for itself, that a metric has, or that two updates' values share.
    """
    taken: dict[str, str] = {}
    for name, update in columns:
        what = reserved_for(name)
        if what is not None:
            raise ValueError(
                f"`updates`: update {update!r} records {name!r}, a name the run gives to "
                f"{what}; rename the update. Reserved: {reserved_names()}."
            )
        if name in metric_names:
            raise ValueError(
                f"`updates`: update {update!r} records {name!r}, and `metrics` has a metric "
                f"{name!r}: the history would hold both under one name; rename one."
            )
        if name in taken:
            raise ValueError(
                f"`updates`: update {update!r} and update {taken[name]!r} both record "
                f"{name!r}; rename one of them."
            )
        taken[name] = update
