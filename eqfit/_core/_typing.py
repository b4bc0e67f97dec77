"""The named types of eqfit's public signatures.

Each alias has two meanings. To a type checker (pyright, mypy) it is what the caller holds:
the model's own class flows through a type variable, an optimizer state is optax's
`OptState`, a model state is `eqx.nn.State`, and a PyTree of arrays is `Any` (jaxtyping's
`PyTree` is unknown to checkers on purpose, and an unknown type spreads to everything the
caller derives from it). At run time beartype reads the jaxtyping meaning, which is what
it can check cheaply.
"""

import os
from collections.abc import Callable, Mapping
from typing import Any, TYPE_CHECKING, TypeAlias, TypeVar

import equinox as eqx
import numpy as np
import optax
from jaxtyping import Array, Key, PyTree, Real, Shaped, UInt32

from ._metric import MetricLike


Model = TypeVar("Model")
"""The caller's model class: `fit(model: Model) -> FitResult[Model]`."""

PathLike: TypeAlias = str | os.PathLike[str]
# `loss(model, *batch)`, a metric `fn(model, *batch)` or one that accumulates (an
# `eqfit.metrics.AbstractMetric`, or a metrax metric class): see `fit`'s docstring.
Loss: TypeAlias = Callable[..., Any]
Metrics: TypeAlias = Mapping[str, MetricLike]
# `{name: schedule}`, each a function of the optimizer's step count.
Schedules: TypeAlias = Mapping[str, Callable[..., Any]]
Optimizer: TypeAlias = optax.GradientTransformation | optax.MultiSteps
# `jax.random.key(seed)`, or a raw `jax.random.PRNGKey(seed)`.
PRNGKey: TypeAlias = Key[Array, ""] | UInt32[Array, "2"]

if TYPE_CHECKING:
    # A real number as the user may hold it: a Python, numpy or JAX scalar.
    Number: TypeAlias = float | np.integer[Any] | np.floating[Any] | Array | np.ndarray
    Flag: TypeAlias = bool | np.bool_
    # A whole number as the user may hold it: a Python int or a numpy integer scalar.
    Integer: TypeAlias = int | np.integer[Any]
    ArrayTree: TypeAlias = Any
    Arrays: TypeAlias = Any
    Data: TypeAlias = Any
    OptState: TypeAlias = optax.OptState
    ModelState: TypeAlias = eqx.nn.State
    FilterSpec: TypeAlias = Any
else:
    # `int` too: beartype does not take an int for a `float`. Values are checked (and made
    # Python floats) by `as_real`.
    Number = int | float | np.integer | np.floating | Real[Array | np.ndarray, ""]
    Flag = bool | np.bool_
    # Checked (and made Python ints) by `as_int` and eqfit's own range checks.
    Integer = int | np.integer
    # A PyTree of arrays: a model's output, a batch's inputs.
    ArrayTree = PyTree
    # Data in memory: a PyTree of arrays sharing their leading (sample) axis.
    Arrays = PyTree[Shaped[Array | np.ndarray, "_n ..."]]
    # Data as `fit`, `evaluate` and `predict` take it: arrays, PyTrees of them, memmaps,
    # loaders and generators. Too many kinds for one runtime annotation (a PyTree check
    # would flatten a generator): eqfit checks it itself (`_data.check_data`,
    # `_sources`, `_loader`), and names what is wrong.
    Data = object
    # What `optimizer.init(params)` returns; `FitResult.opt_state`.
    OptState = PyTree
    # A stateful model's `eqx.nn.State` (or, for an ensemble, a stack of them).
    ModelState = PyTree
    # As `eqx.partition` takes it: a bool, a callable, or a PyTree of them.
    FilterSpec = PyTree
