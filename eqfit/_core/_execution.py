"""How the steps run: inside one compiled loop (`WholeRun`), or as programs of a few
steps written out, which Python calls one after another (`PerStep`); and which of the two
a run gets (`choose`). Validation, `evaluate` and `predict` run their batches the same
way. Each way is handed the makers of the programs and makes them (`Execution.program`,
`Execution.batches`), as optimistix's adjoint is handed the loop it runs: the makers'
modules ask the way, and this one imports none of them.

Both run the same arithmetic, with the same shuffle, keys and record; only XLA's fusion
of it differs. Why two: XLA compiles some operations worse inside a loop's body than in
straight-line code. On its CPU backend, a convolution outside a loop is laid out for its
fast convolution kernels, while inside a `while` body it keeps the loop-carried layout and
becomes a naive loop nest, several times slower (jax issue #12868). Such a step trains
faster called from Python, each call dispatched while the one before it runs, than
scanned; every other step trains faster scanned, where a call per step would cost the
host more than the step.
"""

import abc
from collections.abc import Callable
from typing import Literal, NamedTuple, TypeVar

import equinox as eqx

from ._checks import as_int


_T = TypeVar("_T")


class Execution(eqx.Module):
    """How `fit` runs the training steps: `eqfit.WholeRun()` or `eqfit.PerStep(unroll)`,
    given as `fit(..., execution=...)`. By default (`"auto"`) `fit` chooses, and
    `eqfit.plan` says which and why.

    Each takes `guard=` (keyword only): whether each update sits in a `lax.cond` that
    leaves it unapplied where its loss is not finite, with `on_nan="raise"` and `"stop"`
    (`"skip"` always has it). With `guard=False` the update is applied whatever its
    loss, the run stops after the first non-finite step, and `fit` makes the state that
    step began from again by replaying the run up to it, from the newest checkpoint or
    the start: the same result, bit for bit, with no `cond` in the step. `None` (the
    default, and `"auto"`'s): no guard wherever the run can be replayed, since XLA runs
    a step as fast without it or faster (on the CPU backend, a small step's operations
    are then ordered for memory: see the speed guide). Either way a finite run's
    arithmetic and bits are the same. With several updates and no guard, a non-finite
    step gives the state from before the whole step, where the guard applies the step's
    other updates. `guard=False` is refused where the run cannot be replayed bit for
    bit: under `devices=`, with a precision policy or an ensemble, on a one-shot
    iterator, with several processes; `None` keeps the guard there.

    A way of one's own subclasses it: its words (`describe`), its longest program
    (`steps_per_program`), and the programs made from the makers it is handed
    (`program`, `batches`).
    """

    guard: bool | None = eqx.field(default=None, kw_only=True)

    @abc.abstractmethod
    def describe(self) -> str:
        """The way, in words."""

    @abc.abstractmethod
    def steps_per_program(self) -> int | None:
        """The steps each compiled program runs, written out one after the other; `None`
        for a program that loops over the steps of the whole run: what `check_steps` and
        `plan`'s words read (the programs themselves are made by `program` and `batches`).
        """

    @abc.abstractmethod
    def program(self, whole_run: Callable[[], _T], steps: Callable[[int], _T]) -> _T:
        """The run's program, made by the maker of this way of running the steps, of the
        two that `program_for` hands it: `whole_run()`, calls of `run` (each looping over
        the steps to its stop); or `steps(k)`, calls of `unrolled` (programs of `k` steps
        written out, called from Python, each epoch's end made by the host).
        """

    @abc.abstractmethod
    def batches(self, scanned: Callable[[], _T], in_calls: Callable[[int], _T]) -> _T:
        """What an inference gives (`evaluate`, `predict`, validation's sums where the host
        makes an epoch's end), its batches run by the maker of this way, of the two it is
        handed: `scanned()`, one program looping over all the batches (of the data, or of
        a streamed chunk); or `in_calls(k)`, programs of `k` batches written out, called
        from Python.
        """

    def describe_batches(self) -> str:
        """How the batches of validation, `evaluate` and `predict` run, in words: as the
        steps do, each program running `steps_per_program()` of them.
        """
        batches = self.steps_per_program()
        if batches is None:
            return "every batch in one compiled loop"
        each = "one batch" if batches == 1 else f"{batches} batches"
        return f"a program of {each} called from Python"


class WholeRun(Execution):
    """Every step inside one compiled loop: the whole run is one XLA program (called in
    pieces for the bar, checkpoints and streamed data), so the host does nothing per
    step. The fastest way for nearly every model, and the default but on the CPU backend
    for a loss that convolves.
    """

    def describe(self) -> str:
        return "the whole run in one compiled loop"

    def steps_per_program(self) -> None:
        return None

    def program(self, whole_run: Callable[[], _T], steps: Callable[[int], _T]) -> _T:
        return whole_run()

    def batches(self, scanned: Callable[[], _T], in_calls: Callable[[int], _T]) -> _T:
        return scanned()


class PerStep(Execution):
    """Programs of `unroll` steps written out one after the other, with no loop in them,
    that `fit` calls again and again, each call dispatched while the one before it runs
    (the host never waits for the device between calls). The shuffle, the keys, the
    record, validation, early stopping, checkpoints, signals and the bar are the same as
    in `WholeRun`. It suits a step that XLA compiles worse inside a loop (a convolution
    on the CPU backend) or a step long enough that the host's work per call is nothing
    next to it.

    **Arguments:**

    - `unroll`: the steps of each program (at least 1). More steps cost fewer calls and a
        longer compilation (the step is compiled `unroll` times over); a call never goes
        past an epoch's end or a pass's smaller last batch, which has a program of its own.
        Which steps a call runs together is fixed by the run, never by its speed: the
        bits do not hang on how fast it ran.
    """

    unroll: int = eqx.field(default=1, converter=as_int)

    def __check_init__(self) -> None:
        if isinstance(self.unroll, bool) or not isinstance(self.unroll, int):
            raise TypeError(
                "`PerStep(unroll=...)` must be an integer, the steps each program writes "
                f"out (such as `PerStep(4)`), got {self.unroll!r} ({type(self.unroll).__name__})."
            )
        if self.unroll < 1:
            raise ValueError(f"`PerStep(unroll=...)` must be at least 1, got {self.unroll!r}.")

    def describe(self) -> str:
        steps = "one step" if self.unroll == 1 else f"{self.unroll} steps"
        return f"a program of {steps} called from Python"

    def steps_per_program(self) -> int:
        return self.unroll

    def program(self, whole_run: Callable[[], _T], steps: Callable[[int], _T]) -> _T:
        return steps(self.unroll)

    def batches(self, scanned: Callable[[], _T], in_calls: Callable[[int], _T]) -> _T:
        return in_calls(self.unroll)


class Choice(NamedTuple):
    """The way a run's steps run, and why (for `eqfit.plan`)."""

    execution: Execution
    why: str


def check_steps(execution: Execution, steps: int, where: str) -> None:
    """Refuses programs of more steps than a call can run, before the first is traced: a
    program's steps are traced and compiled one after the other, and those past the
    call's end would never run.

    **Arguments:**

    - `execution`: the way asked for.
    - `steps`: the most steps a call runs (an epoch's, or a chunk's of streamed data).
    - `where`: what `steps` counts, as the message says it ("an epoch of this run has").
    """
    unroll = execution.steps_per_program()
    if unroll is not None and unroll > steps:
        raise ValueError(
            f"`execution={execution!r}` asks for programs of {unroll} steps, but "
            f"{where} {steps}, and a call never goes past it: the steps past it would be "
            f"compiled and never run. Give `unroll` at most {steps}."
        )


def choose(
    asked: Execution | Literal["auto"],
    *,
    platform: str,
    steps_per_epoch: int | None,
    convolves: Callable[[], bool],
) -> Choice:
    """The way the run's steps run: `asked`, checked against the run; or by default
    `PerStep(1)` where the loss convolves on the CPU backend, else `WholeRun()`.

    **Arguments:**

    - `asked`: `fit`'s `execution`.
    - `platform`: the training devices' platform (`"cpu"`, `"gpu"`, `"tpu"`).
    - `steps_per_epoch`: the epoch's steps (`None`: not yet known, a loader's).
    - `convolves`: whether the loss convolves (asked only where it decides).

    **Returns:**

    The `Choice`.
    """
    if asked != "auto":
        unroll = asked.steps_per_program()
        if unroll is not None and (
            isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1
        ):
            raise ValueError(
                f"`execution={asked!r}` says its programs run {unroll!r} steps each "
                "(`steps_per_program()`): that must be a whole number of 1 or more, or `None` "
                "for a program that loops over the whole run."
            )
        if steps_per_epoch is not None:
            check_steps(asked, steps_per_epoch, "an epoch of this run has")
        return Choice(asked, "as `execution=` asks")
    if platform == "cpu" and convolves():
        why = (
            "the loss convolves, on the CPU backend, where XLA compiles a convolution "
            "inside a loop as a naive loop nest (jax #12868)"
        )
        return Choice(PerStep(1), why)
    if platform == "cpu":
        return Choice(WholeRun(), "no convolution: nothing XLA compiles worse in a loop")
    return Choice(WholeRun(), f"on {platform}, no operation known to compile worse in a loop")
