"""`fit`'s `checkpoint=` as a concern that owns its behaviour (diffrax's way): `Keeping.of`
checks the option where it is made, and the run calls its methods, phase by phase: the
`keep_best` value checked before any data is read and against the run's record
(`check_record`), the directory whose newest checkpoint may keep a loader's epoch length,
the store opened (`open`, giving the run's `Kept`), the state resumed, the observer that
writes, and what the callbacks are told (`config`). `KeepNothing`, a run that keeps no
checkpoints, does nothing at each, so that the run asks no `checkpoint is None`.
"""

import abc
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast, final, TypeVar

import jax

from .._core._checks import as_int, check_whole
from .._core._extras import require_orbax
from .._core._policy import Checkpoint
from .._program._build import check_monitor
from .._program._compile import Starting
from .._program._loop import Loop
from .._program._options import known_values, Options, refuse_impossible_monitor
from .._program._parallel import param_specs, Placement
from .._program._schedule import Schedule
from .._program._state import TrainState
from ._checkpoint import Checkpoints
from ._resume import resume
from ._writer import going


KEEP_BEST = "`checkpoint`'s `keep_best`"
# What the callbacks' `on_train_begin` is told of the checkpoints (`Kept.config`), in order.
CONFIG_KEYS = (
    "checkpoint",
    "checkpoint_every",
    "checkpoint_every_steps",
    "checkpoint_every_seconds",
)

_Observer = TypeVar("_Observer")
_State = TypeVar("_State", bound=TrainState | Starting)


class Kept(abc.ABC):
    """A run's checkpoints as the run goes (`Keeping.open`'s): the state it resumes
    from, the newest checkpoint, the observer that writes them.
    """

    @abc.abstractmethod
    def resume(self, state: _State, schedule: Schedule) -> tuple[_State, int]:
        """The state to start from, and its position: the newest good checkpoint's, or
        `state` at the schedule's start.
        """

    @abc.abstractmethod
    def newest(self) -> Path | None:
        """The newest good checkpoint's folder (`None`: none)."""

    @abc.abstractmethod
    def observers(self, make: Callable[[Checkpoints, Checkpoint], _Observer]) -> list[_Observer]:
        """The observer that writes the checkpoints, made by `make(store, policy)`, if any."""

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """What the callbacks' `on_train_begin` is told of the checkpoints."""

    @abc.abstractmethod
    def close(self) -> None:
        """The run is over: the directory's lock let go."""


class Keeping(abc.ABC):
    """`fit`'s `checkpoint=` and `checkpoint_every=`, checked (`of`): what the run does
    for its checkpoints. `KeepBy` a `Checkpoint` policy's; `KeepNothing` none.
    """

    @staticmethod
    def of(checkpoint: Any, checkpoint_every: Any, options: Options) -> "Keeping":
        """`fit`'s `checkpoint` as a concern: a directory is `Checkpoint(directory,
        every_epochs=checkpoint_every)`. A run under `shard=` needs orbax to write. Its
        `keep_best` is refused where no run with these `options` computes it.
        """
        checkpoint_every = as_int(checkpoint_every)
        check_whole("checkpoint_every", checkpoint_every, 1)
        if param_specs(options.placement) is not None and checkpoint is not None:
            require_orbax()
        if checkpoint is None:
            return KeepNothing()
        if isinstance(checkpoint, Checkpoint):
            if checkpoint_every != 1:
                raise ValueError(
                    "`checkpoint_every` with a `Checkpoint`: its policy says when to write; "
                    f"give `Checkpoint(..., every_epochs={checkpoint_every})` instead."
                )
            policy = checkpoint
        elif isinstance(checkpoint, str | os.PathLike):
            policy = Checkpoint(checkpoint, every_epochs=checkpoint_every)
        else:
            raise TypeError(
                "`checkpoint` must be a directory (a string or `pathlib.Path`) or an "
                f"`eqfit.Checkpoint`, got {type(checkpoint).__name__}."
            )
        if policy.keep_best is not None:
            metric_names = tuple(name for name, _ in options.objects.metrics)
            known = known_values(options, metric_names)
            refuse_impossible_monitor(policy.keep_best, options, known, KEEP_BEST)
        return KeepBy(policy)

    @property
    @abc.abstractmethod
    def directory(self) -> Any:
        """Where the checkpoints live (`None`: nowhere): a loader without `len` reads the
        epoch's length its newest checkpoint keeps there.
        """

    @property
    @abc.abstractmethod
    def resumes(self) -> bool:
        """Whether the run may resume from a checkpoint: its starting state is then made
        before its program is traced.
        """

    @abc.abstractmethod
    def check_record(self, loop: Loop) -> None:
        """Refuses a `keep_best` that the run's record does not hold as one number."""

    @abc.abstractmethod
    def open(
        self,
        state: TrainState | Starting,
        config: Callable[[TrainState], dict[str, Any]],
        placement: Placement,
        schedule: Schedule,
    ) -> Kept:
        """The run's checkpoints, opened for the run that `config(state)` identifies
        (refused where the directory's are another run's).
        """


@final
@dataclasses.dataclass(frozen=True)
class KeepNothing(Keeping, Kept):
    """A run that keeps no checkpoints: it resumes from none and writes none."""

    @property
    def directory(self) -> None:
        return None

    @property
    def resumes(self) -> bool:
        return False

    def check_record(self, loop: Loop) -> None:
        pass

    def open(
        self,
        state: TrainState | Starting,
        config: Callable[[TrainState], dict[str, Any]],
        placement: Placement,
        schedule: Schedule,
    ) -> Kept:
        return self

    def config(self) -> dict[str, Any]:
        return dict.fromkeys(CONFIG_KEYS)

    def resume(self, state: _State, schedule: Schedule) -> tuple[_State, int]:
        return state, schedule.begin

    def newest(self) -> None:
        return None

    def observers(self, make: Callable[[Checkpoints, Checkpoint], _Observer]) -> list[_Observer]:
        return []

    def close(self) -> None:
        pass


@final
@dataclasses.dataclass(frozen=True)
class KeepBy(Keeping):
    """A run that keeps checkpoints as its `policy` says."""

    policy: Checkpoint

    @property
    def directory(self) -> Any:
        return self.policy.directory

    @property
    def resumes(self) -> bool:
        return True

    def check_record(self, loop: Loop) -> None:
        if self.policy.keep_best is not None:
            check_monitor(self.policy.keep_best, loop, what=KEEP_BEST)

    def open(
        self,
        state: TrainState | Starting,
        config: Callable[[TrainState], dict[str, Any]],
        placement: Placement,
        schedule: Schedule,
    ) -> Kept:
        """Under `shard=`, Orbax's format, which every process writes its shards of; else
        one file, which process 0 writes and every process reads.
        """
        assert not isinstance(state, Starting)  # made now: the run may resume (`resumes`)
        policy = self.policy
        best = None if policy.keep_best is None else (policy.keep_best, policy.mode)
        if param_specs(placement) is not None:
            from ._orbax import ShardedCheckpoints

            store: Checkpoints = ShardedCheckpoints(
                policy.directory,
                config(state),
                schedule.steps_per_epoch,
                keep=policy.keep,
                best=best,
                allow=policy.allow_changes,
            )
        else:
            store = Checkpoints(
                policy.directory,
                config(state),
                schedule.steps_per_epoch,
                writer=jax.process_index() == 0,
                keep=policy.keep,
                best=best,
                allow=policy.allow_changes,
            )
        return Stored(store, policy)


@final
class Stored(Kept):
    """The checkpoints of a run that keeps them: its `store`, written as `policy` says."""

    def __init__(self, store: Checkpoints, policy: Checkpoint):
        self.store, self.policy = store, policy

    def resume(self, state: _State, schedule: Schedule) -> tuple[_State, int]:
        assert not isinstance(state, Starting)  # made before the store opened
        resumed, position = resume(self.store, state, schedule)
        return cast(_State, resumed), position

    def newest(self) -> Path | None:
        # The run's last, where it goes on after `fit` returns (`go_on`), being written.
        return going(self.store.directory) or self.store.newest()

    def observers(self, make: Callable[[Checkpoints, Checkpoint], _Observer]) -> list[_Observer]:
        return [make(self.store, self.policy)]

    def config(self) -> dict[str, Any]:
        policy = self.policy
        values = (
            str(policy.directory),
            policy.every_epochs,
            policy.every_steps,
            policy.every_seconds,
        )
        return dict(zip(CONFIG_KEYS, values, strict=True))

    def close(self) -> None:
        self.store.close()
