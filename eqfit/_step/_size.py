"""How large a step is: the FLOPs of a jaxpr's matrix products and convolutions, read off
its equations (nothing is lowered or compiled). A cheap measure of a loss's forward
pass, for choices that depend on a step's size (`_program/_parallel.py`'s XLA:CPU
scheduler); `eqfit.plan` counts a step's FLOPs in full with XLA (`_host/_flops.py`).
"""

import math
from typing import Any

import jax.extend as jex


def product_flops(jaxpr: Any) -> float:
    """The FLOPs of the matrix products (`dot_general`) and convolutions
    (`conv_general_dilated`) that `jaxpr` computes: a `scan`'s body counted as many
    times as it runs, a `while_loop`'s once, a `cond`'s costliest branch.
    """
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot(eqn)
        elif name == "conv_general_dilated":
            total += _conv(eqn)
        elif name == "scan":
            total += eqn.params["length"] * product_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(product_flops(b.jaxpr) for b in eqn.params["branches"])
        else:
            total += sum(product_flops(inner) for inner in jex.core.jaxprs_in_params(eqn.params))
    return total


def _dot(eqn: Any) -> float:
    """Two FLOPs per multiply-add: each output entry sums over the contracted axes."""
    (contracting, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contracted = math.prod(lhs[i] for i in contracting)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _conv(eqn: Any) -> float:
    """Two FLOPs per multiply-add: each output entry sums over a kernel's window and its
    group's input features.
    """
    kernel = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, window...)
    window = math.prod(kernel[i] for i in spec[1:])  # in features (of a group) and window
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * window
