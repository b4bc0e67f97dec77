"""Early stopping: a static description that the compiled loop carries out on the device."""

from typing import Literal

import equinox as eqx


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
