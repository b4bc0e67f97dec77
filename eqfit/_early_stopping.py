"""Early stopping: an option that owns its state and logic, carried out on the device."""

from typing import Literal, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PyTree


class StoppingState(NamedTuple):
    """What early stopping carries from epoch to epoch."""

    best_value: Float[Array, ""]
    best_epoch: Int[Array, ""]  # -1 until an epoch improves on the start
    wait: Int[Array, ""]  # epochs since the best one
    best_params: PyTree  # the best epoch's trained arrays, with `restore_best`
    best_model_state: PyTree


class EarlyStopping(eqx.Module):
    """Stop training when a monitored value stops improving.

    It runs inside the compiled program: after each epoch the monitored value is compared
    with the best so far, and once `patience` epochs pass without an improvement of more
    than `min_delta`, the remaining epochs do no work.

    **Arguments:**

    - `patience`: epochs without improvement before stopping.
    - `min_delta`: the smallest change that counts as an improvement.
    - `monitor`: `"loss"`, `"val_loss"`, or a metric's name, with `"val_"` in front for
        its value on the validation data.
    - `restore_best`: return the parameters (and state) of the best epoch rather than
        the last.
    - `mode`: `"min"` when smaller is better (losses), `"max"` when larger is (accuracy).
    """

    patience: int
    min_delta: float = 0.0
    monitor: str = "val_loss"
    restore_best: bool = True
    mode: Literal["min", "max"] = "min"

    def __check_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"`EarlyStopping.patience` must be at least 1, got {self.patience}.")
        if self.min_delta < 0:
            raise ValueError(f"`EarlyStopping.min_delta` must be >= 0, got {self.min_delta}.")

    def init(self, params: PyTree, model_state: PyTree) -> StoppingState:
        """The state before the first epoch."""
        worst = -jnp.inf if self.mode == "max" else jnp.inf
        return StoppingState(
            best_value=jnp.asarray(worst, jnp.float32),
            best_epoch=jnp.asarray(-1, jnp.int32),
            wait=jnp.asarray(0, jnp.int32),
            best_params=params if self.restore_best else None,
            best_model_state=model_state if self.restore_best else None,
        )

    def update(
        self,
        state: StoppingState,
        value: Float[Array, ""],
        epoch: Int[Array, ""],
        params: PyTree,
        model_state: PyTree,
    ) -> tuple[StoppingState, Bool[Array, ""]]:
        """Takes epoch `epoch`'s monitored `value`; returns the new state and whether to
        stop. `params` and `model_state` are the model after that epoch.
        """
        sign = 1.0 if self.mode == "min" else -1.0
        improved = sign * (state.best_value - value) > self.min_delta
        wait = jnp.where(improved, 0, state.wait + 1)
        keep = self.restore_best
        state = StoppingState(
            best_value=jnp.where(improved, value, state.best_value),
            best_epoch=jnp.where(improved, epoch, state.best_epoch),
            wait=wait,
            best_params=optax.tree.where(improved, params, state.best_params) if keep else None,
            best_model_state=(
                optax.tree.where(improved, model_state, state.best_model_state) if keep else None
            ),
        )
        return state, wait >= self.patience

    def trained(
        self, state: StoppingState, params: PyTree, model_state: PyTree
    ) -> tuple[PyTree, PyTree]:
        """The parameters and model state training returns: the best epoch's with
        `restore_best` (once an epoch improved on the start), else the last.
        """
        if not self.restore_best:
            return params, model_state
        found = state.best_epoch >= 0
        return (
            optax.tree.where(found, state.best_params, params),
            optax.tree.where(found, state.best_model_state, model_state),
        )
