"""The state a run resumes from: the newest good checkpoint's, if there is one."""

from typing import Any

import jax

from .._program._schedule import Schedule
from .._program._state import TrainState
from .._step._hyperparams import with_injected
from ._checkpoint import Checkpoints, position
from ._fingerprint import hyperparams_changed
from ._identity import grafted, grows, shaped_as


def resume(store: Checkpoints, state: TrainState, schedule: Schedule) -> tuple[TrainState, int]:
    """The training state to start from, and its position: the newest good checkpoint's,
    if there is one, else the start's. A checkpoint of the same run asked for fewer epochs
    (`grows`) is continued: its state, with the rows of the epochs this run adds. One of
    a run whose optimizer's injected hyperparameters were others (a change allowed) goes
    on with this run's.
    """
    if store.collective:  # read straight into the state's layout (`shard=`)
        fresh = state
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
    else:
        fresh = like = jax.device_get(state)

    def shorter(config: dict[str, Any]) -> Any:
        return shaped_as(like, config["state"]) if grows(config, store.config) else None

    restored = store.restore(like, shorter)
    if restored is None:
        return state, schedule.begin
    if restored.first is None:  # of the state's earlier layout: the run's (`grows`)
        restored = restored._replace(first=fresh.first)
    restored = grafted(fresh, restored)
    assert store.restored is not None
    if hyperparams_changed(store.restored, store.config):  # allowed, or `restore` refused it
        opt_state = with_injected(restored.opt_state, fresh.opt_state)
        restored = restored._replace(opt_state=opt_state)
    if not store.collective:
        restored = jax.device_put(restored)
    return restored, position(restored)
