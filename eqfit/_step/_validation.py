"""Several named validation sets, and the names their values take in the history.

A plain dict cannot be the named form: `validation_data={"x": x, "y": y}` is one dataset
whose batches are passed whole, `loss(model, batch)`, as `data`'s are. So the named form
is a type of its own, `ValidationSets`, which is no PyTree: nothing mistakes it for data.
"""

import re
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, final

from .._core._typing import Data


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
