"""Early stopping: an option that owns its state and logic, carried out on the device."""

import math
from typing import Literal, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int

from ._typing import ArrayTree


# Names whose value is better when larger, as Keras 2 inferred them for `mode="auto"`;
# and, unlike Keras, a reinforcement learner's return and reward (`ppo_return`).
_LARGER_IS_BETTER = (
    *("acc", "auc", "precision", "recall", "f1", "fmeasure", "iou", "r2"),
    *("return", "reward"),
)


class StoppingState(NamedTuple):
    """What early stopping carries from epoch to epoch."""

    best_value: Float[Array, ""]
    best_epoch: Int[Array, ""]  # counted from 1; -1 before the first monitored epoch
    wait: Int[Array, ""]  # monitored epochs since the last that reset it
    best_params: ArrayTree  # the best epoch's trained arrays, with `restore_best`
    best_model_state: ArrayTree


class EarlyStopping(eqx.Module):
    """Stop training when a monitored value stops improving, as Keras's `EarlyStopping`.

    It runs inside the compiled program. After each epoch from `start_from_epoch` on, the
    monitored value is compared with the best so far: it improves on it if it is better
    by more than `min_delta` (the first monitored epoch always does, unless its value is
    NaN: a NaN never improves, and `fit` warns of it). Every epoch that does not improve
    counts towards `patience`; once the count reaches it, the remaining
    epochs do no work. An improvement resets the count, but with a `baseline` only if the
    value also beats the baseline.

    Every argument has Keras's default but `restore_best`, so `EarlyStopping()` watches
    `"val_loss"` and stops at the first epoch that does not improve on the best.

    **Arguments:**

    - `patience`: epochs without improvement before stopping (0: stop at the first).
    - `min_delta`: the smallest change that counts as an improvement.
    - `monitor`: `"loss"`, `"val_loss"`, or a metric's name, with `"val_"` in front for
        its value on the validation data (`"val_<set>_"` on a named set's,
        [`eqfit.ValidationSets`][]). With `fit(..., validation_freq=)`, a validation
        value is taken only from the epochs validated: the others do not count. With
        `fit(..., validation_every=n)`, a validation value is judged at each validation
        instead of each epoch, and `patience` and `start_from_epoch` count validations
        (as Lightning's early stopping counts its checks); the best is a validation's,
        `history.best_step`.
    - `restore_best`: return the parameters (and state) of the best epoch rather than
        the last. It defaults to `True`, unlike Keras's `restore_best_weights=False`: the
        best model is what you asked for by stopping early.
    - `mode`: `"min"` when smaller is better, `"max"` when larger is, or `"auto"`: `"max"`
        for accuracy-like names (containing `acc`, `auc`, `precision`, `recall`, `f1`,
        `fmeasure`, `iou` or `r2`, as Keras reads them) and for a reinforcement learner's
        (containing `return` or `reward`, which Keras would minimise), else `"min"`.
    - `baseline`: a value the monitored one must beat for an improvement to reset the
        count, as in Keras.
    - `start_from_epoch`: epochs to let pass before monitoring (a warm-up).
    """

    # Keras's defaults (but `restore_best`), in eqfit's order: `EarlyStopping(3)` is a
    # patience, as it always was here.
    patience: int = 0
    min_delta: float = 0.0
    monitor: str = "val_loss"
    restore_best: bool = True
    mode: Literal["auto", "min", "max"] = "auto"
    baseline: float | None = None
    start_from_epoch: int = 0

    def __check_init__(self) -> None:
        def integer(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"`EarlyStopping.{name}` must be an integer of 0 or more, got {value!r}."
                )

        integer("patience", self.patience)
        if not isinstance(self.restore_best, bool):
            raise ValueError(
                f"`EarlyStopping.restore_best` must be a bool, got {self.restore_best!r}."
            )
        integer("start_from_epoch", self.start_from_epoch)
        delta = self.min_delta
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not delta >= 0:
            raise ValueError(f"`EarlyStopping.min_delta` must be a number >= 0, got {delta!r}.")
        if self.mode not in ("auto", "min", "max"):
            raise ValueError(
                f"`EarlyStopping.mode` must be 'auto', 'min' or 'max', got {self.mode!r}."
            )
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ValueError(
                f"`EarlyStopping.monitor` must be a name such as 'val_loss', got {self.monitor!r}."
            )
        baseline = self.baseline
        if baseline is not None and (
            isinstance(baseline, bool)
            or not isinstance(baseline, (int, float))
            or not math.isfinite(baseline)
        ):
            raise ValueError(
                f"`EarlyStopping.baseline` must be a finite number or None, got {baseline!r}."
            )

    @property
    def maximise(self) -> bool:
        """Whether a larger monitored value is better (`mode`, with `"auto"` resolved)."""
        if self.mode != "auto":
            return self.mode == "max"
        name = self.monitor.removeprefix("val_").lower()
        return any(word in name for word in _LARGER_IS_BETTER)

    def init(self, params: ArrayTree, model_state: ArrayTree) -> StoppingState:
        """The state before the first epoch."""
        return StoppingState(
            best_value=jnp.asarray(jnp.nan, jnp.float32),
            best_epoch=jnp.asarray(-1, jnp.int32),
            wait=jnp.asarray(0, jnp.int32),
            best_params=params if self.restore_best else None,
            best_model_state=model_state if self.restore_best else None,
        )

    def _better(self, value: Float[Array, ""], than: Float[Array, ""] | float) -> Bool[Array, ""]:
        if self.maximise:
            return value - self.min_delta > than
        return value + self.min_delta < than

    def update(
        self,
        state: StoppingState,
        value: Float[Array, ""],
        epoch: Int[Array, ""],
        params: ArrayTree,
        model_state: ArrayTree,
    ) -> tuple[StoppingState, Bool[Array, ""]]:
        """Takes epoch `epoch`'s (counted from 1) monitored `value`; returns the new state
        and whether to stop. `params` and `model_state` are the model after that epoch.
        """
        monitored = epoch > self.start_from_epoch
        first = state.best_epoch < 0
        # A NaN (a non-finite loss, a validation set of weight 0) never improves.
        improved = monitored & ~jnp.isnan(value) & (first | self._better(value, state.best_value))
        resets = improved
        if self.baseline is not None:
            resets = improved & self._better(value, self.baseline)
        wait = jnp.where(resets, 0, state.wait + monitored.astype(jnp.int32))
        keep = self.restore_best
        new = StoppingState(
            best_value=jnp.where(improved, value, state.best_value),
            best_epoch=jnp.where(improved, epoch, state.best_epoch),
            wait=wait,
            best_params=optax.tree.where(improved, params, state.best_params) if keep else None,
            best_model_state=(
                optax.tree.where(improved, model_state, state.best_model_state) if keep else None
            ),
        )
        return new, monitored & ~improved & (wait >= self.patience)

    def trained(
        self, state: StoppingState, params: ArrayTree, model_state: ArrayTree
    ) -> tuple[ArrayTree, ArrayTree]:
        """The parameters and model state training returns: the best epoch's with
        `restore_best` (once an epoch was monitored), else the last.
        """
        if not self.restore_best:
            return params, model_state
        found = state.best_epoch >= 0
        return (
            optax.tree.where(found, state.best_params, params),
            optax.tree.where(found, state.best_model_state, model_state),
        )
