"""`save` and `load`: a result in one file, read back into a `like` by its arrays' paths
and the classes that hold them, not by their order.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any, overload

import equinox as eqx
import jax
import numpy as np

from ._core._checks import checked
from ._core._typing import Model, PathLike
from ._history import History, NonFinite
from ._keep._checkpoint import versions
from ._keep._files import read_leaves, write_atomically
from ._result import FitResult


_MAGIC = b"eqfit-result\n"

# The parts of a result that `save` writes, in order, as `load`'s errors name them.
_PARTS = (
    ("model", "model"),
    ("opt_state", "optimizer state"),
    ("state", "model state"),
    ("ema_model", "moving average"),
)


@checked(
    "save",
    {
        "result": "the `FitResult` that `fit` returned (a model alone saves with "
        "`eqx.tree_serialise_leaves`)"
    },
)
def save(path: PathLike, result: FitResult[Any]) -> None:
    """Writes a [`eqfit.FitResult`][] to one file: model, optimizer state, model state and
    history. The write is atomic: a crash leaves the old file or the new one, never half.

    **Arguments:**

    - `path`: the file to write, in a directory that exists.
    - `result`: what `fit` returned.
    """
    _check_writable(Path(path))
    h = result.history
    header = {
        "history": {
            "values": {k: np.asarray(v).tolist() for k, v in h.values.items()},
            "step_loss": np.asarray(h.step_loss).tolist(),
            "batch_sizes": np.asarray(h.batch_sizes).tolist(),
            "initial_epoch": h.initial_epoch,
            "wall_time": h.wall_time,
            "best_epoch": h.best_epoch,
            "stop_reason": h.stop_reason,
            "step_values": {k: np.asarray(v).tolist() for k, v in h.step_values.items()},
            "validation_steps": np.asarray(h.validation_steps).tolist(),
            "validations": {k: np.asarray(v).tolist() for k, v in h.validations.items()},
            "best_step": h.best_step,
            "non_finite": None if h.non_finite is None else dataclasses.asdict(h.non_finite),
        },
        "versions": versions(),
        "structure": {part: _structure(getattr(result, part)) for part, _ in _PARTS},
    }
    leaves = (result.model, result.opt_state, result.state, result.ema_model)
    write_atomically(Path(path), _MAGIC + json.dumps(header).encode() + b"\n", leaves)


@overload
def load(path: PathLike, *, like: FitResult[Model]) -> FitResult[Model]: ...
@overload
def load(path: PathLike, *, like: Model) -> Model: ...
@checked("load")
def load(path: PathLike, *, like: Any) -> Any:
    """Reads what `save` wrote.

    **Arguments:**

    - `path`: the file.
    - `like`: a `FitResult` of the same structure (`fit(..., epochs=0)` with the saved
        run's optimizer makes one), or just a model of the same structure: a real one,
        or a skeleton with no arrays made, `eqx.filter_eval_shape(Model, ..., key=key)`.

    Each array is read into the leaf of `like` at its path (`.layers[0].weight`), held by
    the classes that held it when saved: a class whose fields are declared in another
    order reads right, and a `like` of another architecture (another path, another class
    on the way to an array, another shape or dtype, another function where the model
    holds one, such as its activation) is refused, naming the first such path with the
    file's side and `like`'s. (Files written by an earlier eqfit keep no paths: they are
    read in order, their arrays' shapes and dtypes checked.)

    **Returns:**

    A `FitResult` with the saved model, optimizer state, state and history; or, given a
    model, the saved model.
    """
    if not isinstance(like, FitResult) and not any(map(_holds, jax.tree.leaves(like))):
        raise TypeError(
            "`like` must be a `FitResult` (such as `fit(..., epochs=0)` returns) or a model "
            f"of the saved one's structure, to read the arrays into; got {type(like).__name__}, "
            "which holds no arrays (nor `jax.ShapeDtypeStruct`s, as `eqx.filter_eval_shape` "
            "makes)."
        )
    parts = _PARTS if isinstance(like, FitResult) else _PARTS[:1]
    given = [getattr(like, part) if isinstance(like, FitResult) else like for part, _ in parts]
    with open(path, "rb") as f:
        if f.readline() != _MAGIC:
            raise ValueError(f"{path} is not an eqfit file written by `eqfit.save`.")
        try:
            header = json.loads(f.readline())
        except ValueError:
            raise ValueError(f"{path} is truncated: its header does not read.") from None
        saved = header.get("structure")  # older files have none
        _check_like(path, saved, given, parts)
        try:
            if saved is not None and "paths" in saved["model"]:
                loaded = _read_by_path(f, saved, given, parts)
            else:  # a file of an eqfit before paths: in order
                loaded = list(read_leaves(f, tuple(given)))
        except Exception as e:  # a truncated file, or arrays of another structure
            raise ValueError(
                f"{path} does not read back into `like`: the file is truncated, or was saved "
                f"from a model of another structure ({type(e).__name__}: {e})."
            ) from None
        extra = len(f.read()) if isinstance(like, FitResult) else 0  # a model: more follows
    if extra:
        raise ValueError(
            f"{path} has {extra} bytes more than `like`'s arrays take: it was saved from a "
            "model of another structure, or is not the file `eqfit.save` wrote."
        )
    if not isinstance(like, FitResult):
        return loaded[0]
    model, opt_state, state, ema_model = loaded
    return FitResult(model, opt_state, _history(header["history"]), state, ema_model)


def _history(h: dict[str, Any]) -> History:
    """The history as `save` wrote it (JSON)."""
    return History(
        {k: np.asarray(v, np.float32) for k, v in h["values"].items()},
        np.asarray(h["step_loss"], np.float32),
        np.asarray(h["batch_sizes"], np.int32),
        h["wall_time"],
        tuple(h["best_epoch"]) if isinstance(h["best_epoch"], list) else h["best_epoch"],
        tuple(h["stop_reason"]) if isinstance(h["stop_reason"], list) else h["stop_reason"],
        h["initial_epoch"],
        {k: np.asarray(v, np.float32) for k, v in h.get("step_values", {}).items()},
        validation_steps=np.asarray(h.get("validation_steps", []), np.int64),
        validations={k: np.asarray(v, np.float32) for k, v in h.get("validations", {}).items()},
        best_step=tuple(best) if isinstance(best := h.get("best_step"), list) else best,
        non_finite=_non_finite(h.get("non_finite")),
    )


def _read_by_path(
    f: Any, saved: dict[str, Any], given: list[Any], parts: tuple[tuple[str, str], ...]
) -> list[Any]:
    """The parts of `like` (`given`), each read from the file `f` by its leaves' paths:
    `like`'s leaves taken in the file's order, read, and put back each at its path.
    """
    in_file_order, places = [], []
    for (part, _), tree in zip(parts, given):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        index = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(leaves)}
        order = [index[where] for where, _, _ in saved[part]["paths"]]
        in_file_order += [leaves[i][1] for i in order]
        places.append((treedef, order))
    read = iter(read_leaves(f, in_file_order))
    out = []
    for treedef, order in places:
        leaves = [None] * len(order)
        for i in order:
            leaves[i] = next(read)
        out.append(jax.tree_util.tree_unflatten(treedef, leaves))
    return out


def _check_writable(path: Path) -> None:
    """Refuses a `path` that `save` cannot write, before anything is written."""
    if path.is_dir():
        raise IsADirectoryError(
            f"`path` must be a file to write, got {str(path)!r}, which is a directory. Name "
            f"a file in it, such as {str(path / 'result.eqx')!r}."
        )
    parent = path.parent
    if not parent.exists():
        raise FileNotFoundError(
            f"`path` must be in a directory that exists, but {str(parent)!r} does not exist "
            f"(`path` is {str(path)!r}). Create it first, with `os.makedirs`."
        )
    if not parent.is_dir():
        raise NotADirectoryError(
            f"`path` must be in a directory, but {str(parent)!r} is a file "
            f"(`path` is {str(path)!r})."
        )


def _structure(tree: Any) -> dict[str, Any]:
    """A part of a result as `save` records it, for `load` to compare with `like`'s: its
    outer types, each leaf's dtype and shape (JSON), and each leaf's path, the classes
    that hold it and what it is (`_located`).
    """
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        kinds = f"({', '.join(type(s).__name__ for s in tree)})"
    else:
        kinds = type(tree).__name__
    leaves = [_kind(x, named=False) for x in jax.tree.leaves(tree)]
    return {"kinds": kinds, "leaves": leaves, "paths": _located(tree)}


def _kind(x: Any, named: bool = True) -> str:
    """A leaf in a word: an array (or what stands for one) by its dtype and shape; a
    function by its name (`named`; an earlier eqfit's files named its class alone);
    anything else by its class.
    """
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{x.dtype}[{', '.join(map(str, x.shape))}]"
    name = getattr(x, "__name__", None)  # not where it was made: a lambda is `<lambda>`
    if named and callable(x) and isinstance(name, str):
        return f"function {name}"
    return type(x).__name__


def _located(tree: Any) -> list[list[str]]:
    """Each leaf of `tree`, in order, as `[path, classes, kind]`: its path (`keystr`),
    the classes of the nodes above it from the root (`MLP/tuple/Linear`), and `_kind`.
    """
    found: list[list[str]] = []

    def walk(node: Any, path: tuple[Any, ...], classes: tuple[str, ...]) -> None:
        leaves = jax.tree.leaves(node)
        if not leaves:
            return
        if len(leaves) == 1 and leaves[0] is node:
            found.append([jax.tree_util.keystr(path), "/".join(classes), _kind(node)])
            return
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        for key, child in children:
            walk(child, path + key, (*classes, type(node).__name__))

    walk(tree, (), ())
    return found


def _summary(structure: dict[str, Any]) -> str:
    """A part's structure in a line: its outer types and its first few leaves."""
    leaves = structure["leaves"]
    if not leaves:
        return f"{structure['kinds']}, with no arrays"
    more = ", ..." if len(leaves) > 4 else ""
    return f"{structure['kinds']} of {len(leaves)} leaves [{', '.join(leaves[:4])}{more}]"


def _non_finite(saved: dict[str, Any] | None) -> NonFinite | None:
    """A history's `non_finite` as `save` wrote it (JSON: its tuples as lists)."""
    if saved is None:
        return None
    rows = saved["rows"]
    lists = {k: tuple(saved.get(k, ())) for k in ("parameters", "began_non_finite")}
    return NonFinite(**{**saved, **lists, "rows": rows and tuple(rows)})


def _holds(leaf: Any) -> bool:
    """Whether a leaf of `load`'s `like` stands for an array to read."""
    return eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct)


# What to do about a part of `like` that differs from the file's, by part.
_HINTS = {
    "model": "Pass a result (or model) of the saved model's structure.",
    "opt_state": "Was `like` made with another optimizer? Make it with the saved run's "
    "optimizer: `fit(model, data, optimizer=..., epochs=0)`.",
    "state": "Make it with the saved run's `state=`.",
    "ema_model": "Make it with the saved run's `ema=` (or without, as it was saved).",
}


def _check_like(
    path: PathLike,
    saved: dict[str, Any] | None,
    given: list[Any],
    parts: tuple[tuple[str, str], ...],
) -> None:
    """Refuses a `like` whose model, optimizer state or model state differs from the saved
    one's, naming the part and the first path that differs, with both sides: reading on
    would put arrays where others belong, or fail later with a message about bytes.
    """
    if saved is None:
        return
    for (part, name), tree in zip(parts, given):
        kept = saved.get(part, _structure(None))  # files from before `ema_model` have none
        if "paths" in kept:
            differs = _first_difference(kept["paths"], _located(tree))
        else:  # an earlier eqfit's file: its leaves, in order
            mine = _structure(tree)
            same = mine["leaves"] == kept["leaves"]
            differs = None if same else f"the file holds {_summary(kept)}, `like` {_summary(mine)}"
        if differs is not None:
            raise ValueError(
                f"`like`'s {name} differs from the one saved in {path}: {differs}. {_HINTS[part]}"
            )


def _first_difference(kept: list[list[str]], given: list[list[str]]) -> str | None:
    """Where `like`'s leaves (`given`, `_located`'s) first differ from the file's (`kept`):
    a path one of them lacks, or the classes above a leaf or the leaf itself, in words
    with both sides; `None` where they agree (in any order).
    """
    mine = {where: (classes, kind) for where, classes, kind in given}
    theirs = {where: (classes, kind) for where, classes, kind in kept}
    for where, classes, kind in kept:
        if where not in mine:
            return (
                f"the file holds {kind} at `{where or 'itself'}` (in {classes or 'the root'}), "
                f"which `like` has not; `like` has {_paths(given, theirs)}"
            )
        held, have = mine[where]
        if (held, have) != (classes, kind):
            return (
                f"at `{where or 'itself'}` the file holds {kind} in {classes or 'the root'}, "
                f"`like` holds {have} in {held or 'the root'}"
            )
    for where, classes, kind in given:
        if where not in theirs:
            return f"`like` holds {kind} at `{where}` (in {classes}), which the file has not"
    return None


def _paths(located: list[list[str]], other: dict[str, Any]) -> str:
    """The paths of `located` that `other` lacks, a few, for a message."""
    extra = [f"`{where}`" for where, _, _ in located if where not in other]
    if not extra:
        return "no path the file lacks"
    more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
    return f"{', '.join(extra[:3])}{more} instead"
