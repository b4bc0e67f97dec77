"""`eqfit.plan`: the run's programs compiled as `fit` compiles them, and what they will
need (memory per device, FLOPs per step, the model's arrays and their layout), before
anything trains.

The plan lowers and compiles exactly the programs that `fit` then calls (from eqfit's
cache of programs), so a `fit` with the same arguments compiles nothing more. Memory
comes from XLA's `memory_analysis()` of the compiled run, per device; FLOPs from the
`cost_analysis()` of one step, lowered on its own, since XLA counts a loop's body once
whatever its trip count.
"""

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._compile import PROGRAM_CACHE
from ._loop import Consts, Inputs, Loop, Piece, run_key, run_program, start_program, TrainState
from ._observers import Costs
from ._parallel import OneDevice, param_specs, Pmap, Sharded
from ._sources import Source


class Memory(NamedTuple):
    """Bytes one device holds while a compiled program runs, as XLA's
    `memory_analysis()` reports them.

    **Attributes:**

    - `argument`: the program's inputs (the training state, the data, the keys).
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
    - `start_memory`: the same of the program that makes the training state, run once
        before the first step.
    - `flops_per_step`: the floating-point operations of one optimizer step over a whole
        batch (every device's share together), forward, backward and update.
    - `steps`: the optimizer steps this run takes (from its first epoch to `epochs`);
        `None` for a loader without `len`, whose epochs are as long as its first pass.
    - `arrays`: a tuple of [`eqfit.ArrayPlan`][], one for each array of the model.
    - `devices`: how many devices train.
    - `device_kind`: what they are (`jax.Device.device_kind`).
    - `memory_limit`: the bytes each device can hold, where it says
        (`jax.Device.memory_stats()`, on GPUs and TPUs); else `None`.
    - `peak_flops`: each device's peak FLOP/s at the run's compute dtype, from eqfit's
        table of common GPUs and TPUs or `fit(..., peak_flops=)`; else `None`.
    - `compiled`: the run's compiled program (`jax.stages.Compiled`, or
        Equinox's for `devices=`): `plan.compiled.as_text()` shows its HLO.
    """

    memory: Memory
    start_memory: Memory
    flops_per_step: float
    steps: int | None
    arrays: tuple[ArrayPlan, ...]
    devices: int
    device_kind: str
    memory_limit: int | None
    peak_flops: float | None
    compiled: Any = dataclasses.field(repr=False, compare=False)

    @property
    def flops(self) -> float | None:
        """The whole run's FLOPs: the step's times the steps (`None` if not known)."""
        return None if self.steps is None else self.flops_per_step * self.steps

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
        for a in self.arrays:
            spec = "replicated" if a.spec is None else str(tuple(a.spec))
            path = a.path if a.trains else f"{a.path} (frozen)"
            rows.append((path, str(a.shape), a.dtype, spec, _bytes(a.bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        line = "  ".join("-" * w for w in widths)
        # Left-aligned text, right-aligned bytes.
        table = [
            "  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths)), r[4].rjust(widths[4])])
            for r in rows
        ]
        table.insert(1, line)
        on = f"{self.devices} × {self.device_kind}" if self.devices > 1 else self.device_kind
        memory = self.memory
        lines = [
            *table,
            line,
            f"parameters: {self.parameters:,} trained"
            + (f", {self.split} of {len(self.arrays)} arrays split" if self.sharded else ""),
            f"devices: {on}",
            f"memory per device: {_bytes(memory.total)} = arguments {_bytes(memory.argument)}"
            f" + outputs {_bytes(memory.output)} - aliased {_bytes(memory.alias)}"
            f" + temporaries {_bytes(memory.temporary)}"
            + (f" + code {_bytes(memory.code)}" if memory.code else ""),
        ]
        if self.memory_limit is not None:
            room = self.memory_limit - memory.total
            verdict = "fits" if room >= 0 else "does NOT fit"
            lines.append(
                f"device memory: {_bytes(self.memory_limit)}: {verdict}, "
                f"{_bytes(abs(room))} {'to spare' if room >= 0 else 'short'}"
            )
        run = "the run's steps are known once the loader's first pass is read"
        if self.flops is not None:
            run = f"{_flops(self.flops)} for the run's {self.steps:,} steps"
        lines.append(f"FLOPs: {_flops(self.flops_per_step)} per step, {run}")
        if self.peak_flops is not None:
            lines.append(f"peak: {_flops(self.peak_flops)}/s per device")
        return "\n".join(lines)


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
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, state
    )
    consts = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), consts)

    def one_step(state: TrainState, batch: PyTree, consts: Consts) -> Any:
        # The whole batch on one device: the same arithmetic as the placement's, without
        # the collectives that split it.
        step = dataclasses.replace(loop.parts(consts).step, axis_name=None)
        key = jax.random.key(0) if loop.use_key else None

        def one(state: TrainState) -> Any:
            args = (state.params, state.opt_state, state.model_state, state.average)
            return step(*args, state.loss_scale, batch, key)

        if loop.members is None:
            return one(state)
        return jax.vmap(one)(state)

    costs = jax.jit(one_step).lower(abstract, batch, consts).cost_analysis()
    flops = float(costs.get("flops", 0.0)) if costs else 0.0
    PROGRAM_CACHE.set_fact(run_key(loop), "flops_per_step", flops)
    return flops


def make_plan(
    loop: Loop,
    model: PyTree,
    source: Source,
    val_data: PyTree | None,
    start_args: tuple[Any, ...],
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
    start_args: tuple[Any, ...],
    options: Any,
) -> Plan:
    threads: list[concurrent.futures.Future[Any]] = []
    try:
        return _compile_plan_in(loop, model, source, val_data, start_args, options, threads)
    finally:
        _join(threads)


def _compile_plan_in(
    loop: Loop,
    model: PyTree,
    source: Source,
    val_data: PyTree | None,
    start_args: tuple[Any, ...],
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
    consts = start_args[-1]
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
    # The step is traced to count its FLOPs while XLA compiles the run.
    counting = _in_thread(step_flops, loop, lowered.out_info[0], source.like, consts)
    threads.append(counting)
    compiled = run.compile()
    flops = counting.result()
    devices = devices_of(loop)
    peak = _device_peak(loop, model, options, devices)
    start = compiling.result()
    return Plan(
        memory=memory_of(compiled),
        start_memory=memory_of(start),
        flops_per_step=flops,
        steps=None if schedule.learning else schedule.total - schedule.begin,
        arrays=array_plans(loop, model),
        devices=len(devices),
        device_kind=str(devices[0].device_kind),
        memory_limit=memory_limit(devices),
        peak_flops=peak,
        compiled=compiled,
    )


def run_costs(
    loop: Loop,
    model: PyTree,
    source: Source,
    start_args: tuple[Any, ...],
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
        flops = step_flops(loop, state, source.like, start_args[-1])
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
    if loop.precision is not None:
        return loop.precision.compute_dtype
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
    the host traces on meanwhile.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with the call
    return future


def _join(threads: list["concurrent.futures.Future[Any]"]) -> None:
    """Waits for the threads that compile or trace, on every way out: a process must not
    exit with XLA at work in one (it crashes). A further Ctrl-C does not cut the wait
    short; the one that ends the plan is already on its way.
    """
    for future in threads:
        while True:
            try:
                concurrent.futures.wait([future])
                break
            except KeyboardInterrupt:
                continue


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
