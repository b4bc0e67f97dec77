"""Several named validation sets, and the names their values take in the history; and
the validation data's checks made before any is read: a list of datasets, and whether
the sets stream (memmaps, loaders).

A plain dict cannot be the named form: `validation_data={"x": x, "y": y}` is one dataset
whose batches are passed whole, `loss(model, batch)`, as `data`'s are. So the named form
is a type of its own, `ValidationSets`, which is no PyTree: nothing mistakes it for data.
"""

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, final

import jax

from .._core._checks import as_int, as_steps
from .._core._data import data_kind
from .._core._typing import Data
from ._average import Average
from ._validation_steps import AT_EPOCH_ENDS, EveryNSteps, StepValidation


# A set's name goes into the history's names, `val_<name>_loss`: a word, so that the name
# reads back from them.
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@final
class ValidationSets(Mapping[str, Any]):
    """Several validation sets, each named:
    `fit(..., validation_data=eqfit.ValidationSets(clean=(x, y), noisy=(xn, yn)))`.

    Each set is evaluated at the end of every validated epoch and recorded under its
    name: `val_<name>_loss`, and `val_<name>_<metric>` for each metric and aux value
    (`val_clean_loss`, `val_noisy_accuracy`), each a name that early stopping can monitor
    and a `Checkpoint` can keep the best by. A plain dict is one dataset (a PyTree of
    arrays, passed whole as `loss(model, batch)`), not several: hence this type.

    **Arguments:**

    - `**sets`: each set by its name, as `validation_data` takes one: a tuple of arrays
        sharing their leading axis, or another PyTree of them, like `data`'s. A name is
        a letter, then letters, digits and underscores.
    """

    __slots__ = ("_sets",)

    def __init__(self, **sets: Data):
        if not sets:
            raise ValueError(
                "`eqfit.ValidationSets()` holds no set: name each, "
                "`eqfit.ValidationSets(clean=(x, y), noisy=(x_noisy, y_noisy))`."
            )
        for name in sets:
            if not _NAME.fullmatch(name):
                raise ValueError(
                    f"`eqfit.ValidationSets` has a set named {name!r}: a set's name makes "
                    "the history's `val_<name>_loss`, so it must be a letter, then letters, "
                    "digits and underscores (such as 'clean' or 'test_2')."
                )
        self._sets: Mapping[str, Any] = MappingProxyType(dict(sets))

    def __getitem__(self, name: str) -> Any:
        return self._sets[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sets)

    def __len__(self) -> int:
        return len(self._sets)

    def __repr__(self) -> str:
        return f"ValidationSets({', '.join(self._sets)})"


def validation_names(
    sets: tuple[str, ...], aux_names: tuple[str, ...], metric_names: tuple[str, ...]
) -> tuple[str, ...]:
    """The history's names of the validation values, in the order they are recorded:
    for one unnamed set (`sets` empty) `val_loss`, `val_<aux>`, `val_<metric>`; for named
    sets, each set's in turn, `val_<set>_loss` and so on.
    """
    values = ("loss", *aux_names, *metric_names)
    if not sets:
        return tuple(f"val_{n}" for n in values)
    return tuple(f"val_{s}_{n}" for s in sets for n in values)


def check_unique(
    train_names: tuple[str, ...],
    sets: tuple[str, ...],
    aux_names: tuple[str, ...],
    metric_names: tuple[str, ...],
) -> None:
    """Refuses validation values that the history would hold under one name: two of them,
    or one and a training value (`train_names`), naming where each comes from.
    """
    values = [("the loss", "loss")]
    values += [(f"the aux value {n!r}", n) for n in aux_names]
    values += [(f"the metric {n!r}", n) for n in metric_names]
    made: dict[str, str] = {name: f"the training value {name!r}" for name in train_names}
    for s in sets or (None,):
        for what, n in values:
            name = f"val_{n}" if s is None else f"val_{s}_{n}"
            origin = f"{what} on the validation data" if s is None else f"set {s!r}'s {what[4:]}"
            if name in made:
                fix = "rename a set or the metric" if sets else "rename the metric"
                raise ValueError(
                    f"`validation_data`: {origin} and {made[name]} would both be the "
                    f"history's {name!r}; {fix}."
                )
            made[name] = origin


def naming_advice(n: int, kind: str) -> str:
    """How to name `n` validation sets passed together as a `kind` (`"list"`, `"tuple"`):
    a call that works as written, with `sets` the `kind` passed, and the names it records.
    """
    if n <= 3:
        names = [chr(ord("a") + i) for i in range(n)]
        call = ", ".join(f"{name}=sets[{i}]" for i, name in enumerate(names))
    elif n <= 26:
        names = [chr(ord("a") + i) for i in range(n)]
        call = f"**dict(zip({''.join(names)!r}, sets))"
    else:
        names = [f"set{i + 1}" for i in range(n)]
        call = '**{f"set{i + 1}": s for i, s in enumerate(sets)}'
    recorded = ", ".join(f"`val_{name}_loss`" for name in names[:2])
    return (
        f"Name each set, with `sets` the {kind} you passed: "
        f"`validation_data=eqfit.ValidationSets({call})`, recorded as {recorded}, and so on."
    )


def check_frequency(validation_freq: Any, validates: bool) -> None:
    """Refuses a `validation_freq` that is not a whole number of epochs, 1 or more, and one
    other than 1 for a run that validates nothing.
    """
    if isinstance(validation_freq, bool) or not isinstance(validation_freq, int):
        raise TypeError(
            "`validation_freq` must be a whole number of epochs (validate every n-th), got "
            f"{validation_freq!r}."
        )
    if validation_freq < 1:
        raise ValueError(
            "`validation_freq` must be 1 or more (validate every n-th epoch), got "
            f"{validation_freq}."
        )
    if validation_freq != 1 and not validates:
        raise ValueError(
            f"`validation_freq={validation_freq}` says how often to validate, but this run "
            "validates nothing: give `validation_data` or `validation_split` too."
        )


def check_every(validation_every: Any, validation_freq: int, validates: bool) -> int | None:
    """`validation_every` checked: `None`, or a whole number of steps, 1 or more, for a run
    that validates, and not beside a `validation_freq` (which counts epochs).
    """
    validation_every = as_steps("validation_every", validation_every, "validate after")
    if validation_every is None:
        return None
    if not validates:
        raise ValueError(
            f"`validation_every={validation_every}` says how often to validate, but this run "
            "validates nothing: give `validation_data` or `validation_split` too."
        )
    if validation_freq != 1:
        raise ValueError(
            f"Give `validation_every={validation_every}` (steps) or `validation_freq="
            f"{validation_freq}` (epochs), not both: they say when to validate two ways."
        )
    return validation_every


def refuse_list_of_sets(validation_data: Any) -> None:
    """Refuses a list of datasets for `validation_data`, showing the named form. (A list
    of arrays is refused by the data's own check, with the advice to pass a tuple.)
    """
    if not isinstance(validation_data, list) or not validation_data:
        return
    if not all(isinstance(d, tuple | dict | list) for d in validation_data):
        return
    n = len(validation_data)
    raise TypeError(
        f"`validation_data` is a list of {n} datasets: a list (or tuple) of them would be "
        f"taken for one dataset's arrays. {naming_advice(n, 'list')} (If they are batches of "
        "one set, pass the loader that yields them instead: a PyTorch `DataLoader`, a Grain "
        "dataset, or an object whose `__iter__` yields them.)"
    )


def validation_streams(
    validation_data: Any, freq: int, initial_epoch: Any, epochs: Any, every: int | None = None
) -> bool:
    """Whether `validation_data` streams (memmaps, loaders), as `data` can: then each
    validation reads its sets anew. Refuses an iterator (a generator) that the run would
    read more than once (with `validation_every`, any: it validates as its steps go), and
    a streamed set over several processes.
    """
    given = validation_data.items() if isinstance(validation_data, ValidationSets) else None
    named = list(given) if given is not None else [(None, validation_data)]
    streamed = False
    for name, data in named:
        what = "`validation_data`" if name is None else f"`validation_data`'s set {name!r}"
        if data is None or data_kind(data) == "arrays":
            continue
        streamed = True
        validations = sum(e % freq == 0 for e in range(int(initial_epoch) + 1, int(epochs) + 1))
        epochs_said = f"epochs {int(initial_epoch) + 1} to {int(epochs)}, every {freq}"
        when = f"{validations} times ({epochs_said})"
        if every is not None:
            validations, when = 2, f"after every {every}-th step (`validation_every`)"
        if isinstance(data, Iterator) and validations > 1:
            raise ValueError(
                f"{what} is an iterator (a generator, say), which can be read once, but this "
                f"run validates {when}. Pass something read anew at each validation: a "
                "list of batches, a re-iterable loader (a class whose `__iter__` makes the "
                "generator), or the arrays (memmaps too); or validate once."
            )
        if jax.process_count() > 1:
            raise ValueError(
                f"{what} streams (memmaps or a loader), which a run over several processes "
                "does not do yet: each process would read its own validation rows at its own "
                "pace. Pass the validation rows as arrays in memory."
            )
    return streamed


@dataclasses.dataclass(frozen=True)
class Validation:
    """How a run validates (`None` where it does not): `validation_data`'s sets' names
    (`ValidationSets`; empty for one unnamed set), `validation_freq=`, `validate_ema=`.
    Hashable: the run's static description holds it whole.
    """

    sets: tuple[str, ...] = ()
    freq: int = 1  # validate the epochs whose number is a multiple of it
    ema: bool = False  # validate the average (and early stopping reads its values)
    # The sets are read as training streams its data (memmaps, loaders), a pass a
    # validation, and their batches given to programs of their own at an epoch's end.
    streamed: bool = False
    # `validation_every=n` (`EveryNSteps`): validate after every n-th step, not at
    # epochs' ends; by default at epochs' ends (`freq`).
    steps: StepValidation = AT_EPOCH_ENDS

    @staticmethod
    def of(
        data: Any,
        split: Any,
        freq: Any,
        every: Any,
        ema: bool,
        average: Average | None,
        members: int | None,
        epochs: tuple[int, int],
    ) -> "Validation | None":
        """How a run validates, from `fit`'s `validation_data`, `validation_split`,
        `validation_freq`, `validation_every` and `validate_ema` (the average, `ema=`'s;
        the ensemble's size; the epochs, first and last), refusing what cannot be;
        `None` where it validates nothing.
        """
        if data is not None and split is not None:
            raise ValueError("Give `validation_data` or `validation_split`, not both.")
        refuse_list_of_sets(data)
        validates = data is not None or split is not None
        freq = as_int(freq)
        check_frequency(freq, validates)
        every = check_every(every, freq, validates)
        if split is not None:
            if isinstance(split, bool) or not isinstance(split, (int, float)):
                raise TypeError(f"`validation_split` must be a float in (0, 1), got {split!r}.")
            if not (math.isfinite(split) and 0.0 < split < 1.0):
                raise ValueError(f"`validation_split` must be in (0, 1), got {split}.")
            if members is not None:
                raise ValueError(
                    "`validation_split` would hold out different samples for each member of "
                    "an ensemble; pass `validation_data` instead."
                )
        if ema and average is None:
            raise ValueError(
                "`validate_ema=True` validates the moving average, but there is none: give "
                "`ema=` too (such as `ema=0.999`)."
            )
        if ema and not validates:
            raise ValueError(
                "`validate_ema=True` runs validation (and early stopping on its values) on "
                "the moving average, but this run validates nothing: give `validation_data` "
                "or `validation_split`, or leave `validate_ema` out."
            )
        if not validates:
            return None
        sets = tuple(data) if isinstance(data, ValidationSets) else ()
        streamed = validation_streams(data, freq, *epochs, every)
        steps = AT_EPOCH_ENDS if every is None else EveryNSteps(every)
        return Validation(sets, freq, ema, streamed, steps)

    def checkpoint_config(self) -> dict[str, Any]:
        """Named sets, a `validation_freq` and a `validation_every`, where given: a run
        with one unnamed set, validated every epoch, has the config it had before they
        were, so that its checkpoints still resume.
        """
        config: dict[str, Any] = {}
        if self.sets:  # their order is that of the record's columns
            config["validation_sets"] = list(self.sets)
        if self.freq != 1:
            config["validation_freq"] = self.freq
        return config | self.steps.config()


def run_config(validation: Validation | None) -> dict[str, Any]:
    """How a run validates, as the callbacks' run config (`on_train_begin`) says it: each
    option, `None` (or 1) where not given.
    """
    steps = AT_EPOCH_ENDS if validation is None else validation.steps
    return {
        "validation_sets": None if validation is None else list(validation.sets) or None,
        "validation_freq": 1 if validation is None else validation.freq,
        "validation_every": steps.config().get("validation_every"),
    }


def refuse_sets(data: Any, name: str, where: str) -> None:
    """Refuses `ValidationSets` given as `where`'s argument `name` (`fit`'s `data`,
    `evaluate`'s), which takes one dataset.
    """
    if isinstance(data, ValidationSets):
        each = (
            "and the sets as `validation_data=`"
            if where == "fit"
            else f"or each set, `{{n: eqfit.{where}(model, s, ...) for n, s in sets.items()}}`"
        )
        raise TypeError(
            f"`{where}`'s `{name}` is an `eqfit.ValidationSets` ({', '.join(data)}), which "
            f"only `fit`'s `validation_data` takes: give one dataset, such as `(x, y)`, {each}."
        )
