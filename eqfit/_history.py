"""The History record: arrays in, plain numbers out."""

import dataclasses
from typing import Any

import numpy as np
from jaxtyping import Float

from ._data import BatchPlan


@dataclasses.dataclass(frozen=True)
class History:
    """What happened during `fit`, as numpy arrays and plain numbers.

    **Attributes:**

    - `loss`: the mean training loss of each epoch, shape `(epochs,)`. Each step's loss
        is weighted by its batch size, so with a remainder batch this is the mean over
        samples, exactly as one full-batch pass would average a mean loss.
    - `step_loss`: the loss of every step, shape `(epochs, steps_per_epoch)`. It is the
        loss of the parameters *before* that step's update.
    - `batch_sizes`: the size of each step's batch within an epoch.
    - `wall_time`: seconds spent in `fit`, compilation included.
    """

    loss: Float[np.ndarray, " epochs"]
    step_loss: Float[np.ndarray, "epochs steps"]
    batch_sizes: tuple[int, ...]
    wall_time: float

    @property
    def epochs(self) -> int:
        """How many epochs ran."""
        return int(self.loss.shape[0])

    def to_dict(self) -> dict[str, Any]:
        """The per-epoch values as lists of floats, keyed by name."""
        return {"epoch": list(range(self.epochs)), "loss": self.loss.tolist()}


def make_history(
    step_loss: Float[np.ndarray, "epochs steps"], plan: BatchPlan, wall_time: float
) -> History:
    sizes = (plan.batch_size,) * plan.num_full + ((plan.remainder,) if plan.remainder else ())
    step_loss = np.asarray(step_loss, dtype=np.float32)
    weights = np.asarray(sizes, dtype=np.float64)
    loss = (step_loss.astype(np.float64) @ weights / weights.sum()).astype(np.float32)
    return History(loss, step_loss, sizes, wall_time)
