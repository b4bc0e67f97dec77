"""How `eqfit.plan` is made: the run's programs lowered and compiled as `fit` compiles
them (in threads, into eqfit's cache), their memory read from XLA's `memory_analysis()`,
their arguments told apart by what they are in the run's inputs, and FLOPs per step and
per validation pass from the `cost_analysis()` of each lowered on its own (XLA counts a
loop's body once whatever its trip count). `step_costs` gives the throughput figures the
same FLOPs.
"""

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._core._early_stopping import StoppingState
from .._program._calls import program_for, program_key
from .._program._compile import PROGRAM_CACHE
from .._program._loop import Loop
from .._program._parallel import OneDevice, param_specs, placement_devices, Pmap, Sharded
from .._program._start import start_program
from .._program._state import Consts, Inputs, Piece, StartArgs, TrainState
from .._step._evaluate import evaluate_batches
from ._flops import Flops, program_flops
from ._inference import StreamedSets
from ._loader import Loader
from ._observers import Costs
from ._plan import ArgumentBytes, ArrayPlan, Memory, Plan
from ._sources import Source


_T = TypeVar("_T")


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
    return placement_devices(loop.placement)


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


def step_flops(loop: Loop, state: TrainState, data_like: PyTree, consts: Consts) -> Flops:
    """The FLOPs of one optimizer step over a whole batch, from XLA's cost analysis of
    the step lowered alone (not compiled), each loop inside it (a scanned layer, say)
    counted as many times as it runs (`program_flops`). Cached with the run's program.
    """
    known = PROGRAM_CACHE.fact(program_key(loop), "flops_per_step")
    if known is not None:
        return known
    batch = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((loop.schedule.batch_size, *a.shape[1:]), a.dtype),
        data_like,
    )

    def one_step(state: TrainState, batch: PyTree, consts: Consts) -> Any:
        # The whole batch on one device, in one pass: the same arithmetic as the
        # placement's, without the collectives that split it, nor the loop over
        # microbatches, which would count the batch's rows once more per microbatch;
        # and with no forward pass checkpointed (`remat=`): the model's FLOPs, without
        # those of the forward pass computed again.
        step = loop.parts(consts).step
        step = dataclasses.replace(step, axis_name=None, microbatch=None, recompute=False)
        key = jax.random.key(0) if loop.use_key else None
        args = (state.params, state.opt_state, state.model_state, state.average)
        return step(*args, state.loss_scale, batch, key, state.step)

    flops = _lowered_flops(loop, one_step, state, batch, consts)
    PROGRAM_CACHE.set_fact(program_key(loop), "flops_per_step", flops)
    return flops


def _lowered_flops(loop: Loop, one: Callable[..., Any], state: TrainState, *args: Any) -> Flops:
    """The FLOPs of `one(state, *args)` lowered alone (not compiled) on abstract arrays,
    for every member of an ensemble (`one` vmapped over the state's members and the
    frozen arrays of the run's `Consts`, `args`' last).
    """

    def like(x: Any) -> Any:
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if eqx.is_array(x) else x

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, state
    )

    def program(state: TrainState, *args: Any) -> Any:
        if loop.members is None:
            return one(state, *args)
        *rest, consts = args

        def member(state: TrainState, frozen: list[Any]) -> Any:
            return one(state, *rest, consts._replace(frozen=frozen))

        return jax.vmap(member)(state, consts.frozen)

    return program_flops(program, abstract, *jax.tree.map(like, args))


def validation_flops(loop: Loop, state: TrainState, val_data: PyTree, consts: Consts) -> Flops:
    """The FLOPs of one validation pass over every set, from XLA's cost analysis of the
    pass lowered alone (not compiled), each set as one batch: the same arithmetic as its
    batches one by one, which a loop would count once. 0 without validation.
    """
    validation = loop.validation
    if validation is None or val_data is None:
        return Flops(0.0)

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


def run_steps(loop: Loop) -> int | None:
    """The steps of the run (`None` while its epoch's length is to be learned)."""
    schedule = loop.schedule
    return None if schedule.learning else schedule.total - schedule.begin


def validation_passes(loop: Loop) -> int:
    """The validation passes of the run: its epochs whose number `validation_freq`
    divides, or its steps that `validation_every` does (0 without validation).
    """
    if loop.validation is None:
        return 0
    return loop.validation.steps.passes(loop.schedule, loop.validation.freq)


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
    val_data = _validation_like(loop, val_data)
    name = ("plan", _shapes((start_args, source.like, val_data)), options.peak_flops)
    plan = PROGRAM_CACHE.fact(program_key(loop), name)
    if plan is None:
        plan = _compile_plan(loop, model, source, val_data, start_args, options)
        PROGRAM_CACHE.set_fact(program_key(loop), name, plan)
    # Runs of other extents share the programs (`Loop.for_programs`), not the steps.
    return dataclasses.replace(plan, steps=run_steps(loop), validations=validation_passes(loop))


def _validation_like(loop: Loop, val_data: PyTree | None) -> PyTree | None:
    """The validation data as the plan sees it: in memory, the arrays; streamed
    (`StreamedSets`), each set's arrays as `jax.ShapeDtypeStruct`s (named sets by their
    names), which the run's programs never take as inputs; `None` where a set's length is
    not known ahead (a loader without `len`).
    """
    if not isinstance(val_data, StreamedSets):
        return val_data
    sets = [opened.abstract() for opened in val_data.sets]
    if any(s is None for s in sets):
        return None
    assert loop.validation is not None
    if loop.validation.sets:
        return dict(zip(loop.validation.sets, sets))
    return sets[0]


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
        # Its shapes are known from its trace (cached with the lowering): the run's
        # program is traced and compiled while XLA compiles this one, as `fit` does. Not
        # from the lowering's `out_info`, which drops weak types (a state of
        # `jnp.asarray(0)`'s, gymnax's), and the run `fit` calls would not be this one.
        state = jax.eval_shape(start_program(loop), *start_inputs)[0]
    else:  # the state's layout, or the state itself (`pmap`), from the compiled program
        state = _state_like(placement, compiling.result(), start_inputs)
    key = options.key
    if loop.members is not None:  # as `start` splits it
        key = jax.random.split(key, loop.members)
    consts = start_args.consts
    streams = loop.validation is not None and loop.validation.streamed
    inputs = Inputs(
        placement.put(_first_data(source, loop), sharded=True),
        None if streams else placement.put(val_data, sharded=True),
        placement.put(key),
        placement.put(consts),
    )
    if source.streamed:
        piece = Piece(np.zeros(_chunk_rows(source, loop), np.uint32), np.int32(0), np.int32(0))
        inputs = inputs._replace(piece=placement.put(piece))
    runs = program_for(loop).lower(state, inputs, schedule.begin)
    # The step and a validation pass are traced to count their FLOPs while XLA compiles
    # the run.
    counting = _in_thread(_count_flops, loop, lowered.out_info[0], source.like, val_data, consts)
    threads.append(counting)
    # Not in this thread: JAX lets a Ctrl-C cut short its wait for a compilation in the
    # main thread, but XLA compiles on, and a process that exits meanwhile crashes.
    compiling_runs = [_in_thread(run.compile) for run in runs]
    threads.extend(compiling_runs)
    step, validation = counting.result()
    if streams and val_data is None:  # a loader's set: its passes' FLOPs are not known
        validation = Flops(0.0, "a validation loader that does not say its length")
    compiled = [compiling.result() for compiling in compiling_runs][0]  # the most steps
    devices = devices_of(loop)
    peak = _device_peak(loop, model, options, devices)
    start = compiling.result()
    memory = memory_of(compiled)
    return Plan(
        memory=memory,
        arguments=argument_bytes(compiled, memory.argument),
        start_memory=memory_of(start),
        flops_per_step=step.flops,
        validation_flops=validation.flops,
        steps=run_steps(loop),
        validations=validation_passes(loop),
        arrays=array_plans(loop, model),
        devices=len(devices),
        device_kind=str(devices[0].device_kind),
        precision=loop.step.precision,
        memory_limit=memory_limit(devices),
        peak_flops=peak,
        execution=loop.execution,
        execution_why=loop.execution_why,
        compiled=compiled,
        flops_lower_bound=step.lower_bound or validation.lower_bound,
        validation_streamed=streams,
        bucket_shapes=source.bucket_shapes() if isinstance(source, Loader) else None,
        microbatches=loop.step.microbatches,
    )


def _count_flops(
    loop: Loop, state: TrainState, data_like: PyTree, val_data: PyTree | None, consts: Consts
) -> tuple[Flops, Flops]:
    """The FLOPs of a step and of a validation pass."""
    step = step_flops(loop, state, data_like, consts)
    return step, validation_flops(loop, state, val_data, consts)


def step_costs(
    loop: Loop,
    model: PyTree,
    source: Source,
    start_args: StartArgs,
    options: Any,
    plan: Plan | None,
) -> Costs | None:
    """What a step of the run costs, for its FLOP/s and MFU: the plan's, if there is one;
    else where eqfit can tell the MFU (a device of known peak, or `peak_flops=`), the
    step's FLOPs, lowered once per configuration: counted by the `Costs` in a thread while
    XLA compiles the run (`Costs.start`), where no earlier fit counted them; else `None`:
    a plain `fit` on a device of unknown peak does not pay for tracing its step once more.
    """
    if plan is not None:
        peak = None if plan.peak_flops is None else plan.peak_flops * plan.devices
        return Costs(plan.flops_per_step, peak)
    devices = devices_of(loop)
    peak = _device_peak(loop, model, options, devices)
    flops = PROGRAM_CACHE.fact(program_key(loop), "flops_per_step")
    if flops is None and peak is None:
        return None
    peak = None if peak is None else peak * len(devices)
    if flops is not None:
        return Costs(flops.flops, peak)
    inputs = loop.placement.start_inputs(start_args, loop.trains)
    # Its shapes, here: no arrays are held while it counts (and JAX keeps `start`'s trace).
    state = jax.eval_shape(start_program(loop), *inputs)[0]
    return Costs(
        None,
        peak,
        lambda: step_flops(loop, state, source.like, start_args.consts).flops,
        in_callers_mesh,
    )


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


def in_callers_mesh(fn: Callable[..., _T]) -> Callable[..., _T]:
    """`fn` called under the mesh of the caller's context (`jax.set_mesh`), if any, from
    another thread: JAX's context is the thread's own, and a step that constrains its
    arrays' sharding traces only inside a mesh.
    """
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
        return fn

    def called(*args: Any) -> _T:
        with jax.set_mesh(mesh):
            return fn(*args)

    return called


def _in_thread(fn: Callable[..., Any], *args: Any) -> "concurrent.futures.Future[Any]":
    """`fn(*args)` called in a thread of its own: XLA compiles without Python's lock, so
    the host traces on meanwhile. The thread is a `ThreadPoolExecutor`'s, which Python
    waits for as it exits, before any `atexit` handler (JAX's, which tear the backend
    down, included): a thread left at work by a Ctrl-C never meets a process gone.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(in_callers_mesh(fn), *args)
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
