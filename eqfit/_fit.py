"""The public `fit`: check the inputs, partition, pick the loop, combine, return the result."""

import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from beartype import beartype
from jax.sharding import Mesh
from jaxtyping import Array, jaxtyped, Key, PyTree, Shaped, UInt32

from ._data import as_data, as_key, plan_batches
from ._history import History, make_history
from ._loop import Loop, run_chunked, run_compiled
from ._parallel import choose_placement, Device, Pmap
from ._step import Step, takes_key


ArrayData = tuple[Shaped[Array | np.ndarray, "n ..."], ...]


class FitResult(eqx.Module):
    """What `fit` returns.

    **Attributes:**

    - `model`: the trained model, of the same type as the one passed in.
    - `opt_state`: the optimizer state, to continue training with `fit(..., opt_state=)`.
    - `history`: a [`eqfit.History`][] of per-epoch and per-step losses.
    """

    model: PyTree
    opt_state: PyTree
    history: History


@jaxtyped(typechecker=beartype)
def fit(
    model: PyTree,
    data: ArrayData,
    *,
    loss: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    key: Key[Array, ""] | UInt32[Array, "2"],
    epochs: int = 1,
    batch_size: int = 32,
    shuffle: bool = True,
    drop_remainder: bool = False,
    progress: bool = False,
    filter_spec: PyTree = eqx.is_inexact_array,
    opt_state: PyTree | None = None,
    devices: int | Sequence[Device] | None = None,
    mesh: Mesh | None = None,
) -> FitResult:
    """Trains `model` on `data` by minibatch gradient descent, compiled end to end.

    **Arguments:**

    - `model`: any PyTree of arrays, usually an `eqx.Module`. It is not changed.
    - `data`: a tuple of numpy or JAX arrays sharing their leading (sample) axis. It is
        moved to the device once; each epoch then permutes indices, not data.
    - `loss`: called as `loss(model, *batch)`, returning a scalar. If it takes a keyword
        `key`, it gets a fresh key every step (for dropout and the like).
    - `optimizer`: any optax `GradientTransformation`. Transformations that read the loss
        (`optax.contrib.reduce_on_plateau`) receive it as `value`.
    - `key`: a PRNG key. It drives the shuffle and the per-step keys.
    - `epochs`: passes over the data.
    - `batch_size`: samples per step.
    - `shuffle`: visit the samples in a new random order each epoch.
    - `drop_remainder`: skip the last, smaller batch of each epoch instead of taking it
        as one more step.
    - `progress`: `False` runs the whole training as one XLA program. `True` shows a
        tqdm bar and runs the same compiled steps in chunks; the result is the same.
    - `filter_spec`: which leaves of `model` train, as in `eqx.partition`. Leaves that
        are not floating-point arrays never train.
    - `opt_state`: an optimizer state to continue from, such as a previous result's.
    - `devices`: data parallel over these local devices (or the first `devices` of them)
        with `eqx.filter_pmap`. Each batch is split evenly over them, so `batch_size`
        must be a multiple of their number.
    - `mesh`: data parallel through sharding over the first axis of this
        `jax.sharding.Mesh`, which may span several processes (`jax.distributed`); then
        each process passes its own rows of `data`.

    **Returns:**

    A [`eqfit.FitResult`][] with the trained `model`, the `opt_state` and the `history`.

    !!! warning "What triggers a compilation"

        The run is compiled once per model structure, `loss` object, `optimizer` object,
        data shapes and `(epochs, batch_size, shuffle, drop_remainder)`. A new
        `optax.adam(...)` is a new object, so keep one optimizer to reuse the program.
    """
    data_ = as_data(data)
    key_ = as_key(key)
    if isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"`epochs` must be 0 or more, got {epochs}.")
    placement = choose_placement(devices, mesh, batch_size)
    num_samples = data_[0].shape[0]
    if mesh is not None and jax.process_count() > 1:
        num_samples *= jax.process_count()  # each process passed its own rows
    plan = plan_batches(num_samples, batch_size, drop_remainder)

    # Only floating-point arrays chosen by `filter_spec` train; everything else,
    # frozen arrays included, is closed over by the step.
    params, static = eqx.partition(model, filter_spec)
    params, frozen = eqx.partition(params, eqx.is_inexact_array)
    static = eqx.combine(frozen, static)
    if opt_state is None:
        opt_state = optimizer.init(params)

    axis_name = placement.axis_name if isinstance(placement, Pmap) else None
    step = Step(static, loss, optimizer, takes_key(loss), axis_name)
    loop = Loop(step, plan, shuffle, placement)
    keys = jax.random.split(key_)
    start = time.perf_counter()
    if progress:
        carry, step_loss = _run_with_bar(loop, (params, opt_state), data_, keys, epochs)
    else:
        carry, step_loss = run_compiled(loop, (params, opt_state), data_, keys, 0, epochs)
    history = make_history(step_loss, plan, time.perf_counter() - start)
    params, opt_state = carry
    return FitResult(eqx.combine(params, static), opt_state, history)


def _run_with_bar(
    loop: Loop, carry: Any, data: Any, keys: Any, epochs: int
) -> tuple[Any, np.ndarray]:
    from tqdm.auto import tqdm

    steps = loop.plan.steps_per_epoch
    totals = {"epoch": -1, "loss": 0.0, "steps": 0}
    with tqdm(total=epochs * steps, unit="step", dynamic_ncols=True) as bar:

        def on_chunk(epoch: int, n: int, loss_sum: float) -> None:
            if epoch != totals["epoch"]:
                totals.update(epoch=epoch, loss=0.0, steps=0)
                bar.set_description(f"epoch {epoch + 1}/{epochs}", refresh=False)
            totals["loss"] += loss_sum
            totals["steps"] += n
            bar.set_postfix(loss=f"{totals['loss'] / totals['steps']:.4g}", refresh=False)
            bar.update(n)

        return run_chunked(loop, carry, data, keys, epochs, on_chunk)
