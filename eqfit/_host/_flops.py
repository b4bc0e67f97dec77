"""The FLOPs of a program as it runs: XLA's cost analysis, with each loop's body counted
as many times as the loop runs.

XLA counts a loop's body once, whatever its trip count (`cost_analysis()`), so a model
that scans a layer over time or over its depth (a GRU, a scanned transformer, a sampler,
an RL rollout) would read as one iteration's cost. Here the program's jaxpr is walked:
each `scan` (and `fori_loop` with static bounds, which JAX writes as a scan) adds its
body's cost, lowered alone, times its length less the once XLA counted, nested loops
included; a `while_loop`, whose trip count is not known when compiling, keeps its body
counted once, and the figure is then a lower bound, said so.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend as jex


class Flops(NamedTuple):
    """A program's FLOPs, and whether they are exact."""

    flops: float
    # Why the figure is a lower bound (a loop of unknown trip count), in words; `None`
    # where every loop's count was known.
    lower_bound: str | None = None


def program_flops(fn: Callable[..., Any], *args: Any) -> Flops:
    """The FLOPs of `fn(*args)` (`args` abstract arrays, or arrays) lowered alone (not
    compiled), each loop's body counted as many times as the loop runs.
    """
    traced, lowered = _lowered(fn, args)
    flops = _xla_flops(lowered)
    extra, unknown = _loops(traced.jaxpr.jaxpr)
    why = None
    if unknown:
        why = (
            f"{unknown} `while_loop`{'s' if unknown > 1 else ''} whose trip count is not "
            "known when compiling, each body counted once"
        )
    return Flops(flops + extra, why)


def _on_cpu(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args`' abstract arrays placed on the CPU, so that their program is lowered for
    the CPU's backend, whose cost analysis needs no compile: a TPU's (a PJRT plugin's)
    has none before compiling, and a count made by compiling the step once more costs a
    first `fit` on the chip what its own compile does. Done on the CPU too, so that its
    tests take the chip's path. As they are where JAX has no CPU.
    """
    try:
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    except RuntimeError:
        return args

    def place(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu)
        return x

    return jax.tree.map(place, args)


def _lowered(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """`fn(*args)` traced and lowered for the CPU whatever the devices, its arrays placed
    there (`_on_cpu`): the same count on every platform, with nothing compiled. Where
    that fails (a step that lays its arrays out over the devices' mesh), lowered for the
    CPU as placed; a program the CPU cannot lower (a kernel of the device's own, such as
    Pallas's) for its device.
    """
    placed = _on_cpu(args)
    if placed is not args:  # as placed, with nothing compiled
        traced = jax.jit(fn).trace(*placed)
        try:
            return traced, traced.lower(lowering_platforms=("cpu",))
        except Exception:
            pass
    traced = jax.jit(fn).trace(*args)
    try:
        return traced, traced.lower(lowering_platforms=("cpu",))
    except Exception:
        return traced, traced.lower()


def _xla_flops(lowered: Any) -> float:
    """XLA's FLOPs of a lowered program, as its cost analysis counts them before
    optimising it; compiled where that is what gives a count (a device's own lowering).
    """
    costs = lowered.cost_analysis()
    if not costs or "flops" not in costs:
        costs = lowered.compile().cost_analysis()
    if isinstance(costs, list | tuple):  # one per device program, in older JAXs
        costs = costs[0] if costs else None
    return float(costs.get("flops", 0.0)) if costs else 0.0


def _body_flops(body: Any) -> float:
    """XLA's FLOPs of a loop's body (a closed jaxpr), lowered alone."""
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in body.in_avals)
    return _xla_flops(_lowered(jex.core.jaxpr_as_fun(body), avals)[1])


def _loops(jaxpr: Any) -> tuple[float, int]:
    """The FLOPs that XLA's count of `jaxpr` misses, its loops' bodies counted once, and
    the number of loops whose trip count is unknown.
    """
    extra, unknown = 0.0, 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            body, length = eqn.params["jaxpr"], eqn.params["length"]
            inner, inner_unknown = _loops(body.jaxpr)
            once = _body_flops(body) if length != 1 else 0.0
            # XLA counted the body once; it runs `length` times, inner loops in full.
            extra += (length - 1) * once + length * inner
            unknown += inner_unknown
            continue
        if name == "while":
            inner, inner_unknown = _loops(eqn.params["body_jaxpr"].jaxpr)
            extra += inner
            unknown += 1 + inner_unknown
            continue
        for sub in jex.core.jaxprs_in_params(eqn.params):
            inner, inner_unknown = _loops(sub)
            extra += inner
            unknown += inner_unknown
    return extra, unknown
