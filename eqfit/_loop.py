"""The compiled multi-epoch scan, and the chunked runner that the progress bar drives."""

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key, PyTree, UInt32

from ._data import BatchPlan, Data, epoch_order
from ._parallel import OneDevice, Placement
from ._step import Step


Carry = tuple[PyTree, PyTree]  # (params, opt_state)
Keys = Key[Array, "2"]  # (shuffle key, step key)
Losses = Float[Array, " steps"]


class Loop(eqx.Module):
    """A run's static description: the step, the batch plan, the shuffle, the placement.

    It holds no arrays (beyond any frozen ones of the model), so it is hashed as a static
    argument of the compiled programs.
    """

    step: Step
    plan: BatchPlan
    shuffle: bool
    placement: Placement = OneDevice()

    def order(self, keys: Keys, epoch: Int[Array, ""]) -> UInt32[Array, " n"]:
        return epoch_order(keys[0], epoch, self.plan.num_samples, self.shuffle)

    def step_key(self, keys: Keys, epoch: Int[Array, ""], j: Any) -> Key[Array, ""]:
        # One key per global step, so a step's key does not depend on how the run is
        # cut into chunks or checkpoints.
        return jax.random.fold_in(keys[1], epoch * self.plan.steps_per_epoch + j)

    def run_steps(
        self,
        carry: Carry,
        losses: Losses,
        data: Data,
        order: UInt32[Array, " n"],
        keys: Keys,
        epoch: Int[Array, ""],
        start: Any,
        stop: Any,
    ) -> tuple[Carry, Losses]:
        """Full batches `start` to `stop` of one epoch.

        With Python ints for `start` and `stop` this is a `lax.scan`; with traced ones a
        `while_loop`. The body is the same, so both give the same bits.
        """
        size = self.plan.batch_size
        if self.plan.num_full == 0:  # fewer samples than one batch: only the remainder
            return carry, losses

        def body(j: Any, state: tuple[Carry, Losses]) -> tuple[Carry, Losses]:
            (params, opt_state), losses = state
            index = jax.lax.dynamic_slice_in_dim(order, j * size, size)
            batch = self.placement.full_batch(data, index)
            params, opt_state, loss = self.step(
                params, opt_state, batch, self.step_key(keys, epoch, j)
            )
            return (params, opt_state), losses.at[j].set(loss)

        return jax.lax.fori_loop(start, stop, body, (carry, losses))

    def run_remainder(
        self,
        carry: Carry,
        losses: Losses,
        data: Data,
        order: UInt32[Array, " n"],
        keys: Keys,
        epoch: Int[Array, ""],
    ) -> tuple[Carry, Losses]:
        """The epoch's last, smaller batch, traced at its own shape.

        It is never split over devices (it need not divide evenly), so its step has no
        cross-device mean.
        """
        plan = self.plan
        if plan.remainder == 0:
            return carry, losses
        index = order[plan.num_full * plan.batch_size :]
        batch = self.placement.remainder_batch(data, index)
        step = dataclasses.replace(self.step, axis_name=None)
        params, opt_state, loss = step(*carry, batch, self.step_key(keys, epoch, plan.num_full))
        return (params, opt_state), losses.at[plan.num_full].set(loss)

    def run_epoch(
        self, carry: Carry, data: Data, keys: Keys, epoch: Int[Array, ""]
    ) -> tuple[Carry, Losses]:
        losses = jnp.zeros(self.plan.steps_per_epoch)
        order = self.order(keys, epoch)
        carry, losses = self.run_steps(
            carry, losses, data, order, keys, epoch, 0, self.plan.num_full
        )
        return self.run_remainder(carry, losses, data, order, keys, epoch)


def _run_epochs(
    loop: Loop,
    carry: Carry,
    data: Data,
    keys: Keys,
    first_epoch: Int[Array, ""],
    num_epochs: int,
) -> tuple[Carry, Float[Array, "epochs steps"]]:
    def epoch(carry: Carry, e: Int[Array, ""]) -> tuple[Carry, Losses]:
        return loop.run_epoch(carry, data, keys, e)

    return jax.lax.scan(epoch, carry, first_epoch + jnp.arange(num_epochs))


def run_compiled(
    loop: Loop,
    carry: Carry,
    data: Data,
    keys: Keys,
    first_epoch: int,
    num_epochs: int,
) -> tuple[Carry, Float[np.ndarray, "epochs steps"]]:
    """The whole run as one program: a scan over epochs of a scan over batches.

    **Returns:**

    The final `(params, opt_state)` and the per-step losses, shape `(epochs, steps)`.
    """
    p = loop.placement
    run = p.compile(_run_epochs, "none")
    carry, losses = run(
        p.put(loop),
        p.put(carry),
        p.put(data, sharded=True),
        p.put(keys),
        p.put(jnp.asarray(first_epoch)),
        num_epochs,
    )
    carry, losses = p.get((carry, losses))
    return carry, np.asarray(losses)


# The chunked runner. A chunk is a range of full batches inside one epoch; the epoch's
# remainder step and the next epoch's order are one more call. Bounds are traced, so
# every chunk length shares one compilation. On one device the carry and the epoch's loss
# buffer are donated between calls (they are copies made by `run_chunked`, never the
# caller's); "all-except-first" keeps the data, order and keys, passed first, alive.


def _first_order(static: tuple[Loop, Keys, Int[Array, ""]]) -> UInt32[Array, " n"]:
    loop, keys, epoch = static
    return loop.order(keys, epoch)


def _chunk(
    static: tuple[Loop, Data, UInt32[Array, " n"], Keys, Int[Array, "3"]],
    carry: Carry,
    losses: Losses,
) -> tuple[Carry, Losses, Float[Array, ""]]:
    loop, data, order, keys, bounds = static
    epoch, start, stop = bounds[0], bounds[1], bounds[2]
    carry, losses = loop.run_steps(carry, losses, data, order, keys, epoch, start, stop)
    steps = jnp.arange(losses.shape[0])
    return carry, losses, jnp.sum(jnp.where((steps >= start) & (steps < stop), losses, 0.0))


def _epoch_end(
    static: tuple[Loop, Data, UInt32[Array, " n"], Keys, Int[Array, ""]],
    carry: Carry,
    losses: Losses,
) -> tuple[Carry, Losses, UInt32[Array, " n"]]:
    loop, data, order, keys, epoch = static
    carry, losses = loop.run_remainder(carry, losses, data, order, keys, epoch)
    return carry, losses, loop.order(keys, epoch + 1)


def run_chunked(
    loop: Loop,
    carry: Carry,
    data: Data,
    keys: Keys,
    num_epochs: int,
    on_chunk: Callable[[int, int, float], None],
    seconds_per_chunk: float = 0.2,
) -> tuple[Carry, Float[np.ndarray, "epochs steps"]]:
    """The same run as `run_compiled`, in chunks, calling `on_chunk(epoch, steps, loss_sum)`.

    Chunk i+1 is dispatched before chunk i's loss is read, so the host's wait for the bar
    overlaps the device's work. The chunk length adapts so that each takes about
    `seconds_per_chunk`.
    """
    plan, p = loop.plan, loop.placement
    first_order = p.compile(_first_order, "none")
    chunk = p.compile(_chunk, "all-except-first")
    epoch_end = p.compile(_epoch_end, "all-except-first")

    loop, data, keys = p.put(loop), p.put(data, sharded=True), p.put(keys)
    carry = p.put(jax.tree.map(lambda x: jnp.array(x, copy=True), carry))
    order = first_order((loop, keys, p.put(jnp.asarray(0))))
    epoch_losses = []
    pending: tuple[int, int, Any] | None = None
    size = 8  # a quick first redraw; later chunks adapt
    clock, steps_since = time.perf_counter(), 0

    def report() -> None:
        nonlocal pending, clock, steps_since, size
        if pending is None:
            return
        epoch, steps, loss_sum = pending
        on_chunk(epoch, steps, float(p.get(loss_sum)))  # waits for that chunk only
        pending = None
        now = time.perf_counter()
        seconds_per_step = (now - clock) / max(steps_since, 1)
        clock, steps_since = now, 0
        size = max(1, int(seconds_per_chunk / max(seconds_per_step, 1e-7)))

    for epoch in range(num_epochs):
        losses = p.put(jnp.zeros(plan.steps_per_epoch))
        for start, stop in _ranges(plan.num_full, lambda: size):
            bounds = p.put(jnp.asarray([epoch, start, stop]))
            carry, losses, loss_sum = chunk((loop, data, order, keys, bounds), carry, losses)
            steps_since += stop - start
            report()
            pending = (epoch, stop - start, loss_sum)
        carry, losses, order = epoch_end(
            (loop, data, order, keys, p.put(jnp.asarray(epoch))), carry, losses
        )
        epoch_losses.append(losses)
        if plan.remainder:
            steps_since += 1
            report()
            pending = (epoch, 1, losses[..., plan.num_full])
    report()
    history = np.zeros((num_epochs, plan.steps_per_epoch), np.float32)
    for epoch, losses in enumerate(epoch_losses):
        history[epoch] = np.asarray(p.get(losses))
    return p.get(carry), history


def _ranges(total: int, size: Callable[[], int]) -> Iterator[tuple[int, int]]:
    start = 0
    while start < total:
        stop = min(total, start + size())
        yield start, stop
        start = stop
