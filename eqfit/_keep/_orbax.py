"""Checkpoints of sharded state, kept by Orbax: each process writes its own shards."""

import hashlib
import os
import re
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np
from jaxtyping import PyTree

from .._core._extras import require_orbax
from .._core._policy import KEEP
from ._checkpoint import Checkpoints, NotLike, position
from ._files import fsync_dir


class ShardedCheckpoints(Checkpoints):
    """A directory of training checkpoints whose state is sharded over devices, and maybe
    over processes, so that no process holds all of it.

    The directory works as `Checkpoints`' does (folders `ckpt-<epoch>-<step>`, a manifest,
    an atomic rename, the newest `keep` kept and the best with `best`, a lock, damaged
    checkpoints skipped with a warning, another configuration's refused), but a
    checkpoint's state is an Orbax PyTree checkpoint in its subfolder `state/`: the flat
    dict `{"0": leaf, "1": ...}` of the state's arrays, in the order of `jax.tree.leaves`.
    The manifest lists each array's path, shape and dtype under `"arrays"`, and its
    `sha256` covers every file of `state/`.

    Every process must call `save` and `restore`. Each writes its own shards into one
    temporary folder, `.tmp-ckpt-<epoch>-<step>-<n>`; process 0 then writes the manifest and
    renames the folder into place, while the others wait. (Orbax and this directory
    expect one filesystem that every process sees.) With several processes a full disk
    is an error at once, not retried after removing the oldest checkpoint, as the others
    could not know to write again. `orbax-checkpoint` is needed only here, and imported
    on the first save or restore.

    !!! example "Reading a checkpoint without eqfit"

        On any devices, even one, as numpy arrays:

        ```python
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        path = "run/ckpt-000004-000000/state"
        checkpointer = ocp.PyTreeCheckpointer()
        metadata = checkpointer.metadata(path).item_metadata
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
        arrays = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        ```

        `arrays["0"]`, `arrays["1"]`, ... are the state's leaves; `manifest.json` beside
        `state/` says which is which.

    **Arguments:**

    - `directory`: where the checkpoints live; created if missing.
    - `config`: what identifies the run (JSON). A checkpoint written under another
        configuration is refused, not loaded.
    - `steps_per_epoch`: to name checkpoints by epoch.
    - `writer`: whether this process commits checkpoints. It must be process 0, Orbax's
        primary process; by default, it is.
    """

    storage: ClassVar[str | None] = "orbax"
    collective: ClassVar[bool] = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: dict[str, Any],
        steps_per_epoch: int,
        *,
        writer: bool | None = None,
        keep: int = KEEP,
        best: tuple[str, str] | None = None,
        allow: Collection[str] = (),
    ):
        require_orbax()
        primary = jax.process_index() == 0
        if writer is not None and writer != primary:
            raise ValueError(
                f"`writer={writer}` in process {jax.process_index()}: the writer of sharded "
                "checkpoints must be process 0, which commits what Orbax writes. Leave "
                "`writer` out."
            )
        super().__init__(
            directory, config, steps_per_epoch, writer=primary, keep=keep, best=best, allow=allow
        )
        self.attempts = 0  # writes begun, which name their temporary folders

    def save(self, state: PyTree, value: float | None = None) -> Path | None:
        """Writes the training state as a checkpoint at its position, and prunes old ones.
        Every process calls it; each writes the shards it holds.

        **Arguments:**

        - `state`: the training state, a PyTree of `jax.Array`s (sharded or not, global
            across processes or not; not a host copy) and `None`s. It has fields `step`
            and `reason`, which give its position (see `position`).

        **Returns:**

        The checkpoint's folder in process 0; `None` in the others.
        """
        return super().save(state, value)

    def restore(
        self, like: PyTree, grows: Callable[[dict[str, Any]], PyTree | None] | None = None
    ) -> PyTree | None:
        """The newest good checkpoint's state, laid out as `like` asks; `None` if there is
        none. Every process calls it. A damaged checkpoint is skipped with a warning,
        falling back to the one before it; one from another configuration raises
        `ValueError`, as does a `like` that does not describe the saved state.

        **Arguments:**

        - `like`: the state's structure, with a `jax.ShapeDtypeStruct` for each array
            that carries the `sharding` to restore it with (or a `jax.Array` laid out so).
            The mesh and the specs may differ from those the checkpoint was saved with;
            the paths, shapes and dtypes may not.
        - `grows`: as `Checkpoints.restore`'s, the shape to read a shorter run's
            checkpoint into, which this run continues.

        **Returns:**

        A PyTree of `like`'s structure, each array a `jax.Array` with its leaf's sharding.
        """
        for path, leaf in jax.tree_util.tree_leaves_with_path(like):
            where = jax.tree_util.keystr(path) or "itself"
            if not isinstance(leaf, jax.ShapeDtypeStruct | jax.Array):
                raise TypeError(
                    f"`like`'s leaf {where} is a {type(leaf).__name__}: give a "
                    "`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` for every array."
                )
            if leaf.sharding is None:
                raise TypeError(
                    f"`like`'s leaf {where} has no sharding: give it the sharding to "
                    "restore onto, `jax.ShapeDtypeStruct(shape, dtype, sharding=...)`."
                )
        return super().restore(like, grows)

    def _position(self, state: PyTree) -> int:
        # `position` reads the step on the host; each process has its own copy when the
        # step is replicated, and gathers it otherwise (every process is here).
        return position(_OnHost(_host(state.step), _host(state.reason)))

    def _encode(self, state: PyTree) -> Any:
        leaves = jax.tree_util.tree_leaves_with_path(state)
        for path, leaf in leaves:
            if not isinstance(leaf, jax.Array | np.ndarray | np.generic):
                raise TypeError(
                    f"The state's leaf {jax.tree_util.keystr(path)} is a "
                    f"{type(leaf).__name__}: sharded checkpoints hold arrays (and `None`s) "
                    "alone. Make it an array, or keep it out of the state."
                )
        if not leaves:
            raise ValueError("The state holds no arrays: there is nothing to checkpoint.")
        # Orbax refuses arrays of no elements (a run without metrics records an empty
        # column of them); their shape and dtype, in the manifest, are all they hold.
        arrays = {str(i): leaf for i, (_, leaf) in enumerate(leaves) if np.size(leaf)}
        return arrays, _describe(leaves)

    def _temporary(self, final: Path) -> Path:
        # The same name in every process, each of which writes its shards there, and a
        # new one for each attempt: a retry must not meet a failed write's late files.
        self.attempts += 1
        tmp = self.directory / f".tmp-{final.name}-{self.attempts}"
        if self.writer:
            tmp.mkdir()
        return tmp

    def _write_state(self, folder: Path, payload: Any) -> dict[str, Any]:
        import orbax.checkpoint as ocp

        arrays, described = payload
        # Orbax's own async checkpointing (`AsyncCheckpointer`) is not needed: in one
        # process, where the checkpoint is written in the background, this whole write runs
        # in eqfit's writer thread from a copy made on the device, so the training waits
        # for no part of it; with several processes it is made in the training thread, in
        # step with the training's collectives (`in_background`).
        try:
            # Collective: Orbax's primary process (0) makes its temporary folder
            # `state.orbax-checkpoint-tmp`, every process writes its shards, and the primary
            # renames it to `state` once all are written. Uncompressed: trained weights'
            # low bits are noise, so compression saves little space and costs time on both
            # save and restore (Orbax reads either kind).
            checkpointer = ocp.PyTreeCheckpointer(use_compression=False)
            checkpointer.save(folder / "state", args=ocp.args.PyTreeSave(arrays))
        except (ValueError, RuntimeError) as e:
            # Orbax returns at the first failed write, while TensorStore may still be
            # writing others: let them end before the folder is removed.
            _wait_until_still(folder)
            # TensorStore reports a failed write (a full disk) as a `ValueError` with the
            # OS's error code; as an `OSError`, a full disk is handled as `state.eqx`'s is.
            code = re.search(r"os_error_code='(\d+)'", str(e))
            if code is None:
                raise OSError(f"Orbax could not write it ({type(e).__name__}: {e})") from None
            errno = int(code[1])
            raise OSError(errno, os.strerror(errno), str(e)) from None  # `str(e)`: details
        return {
            "sha256": "",  # taken by the commit (`_sync_state`), in the writer's thread
            "storage": self.storage,
            "orbax_checkpoint": ocp.__version__,
            "arrays": described,
        }

    def _sync_state(self, folder: Path) -> dict[str, Any]:
        # Orbax's files fsynced as their digest is taken, by the writer alone, which
        # writes the manifest: in the commit, which runs beside training where the
        # checkpoint is written in the background or the training thread wrote its shards.
        if not self.writer:
            return {}
        return {"sha256": _digest(folder / "state", sync=True)}

    def _size(self, payload: Any, head: dict[str, Any]) -> int:
        arrays, _ = payload
        return sum(int(x.nbytes) for x in arrays.values())  # the manifest aside

    def _check_state(self, folder: Path, manifest: dict[str, Any]) -> None:
        if not isinstance(manifest.get("arrays"), list):
            raise ValueError("its manifest has no list 'arrays'")
        if not (folder / "state").is_dir():
            raise ValueError("it has no Orbax state folder `state/`")
        try:
            digest = _digest(folder / "state")
        except OSError as e:
            raise ValueError(f"its state cannot be read ({e.strerror})") from None
        if digest != manifest.get("sha256"):  # Orbax's state has a SHA-256 alone
            raise ValueError("its contents do not match the checksum in its manifest")

    def _read_state(self, folder: Path, manifest: dict[str, Any], like: PyTree) -> PyTree:
        import orbax.checkpoint as ocp

        leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
        _check_like(folder, manifest["arrays"], _describe(leaves))
        targets = {str(i): leaf for i, (_, leaf) in enumerate(leaves) if np.prod(leaf.shape)}
        # Each array is read straight into the target's shards, whatever the mesh and
        # layout it was saved with.
        restore_args = ocp.checkpoint_utils.construct_restore_args(targets)
        restored = ocp.PyTreeCheckpointer().restore(
            folder / "state", args=ocp.args.PyTreeRestore(item=targets, restore_args=restore_args)
        )

        def empty(leaf: Any) -> jax.Array:
            return jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)

        arrays = [restored.get(str(i)) for i in range(len(leaves))]
        arrays = [empty(leaf) if a is None else a for a, (_, leaf) in zip(arrays, leaves)]
        return jax.tree_util.tree_unflatten(treedef, arrays)


class _OnHost:
    """The fields of the state that `position` reads, as host arrays."""

    def __init__(self, step: np.ndarray, reason: np.ndarray):
        self.step, self.reason = step, reason


def _host(x: Any) -> np.ndarray:
    """An array's value on this host, whatever processes hold its shards."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _describe(leaves: list[tuple[Any, Any]]) -> list[list[Any]]:
    """Each array's path, shape and dtype, as JSON; as `describe`, but of every leaf,
    `jax.ShapeDtypeStruct`s included.
    """
    return [[jax.tree_util.keystr(path), list(x.shape), str(x.dtype)] for path, x in leaves]


def _check_like(folder: Path, saved: list[Any], wanted: list[list[Any]]) -> None:
    """Refuses a `like` that does not describe the saved arrays, naming the first
    difference.
    """
    if saved == wanted:
        return
    for i, (old, new) in enumerate(zip(saved, wanted)):
        if old != new:
            what = f"its array {i} is {_one(old)}, where `like` has {_one(new)}"
            break
    else:
        what = f"it holds {len(saved)} arrays, where `like` has {len(wanted)}"
    raise NotLike(
        f"`like` does not describe the state in the checkpoint {folder}: {what}. Give "
        "`like` the saved state's structure, shapes and dtypes, with the shardings to "
        "restore onto."
    )


def _one(entry: Any) -> str:
    path, shape, dtype = entry
    return f"{path or 'the state'} of shape {tuple(shape)} and dtype {dtype}"


def _wait_until_still(folder: Path, *, still: float = 0.25, limit: float = 10.0) -> None:
    """Waits until no file under `folder` has changed for `still` seconds (at most
    `limit` seconds in all).
    """

    def files() -> list[tuple[str, int, int]]:
        found = []
        for path in folder.rglob("*"):
            try:
                status = path.stat()
            except OSError:  # removed meanwhile
                continue
            found.append((str(path), status.st_size, status.st_mtime_ns))
        return sorted(found)

    start = last_change = time.monotonic()
    seen = files()
    while time.monotonic() - last_change < still and time.monotonic() - start < limit:
        time.sleep(0.05)
        now = files()
        if now != seen:
            seen, last_change = now, time.monotonic()


def _digest(root: Path, *, sync: bool = False) -> str:
    """A SHA-256 over the files under `root`: each one's relative path, size and
    contents, in the order of their paths. With `sync`, also fsyncs them and their
    folders, as the checkpoint is committed.
    """
    digest = hashlib.sha256()
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())
    for name, path in files:
        with open(path, "rb") as f:
            encoded = name.encode()
            size = os.fstat(f.fileno()).st_size
            digest.update(b"%d:%s:%d:" % (len(encoded), encoded, size))
            while chunk := f.read(1 << 20):
                digest.update(chunk)
            if sync:
                os.fsync(f.fileno())
    if sync:
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            fsync_dir(folder)
    return digest.hexdigest()
