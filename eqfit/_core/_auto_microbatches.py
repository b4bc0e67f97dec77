"""`microbatches="auto"`: the fewest microbatches with which the step fits the device's
memory, as the compiled programs' memory analysis (the plan's) says. An option that owns
its check and its choice; the host hands it the memory of a count's compiled run.
"""

import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx


class Needs(NamedTuple):
    """What a run compiled with a count of microbatches holds on one device at once: in
    all (`Memory.total`), and of it the working memory that microbatches shrink.
    """

    total: int
    temporary: int


class AutoMicrobatches(eqx.Module):
    """Choose the number of microbatches (`fit(..., microbatches=)`) from the memory the
    run's compiled program needs: the fewest, among the counts that divide each device's
    share of the batch, with which the plan's memory per device (`eqfit.Memory.total`)
    is at most `(1 - margin)` of the device's. `microbatches="auto"` is
    `AutoMicrobatches()`.

    A count is only compiled where it might fit: the working memory (XLA's temporaries)
    shrinks at best as `1 / count`, so counts that would not fit even then are skipped.
    The count is `history.microbatches`, and why `eqfit.plan(...).microbatches_why` (and
    the bar's summary); none that fits is a `ValueError` saying what each count needs.

    **Arguments:**

    - `memory`: the bytes one device may use. `None` (the default): what the device says
        it can hold (`jax.Device.memory_stats()["bytes_limit"]`, on GPUs and TPUs), or
        on the CPU, which says nothing, the machine's physical memory.
    - `margin`: the share of `memory` kept free, `0 <= margin < 1`; by default 0.1. XLA's
        analysis counts the program's own buffers; the device also holds what is outside
        them (the program that makes the training state, arrays the caller keeps, the
        allocator's fragmentation), which the margin leaves room for.
    """

    memory: int | None = None
    margin: float = 0.1

    def __check_init__(self) -> None:
        memory = self.memory
        if memory is not None and (
            isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0
        ):
            raise ValueError(
                f"`AutoMicrobatches(memory=)` must be a number of bytes above 0, or None for "
                f"the device's own, got {memory!r}."
            )
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(
                f"`AutoMicrobatches(margin=)` must be a share of the memory in [0, 1), got "
                f"{margin!r}."
            )

    def budget(self, device_limit: int | None) -> tuple[int, str]:
        """The bytes a device's run may need, and whose memory that is, in words."""
        if self.memory is not None:
            memory, whose = self.memory, "`AutoMicrobatches(memory=)`"
        elif device_limit is not None:
            memory, whose = device_limit, "the device's"
        else:
            memory, whose = _physical_memory(), "the machine's: a CPU device says none"
        return math.floor(memory * (1 - self.margin)), f"{_gib(memory)}, {whose}"

    def choose(
        self, rows: int, needs: Callable[[int], Needs | None], device_limit: int | None
    ) -> tuple[int, str]:
        """The fewest microbatches that fit, and why, in words.

        **Arguments:**

        - `rows`: the rows of a batch each device computes; a count divides it.
        - `needs`: what the run compiled with a count needs (it compiles it); `None`
            where the compilation itself ran out of the device's memory (XLA on a TPU
            refuses a program whose temporaries exceed it).
        - `device_limit`: the bytes the device says it holds, if it says.

        **Returns:**

        The count, and a sentence saying why.

        **Raises:**

        `ValueError` where no count fits, saying what the counts tried need.
        """
        budget, whose = self.budget(device_limit)
        room = f"{_gib(budget)} ({1 - self.margin:.0%} of {whose})"
        tried: dict[int, Needs | None] = {}
        known, known_count = None, 1  # the last count that compiled, and what it needs
        for count in [k for k in range(1, rows + 1) if rows % k == 0]:
            if known is not None:
                fixed = known.total - known.temporary
                if fixed + known.temporary * known_count / count > budget:
                    continue  # would not fit even were the temporaries to shrink in full
            tried[count] = need = needs(count)
            if need is None:  # its compilation ran out of the device's memory
                continue
            if need.total <= budget:
                if count == 1:
                    return 1, f"1: the whole batch needs {_gib(need.total)} of {room}"
                return count, (
                    f"{count}: the fewest that fit {room}: {_tried(tried)}{_skipped(tried, rows)}"
                )
            known, known_count = need, count
        raise ValueError(
            f'`microbatches="auto"`: no number of microbatches fits the step in {room}: '
            f"{_tried(tried)}, the counts that divide the batch's {rows} rows per device "
            "and were not tried too big even were their temporaries to shrink in full. "
            'Give a smaller `batch_size`, a precision policy (`precision="bfloat16"`), '
            "`remat=`, or more devices."
        )


def as_microbatches(value: Any) -> tuple[Any, AutoMicrobatches | None]:
    """`fit`'s `microbatches`: a count to check as it is (`StepOptions`), or `"auto"` /
    an `AutoMicrobatches`, which starts from 1 and is chosen once the run is built (`fit`'s
    signature refuses any other string).
    """
    if isinstance(value, AutoMicrobatches):
        return 1, value
    if isinstance(value, str):
        return 1, AutoMicrobatches()
    return value, None


def _tried(tried: dict[int, Needs | None]) -> str:
    over = "more than the device has (XLA would not compile it)"
    return "memory per device by count: " + ", ".join(
        f"{k}: {over if n is None else _gib(n.total)}" for k, n in tried.items()
    )


def _skipped(tried: dict[int, Needs | None], rows: int) -> str:
    below = [k for k in range(2, max(tried)) if rows % k == 0 and k not in tried]
    if not below:
        return ""
    return f" ({', '.join(map(str, below))} skipped: too big even were the temporaries to shrink)"


def _gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
