"""What a long run is asked to do: when to checkpoint and what to keep (`Checkpoint`),
which steps to trace (`Profile`), and which signals stop it (`signals=`). Plain values,
checked as they are made.
"""

import dataclasses
import math
import os
import signal
from typing import Any, Literal


# Checkpoints kept by default: the newest, and one before it in case the newest is damaged.
KEEP = 2

# What a run resumed from a checkpoint may differ in, where `Checkpoint.allow_changes`
# says the change is meant; each is compared by a fingerprint the checkpoint keeps.
CHANGES = ("data", "validation_data", "metrics", "optimizer")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """When `fit` writes checkpoints, and which it keeps: `fit(..., checkpoint=
    eqfit.Checkpoint(directory, ...))`. `checkpoint=directory` is `Checkpoint(directory)`.

    A checkpoint falls at every step that any of the periods given reaches (an epoch's
    end, a multiple of `every_steps` steps, `every_seconds` of wall time since the last
    one), at the run's end, and at the step where a signal stopped it (Ctrl-C, SIGTERM,
    SIGUSR1). It may fall inside an epoch: a run resumed from it goes on bit for bit.
    Each is written where it costs the run least (`background`); `fit` returns once the
    last is committed, or in the background once its state is copied (its write goes on:
    [`eqfit.wait_for_checkpoints`][] waits for it).

    **Arguments:**

    - `directory`: where the checkpoints live; created if missing.
    - `every_epochs`: epochs between checkpoints at epochs' ends (`None`: none there).
    - `every_steps`: optimizer steps between checkpoints, counted from the run's first
        step ever (so step multiples of it), inside epochs too.
    - `every_seconds`: wall seconds between checkpoints: one is written at the first
        end of a call (about half a second apart) once this long has passed since the
        last. With several processes (`jax.distributed`), process 0's clock decides.
    - `keep`: how many of the newest checkpoints to keep (the newest is the one a run
        resumes from).
    - `keep_best`: a per-epoch value the run records, such as `"val_loss"`: also keep
        the checkpoint of the best epoch by it, never rotated out. Each epoch whose value
        is the best so far is written at its end, due or not.
    - `mode`: `"min"` or `"max"`: whether `keep_best`'s best is its lowest or highest.
    - `background`: where a checkpoint is written. `True`: in a background thread while
        training goes on: the state is copied on the device, queued behind the training
        (which takes device memory for one more training state until the copy is on the
        host), and the thread takes the copy to the host, writes it with its CRC32,
        fsyncs it and renames it into place; the training waits for nothing but a write
        still going when the next checkpoint falls due. `False`: in the training thread,
        at the checkpoint's step, while the device waits. `None` (the default) chooses by
        where the state lives: in the background on a GPU or TPU, whose host's cores are
        free while it computes, and in the training thread on the CPU backend, where a
        writer thread would take its cores from XLA's computation: there the training
        thread, which needs no copy of the state, writes the state's file, and a thread
        that needs no core waits for the disk (`fsync`) and renames it into place while
        training goes on. `False` commits each checkpoint at its step, before training
        goes past it (a callback of its epoch finds it). Either way a checkpoint is
        fsynced and renamed into place whole, one write at a time: a checkpoint that
        falls due while the last is still being written waits for it, which the `eqfit`
        logger says once a run (a warning; each later wait at its DEBUG level). Each
        epoch's `history.throughput["checkpoint_blocked_seconds"]` says how long the
        training waited at its checkpoints. A failed write raises
        [`eqfit.CheckpointError`][] with the training so far. In the background the
        run's last write goes on as `fit` returns (queued behind any write in flight),
        as Orbax's asynchronous checkpoints do: a `fit` reading the directory, the
        process's exit and [`eqfit.wait_for_checkpoints`][] wait for it, and the last
        raises its error (which the `eqfit` logger has said). With several processes
        (`jax.distributed`) it is written in the training thread whatever this says:
        every process takes part, in step with the training's collectives.
    - `allow_changes`: what a run resumed from these checkpoints may change, on purpose:
        any of `"data"`, `"validation_data"`, `"metrics"` and `"optimizer"`. A
        checkpoint keeps a fingerprint of each (the rows of data in memory or memmaps,
        sampled; each metric's configuration; the optimizer's numbers and its injected
        hyperparameters), and a run that differs in one is refused, naming it with the
        checkpoint's value and the run's, unless it is allowed here: to go on with a new
        learning rate, say, `Checkpoint(directory, allow_changes=("optimizer",))`. The
        checkpoints written after such a resume keep the new fingerprints.
    """

    directory: Any
    every_epochs: int | None = 1
    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = KEEP
    keep_best: str | None = None
    mode: Literal["min", "max"] = "min"
    background: bool | None = None
    allow_changes: tuple[str, ...] | str = ()

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str | os.PathLike):
            raise TypeError(
                "`Checkpoint`'s `directory` must be a path (a string or `pathlib.Path`), got "
                f"{type(self.directory).__name__}."
            )
        for name in ("every_epochs", "every_steps"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"`Checkpoint`'s `{name}` must be a whole number of 1 or more, or "
                    f"`None`; got {value!r}."
                )
        seconds = self.every_seconds
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(
                "`Checkpoint`'s `every_seconds` must be a number of seconds above 0, or "
                f"`None`; got {seconds!r}."
            )
        if self.every_epochs is None and self.every_steps is None and seconds is None:
            raise ValueError(
                "`Checkpoint` has no policy: `every_epochs`, `every_steps` and "
                "`every_seconds` are all `None`, so no checkpoint would be written but at "
                "the run's end. Give one of them (`every_epochs=1`, say)."
            )
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(
                f"`Checkpoint`'s `keep` must be a whole number of 1 or more, got {self.keep!r}."
            )
        if self.keep_best is not None and not (isinstance(self.keep_best, str) and self.keep_best):
            raise TypeError(
                "`Checkpoint`'s `keep_best` must name a per-epoch value such as 'val_loss', "
                f"got {self.keep_best!r}."
            )
        if self.mode not in ("min", "max"):
            raise ValueError(f"`Checkpoint`'s `mode` must be 'min' or 'max', got {self.mode!r}.")
        if self.background is not None and not isinstance(self.background, bool):
            raise TypeError(
                "`Checkpoint`'s `background` must be `True`, `False` or `None` (chosen by "
                f"the backend), got {self.background!r}."
            )
        allowed = self.allow_changes
        if isinstance(allowed, str):  # one of them, named alone
            allowed = (allowed,)
        if not isinstance(allowed, tuple | list | set | frozenset) or any(
            a not in CHANGES for a in allowed
        ):
            raise ValueError(
                f"`Checkpoint`'s `allow_changes` must be a tuple of what a resumed run may "
                f"change, of {CHANGES}; got {self.allow_changes!r}."
            )
        object.__setattr__(self, "allow_changes", tuple(a for a in CHANGES if a in allowed))

    def next_due(self, position: int, steps_per_epoch: int) -> int | None:
        """The first position after `position` where a period falls due (not counting
        `every_seconds`, which no position foretells); `None` if none does.
        """
        due = []
        if self.every_epochs is not None:
            every = self.every_epochs * steps_per_epoch
            due.append((position // every + 1) * every)
        if self.every_steps is not None:
            due.append((position // self.every_steps + 1) * self.every_steps)
        return min(due) if due else None

    def is_due(self, position: int, steps_per_epoch: int) -> bool:
        """Whether a period (of epochs or steps) falls due at `position`."""
        by_epochs = self.every_epochs is not None and (
            position % (self.every_epochs * steps_per_epoch) == 0
        )
        by_steps = self.every_steps is not None and position % self.every_steps == 0
        return by_epochs or by_steps


@dataclasses.dataclass(frozen=True)
class Profile:
    """A stretch of steps to trace with `jax.profiler`: `fit(..., profile=
    eqfit.Profile(directory, start_step, steps))`.

    The calls of the run end at the stretch's two edges, and the host waits there for
    the device, so that the trace (`jax.profiler.start_trace(directory)` before the
    first step, `stop_trace()` after the last) holds those steps' work and none of the
    steps around them; the calls in between go on as usual, and the run's results are
    the same, bit for bit. Read the trace with TensorBoard's profile plugin or XProf
    (`plugins/profile/<run>/*.xplane.pb` under `directory`) or Perfetto
    (`*.trace.json.gz`). The whole run is one compiled loop, so the trace shows XLA's
    operations (fusions, the loop's `while`), not Python steps.

    **Arguments:**

    - `directory`: where the trace is written; created if missing.
    - `start_step`: the first step traced, counted from 0 from the run's first step
        ever (`initial_epoch`'s steps included), as `Checkpoint.every_steps` counts: a
        continued or resumed run traces the same steps of the training. Step `t` is in
        epoch `t // steps_per_epoch + 1`.
    - `steps`: how many steps to trace.

    `fit` refuses a `start_step` outside the run's steps before anything compiles (a
    loader without `len` has no known end until its first pass is read: only a start
    before the run's first step is refused there). A stretch that reaches past the run's
    end, or one that the run stops inside (early stopping, a callback, a signal), is
    traced to where the run ended. A run resumed from a checkpoint past `start_step`
    traces what is left of the stretch, and warns if nothing is.
    A stretch from the run's first step also holds the run's compilation, unless it was
    compiled before (`progress=True` compiles it before the first step).
    """

    directory: Any
    start_step: int
    steps: int

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str | os.PathLike):
            raise TypeError(
                "`Profile`'s `directory` must be a path (a string or `pathlib.Path`), got "
                f"{type(self.directory).__name__}."
            )
        for name, least in (("start_step", 0), ("steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"`Profile`'s `{name}` must be a whole number of {least} or more, got "
                    f"{value!r}."
                )

    @property
    def stop_step(self) -> int:
        """The position after the last step traced."""
        return self.start_step + self.steps


# The signals a cluster's scheduler stops a job with (SLURM: SIGTERM, then SIGKILL after a
# grace period; SIGUSR1 ahead of it where asked, `--signal=USR1@90`; Kubernetes: SIGTERM).
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")


def as_signals(signals: Any) -> tuple[signal.Signals, ...]:
    """`fit`'s `signals`, checked: names (`"SIGTERM"`) or numbers of signals that Python
    can catch.
    """
    if signals is None:
        return ()
    if isinstance(signals, str | int):
        signals = (signals,)
    try:
        given = tuple(signals)
    except TypeError:
        raise TypeError(
            f"`signals` must be a sequence of signal names such as `('SIGTERM', 'SIGUSR1')`, "
            f"or `()` for none; got {signals!r}."
        ) from None
    out = []
    for item in given:
        try:
            if isinstance(item, str):
                name = item.upper()
                number = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            elif isinstance(item, int) and not isinstance(item, bool):
                number = signal.Signals(item)
            else:
                raise KeyError(item)
        except (KeyError, ValueError):
            raise ValueError(
                f"`signals` holds {item!r}, which is not a signal here; give names such as "
                "'SIGTERM', 'SIGUSR1' or 'SIGUSR2'."
            ) from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"`signals` holds {number.name}, which no process can catch; it stops the "
                "process at once. Ask the scheduler for a signal ahead of it (SLURM: "
                "`--signal=USR1@90`)."
            )
        if number not in out:
            out.append(number)
    return tuple(out)
