"""Where a run lives: one device, `eqx.filter_pmap` over devices, or a sharded `Mesh`.

Each placement compiles the loop's programs its own way and moves arrays to and from its
layout. The loop itself only asks it how to cut a batch.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, PyTree, UInt32

from .._core._data import take, take_rows


# `jax.Device`, which type checkers see as a variable rather than a class.
Device = Any

# XLA's options for a compiled program (`jax.jit`'s `compiler_options`), by name.
CompilerOptions = tuple[tuple[str, str], ...]

# XLA:CPU's default scheduler orders a program's operations for concurrency, which its
# runtime then runs side by side. A small step whose updates are not in a `cond` (a run
# without the NaN guard) loses more to that than it gains, and runs more slowly than the
# same step with them in one; ordered for memory, it runs no slower than the guarded
# one, while a larger step gains from the concurrency. Small: a loss whose matrix
# products and convolutions (`_step/_size.py`) take fewer than `SMALL_STEP_FLOPS` a
# batch (`benchmarks/small_steps.py --guards`, and the larger steps of
# `benchmarks/model_families.py`). Scheduling leaves every operation's arithmetic, and
# so every bit, as it was.
SMALL_STEP_FLOPS = 2e7
SMALL_STEP_OPTIONS = (("xla_cpu_scheduler_type", "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"),)


def copying(tree: PyTree) -> PyTree:
    """`tree`, its arrays' copies to the host started, all before any is read: an
    accelerator's reads then wait about one transfer's latency in all, not one each.
    (Arrays on the CPU are in the host's memory already.)
    """
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if arrays and next(iter(arrays[0].sharding.device_set)).platform != "cpu":
        for x in arrays:
            x.copy_to_host_async()
    return tree


# Placements are frozen dataclasses, not `eqx.Module`s: `fit` calls their methods several
# times per call, and a Module makes a new bound-method Module at each method access.


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """The default: everything on JAX's default device, compiled with `jax.jit`."""

    axis_name: None = None

    def compile(
        self, fn: Callable, donate: tuple[int, ...] = (), options: CompilerOptions = ()
    ) -> Callable:
        """`fn(*arrays)` compiled, donating the arguments at the positions `donate`, with
        XLA's `options` (`Loop.compiler_options`).
        """
        return jax.jit(fn, donate_argnums=donate, compiler_options=dict(options) or None)

    def put(self, tree: PyTree, *, sharded: bool = False) -> PyTree:
        del sharded
        return tree

    def get(self, tree: PyTree) -> PyTree:
        return tree

    def constant(self, tree: PyTree) -> PyTree:
        """`tree`'s values from the host (numpy scalars), placed once as an argument that
        the programs do not map over, so that calls given it again move nothing.
        """
        return jax.device_put(tree)

    def start_inputs(self, tree: PyTree, trains: tuple[bool, ...]) -> PyTree:
        """The arguments of the program that makes the training state, placed for it:
        `(params, ...)`, `params` the model's arrays for which `trains` is true.
        """
        del trains
        return tree

    def host(self, tree: PyTree) -> Any:
        """`tree`'s arrays read back to numpy: waits for them only, not for work queued
        after them.
        """
        return jax.tree.map(np.asarray, copying(tree))

    def rows(self, data: PyTree) -> int:
        """The rows of `data` placed by `put`: its leading axis's length."""
        return jax.tree.leaves(data)[0].shape[0]

    def full_batch(
        self, data: PyTree, index: UInt32[Array, " batch"], consecutive: bool = False
    ) -> PyTree:
        return take_rows(data, index, consecutive)

    def remainder_batch(
        self, data: PyTree, index: UInt32[Array, " batch"], consecutive: bool = False
    ) -> PyTree:
        return take_rows(data, index, consecutive)


@dataclasses.dataclass(frozen=True)
class Pmap:
    """Data parallel with `eqx.filter_pmap`: one replica of everything per device.

    Each full batch is split evenly over the devices, and the step averages losses and
    gradients with `lax.pmean`. The remainder batch, which need not split evenly, is
    computed whole on every device, so the replicas stay identical without a pmean.
    """

    devices: tuple[Device, ...]
    axis_name: str = "devices"

    def compile(
        self, fn: Callable, donate: tuple[int, ...] = (), options: CompilerOptions = ()
    ) -> Callable:
        # filter_pmap cannot donate some arguments and not others. Arrays are mapped over
        # their leading (device) axis, but for the last argument, the stop position,
        # which every device shares. It takes no compiler options: those are for a run
        # without the NaN guard, which `pmap` never is (`_replay.unreplayable`).
        del donate, options
        return eqx.filter_pmap(
            fn,
            in_axes=(eqx.if_array(0), eqx.if_array(0), None),
            axis_name=self.axis_name,
            devices=self.devices,  # type: ignore[arg-type]
        )

    def put(self, tree: PyTree, *, sharded: bool = False) -> PyTree:
        del sharded  # every device keeps the whole dataset and gathers its share
        arrays, rest = eqx.partition(tree, eqx.is_array)
        return eqx.combine(_replicate(self.devices)(arrays), rest)

    def get(self, tree: PyTree) -> PyTree:
        arrays, rest = eqx.partition(tree, eqx.is_array)
        return eqx.combine(_first_replica(arrays), rest)

    def constant(self, tree: PyTree) -> PyTree:
        return tree  # `pmap` sends an argument it does not map to every device at each call

    def start_inputs(self, tree: PyTree, trains: tuple[bool, ...]) -> PyTree:
        del trains
        return tree  # the state is made on one device, then replicated

    def host(self, tree: PyTree) -> Any:
        # On the host: a compiled `get` would queue behind the work dispatched since.
        return jax.tree.map(lambda x: np.asarray(x)[0], copying(tree))

    def rows(self, data: PyTree) -> int:
        return jax.tree.leaves(data)[0].shape[1]  # after the devices' axis

    def full_batch(
        self, data: PyTree, index: UInt32[Array, " batch"], consecutive: bool = False
    ) -> PyTree:
        share = index.shape[0] // len(self.devices)
        start = jax.lax.axis_index(self.axis_name) * share
        return take_rows(data, jax.lax.dynamic_slice_in_dim(index, start, share), consecutive)

    def remainder_batch(
        self, data: PyTree, index: UInt32[Array, " batch"], consecutive: bool = False
    ) -> PyTree:
        return take_rows(data, index, consecutive)


@dataclasses.dataclass(frozen=True)
class Sharded:
    """Data parallel through sharding: the data split over the mesh's first axis, the
    parameters replicated, and one SPMD program that XLA partitions. The mesh may span
    several processes started with `jax.distributed.initialize`; then each process passes
    its own part of the data.
    """

    mesh: Mesh
    # With `shard=`: the layout of each array of the model, in order (`split_arrays`'s);
    # `None`: every array replicated.
    specs: tuple[P, ...] | None = None
    axis_name: None = None  # XLA partitions the program: the step needs no collective

    @property
    def axis(self) -> str:
        return self.mesh.axis_names[0]

    @property
    def num_devices(self) -> int:
        return self.mesh.shape[self.axis]

    def compile(
        self, fn: Callable, donate: tuple[int, ...] = (), options: CompilerOptions = ()
    ) -> Callable:
        return jax.jit(fn, donate_argnums=donate, compiler_options=dict(options) or None)

    def put(self, tree: PyTree, *, sharded: bool = False) -> PyTree:
        spec = P(self.axis) if sharded else P()
        sharding = NamedSharding(self.mesh, spec)
        multiprocess = jax.process_count() > 1

        def place(x: Any) -> Any:
            if not eqx.is_array(x):
                return x
            if _laid_out_on(x, self.mesh):
                return x  # laid out by the program already (`shard=`): keep its layout
            if multiprocess:
                # Each process holds its own rows of the data (and a full copy of
                # everything replicated); JAX stitches them into one global array.
                if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                    bits = jax.make_array_from_process_local_data(
                        sharding, np.asarray(jax.random.key_data(x))
                    )
                    return jax.random.wrap_key_data(bits, impl=jax.random.key_impl(x))
                local = sum(d.process_index == jax.process_index() for d in self.mesh.devices.flat)
                if sharded and x.shape[0] % local:
                    raise ValueError(
                        "With a mesh over several processes each passes its own rows of "
                        f"`data`: process {jax.process_index()} passed {x.shape[0]} rows, "
                        f"which do not split evenly over its {local} devices in the mesh."
                    )
                return jax.make_array_from_process_local_data(sharding, np.asarray(x))
            if sharded and x.shape[0] % self.num_devices:
                return jax.device_put(x, NamedSharding(self.mesh, P()))
            return jax.device_put(x, sharding)

        return jax.tree.map(place, tree)

    def get(self, tree: PyTree) -> PyTree:
        return tree

    def constant(self, tree: PyTree) -> PyTree:
        return self.put(tree)  # replicated

    def start_inputs(self, tree: PyTree, trains: tuple[bool, ...]) -> PyTree:
        # With `shard=`, the program that makes the state lays it out over the mesh, so
        # it runs over the mesh: its arguments go there. The arrays that train go
        # straight to their layouts (each device gets its share, never the whole array),
        # unless laid out already (a model built by `eqfit.sharding.init` is); the rest
        # is replicated. Over several processes each passes its whole model, which `put`
        # stitches together replicated, and the program lays it out.
        if self.specs is None:
            return tree
        params = tree.params
        if jax.process_count() == 1:
            specs = [spec for spec, t in zip(self.specs, trains) if t]
            layouts = [NamedSharding(self.mesh, _trimmed(spec)) for spec in specs]
            params = [
                x if _laid_out_on(x, self.mesh) else jax.device_put(x, layout)
                for x, layout in zip(params, layouts)
            ]
        return self.put(tree._replace(params=params))

    def host(self, tree: PyTree) -> Any:
        return jax.tree.map(np.asarray, copying(tree))

    def rows(self, data: PyTree) -> int:
        return jax.tree.leaves(data)[0].shape[0]  # the global array's

    # Gathered even where the rows are consecutive (`consecutive`): a slice of the data
    # laid out over the mesh at any offset is no cheaper for XLA to partition.
    def full_batch(
        self, data: PyTree, index: UInt32[Array, " batch"], consecutive: bool = False
    ) -> PyTree:
        return eqx.filter_shard(take(data, index), NamedSharding(self.mesh, P(self.axis)))

    def remainder_batch(
        self, data: PyTree, index: UInt32[Array, " batch"], consecutive: bool = False
    ) -> PyTree:
        splits = index.shape[0] % self.num_devices == 0
        spec = P(self.axis) if splits else P()
        return eqx.filter_shard(take(data, index), NamedSharding(self.mesh, spec))


Placement = OneDevice | Pmap | Sharded


def placement_devices(placement: Placement) -> list[Any]:
    """The devices that train under `placement`."""
    if isinstance(placement, Pmap):
        return list(placement.devices)
    if isinstance(placement, Sharded):
        return list(placement.mesh.devices.flat)
    return [jax.devices()[0]]


def choose_placement(
    devices: int | Sequence[Device] | None,
    mesh: Mesh | None,
    batch_size: int | None,
    specs: tuple[P, ...] | None = None,
) -> Placement:
    """Checks `devices` and `mesh` against each other (and against `batch_size`, if
    given); returns a placement.
    """
    if devices is not None and mesh is not None:
        raise ValueError(
            "Give `devices=` (pmap) or `mesh=` (sharding), not both: "
            f"got {_count(devices)} devices and a mesh of shape {dict(mesh.shape)}."
        )
    if mesh is not None:
        # eqfit places every array itself and constrains each batch inside the program,
        # which needs the mesh's axes in "auto" mode (`jax.make_mesh` makes explicit ones).
        auto = (AxisType.Auto,) * len(mesh.axis_names)
        placement: Placement = Sharded(Mesh(mesh.devices, mesh.axis_names, axis_types=auto), specs)
    elif devices is not None:
        available = jax.local_devices()
        if isinstance(devices, int) and not isinstance(devices, bool):
            if devices < 1 or devices > len(available):
                raise ValueError(
                    f"`devices={devices}` asks for {devices} devices, but "
                    f"{len(available)} local devices are available ({available})."
                )
            chosen = tuple(available[:devices])
        else:
            chosen = tuple(devices)  # type: ignore[arg-type]
            if not chosen:
                raise ValueError("`devices` is empty: give at least one device.")
            missing = [d for d in chosen if d not in available]
            if missing:
                raise ValueError(
                    f"`devices` names {missing}, which are not among this process's "
                    f"{len(available)} local devices."
                )
        placement = Pmap(chosen)
    else:
        placement = OneDevice()
    if batch_size is not None:
        check_batch_split(placement, batch_size)
    return placement


def param_specs(placement: Placement) -> tuple[P, ...] | None:
    """The layout of each array of the model that `shard=` asked for; `None`: replicated."""
    return placement.specs if isinstance(placement, Sharded) else None


def split_count(placement: Placement) -> int:
    """How many shares a full batch is split into: one per device that trains."""
    if isinstance(placement, Pmap):
        return len(placement.devices)
    if isinstance(placement, Sharded):
        return placement.num_devices
    return 1


def check_batch_split(placement: Placement, batch_size: int, microbatches: int = 1) -> None:
    """Refuses a `batch_size` that does not split evenly over the placement's devices,
    and, with `microbatches=k`, each device's share into `k` microbatches.
    """
    count = split_count(placement)
    what = f"the mesh axis {placement.axis!r}" if isinstance(placement, Sharded) else "the devices"
    if batch_size % count:
        lower, upper = (batch_size // count) * count, -(-batch_size // count) * count
        raise ValueError(
            f"`batch_size`={batch_size} does not split evenly over {count} devices "
            f"({what}); use a multiple of {count}, such as {lower or upper} or {upper}."
        )
    parts = count * microbatches
    if batch_size % parts:
        lower, upper = (batch_size // parts) * parts, -(-batch_size // parts) * parts
        over = f" on each of {count} devices" if count > 1 else ""
        if lower == 0:  # more microbatches than rows
            such = f"such as {upper}, or at most {batch_size // count} microbatches"
        else:
            such = f"such as {lower} or {upper}"
        raise ValueError(
            f"`microbatches`={microbatches} does not split `batch_size`={batch_size} "
            f"evenly{over}; use a batch size that is a multiple of {parts}, {such}."
        )


def microbatch_rows(
    placement: Placement, batch_size: int, microbatches: int, rows: int | None = None
) -> int | None:
    """With `microbatches=k`, the rows of one microbatch of the batch the step sees: of a
    full batch (`rows=None`), `batch_size / k` (each device's share of it under
    `devices=`); of a pass's smaller last batch of `rows` rows, as many rows per device as
    a full batch's microbatch has, on each device that computes it whole. `None`: no
    microbatches.
    """
    if microbatches == 1:
        return None
    count = split_count(placement)
    per_device = batch_size // (count * microbatches)
    if isinstance(placement, Pmap):  # the step sees a device's share
        return per_device
    if isinstance(placement, Sharded) and (rows is None or rows % count == 0):
        return per_device * count  # the step sees the batch, split over the devices
    return per_device


def _count(devices: Any) -> int:
    return devices if isinstance(devices, int) else len(devices)


# Moving a run's few dozen arrays to and from the replicas one by one costs a dispatch
# each; one compiled call each way does it in a single dispatch.
@functools.cache
def _replicate(devices: tuple[Device, ...]) -> Callable:
    n = len(devices)
    sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d"))
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)  # noqa: E731
    return jax.jit(stack, out_shardings=sharding)


@jax.jit
def _first_replica(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x[0], tree)


def global_rows(placement: Placement, rows: int | None) -> int | None:
    """The rows of a pass over the whole mesh: with a mesh over several processes, each
    passes its own rows, and they must agree (checked, all processes taking part) before
    anything trains.
    """
    if rows is None or not isinstance(placement, Sharded) or jax.process_count() == 1:
        return rows
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(np.int64(rows))).reshape(-1)
    if (every != rows).any():
        raise ValueError(
            "With a mesh over several processes each passes its own rows of `data`, as "
            f"many as every other: the processes passed {every.tolist()} rows (by process "
            "index), which differ."
        )
    return rows * jax.process_count()


def _trimmed(spec: P) -> P:
    """`spec` without trailing `None`s, as a program's outputs name the same layout (so the
    trained model's arrays say `P("model")`, not `P("model", None)`, whatever came in).
    """
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def _laid_out_on(x: Any, mesh: Mesh) -> bool:
    """Whether `x` is a JAX array laid out over `mesh` already."""
    if not isinstance(x, jax.Array):
        return False
    return isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
