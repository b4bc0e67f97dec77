"""`eqfit.plan`: the run's programs compiled as `fit` compiles them, and what they will
need (memory per device, and what its arguments hold; FLOPs per step and per validation
pass; the model's arrays and their layout), before anything trains.

The plan lowers and compiles exactly the programs that `fit` then calls (from eqfit's
cache of programs), so a `fit` with the same arguments compiles nothing more. Memory
comes from XLA's `memory_analysis()` of the compiled run, per device, and its arguments
are told apart by what they are in the run's inputs (`TrainState`'s and `Inputs`'
fields), each counted as the compiled program lays it out. FLOPs come from the
`cost_analysis()` of one step, and of one validation pass, each lowered on its own, since
XLA counts a loop's body once whatever its trip count.
"""

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec

from .._core._execution import Execution
from .._step._precision import Precision


class Memory(NamedTuple):
    """Bytes one device holds while a compiled program runs, as XLA's
    `memory_analysis()` reports them.

    **Attributes:**

    - `argument`: the program's inputs (the training state, the data, the keys);
        [`eqfit.ArgumentBytes`][] (`Plan.arguments`) splits them by what they are.
    - `output`: its outputs (the next training state and the report; `PerStep`'s
        program's, the state and the step it reached, its report made apart).
    - `alias`: outputs written in the place of donated inputs, counted in both above.
    - `temporary`: the working memory of the program (activations, gradients, ...).
    - `code`: the compiled code, where the device reports it.
    """

    argument: int
    output: int
    alias: int
    temporary: int
    code: int = 0

    @property
    def total(self) -> int:
        """All of it at once: arguments, outputs less the aliased, temporaries, code."""
        return self.argument + self.output - self.alias + self.temporary + self.code


class ArgumentBytes(NamedTuple):
    """The bytes one device holds of the run's arguments (`Memory.argument`), by what
    they are. They sum to `Memory.argument`: `plan.arguments.total ==
    plan.memory.argument`.

    **Attributes:**

    - `parameters`: the trained arrays (the master copy, in `Precision.params` under a
        precision policy).
    - `frozen`: the model's arrays that do not train (`filter_spec`).
    - `optimizer_state`: the optimizer's state.
    - `average`: the moving average of the trained arrays (`ema=`); 0 without it.
    - `model_state`: the model's `eqx.nn.State` (`state=`); 0 without it.
    - `best`: early stopping's copy of the best epoch's trained arrays and model state
        (`EarlyStopping(restore_best=True)`); 0 without it.
    - `data`: the training data on the device: its rows (all of them, or each device's
        share under `mesh=`), or for a loader or memmap the chunk of batches and its order.
    - `validation_data`: the validation sets; 0 without them.
    - `other`: the rest: the run's record of its steps and epochs, its counters, keys and
        loss scale, the arrays the loss, metrics and optimizer hold, and anything else
        XLA counts among the arguments.
    """

    parameters: int
    frozen: int
    optimizer_state: int
    average: int
    model_state: int
    best: int
    data: int
    validation_data: int
    other: int

    @property
    def total(self) -> int:
        """All of them: `Memory.argument`."""
        return sum(self)


# How `print(plan)` names each part of the arguments.
ARGUMENT_NAMES = {
    "parameters": "parameters",
    "frozen": "frozen",
    "optimizer_state": "optimizer state",
    "average": "average",
    "model_state": "model state",
    "best": "best epoch's copy",
    "data": "data",
    "validation_data": "validation data",
    "other": "other",
}


class ArrayPlan(NamedTuple):
    """One array of the model, as the run lays it out.

    **Attributes:**

    - `path`: where it is in the model, as `jax.tree_util.keystr` writes it.
    - `shape`, `dtype`: as the model holds it.
    - `spec`: its `PartitionSpec` over the mesh under `shard=`; `None`: replicated.
    - `bytes`: what the fullest device holds of it.
    - `trains`: whether it is trained (else frozen by `filter_spec`).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec | None
    bytes: int
    trains: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run will need, from its compiled programs: `eqfit.plan`'s result.
    `print(plan)` shows it as a table.

    **Attributes:**

    - `memory`: a [`eqfit.Memory`][] of the run's program, per device (every device runs
        the same program).
    - `arguments`: an [`eqfit.ArgumentBytes`][]: what `memory.argument` holds, by part
        (parameters, optimizer state, the average, model state, data, validation data).
    - `start_memory`: the same of the program that makes the training state, run once
        before the first step.
    - `flops_per_step`: the floating-point operations of one optimizer step over a whole
        batch (every device's share together), forward, backward and update; each loop
        inside it (`lax.scan`, `fori_loop` with static bounds: a recurrent layer, layers
        scanned over depth) counted as many times as it runs, where XLA's own count
        (`cost_analysis()`) counts a loop's body once.
    - `validation_flops`: those of one validation pass: the loss, aux values and metrics
        over every validation set (every device's share together); 0 without
        validation.
    - `steps`: the optimizer steps this run takes (from its first epoch to `epochs`);
        `None` for a loader without `len`, whose epochs are as long as its first pass.
    - `validations`: the validation passes this run makes (the epochs `validation_freq`
        validates, or the steps `validation_every` does); 0 without validation.
    - `arrays`: a tuple of [`eqfit.ArrayPlan`][], one for each array of the model.
        `print(plan)` folds the arrays of repeated blocks into one row; this keeps one
        for each.
    - `devices`: how many devices train.
    - `device_kind`: what they are (`jax.Device.device_kind`).
    - `precision`: the run's precision policy (an [`eqfit.Precision`][],
        `fit(..., precision=)`); `None`: the model's own dtypes.
    - `memory_limit`: the bytes each device can hold, where it says
        (`jax.Device.memory_stats()`, on GPUs and TPUs); else `None`.
    - `peak_flops`: each device's peak FLOP/s at the run's compute dtype, from eqfit's
        table of common GPUs and TPUs or `fit(..., peak_flops=)`; else `None`.
    - `execution`: how the steps run (`fit(..., execution=)`): an [`eqfit.WholeRun`][]
        or an [`eqfit.PerStep`][], as asked or as `fit` chooses by default.
    - `execution_why`: why, in words.
    - `flops_lower_bound`: why `flops_per_step` (or `validation_flops`) is a lower
        bound, in words: a `lax.while_loop` whose trip count is not known when compiling,
        its body counted once, or a streamed validation loader that does not say its
        length; `None` where every count is known.
    - `bucket_shapes`: for a loader in buckets that says its shapes ([`eqfit.Buckets`][]),
        each bucket's, a sample's shape of each array: each trains with a program of its
        own, compiled when first met; `memory` and the FLOPs are those of the first
        batch's shape. `None` for data of one shape.
    - `validation_streamed`: the validation sets stream (memmaps, loaders): read from
        the host a chunk at a time at each validation, so no device holds them, and
        `memory` leaves them out.
    - `microbatches`: the number of microbatches each batch is computed in
        (`fit(..., microbatches=)`).
    - `microbatches_why`: with `microbatches="auto"`, why that number, in words: the
        memory each count tried needs, against the device's; else `None`.
    - `compiled`: the run's compiled program (`jax.stages.Compiled`, or
        Equinox's for `devices=`): `plan.compiled.as_text()` shows its HLO. With
        `PerStep`, the program of full batches' steps that `fit` calls again and again
        (`memory` is its).
    """

    memory: Memory
    arguments: ArgumentBytes
    start_memory: Memory
    flops_per_step: float
    validation_flops: float
    steps: int | None
    validations: int
    arrays: tuple[ArrayPlan, ...]
    devices: int
    device_kind: str
    precision: Precision | None
    memory_limit: int | None
    peak_flops: float | None
    execution: Execution
    execution_why: str
    compiled: Any = dataclasses.field(repr=False, compare=False)
    flops_lower_bound: str | None = None
    validation_streamed: bool = False
    bucket_shapes: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    microbatches: int = 1
    microbatches_why: str | None = None

    @property
    def flops(self) -> float | None:
        """The whole run's FLOPs: the step's times the steps, plus a validation pass's
        times the passes (`None` if the steps are not known).
        """
        if self.steps is None:
            return None
        return self.flops_per_step * self.steps + self.validation_flops * self.validations

    @property
    def parameters(self) -> int:
        """The number of trained values (elements of the trained arrays)."""
        return sum(int(np.prod(a.shape)) for a in self.arrays if a.trains)

    @property
    def split(self) -> int:
        """How many of the model's arrays are split over devices (`shard=`)."""
        return sum(1 for a in self.arrays if _splits(a.spec))

    @property
    def sharded(self) -> bool:
        """Whether the run lays its arrays out by `shard=`."""
        return any(a.spec is not None for a in self.arrays)

    @property
    def fits(self) -> bool | None:
        """Whether the run's program fits in a device's memory; `None` where the device
        does not say how much it has.
        """
        if self.memory_limit is None:
            return None
        return self.memory.total <= self.memory_limit

    @property
    def _microbatches(self) -> str:
        """The microbatches in words, and why with `"auto"`; empty for one asked for."""
        if self.microbatches_why is not None:
            return self.microbatches_why
        return f"{self.microbatches} a batch" if self.microbatches > 1 else ""

    def summary(self) -> str:
        """One line: parameters, memory on the fullest device, FLOPs per step, and under
        `shard=` how many arrays are split.
        """
        parts = [
            f"{self.parameters:,} parameters",
            f"{_bytes(self.memory.total)} per device"
            + ("" if self.memory_limit is None else f" of {_bytes(self.memory_limit)}"),
            f"{_flops(self.flops_per_step)} per step",
        ]
        if self.sharded:
            parts.append(f"{self.split} of {len(self.arrays)} arrays split")
        if self._microbatches:
            parts.append(f"microbatches {self._microbatches}")
        return "eqfit: " + ", ".join(parts)

    def __str__(self) -> str:
        rows = [("path", "shape", "dtype", "layout", "bytes/device")]
        for path, count, a in folded_rows(self.arrays):
            path = path if a.trains else f"{path} (frozen)"
            if count > 1:
                path = f"{path}  ×{count}"
            rows.append((path, str(a.shape), a.dtype, layout(a.spec), _bytes(a.bytes * count)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        line = "  ".join("-" * w for w in widths)
        # Left-aligned text, right-aligned bytes.
        table = [
            "  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths)), r[4].rjust(widths[4])])
            for r in rows
        ]
        table.insert(1, line)
        on = f"{self.devices} × {self.device_kind}" if self.devices > 1 else self.device_kind
        lines = [
            *table,
            line,
            f"parameters: {self.parameters:,} trained"
            + (f", {self.split} of {len(self.arrays)} arrays split" if self.sharded else ""),
            f"devices: {on}",
            f"precision: {_precision(self.precision)}",
            f"steps run as: {self.execution.describe()} ({self.execution_why})",
            f"memory per device: {_memory(self.memory, self.arguments)}",
        ]
        if self._microbatches:
            lines.insert(-1, f"microbatches: {self._microbatches}")
        if self.bucket_shapes is not None:
            shown = " | ".join(
                " ".join(str(list(s)) for s in shapes) for shapes in self.bucket_shapes
            )
            lines.insert(
                -1,
                f"data in {len(self.bucket_shapes)} buckets, a program each when first met "
                f"(memory and FLOPs: the first batch's): {shown}",
            )
        if self.validations:
            runs = self.execution.describe_batches()
            if self.validation_streamed:  # a program (or its calls) per chunk
                runs = runs.replace("every batch", "each chunk's batches")
                runs += ", its sets streamed a chunk at a time"
            lines.insert(-1, f"validation runs as: {runs}")
        if self.memory_limit is not None:
            room = self.memory_limit - self.memory.total
            verdict = "fits" if room >= 0 else "does NOT fit"
            lines.append(
                f"device memory: {_bytes(self.memory_limit)}: {verdict}, "
                f"{_bytes(abs(room))} {'to spare' if room >= 0 else 'short'}"
            )
        flops = f"FLOPs: {_flops(self.flops_per_step)} per step"
        if self.validations:
            flops += f", {_flops(self.validation_flops)} per validation pass"
        if self.flops is None:
            flops += ", the run's steps are known once the loader's first pass is read"
        else:
            flops += f", {_flops(self.flops)} for the run's {self.steps:,} steps"
            if self.validations:
                passes = "pass" if self.validations == 1 else "passes"
                flops += f" and {self.validations:,} validation {passes}"
        if self.flops_lower_bound is not None:
            flops += f" (at least: {self.flops_lower_bound})"
        lines.append(flops)
        if self.peak_flops is not None:
            lines.append(f"peak: {_flops(self.peak_flops)}/s per device")
        return "\n".join(lines)


def _memory(memory: Memory, arguments: ArgumentBytes) -> str:
    """`memory`'s total as its parts: the arguments' (each but the parameters shown where
    it holds anything), then the outputs, aliased, temporary bytes and code.
    """
    parts = [
        f"{ARGUMENT_NAMES[name]} {_bytes(n)}"
        for name, n in zip(ArgumentBytes._fields, arguments)
        if n or name == "parameters"
    ]
    text = f"{_bytes(memory.total)} = " + " + ".join(parts)
    text += f" + outputs {_bytes(memory.output)} - aliased {_bytes(memory.alias)}"
    text += f" + temporaries {_bytes(memory.temporary)}"
    return text + (f" + code {_bytes(memory.code)}" if memory.code else "")


def _precision(policy: Precision | None) -> str:
    """A precision policy in words: compute and master dtypes, and its loss scaling."""
    if policy is None:
        return "the model's own dtypes (no policy)"
    compute, master = policy.compute_dtype.name, policy.params_dtype.name
    text = f"{compute} compute, {master} parameters, optimizer state and average"
    if policy.keep:
        text += f", {master} for {', '.join(repr(p) for p in policy.keep)}"
    if policy.scales:
        return text + (
            f", dynamic loss scaling from {policy.initial_scale:g} "
            f"(doubled after {policy.growth_steps:,} finite steps in a row)"
        )
    return text + ", no loss scaling"


def layout(spec: PartitionSpec | None) -> str:
    """An array's layout in words: `replicated` where no axis splits it (no `shard=`,
    or a spec such as `P()` or `P(None, None)`), else the spec's axes.
    """
    if spec is None or not _splits(spec):
        return "replicated"
    return str(tuple(spec))


# An index into a list or tuple in a `keystr` path, such as `.blocks[3]`.
_INDEX = re.compile(r"\[(\d+)\]")


def folded_rows(arrays: Sequence[ArrayPlan]) -> list[tuple[str, int, ArrayPlan]]:
    """`arrays` as `print(plan)` shows them: `(path, count, first array)` per row.

    Repeated blocks fold: where the entries of a list or tuple at consecutive indices
    (`.blocks[0]`, `.blocks[1]`, ...) hold arrays alike, path for path (shape, dtype,
    layout, bytes, trained or not), each of their arrays is one row,
    `.blocks[0..47].attention.query_proj.weight` for 48 arrays. A block unlike its
    neighbours keeps rows of its own. Folded at each index in turn, so that blocks within
    blocks fold too.
    """
    rows = [(a.path, 1, a) for a in arrays]
    while True:
        before, at = len(rows), 0
        while any(len(_INDEX.findall(path)) > at for path, _, _ in rows):
            rows = _fold_at(rows, at)
            at += 1
        if len(rows) == before:
            return rows


def _fold_at(rows: list[tuple[str, int, ArrayPlan]], at: int) -> list[tuple[str, int, ArrayPlan]]:
    """`rows` with each run of alike blocks at consecutive values of the rows' `at`-th
    index folded into the rows of its first block.
    """
    # Each list's entries (by the path up to the index): each entry's rows, by index, as
    # `(row, the path after the index)`.
    lists: dict[str, dict[int, list[tuple[int, str]]]] = {}
    for i, (path, _, _) in enumerate(rows):
        found = list(_INDEX.finditer(path))
        if len(found) > at:
            match = found[at]
            entries = lists.setdefault(path[: match.start()], {})
            entries.setdefault(int(match.group(1)), []).append((i, path[match.end() :]))

    def alike(entry: list[tuple[int, str]]) -> tuple[Any, ...]:
        """What must agree between two blocks that fold."""
        arrays = [(after, rows[i][1], rows[i][2]) for i, after in entry]
        return tuple(
            (after, count, a.shape, a.dtype, layout(a.spec), a.bytes, a.trains)
            for after, count, a in arrays
        )

    into: dict[int, tuple[str, int, ArrayPlan]] = {}  # a row -> its fold
    dropped: set[int] = set()
    for prefix, entries in lists.items():
        runs: list[list[int]] = []
        for index in sorted(entries):
            if (
                runs
                and index == runs[-1][-1] + 1
                and alike(entries[index]) == alike(entries[runs[-1][0]])
            ):
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            if len(run) < 2:
                continue
            first, last = run[0], run[-1]
            for i, after in entries[first]:
                path = f"{prefix}[{first}..{last}]{after}"
                into[i] = (path, rows[i][1] * len(run), rows[i][2])
            dropped.update(i for index in run[1:] for i, _ in entries[index])
    return [into.get(i, r) for i, r in enumerate(rows) if i not in dropped]


def _splits(spec: PartitionSpec | None) -> bool:
    return spec is not None and any(axis is not None for axis in spec)


def _bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _flops(n: int | float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.0f} FLOP" if unit == "" else f"{n:.3g} {unit}FLOP"
        n /= 1000
    raise AssertionError
