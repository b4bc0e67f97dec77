"""Sharded checkpoints through Orbax: each array back bit for bit and laid out as asked, on
another mesh or fewer devices, the directory's rules kept, and readable by Orbax alone.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from helpers import worker_env
from jax.sharding import NamedSharding, PartitionSpec as P

import eqfit
from eqfit._keep._checkpoint import Checkpoints
from eqfit._keep._orbax import ShardedCheckpoints


pytest.importorskip("orbax.checkpoint")

CONFIG = {"run": "test_orbax"}


class State(NamedTuple):
    """A training state as eqfit's: a NamedTuple of arrays, a dict of them and a `None`."""

    params: dict[str, Any]
    opt_state: Any
    step: Any
    reason: Any


def host_state(step: int) -> State:
    rng = np.random.default_rng(step)
    return State(
        params={
            "w": rng.normal(size=(16, 8)).astype(np.float32),
            "b": rng.normal(size=(16,)).astype(np.float32),
        },
        opt_state=None,
        step=np.int32(step),
        reason=np.int32(0),
    )


def mesh(shape, names):
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.sharding.Mesh(np.array(devices).reshape(shape), names)


# The state's layout at save time: its big arrays split over 8 devices, its scalars
# replicated.
SAVED = {"w": P("data"), "b": P("data"), "scalar": P()}
# Layouts to restore onto: the same, another mesh with other specs, and 4 devices.
TARGETS = {
    "same layout": (((8,), ("data",)), SAVED),
    "a (2, 4) mesh": (
        ((2, 4), ("data", "model")),
        {"w": P("model", "data"), "b": P(("data", "model")), "scalar": P()},
    ),
    "4 devices": (((4,), ("data",)), {"w": P(None, "data"), "b": P(), "scalar": P()}),
}


def shardings(on, specs) -> State:
    named = lambda spec: NamedSharding(on, spec)  # noqa: E731
    return State(
        params={"w": named(specs["w"]), "b": named(specs["b"])},
        opt_state=None,
        step=named(specs["scalar"]),
        reason=named(specs["scalar"]),
    )


def placed(state: State, layout: State) -> State:
    return jax.tree.map(jax.device_put, state, layout)


def like(state: State, layout: State) -> State:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, layout
    )


def saved_layout() -> State:
    return shardings(mesh((8,), ("data",)), SAVED)


def assert_restored(restored, expected: State, layout: State):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for got, want, sharding in zip(
        jax.tree.leaves(restored), jax.tree.leaves(expected), jax.tree.leaves(layout)
    ):
        assert isinstance(got, jax.Array)
        assert got.sharding == sharding
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), strict=True)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()  # bit for bit


def store(directory, config=CONFIG) -> ShardedCheckpoints:
    return ShardedCheckpoints(directory, config, steps_per_epoch=1)


def save(directory, *steps: int) -> list[Path]:
    """Saves the states of these steps, laid out as `SAVED`, through one store."""
    with contextlib.closing(store(directory)) as checkpoints:
        paths = [checkpoints.save(placed(host_state(step), saved_layout())) for step in steps]
    assert None not in paths
    return paths


def restore(directory, state: State, layout: State, config=CONFIG):
    with contextlib.closing(store(directory, config)) as checkpoints:
        return checkpoints.restore(like(state, layout))


@pytest.mark.parametrize("target", list(TARGETS))
def test_restores_bitwise_onto_any_layout(tmp_path, target):
    assert len(jax.devices()) == 8
    save(tmp_path, 3)
    (shape, names), specs = TARGETS[target]
    layout = shardings(mesh(shape, names), specs)
    restored = restore(tmp_path, host_state(3), layout)  # as a new run would
    assert_restored(restored, host_state(3), layout)
    w = restored.params["w"]  # each device holds its own shard, no more
    assert {s.data.shape for s in w.addressable_shards} == {w.sharding.shard_shape(w.shape)}


def test_layout_of_the_directory(tmp_path):
    [path] = save(tmp_path, 3)
    assert path == tmp_path / "ckpt-000003-000000"
    assert {p.name for p in path.iterdir()} == {"manifest.json", "state"}
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["storage"] == "orbax" and manifest["sequence"] == 1
    assert manifest["arrays"] == [
        [".params['b']", [16], "float32"],
        [".params['w']", [16, 8], "float32"],
        [".step", [], "int32"],
        [".reason", [], "int32"],
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_keeps_the_last_two(tmp_path):
    save(tmp_path, 1, 2, 3, 4)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [
        "ckpt-000003-000000",
        "ckpt-000004-000000",
    ]
    restored = restore(tmp_path, host_state(4), saved_layout())
    assert_restored(restored, host_state(4), saved_layout())


def truncate_largest(state: Path):
    largest = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:-8])


def alter_a_byte(state: Path):
    data = max((p for p in state.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF
    data.write_bytes(bytes(content))


CORRUPTIONS = {
    "truncated file": (truncate_largest, "do not match the checksum"),
    "altered byte": (alter_a_byte, "do not match the checksum"),
    "file removed": (lambda state: (state / "_METADATA").unlink(), "do not match the checksum"),
    "state removed": (shutil.rmtree, "no Orbax state folder"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_damaged_checkpoint_is_skipped_for_the_one_before(tmp_path, corruption):
    save(tmp_path, 1, 2)
    damage, why = CORRUPTIONS[corruption]
    damage(tmp_path / "ckpt-000002-000000" / "state")
    with pytest.warns(UserWarning, match=rf"Skipping checkpoint .*ckpt-000002-000000: .*{why}"):
        restored = restore(tmp_path, host_state(1), saved_layout())
    assert_restored(restored, host_state(1), saved_layout())


def test_a_checkpoint_from_another_configuration_is_refused(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(ValueError, match=r"different training configuration.*What differs: run"):
        restore(tmp_path, host_state(1), saved_layout(), {"run": "another"})


def test_a_directory_in_use_is_refused(tmp_path):
    checkpoints = store(tmp_path)
    with pytest.raises(eqfit.CheckpointError, match=rf"in use by another run \(pid {os.getpid()}"):
        store(tmp_path)
    checkpoints.close()
    store(tmp_path).close()  # free again


def test_each_store_refuses_the_other_kind(tmp_path):
    save(tmp_path / "sharded", 1)
    with contextlib.closing(Checkpoints(tmp_path / "sharded", CONFIG, 1)) as plain:
        with pytest.raises(ValueError, match=r"keeps its state as an Orbax checkpoint"):
            plain.restore(host_state(1))
    with contextlib.closing(Checkpoints(tmp_path / "plain", CONFIG, 1)) as plain:
        plain.save(host_state(1))
    with pytest.raises(ValueError, match=r"keeps its state as one file, `state.eqx`"):
        restore(tmp_path / "plain", host_state(1), saved_layout())


def test_like_must_describe_the_state_with_shardings(tmp_path):
    save(tmp_path, 1)
    state = host_state(1)
    without = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    other = state._replace(params={**state.params, "w": np.zeros((16, 4), np.float32)})
    with contextlib.closing(store(tmp_path)) as checkpoints:
        with pytest.raises(TypeError, match=r"`like`'s leaf \.params\['b'\] has no sharding"):
            checkpoints.restore(without)
        with pytest.raises(TypeError, match=r"`like`'s leaf \.params\['b'\] is a ndarray"):
            checkpoints.restore(state)
        with pytest.raises(
            ValueError, match=r"its array 1 is \.params\['w'\] of shape \(16, 8\) .* \(16, 4\)"
        ):
            checkpoints.restore(like(other, saved_layout()))
        with pytest.raises(TypeError, match=r"leaf \.params\['w'\]\[0\] is a float"):
            checkpoints.save(state._replace(params={**state.params, "w": [1.0]}))
        # Arrays already laid out serve as well as `jax.ShapeDtypeStruct`s.
        assert_restored(checkpoints.restore(placed(state, saved_layout())), state, saved_layout())


def run_python(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = worker_env()
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.heavy
def test_importing_eqfit_imports_no_orbax():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import eqfit, eqfit._keep._orbax"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eqfit._keep._orbax" in done.stderr and "orbax" not in done.stderr.replace(
        "eqfit._keep._orbax", ""
    )


# Orbax's documented recipe, as `ShardedCheckpoints`' docstring gives it, in a process
# with one CPU device and no eqfit.
ORBAX_ALONE = """
    import sys

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    assert len(jax.devices()) == 1 and "eqfit" not in sys.modules
    path, out = sys.argv[1:]
    checkpointer = ocp.PyTreeCheckpointer()
    metadata = checkpointer.metadata(path).item_metadata
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
    arrays = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    assert all(type(x) is np.ndarray for x in arrays.values())
    np.savez(out, **arrays)
    assert "eqfit" not in sys.modules
"""


@pytest.mark.heavy
def test_orbax_alone_reads_it_on_one_device(tmp_path):
    state = host_state(5)
    [path] = save(tmp_path / "run", 5)
    done = run_python(ORBAX_ALONE, str(path / "state"), str(tmp_path / "arrays.npz"))
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "arrays.npz") as arrays:
        read = [arrays[str(i)] for i in range(len(arrays.files))]
    for got, want in zip(read, jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(got, want, strict=True)


# A save to a disk with no room: files over 16 KiB cannot be written (RLIMIT_FSIZE).
FULL_DISK = """
    import resource
    import sys
    from typing import Any, NamedTuple

    import jax
    import numpy as np

    from eqfit import CheckpointError
    from eqfit._keep._orbax import ShardedCheckpoints

    class State(NamedTuple):
        w: Any
        step: Any
        reason: Any

    w = np.random.default_rng(0).normal(size=2**18).astype(np.float32)  # incompressible
    state = State(*map(jax.numpy.asarray, (w, np.int32(1), np.int32(0))))
    checkpoints = ShardedCheckpoints(sys.argv[1], {}, 1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**14, 2**14))
    try:
        checkpoints.save(state)
    except CheckpointError as e:
        print(e)
"""


@pytest.mark.heavy
def test_a_full_disk_is_an_error_naming_the_directory_and_bytes(tmp_path):
    done = run_python(FULL_DISK, str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    message = f"The checkpoint directory {tmp_path} has no room for a checkpoint of 1048584 bytes"
    assert message in done.stdout
    assert {p.name for p in tmp_path.iterdir()} == {".lock"}  # no litter


# One process of two, four CPU devices each, joined by `jax.distributed`: a state sharded
# over all eight devices, saved, then restored onto another layout.
TWO_PROCESSES = """
    import sys
    from typing import Any, NamedTuple

    import jax

    process, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)

    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from eqfit._keep._orbax import ShardedCheckpoints

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)

    def global_array(x, sharding):
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    class State(NamedTuple):
        w: Any
        step: Any
        reason: Any

    split = NamedSharding(Mesh(devices, ("data",)), P("data"))
    replicated = NamedSharding(split.mesh, P())
    state = State(
        global_array(w, split),
        global_array(np.asarray(7, np.int32), replicated),
        global_array(np.asarray(0, np.int32), replicated),
    )
    checkpoints = ShardedCheckpoints(directory, {"run": "two processes"}, 1)
    path = checkpoints.save(state)
    assert (path is not None) == (process == 0)
    other = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P("b", "a"))
    like = State(
        jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=other),
        jax.ShapeDtypeStruct((), np.int32, sharding=replicated),
        jax.ShapeDtypeStruct((), np.int32, sharding=replicated),
    )
    restored = checkpoints.restore(like)
    assert isinstance(restored, State) and restored.w.sharding == other
    for shard in restored.w.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
    assert int(restored.step.addressable_data(0)) == 7
    checkpoints.close()
    print("ok", flush=True)
    jax.distributed.shutdown()
"""


@pytest.mark.heavy
def test_two_processes_each_write_their_shards(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = worker_env()
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(TWO_PROCESSES),
                str(i),
                str(port),
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [w.communicate(timeout=180)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, log in zip(workers, logs):
        assert w.returncode == 0 and "ok" in log, log[-3000:]
    state = tmp_path / "ckpt-000007-000000" / "state"
    # Each process wrote its own shards.
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    manifest = json.loads((state.parent / "manifest.json").read_text())
    assert manifest["arrays"][0] == [".w", [16, 8], "float32"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
