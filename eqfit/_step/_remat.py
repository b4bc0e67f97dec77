"""Activation checkpointing (`remat=`): the loss's forward pass under one of JAX's
`jax.checkpoint` policies, which says what the forward pass keeps for the backward pass;
the rest is computed again there.

`as_remat` checks and resolves the option, `checkpointed` applies it: the only places
that know what its values mean.
"""

from collections.abc import Callable
from typing import Any, cast, Literal, TypeVar

import equinox as eqx
import jax


_F = TypeVar("_F", bound=Callable[..., Any])

# By name, JAX's policies (`jax.checkpoint_policies`): what the forward pass keeps.
POLICIES: dict[str, Callable[..., Any]] = {
    "nothing": jax.checkpoint_policies.nothing_saveable,  # everything computed again
    "dots": jax.checkpoint_policies.dots_saveable,  # the matrix products' results
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

RematLike = Literal["nothing", "dots", "dots_no_batch"] | Callable[..., Any] | None
# What `remat=` takes, in words (`fit`'s check of its annotation says it too).
REMAT_VALUES = (
    f"None, {', '.join(map(repr, POLICIES))} or a policy function as "
    "`jax.checkpoint(policy=)` takes"
)


class Remat(eqx.Module):
    """A checked `remat=`: a `jax.checkpoint` policy, and its name (for the callbacks'
    configuration). Hashable: the run's static description holds it.
    """

    name: str = eqx.field(static=True)
    policy: Callable[..., Any] = eqx.field(static=True)


def as_remat(remat: Any, name: str = "`remat`") -> Remat | None:
    """`remat` as a policy: `None`, one of `POLICIES`' names, or a policy function as
    `jax.checkpoint(policy=)` takes one; anything else refused, naming it as `name`.
    """
    if remat is None:
        return None
    allowed = f"{REMAT_VALUES} (such as `jax.checkpoint_policies.save_only_these_names('x')`)"
    if isinstance(remat, str):
        if remat not in POLICIES:
            raise ValueError(f"{name} must be {allowed}, got {remat!r}.")
        return Remat(remat, POLICIES[remat])
    if not callable(remat):
        raise TypeError(f"{name} must be {allowed}, got {remat!r}.")
    for policy_name, policy in POLICIES.items():
        if policy is remat:  # one of JAX's policies by its object: the same run
            return Remat(policy_name, policy)
    return Remat(getattr(remat, "__name__", type(remat).__name__), remat)


def checkpointed(fn: _F, remat: Remat | None) -> _F:
    """`fn` under `remat`'s policy (`eqx.filter_checkpoint`, which passes its arguments
    and results that are no arrays through as they are); `fn` itself without one.
    """
    if remat is None:
        return fn
    return cast(_F, eqx.filter_checkpoint(fn, policy=remat.policy))


def chosen(own: Any, run: Remat | None, recompute: bool = True) -> Remat | None:
    """The policy an `eqfit.Update`'s forward pass runs under: its `own`
    (`eqfit.Update(remat=)`), else the `run`'s (`fit(remat=)`); none where the step is
    traced only to count its FLOPs (`recompute` false), which are the model's, without
    what checkpointing computes again.
    """
    if not recompute:
        return None
    policy = as_remat(own)
    return run if policy is None else policy
