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

import concurrent.futures
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._compile import PROGRAM_CACHE
from ._early_stopping import StoppingState
from ._evaluate import evaluate_batches
from ._loop import Loop
from ._observers import Costs
from ._parallel import OneDevice, param_specs, Pmap, Sharded
from ._precision import Precision
from ._program import run_key, run_program, start_program
from ._sources import Source
from ._state import Consts, Inputs, Piece, StartArgs, TrainState


class Memory(NamedTuple):
    """Bytes one device holds while a compiled program runs, as XLA's
    `memory_analysis()` reports them.

    **Attributes:**

    - `argument`: the program's inputs (the training state, the data, the keys);
        [`eqfit.ArgumentBytes`][] (`Plan.arguments`) splits them by what they are.
    - `output`: its outputs (the next training state and the report).
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
_ARGUMENT_NAMES = {
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
        batch (every device's share together), forward, backward and update.
    - `validation_flops`: those of one validation pass: the loss, aux values and metrics
        over every validation set (every device's share together); 0 without
        validation.
    - `steps`: the optimizer steps this run takes (from its first epoch to `epochs`);
        `None` for a loader without `len`, whose epochs are as long as its first pass.
    - `validations`: the validation passes this run makes (the epochs `validation_freq`
        validates); 0 without validation.
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
    - `compiled`: the run's compiled program (`jax.stages.Compiled`, or
        Equinox's for `devices=`): `plan.compiled.as_text()` shows its HLO.
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
    compiled: Any = dataclasses.field(repr=False, compare=False)

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
            f"memory per device: {_memory(self.memory, self.arguments)}",
        ]
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
        lines.append(flops)
        if self.peak_flops is not None:
            lines.append(f"peak: {_flops(self.peak_flops)}/s per device")
        return "\n".join(lines)


def _memory(memory: Memory, arguments: ArgumentBytes) -> str:
    """`memory`'s total as its parts: the arguments' (each but the parameters shown where
    it holds anything), then the outputs, aliased, temporary bytes and code.
    """
    parts = [
        f"{_ARGUMENT_NAMES[name]} {_bytes(n)}"
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


def memory_of(compiled: Any) -> Memory:
    """A compiled program's `Memory` (of JAX's `Compiled` or Equinox's around it)."""
    stats = getattr(compiled, "compiled", compiled).memory_analysis()
    return Memory(
        argument=int(stats.argument_size_in_bytes),
        output=int(stats.output_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
        temporary=int(stats.temp_size_in_bytes),
        code=int(stats.generated_code_size_in_bytes),
    )


def argument_bytes(compiled: Any, total: int) -> ArgumentBytes:
    """The bytes one device holds of each part of `compiled`'s arguments (the run's
    program, of JAX's `Compiled` or Equinox's around it), as the program lays each array
    out; `total` (`Memory.argument`) less the rest is `other`.

    The parts are told apart by where each array sits in the program's inputs (a
    `TrainState`'s and the `Inputs`' fields). An input the program never reads (XLA
    removes it) holds nothing.
    """
    inner = getattr(compiled, "compiled", compiled)
    avals = inner.in_avals
    structure = jax.tree.structure(avals)
    shardings = structure.flatten_up_to(inner.input_shardings)  # `None`: removed
    labels = structure.flatten_up_to(_labels(avals))
    counted = dict.fromkeys(ArgumentBytes._fields, 0)
    for aval, sharding, label in zip(structure.flatten_up_to(avals), shardings, labels):
        if sharding is None:
            continue
        held = sharding.shard_shape(tuple(aval.shape))
        counted[label] += int(np.prod(held)) * aval.dtype.itemsize
    # The program's arguments beyond its inputs' (constants XLA hoists, if any) are the
    # rest's too, so that the parts sum to XLA's figure.
    counted["other"] += total - sum(counted.values())
    return ArgumentBytes(**counted)


def _labels(avals: PyTree) -> PyTree:
    """`avals` (a program's inputs) with each array replaced by the name of the
    `ArgumentBytes` part it counts in."""

    def each(tree: PyTree, label: str) -> PyTree:
        return jax.tree.map(lambda _: label, tree)

    def label(node: Any) -> PyTree:
        if isinstance(node, TrainState):
            stopping = node.stopping
            if isinstance(stopping, StoppingState):
                stopping = each(stopping, "other")._replace(
                    best_params=each(stopping.best_params, "best"),
                    best_model_state=each(stopping.best_model_state, "best"),
                )
            else:
                stopping = each(stopping, "other")
            return each(node, "other")._replace(
                params=each(node.params, "parameters"),
                opt_state=each(node.opt_state, "optimizer_state"),
                model_state=each(node.model_state, "model_state"),
                average=each(node.average, "average"),
                stopping=stopping,
            )
        if isinstance(node, Inputs):
            consts = node.consts
            return Inputs(
                data=each(node.data, "data"),
                val_data=each(node.val_data, "validation_data"),
                key=each(node.key, "other"),
                consts=Consts(each(consts.frozen, "frozen"), each(consts.objects, "other")),
                piece=each(node.piece, "data"),
            )
        return "other"

    return jax.tree.map(label, avals, is_leaf=lambda x: isinstance(x, (TrainState, Inputs)))


def devices_of(loop: Loop) -> list[Any]:
    """The devices that train: the placement's."""
    placement = loop.placement
    if isinstance(placement, Pmap):
        return list(placement.devices)
    if isinstance(placement, Sharded):
        return list(placement.mesh.devices.flat)
    return [jax.devices()[0]]


def memory_limit(devices: Sequence[Any]) -> int | None:
    """The smallest memory limit of `devices`, where they report one (not the CPU)."""
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # not implemented on this backend
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def array_plans(loop: Loop, model: PyTree) -> tuple[ArrayPlan, ...]:
    """The model's arrays as the run lays them out."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(model)
    arrays = [(path, x) for path, x in with_paths if eqx.is_array(x)]  # as `split_arrays`
    specs = param_specs(loop.placement)
    mesh = getattr(loop.placement, "mesh", None)
    plans = []
    for i, ((path, x), trains) in enumerate(zip(arrays, loop.trains)):
        spec = None if specs is None else specs[i]
        shape = tuple(int(n) for n in x.shape)
        dtype = np.dtype(x.dtype)
        held = shape
        if spec is not None and mesh is not None:
            held = NamedSharding(mesh, spec).shard_shape(shape)
        plans.append(
            ArrayPlan(
                path=jax.tree_util.keystr(path),
                shape=shape,
                dtype=str(dtype),
                spec=spec,
                bytes=int(np.prod(held)) * dtype.itemsize,
                trains=trains,
            )
        )
    return tuple(plans)


def step_flops(loop: Loop, state: TrainState, data_like: PyTree, consts: Consts) -> float:
    """The FLOPs of one optimizer step over a whole batch, from XLA's cost analysis of
    the step lowered alone (not compiled): the run's program counts its loop's body once.
    Cached with the run's program.
    """
    known = PROGRAM_CACHE.fact(run_key(loop), "flops_per_step")
    if known is not None:
        return known
    batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((loop.schedule.batch_size, *a.shape[1:]), a.dtype),
        data_like,
    )

    def one_step(state: TrainState, batch: PyTree, consts: Consts) -> Any:
        # The whole batch on one device: the same arithmetic as the placement's, without
        # the collectives that split it.
        step = dataclasses.replace(loop.parts(consts).step, axis_name=None)
        key = jax.random.key(0) if loop.use_key else None
        args = (state.params, state.opt_state, state.model_state, state.average)
        return step(*args, state.loss_scale, batch, key)

    flops = _lowered_flops(loop, one_step, state, batch, consts)
    PROGRAM_CACHE.set_fact(run_key(loop), "flops_per_step", flops)
    return flops


def _lowered_flops(loop: Loop, one: Callable[..., Any], state: TrainState, *args: Any) -> float:
    """XLA's FLOPs for `one(state, *args)` lowered alone (not compiled) on abstract
    arrays, for every member of an ensemble (`one` vmapped over the state's members).
    """

    def like(x: Any) -> Any:
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if eqx.is_array(x) else x

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, state
    )

    def program(state: TrainState, *args: Any) -> Any:
        if loop.members is None:
            return one(state, *args)
        return jax.vmap(lambda member: one(member, *args))(state)

    costs = jax.jit(program).lower(abstract, *jax.tree.map(like, args)).cost_analysis()
    return float(costs.get("flops", 0.0)) if costs else 0.0


def validation_flops(loop: Loop, state: TrainState, val_data: PyTree, consts: Consts) -> float:
    """The FLOPs of one validation pass over every set, from XLA's cost analysis of the
    pass lowered alone (not compiled), each set as one batch: the same arithmetic as its
    batches one by one, which a loop would count once. 0 without validation.
    """
    validation = loop.validation
    if validation is None or val_data is None:
        return 0.0

    def validate(state: TrainState, val_data: PyTree, consts: Consts) -> Any:
        parts = loop.parts(consts)
        sets = [val_data[name] for name in validation.sets] if validation.sets else [val_data]
        model = parts.combine(state.average if validation.ema else state.params)
        values = []
        for data in sets:
            rows = jax.tree.leaves(data)[0].shape[0]
            value, _ = evaluate_batches(parts.objective, model, state.model_state, data, rows)
            values.append(value)
        return values

    return _lowered_flops(loop, validate, state, val_data, consts)


def validation_passes(loop: Loop) -> int:
    """The validation passes of the run: its epochs whose number `validation_freq`
    divides (0 without validation).
    """
    if loop.validation is None:
        return 0
    schedule, every = loop.schedule, loop.validation.freq
    last = max(schedule.epochs, schedule.first_epoch)
    return last // every - schedule.first_epoch // every


def make_plan(
    loop: Loop,
    model: PyTree,
    source: Source,
    val_data: PyTree | None,
    start_args: StartArgs,
    options: Any,
) -> Plan:
    """Compiles the programs of the run described by `loop` (as `fit` will call them, into
    eqfit's cache) and reads what they need.

    **Arguments:**

    - `loop`: the run.
    - `model`: the model, for its arrays' paths.
    - `source`: the training data.
    - `val_data`: the validation data, if any.
    - `start_args`: the arguments of the program that makes the training state.
    - `options`: `fit`'s checked options.

    **Returns:**

    The `Plan`.
    """
    # A second plan of the same run (a second `fit` with the bar, say) is the first: its
    # programs are compiled, and lowering them again would trace the whole run anew.
    name = ("plan", _shapes((start_args, source.like, val_data)), options.peak_flops)
    plan = PROGRAM_CACHE.fact(run_key(loop), name)
    if plan is None:
        plan = _compile_plan(loop, model, source, val_data, start_args, options)
        PROGRAM_CACHE.set_fact(run_key(loop), name, plan)
    return plan


def _shapes(tree: PyTree) -> tuple[Any, ...]:
    """The structure, shapes, dtypes and layouts of `tree`'s arrays, hashable."""
    leaves, structure = jax.tree.flatten(tree)
    described = tuple(
        (x.shape, str(x.dtype), getattr(x, "sharding", None)) if hasattr(x, "shape") else x
        for x in leaves
    )
    return structure, described


def _compile_plan(
    loop: Loop,
    model: PyTree,
    source: Source,
    val_data: PyTree | None,
    start_args: StartArgs,
    options: Any,
) -> Plan:
    threads: list[concurrent.futures.Future[Any]] = []
    try:
        return _compile_plan_in(loop, model, source, val_data, start_args, options, threads)
    except KeyboardInterrupt:
        # A second Ctrl-C: answered at once. The threads compile and trace on; Python
        # waits for them before it exits (`_in_thread`), so the process never exits with
        # XLA at work in one.
        raise
    except BaseException:
        _join(threads)
        raise


def _compile_plan_in(
    loop: Loop,
    model: PyTree,
    source: Source,
    val_data: PyTree | None,
    start_args: StartArgs,
    options: Any,
    threads: list["concurrent.futures.Future[Any]"],
) -> Plan:
    placement, schedule = loop.placement, loop.schedule
    start_inputs = placement.start_inputs(start_args, loop.trains)
    lowered = _lower(start_program(loop), *start_inputs)
    compiling = _in_thread(lowered.compile)
    threads.append(compiling)
    if isinstance(placement, OneDevice):
        # Its shapes are known from the lowering: the run's program is traced and
        # compiled while XLA compiles this one, as `fit` does.
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lowered.out_info[0])
    else:  # the state's layout, or the state itself (`pmap`), from the compiled program
        state = _state_like(placement, compiling.result(), start_inputs)
    key = options.key
    if loop.members is not None:  # as `start` splits it
        key = jax.random.split(key, loop.members)
    consts = start_args.consts
    inputs = Inputs(
        placement.put(_first_data(source, loop), sharded=True),
        placement.put(val_data, sharded=True),
        placement.put(key),
        placement.put(consts),
    )
    if source.streamed:
        piece = Piece(np.zeros(_chunk_rows(source, loop), np.uint32), np.int32(0), np.int32(0))
        inputs = inputs._replace(piece=placement.put(piece))
    run = _lower(run_program(loop), state, inputs, np.int32(schedule.begin))
    # The step and a validation pass are traced to count their FLOPs while XLA compiles
    # the run.
    counting = _in_thread(_count_flops, loop, lowered.out_info[0], source.like, val_data, consts)
    threads.append(counting)
    # Not in this thread: JAX lets a Ctrl-C cut short its wait for a compilation in the
    # main thread, but XLA compiles on, and a process that exits meanwhile crashes.
    compiling_run = _in_thread(run.compile)
    threads.append(compiling_run)
    flops, val_flops = counting.result()
    compiled = compiling_run.result()
    devices = devices_of(loop)
    peak = _device_peak(loop, model, options, devices)
    start = compiling.result()
    memory = memory_of(compiled)
    return Plan(
        memory=memory,
        arguments=argument_bytes(compiled, memory.argument),
        start_memory=memory_of(start),
        flops_per_step=flops,
        validation_flops=val_flops,
        steps=None if schedule.learning else schedule.total - schedule.begin,
        validations=validation_passes(loop),
        arrays=array_plans(loop, model),
        devices=len(devices),
        device_kind=str(devices[0].device_kind),
        precision=loop.step.precision,
        memory_limit=memory_limit(devices),
        peak_flops=peak,
        compiled=compiled,
    )


def _count_flops(
    loop: Loop, state: TrainState, data_like: PyTree, val_data: PyTree | None, consts: Consts
) -> tuple[float, float]:
    """The FLOPs of a step and of a validation pass."""
    step = step_flops(loop, state, data_like, consts)
    return step, validation_flops(loop, state, val_data, consts)


def run_costs(
    loop: Loop,
    model: PyTree,
    source: Source,
    start_args: StartArgs,
    options: Any,
    plan: Plan | None,
) -> Costs | None:
    """What a step of the run costs, for its FLOP/s and MFU: the plan's, if there is one;
    else where eqfit can tell the MFU (a device of known peak, or `peak_flops=`), the
    step's FLOPs, lowered once per configuration; else `None`: a plain `fit` on a device
    of unknown peak does not pay for tracing its step once more.
    """
    if plan is not None:
        peak = None if plan.peak_flops is None else plan.peak_flops * plan.devices
        return Costs(plan.flops_per_step, peak)
    devices = devices_of(loop)
    peak = _device_peak(loop, model, options, devices)
    flops = PROGRAM_CACHE.fact(run_key(loop), "flops_per_step")
    if flops is None and peak is None:
        return None
    if flops is None:
        inputs = loop.placement.start_inputs(start_args, loop.trains)
        state = jax.eval_shape(start_program(loop), *inputs)[0]
        flops = step_flops(loop, state, source.like, start_args.consts)
    return Costs(flops, None if peak is None else peak * len(devices))


def _device_peak(loop: Loop, model: PyTree, options: Any, devices: Sequence[Any]) -> float | None:
    """One device's peak FLOP/s: `fit(..., peak_flops=)`, else eqfit's table's."""
    if options.peak_flops is not None:
        return options.peak_flops
    return peak_flops(str(devices[0].device_kind), compute_dtype(loop, model))


def compute_dtype(loop: Loop, model: PyTree) -> Any:
    """The dtype the step computes in: the precision policy's, else that of the model's
    largest floating array.
    """
    if loop.step.precision is not None:
        return loop.step.precision.compute_dtype
    arrays = [x for x in jax.tree.leaves(model) if eqx.is_array(x)]
    floating = [x for x in arrays if jnp.issubdtype(x.dtype, jnp.floating)]
    if not floating:
        return np.float32
    return max(floating, key=lambda x: x.size).dtype


def _state_like(placement: Any, start: Any, start_inputs: tuple[Any, ...]) -> PyTree:
    """The training state as the run's first call takes it on several devices, from the
    compiled program that makes it: shapes and layouts, or under `pmap` the state itself.
    """
    if isinstance(placement, Pmap):  # `filter_pmap` maps arrays, not shapes
        return placement.put(start(*start_inputs)[0])
    # Under a mesh: laid out by `shard=` already, or replicated over it as `put` does.
    assert isinstance(placement, Sharded)
    replicated = NamedSharding(placement.mesh, PartitionSpec())

    def laid_out(x: Any) -> Any:
        on_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == placement.mesh
        sharding = x.sharding if on_mesh else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(laid_out, start.out_info[0])


def _in_thread(fn: Callable[..., Any], *args: Any) -> "concurrent.futures.Future[Any]":
    """`fn(*args)` called in a thread of its own: XLA compiles without Python's lock, so
    the host traces on meanwhile. The thread is a `ThreadPoolExecutor`'s, which Python
    waits for as it exits, before any `atexit` handler (JAX's, which tear the backend
    down, included): a thread left at work by a Ctrl-C never meets a process gone.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with the call
    return future


def _join(threads: list["concurrent.futures.Future[Any]"]) -> None:
    """Waits for the threads that compile or trace, where the plan fails with an error:
    each ends soon (its own work, or the error it meets). Within a bound: Python waits
    for what is left before it exits.
    """
    concurrent.futures.wait(threads, timeout=_JOIN_SECONDS)


# How long a failed plan waits for its threads, so that an error does not leave
# compilations to run on behind it.
_JOIN_SECONDS = 60.0


def _lower(program: Any, *args: Any) -> Any:
    """`program` (a `jax.jit` or `eqx.filter_pmap` one) lowered for `args`."""
    return program.lower(*args)


def _chunk_rows(source: Source, loop: Loop) -> int:
    size = getattr(source, "chunk_size")(loop.schedule)
    return size * loop.schedule.batch_size


def _first_data(source: Source, loop: Loop) -> PyTree:
    """Data shaped as the run's first call takes it: in memory, the data itself; streamed,
    zeros the shape of a chunk (nothing is read from a loader).
    """
    if not source.streamed:
        chunk = next(iter(source.chunks(loop.schedule, loop.schedule.begin, loop.schedule.total)))
        return chunk.data
    rows = _chunk_rows(source, loop)
    return jax.tree.map(lambda a: np.zeros((rows, *a.shape[1:]), a.dtype), source.like)


# Peak dense FLOP/s of one device, by what `jax.Device.device_kind` says, for the dtype the
# step computes in: the vendors' data sheets, without sparsity. float32 matmuls run as
# TF32 on NVIDIA's tensor cores under JAX's default precision (A100 and later), so
# float32 takes that rate there. Matched by substrings of the lower-cased kind, the first
# that matches; an unknown device has no MFU unless `fit(..., peak_flops=)` gives it.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("b200", {"bfloat16": 2.25e15, "float16": 2.25e15, "float32": 1.1e15}),
    ("h200", {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12}),
    ("h100 pcie", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 495e12}),
    ("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    ("l40s", {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12}),
    ("l4", {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12}),
    ("a10", {"bfloat16": 125e12, "float16": 125e12, "float32": 62.5e12}),
    ("rtx 4090", {"bfloat16": 165e12, "float16": 165e12, "float32": 82.6e12}),
    ("rtx 3090", {"bfloat16": 71e12, "float16": 71e12, "float32": 35.6e12}),
    ("v100", {"float16": 125e12, "float32": 15.7e12}),
    ("t4", {"float16": 65e12, "float32": 8.1e12}),
    ("tpu v6", {"bfloat16": 918e12}),
    ("tpu v5 lite", {"bfloat16": 197e12}),
    ("tpu v5e", {"bfloat16": 197e12}),
    ("tpu v5", {"bfloat16": 459e12}),
    ("tpu v4", {"bfloat16": 275e12}),
    ("tpu v3", {"bfloat16": 123e12}),
    ("tpu v2", {"bfloat16": 45e12}),
)


def peak_flops(device_kind: str, dtype: Any) -> float | None:
    """One device's peak FLOP/s at `dtype` from `PEAK_FLOPS`; `None` if unknown. A TPU's
    matrix units take float32 matmuls at their bfloat16 rate under JAX's default precision.
    """
    kind, name = device_kind.lower(), np.dtype(dtype).name
    for match, peaks in PEAK_FLOPS:
        if match in kind:
            if name not in peaks and kind.startswith("tpu"):
                name = "bfloat16"
            return peaks.get(name)
    return None
