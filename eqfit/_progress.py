"""The progress bar, the user's callbacks and checkpoints, driven by the chunked runner."""

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ._checkpoint import Checkpoints, Interrupt, position
from ._loop import Inputs, Loop, Progress, Record, run_chunked, TrainState
from ._stream import LoaderSource, MemmapSource, run_streamed


@runtime_checkable
class Callback(Protocol):
    """Called on the host after each epoch of a `progress=True` run."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> bool | None:
        """`logs` holds the epoch's values by name. Return `True` to stop training."""
        ...


class _Bar(Progress):
    """Drives a tqdm bar, the user's callbacks and the checkpoints from the chunked runner.

    The bar is made at the first report, when the device already has work queued: making
    it costs a fraction of a millisecond that would otherwise delay the first chunk.
    """

    def __init__(
        self,
        make_bar: Callable[[], Any],
        epochs: int,
        callbacks: Sequence[Callback],
        interrupt: Interrupt,
        store: Checkpoints | None,
        then: Callable[[TrainState, Record], Any] | None = None,
    ):
        self.then, self.then_result = then, None
        self.make_bar, self.made = make_bar, None
        self.epochs, self.callbacks = epochs, callbacks
        self.interrupt, self.store = interrupt, store
        self.epoch, self.loss_sum, self.steps = -1, 0.0, 0
        self.last_logs: dict[str, str] = {}

    @property
    def bar(self) -> Any:
        if self.made is None:
            self.made = self.make_bar()
        return self.made

    def close(self) -> None:
        if self.made is not None:
            self.made.close()

    def on_steps(self, epoch: int, steps: int, loss_sum: float) -> None:
        if epoch != self.epoch:
            self.epoch, self.loss_sum, self.steps = epoch, 0.0, 0
            self.bar.set_description(f"epoch {epoch + 1}/{self.epochs}", refresh=False)
        self.loss_sum += loss_sum
        self.steps += steps
        postfix = {"loss": f"{self.loss_sum / self.steps:.4g}", **self.last_logs}
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(steps)

    def on_epoch(self, epoch: int, logs: dict[str, float]) -> bool:
        self.last_logs = {k: f"{v:.4g}" for k, v in logs.items() if k.startswith("val_")}
        stop = False
        for callback in self.callbacks:
            stop = bool(callback.on_epoch_end(epoch, dict(logs))) or stop
        return stop

    def interrupted(self) -> bool:
        return self.interrupt.requested

    def save(self, s: TrainState, r: Record) -> None:
        if self.store is not None:
            self.store.save((s, r), *position(s))

    def queued_last(self, s: TrainState, r: Record) -> None:
        if self.then is not None:
            self.then_result = self.then(s, r)


def run_with_bar(
    loop: Loop,
    inputs: Inputs,
    s: TrainState,
    r: Record,
    begin: tuple[int, int],
    epochs: int,
    callbacks: Sequence[Callback],
    interrupt: Interrupt,
    store: Checkpoints | None,
    every: int,
    source: MemmapSource | LoaderSource | None = None,
    show: bool = True,
    then: Callable[[TrainState, Record], Any] | None = None,
) -> tuple[TrainState, Record, Any]:
    """Runs the chunked path (or the streamed one, for `source`), with a bar if `show`.

    **Returns:**

    The final state and record, and `then(state, record)` if the chunked run called it as
    its last piece was queued (`Progress.queued_last`), else `None`.
    """
    from tqdm.auto import tqdm

    steps = loop.plan.steps_per_epoch
    done, step = begin
    initial = min(done, epochs) * steps + step  # where a resumed run starts
    every_ = every if store is not None else None
    total = epochs * steps

    def make_bar() -> Any:
        return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=not show)

    progress = _Bar(make_bar, epochs, callbacks, interrupt, store, then)
    try:
        if source is not None:
            s, r = run_streamed(loop, inputs, s, r, begin, epochs, progress, source, every_)
        else:
            sync = bool(callbacks)
            s, r = run_chunked(
                loop, inputs, s, r, begin, epochs, progress, sync, checkpoint_every=every_
            )
        return s, r, progress.then_result
    finally:
        progress.close()
