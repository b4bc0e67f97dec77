"""The runtime check of public signatures, with messages that name the argument.

`checked(fn)` is `jaxtyping.jaxtyped(typechecker=beartype)(fn)` whose failures are cut to
what a caller needs: the function, the argument, what it must be and what it was, and a
hint where eqfit has one. jaxtyping's own message also lists every argument and the whole
signature (thousands of characters for `fit`); that is left out.

The check's cost and its off switch are written down in the docs' guide to types and
runtime checks: jaxtyping's own switch (`JAXTYPING_DISABLE=1` in the environment, or
`jaxtyping.config.update("jaxtyping_disable", True)`) turns it off, leaving eqfit's own
checks of values, which name the argument too.
"""

import ast
import contextlib
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, cast, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import jaxtyped, TypeCheckError


_F = TypeVar("_F", bound=Callable[..., Any])

_PARAMETER = re.compile(r"The problem arose whilst typechecking parameter '(\w+)'")
_WHERE = re.compile(r"whilst checking the parameters of ([\w.<>]+)")
_DETAIL_LINES = ("Actual value:", "Expected type:", "The current values for each dimension")
_MAX_DETAIL = 240


def checked(name: str, hints: dict[str, str] | None = None) -> Callable[[_F], _F]:
    """Checks each call of the decorated function against its annotations.

    **Arguments:**

    - `name`: how messages name the function, as a user calls it (`"fit"`, `"MLP"`).
    - `hints`: for some arguments, what they must be, in words; it leads the message.

    **Returns:**

    A decorator.
    """

    def decorate(fn: _F) -> _F:
        inner = jaxtyped(typechecker=beartype)(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except TypeCheckError as e:
                short = _shorten(e, fn, name, hints or {})
                if short is None:
                    raise
                raise short from None

        shown = _as_written(fn)
        if shown is not None:
            cast(Any, call).__signature__ = shown
        return call  # pyright: ignore[reportReturnType]

    return decorate


_P = ParamSpec("_P")
_R = TypeVar("_R")


def takes_arguments_of(
    fn: Callable[_P, Any], returns: type[_R]
) -> Callable[[Callable[..., _R]], Callable[_P, _R]]:
    """Gives the decorated function `fn`'s signature (for type checkers and the docs),
    returning `returns`: `eqfit.plan` takes `fit`'s arguments.
    """

    def decorate(other: Callable[..., _R]) -> Callable[_P, _R]:
        cast(Any, other).__signature__ = inspect.signature(fn).replace(return_annotation=returns)
        return cast(Any, other)

    return decorate


def _shorten(
    error: TypeCheckError, fn: Callable[..., Any], name: str, hints: dict[str, str]
) -> TypeCheckError | None:
    """A short error for a failed argument, or `None` for any other failure (one raised
    from inside the function's body, or of its return value), which keeps its own message.
    """
    message = str(error)
    found = _PARAMETER.search(message)
    if found is None or _raised_inside(error, fn):
        return None
    argument = found.group(1)
    details = _details(message)
    lead = f"`{name}`'s argument `{argument}`"
    if argument in hints:
        lead += f" must be {hints[argument]}"
    else:
        lead += " has the wrong type or shape"
    return TypeCheckError("\n".join([lead + ".", *details]))


def _raised_inside(error: BaseException, fn: Callable[..., Any]) -> bool:
    # The body's own code: under jaxtyping's import hook (`pytest --jaxtyping-packages`),
    # `fn` is already wrapped in a check of its own.
    code = getattr(inspect.unwrap(fn), "__code__", None)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def as_int(value: Any) -> Any:
    """`value` as a Python int where it is a numpy integer scalar (`np.int64(2)`, as
    arithmetic on numpy arrays gives); anything else as it is, for its own check.
    """
    if isinstance(value, np.integer) and not isinstance(value, np.bool_):
        return int(value)
    return value


def check_whole(name: str, value: Any, least: int) -> None:
    """Refuses an argument `name` whose `value` is not an integer of `least` or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"`{name}` must be an integer of {least} or more, got {value!r}.")


MAX_STEPS = 2**31 - 1  # the most steps a run counts, in int32


def as_steps(name: str, value: Any, does: str) -> int | None:
    """The argument `name`'s `value` checked: `None`, or a whole number of steps, 1 or
    more (`does`: what happens every n-th step, for the message).
    """
    if value is None:
        return None
    every = as_int(value)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"`{name}` must be a whole number of steps, 1 or more ({does} every n-th step), "
            f"or None; got {value!r}."
        )
    if every > MAX_STEPS:
        raise ValueError(
            f"`{name}` must be a number of steps at most {MAX_STEPS} (a run counts its steps "
            f"in int32), got {value!r}."
        )
    return every


def real_dtype(value: Any) -> Any | None:
    """The dtype of `value` where it is a real number or an array of them (floating,
    integer or bool: a Python or numpy number, a numpy or JAX array); else `None` (a
    string, `None`, a complex number, a container).
    """
    dtype = getattr(value, "dtype", None)
    if dtype is None and isinstance(value, bool | int | float | np.number):
        dtype = np.result_type(value)
    if dtype is None:
        return None
    real = (jnp.floating, jnp.integer, jnp.bool_)
    return dtype if any(jnp.issubdtype(dtype, kind) for kind in real) else None


def as_real(value: Any) -> float | None:
    """`value` as a Python float if it is a real number: a Python int or float, or a
    numpy or JAX scalar (a 0-d array) of an integer or floating dtype; else `None` (a
    bool, a complex number, an array of more than one element, anything else).
    """
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | float | np.integer | np.floating):
        return float(value)
    if isinstance(value, jax.Array | np.ndarray) and value.shape == ():
        if jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating):
            return float(value)  # a tracer (inside `jit`) raises here, naming itself
    return None


def _clip(line: str) -> str:
    return line if len(line) <= _MAX_DETAIL else line[: _MAX_DETAIL - 3] + "..."


@contextlib.contextmanager
def reported_as(name: str, argument: str) -> Iterator[None]:
    """Reports a runtime type check that fails while `name` runs the model on batches of
    its `argument` (an int32 `x` for a model that takes floats, say) as that argument's
    fault, with where it failed, rather than as a failure deep inside the model.
    """
    try:
        yield
    except TypeCheckError as e:
        message = str(e)
        found, where = _PARAMETER.search(message), _WHERE.search(message)
        if found is None or where is None:
            raise
        short = TypeCheckError(
            "\n".join(
                [
                    f"`{name}`'s argument `{argument}` does not suit the model or the loss: "
                    f"a batch of it failed the check of `{where.group(1).rstrip('.')}`'s parameter "
                    f"`{found.group(1)}`.",
                    *_details(message),
                ]
            )
        )
        # Notes added on the way out (which call of the loss failed, and on what) still
        # apply to the shorter error.
        for note in getattr(e, "__notes__", ()):
            short.add_note(note)
        raise short from None


def _details(message: str) -> list[str]:
    """The lines of jaxtyping's message that say what was expected and what came."""
    lines = message.split("----------------------")[0].splitlines()
    return [_readable(line.strip()) for line in lines if line.strip().startswith(_DETAIL_LINES)]


def _readable(line: str) -> str:
    line = re.sub(r"<class '(.*)'>", r"\1", line)
    for long, short in (
        ("jaxlib._jax.Array", "Array"),
        ("jaxtyping.", ""),
        ("collections.abc.", ""),
        ("typing.", ""),
    ):
        line = line.replace(long, short)
    return _clip(line)


class _Written:
    """Shows as the source text it holds: an annotation or default as it was written."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _as_written(fn: Callable[..., Any]) -> inspect.Signature | None:
    """`fn`'s signature with annotations and defaults as the source writes them, for
    `help()`: `opt_state: OptState | None = None` rather than the objects' long reprs.
    """
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef):
        return None
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults = dict(zip([a.arg for a in positional][::-1], args.defaults[::-1]))
    defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
    annotations = {
        a.arg: a.annotation
        for a in [*positional, *args.kwonlyargs, args.vararg, args.kwarg]
        if a is not None and a.annotation is not None
    }
    signature = inspect.signature(fn)
    parameters = []
    for p in signature.parameters.values():
        if p.name in annotations:
            p = p.replace(annotation=_Written(ast.unparse(annotations[p.name])))
        if p.name in defaults:
            p = p.replace(default=_Written(ast.unparse(defaults[p.name])))
        parameters.append(p)
    returns = _Written(ast.unparse(node.returns)) if node.returns else signature.empty
    return signature.replace(parameters=parameters, return_annotation=returns)
