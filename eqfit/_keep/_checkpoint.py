"""Checkpoints that survive a crash: atomic writes, a manifest, and a refusal to mix runs."""

import errno
import io
import json
import math
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, ClassVar

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from .._core._policy import KEEP
from .._core._version import __version__
from .._program._schedule import epochs_and_steps
from ._directory import check_writable, CheckpointError, lock
from ._files import (
    CHECKSUMS,
    file_checksum,
    folder_name,
    fsync_dir,
    read_leaves,
    write_file,
    write_leaves,
)
from ._fingerprint import changed, without_fingerprints
from ._writer import after, waited_for


FORMAT = 3  # 2: a sequence number orders checkpoints; 3: a CRC32, where 2 had a SHA-256
_NAME = re.compile(r"^ckpt-(\d{6})-(\d{6})$")


def versions() -> dict[str, str]:
    import optax

    return {
        "eqfit": __version__,
        "jax": jax.__version__,
        "equinox": eqx.__version__,
        "optax": optax.__version__,
    }


def position(state: Any) -> int:
    """Where a run stands, as a global step count: that of the members still training. An
    ensemble's members that stopped early are behind, and stay there; they must not hold
    the others back.
    """
    step = np.asarray(state.step).reshape(-1)
    stopped = np.asarray(state.reason).reshape(-1) != 0  # not `Stop.RUNNING`
    return int(step[~stopped].max() if (~stopped).any() else step.max())


class Checkpoints:
    """A directory of training checkpoints.

    Each checkpoint is a folder `ckpt-<epoch>-<step>` (the epochs done and the steps into
    the next) holding `state.eqx` (the training state and record, by
    `eqx.tree_serialise_leaves`) and `manifest.json` (a sequence number, the run's
    configuration, versions and the state file's CRC32; an earlier eqfit's SHA-256 is
    checked still). It is written into a temporary folder, fsynced, then renamed into
    place, so a crash mid-write never leaves a partial checkpoint under a checkpoint's
    name.

    Checkpoints are ordered by their sequence number, the order they were completed in,
    never by folder name. A folder whose manifest cannot be read, or whose files do not
    match it, is skipped with a warning and never counted among the `keep` kept.

    While a run uses the directory it holds a lock on it (`fcntl`), and on opening it
    removes the temporary folders of writes that were cut short. With several processes
    (`jax.distributed`), process 0 alone writes and holds the lock; the others read.

    How the state itself is written, checked and read is up to a subclass: it overrides
    `_encode`, `_write_state`, `_sync_state`, `_size`, `_check_state` and `_read_state`,
    and names its kind in `storage`, which its manifests carry. `ShardedCheckpoints` keeps an Orbax
    checkpoint this way, under the same directory rules.

    **Arguments:**

    - `directory`: where the checkpoints live; created if missing.
    - `config`: what identifies the run (JSON). A checkpoint written under another
        configuration is refused, not loaded.
    - `steps_per_epoch`: to name checkpoints by epoch.
    - `writer`: whether this process writes (process 0 of a `jax.distributed` run).
    - `keep`: how many of the newest checkpoints are kept.
    - `best`: `(name, mode)`: also keep the checkpoint whose manifest's monitored value
        (`save(..., value=)`) of that name is the best, the lowest (`"min"`) or highest
        (`"max"`), never rotated out.
    - `allow`: the fingerprints of `config` (`_fingerprint.py`'s, by name) that may
        differ from a checkpoint's: the changes a resume is told are meant. The others
        must match, or the checkpoint is refused, naming what differs.
    """

    # The manifest's "storage": how the state is kept. `None` (no such key): `state.eqx`.
    storage: ClassVar[str | None] = None
    # Whether every process writes a part of the state, so each takes part in `_write`.
    collective: ClassVar[bool] = False

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: dict[str, Any],
        steps_per_epoch: int,
        *,
        writer: bool = True,
        keep: int = KEEP,
        best: tuple[str, str] | None = None,
        allow: Collection[str] = (),
    ):
        self.steps_per_epoch, self.writer = steps_per_epoch, writer
        self.keep, self.best, self.allow = keep, best, allow
        self.directory = Path(directory)
        self.config = json.loads(json.dumps(config))  # normalised, as it will read back
        self.warned: set[str] = set()
        self.good: dict[str, tuple[int, Path, dict[str, Any]]] | None = None  # by name
        self.restored: dict[str, Any] | None = None  # the configuration `restore` read
        self._lock: Any = None
        if not writer:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"Cannot create the checkpoint directory {self.directory}: {e.strerror}."
            ) from None
        check_writable(self.directory)
        waited_for(self.directory)  # an earlier run's last write, going on after it
        self._lock = lock(self.directory)
        try:
            self._remove_litter()
        except BaseException:
            self.close()
            raise

    def learned(self, config: dict[str, Any], steps_per_epoch: int) -> None:
        """The run learned its epoch's length (a loader without `len`) before its first
        checkpoint: they are named by it and carry `config`, which holds it, as a resumed
        run's configuration does.
        """
        self.config = json.loads(json.dumps(config))
        self.steps_per_epoch = steps_per_epoch

    def close(self) -> None:
        """Releases the directory's lock."""
        if self._lock is not None:  # once the run's last write is done, if it goes on
            after(self.directory, self._lock.close)
            self._lock = None

    def _remove_litter(self) -> None:
        """Temporary folders left by writes cut short (a kill, a full disk)."""
        for path in self.directory.iterdir():
            if path.name.startswith((".tmp-", ".old-")) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def _checkpoints(self) -> list[tuple[int, Path, dict[str, Any]]]:
        """The good checkpoints, as `(sequence, folder, manifest)`, newest first.

        Each folder is checked once, when this run first looks: its manifest must read
        well and its state must match the manifest's checksum. Those that do not are
        skipped with a warning; those this run writes are known good.
        """
        if self.good is None:
            self.good = {}
            for folder in self.directory.iterdir() if self.directory.is_dir() else ():
                if not _NAME.match(folder.name) or not folder.is_dir():
                    continue
                try:
                    manifest = _read_manifest(folder)
                    # Another kind's state is not this class's to check: `restore` refuses
                    # it by name rather than skipping it as damaged.
                    if manifest.get("storage") == self.storage:
                        self._check_state(folder, manifest)
                except ValueError as e:
                    self._warn(folder, str(e))
                    continue
                self.good[folder.name] = (manifest["sequence"], folder, manifest)
        return sorted(self.good.values(), key=lambda entry: entry[0], reverse=True)

    def _warn(self, folder: Path, why: str) -> None:
        if folder.name not in self.warned:
            self.warned.add(folder.name)
            warnings.warn(f"Skipping checkpoint {folder}: {why}.", stacklevel=4)

    def save(self, state: PyTree, value: float | None = None) -> Path | None:
        """Writes the training state `state` (on the host) as a checkpoint at its position,
        and prunes old ones. If the disk is full, removes the oldest kept checkpoint and
        tries once more. Other processes of a `jax.distributed` run wait for the write.
        `value`: the epoch's monitored value (`best`'s name), kept in the manifest.
        """
        final = None
        if self.writer or self.collective:
            final = self._write(state, value)()
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("eqfit checkpoint written")
        return final if self.writer else None

    def begin(self, state: PyTree, value: float | None = None) -> Callable[[], Path | None]:
        """`save` in two parts: the state's file written now, from `state`'s buffers (the
        part that needs the state and the CPU); and the returned `commit()`, which waits
        for the disk to hold it (`fsync`), writes the manifest, renames the checkpoint
        into place and prunes, and needs neither: the caller may run it in another
        thread while the state's buffers are used again. Until `commit` returns, the
        checkpoint is not there (a kill leaves the one before it the newest). With
        several processes, all of `save` is done now.
        """
        if jax.process_count() > 1 or not self.writer:
            final = self.save(state, value)
            return lambda: final
        return self._write(state, value)

    def newest(self) -> Path | None:
        """The newest good checkpoint's folder, if there is one."""
        found = self._checkpoints()
        return found[0][1] if found else None

    def best_value(self) -> float | None:
        """The best monitored value among the checkpoints kept (`best`), if any."""
        best = self._best()
        return None if best is None else best[2]["monitor"]["value"]

    def _best(self) -> tuple[int, Path, dict[str, Any]] | None:
        """The kept checkpoint with the best monitored value (the newest among equals)."""
        if self.best is None:
            return None
        name, mode = self.best
        scored = [
            entry
            for entry in self._checkpoints()
            if entry[2].get("monitor", {}).get("name") == name
            and isinstance(entry[2]["monitor"].get("value"), float)
            and math.isfinite(entry[2]["monitor"]["value"])
        ]
        if not scored:
            return None
        sign = 1.0 if mode == "min" else -1.0
        return min(scored, key=lambda entry: (sign * entry[2]["monitor"]["value"], -entry[0]))

    def _prunable(self) -> list[Path]:
        """The checkpoints past the newest `keep`, but the best: to remove, oldest last."""
        best = self._best()
        return [f for _, f, _ in self._checkpoints()[self.keep :] if best is None or f != best[1]]

    def _write(self, state: PyTree, value: float | None = None) -> Callable[[], Path]:
        """Writes a checkpoint's state (the writer; with `collective`, every process,
        where only the writer lists, names, commits and prunes), and returns the rest of
        the write, to call once: the commit (`_commit`) and the pruning.
        """
        epoch, step = epochs_and_steps(self._position(state), self.steps_per_epoch)
        payload = self._encode(state)
        existing = self._checkpoints() if self.writer else []
        head: dict[str, Any] = {
            "format": FORMAT,
            "sequence": existing[0][0] + 1 if existing else 1,
            "epoch": epoch,
            "step": step,
        }
        if value is not None and self.best is not None:
            head["monitor"] = {"name": self.best[0], "value": float(value)}
        final = self.directory / folder_name(epoch, step)
        try:
            written = self._put(final, payload)
        except OSError as e:
            if e.errno not in _NO_SPACE:
                raise CheckpointError(f"Cannot write the checkpoint {final}: {e}.") from None
            # Out of space: make room by dropping the oldest kept checkpoint, once. Not when
            # several processes write it: the others could not know to write again.
            if self.collective and jax.process_count() > 1:
                raise CheckpointError(self._no_room(payload, head, e)) from None
            prunable = self._prunable() if self.writer else []
            if len(existing) >= self.keep and prunable:
                self._remove(prunable[-1])
            try:
                written = self._put(final, payload)
            except OSError as again:
                if again.errno not in _NO_SPACE:
                    raise CheckpointError(
                        f"Cannot write the checkpoint {final}: {again}."
                    ) from None
                raise CheckpointError(self._no_room(payload, head, again)) from None

        def commit() -> Path:
            try:
                manifest = self._commit(final, head, *written)
            except OSError as e:
                raise CheckpointError(f"Cannot write the checkpoint {final}: {e}.") from None
            if self.writer:
                assert self.good is not None
                self.good[final.name] = (manifest["sequence"], final, manifest)
                for folder in self._prunable():
                    self._remove(folder)
            return final

        return commit

    def _no_room(self, payload: Any, head: dict[str, Any], error: OSError) -> str:
        return (
            f"The checkpoint directory {self.directory} has no room for a checkpoint "
            f"of {self._size(payload, head)} bytes ({error.strerror}), even after removing "
            "the oldest one. Free some space, or give another directory."
        )

    def _remove(self, folder: Path) -> None:
        """Removes a checkpoint: first renamed out of the way, in one step, so that a kill
        while its files are deleted leaves litter (removed at the next opening), never a
        checkpoint's name on half a checkpoint.
        """
        if self.good is not None:
            self.good.pop(folder.name, None)
        try:
            away = Path(tempfile.mkdtemp(prefix=".old-", dir=self.directory))
            os.replace(folder, away / folder.name)
        except OSError:
            return
        shutil.rmtree(away, ignore_errors=True)

    def _put(self, final: Path, payload: Any) -> tuple[Path, dict[str, Any]]:
        """Writes the state of the checkpoint that will be `final` into a new temporary
        folder; on a failure removes the folder, leaving no litter. Returns the folder
        and the manifest's fields that describe the state (`_write_state`'s).
        """
        tmp = self._temporary(final)
        try:
            return tmp, self._write_state(tmp, payload)
        except BaseException:
            if self.writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _commit(
        self, final: Path, head: dict[str, Any], tmp: Path, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """Commits the checkpoint whose state `_put` wrote into `tmp`: its files fsynced,
        its manifest written, and the folder renamed to `final` (an fsynced rename); on
        a failure removes the temporary folder. Returns its manifest (written by the
        writer alone).
        """
        try:
            synced = self._sync_state(tmp)
            manifest = {**head, **fields, **synced, "config": self.config, "versions": versions()}
            if not self.writer:
                return manifest
            write_file(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
            fsync_dir(tmp)
            if final.exists():  # the same point saved again (after a resume): replace it
                old = Path(tempfile.mkdtemp(prefix=".old-", dir=self.directory))
                os.replace(final, old / final.name)
                os.replace(tmp, final)
                shutil.rmtree(old)
            else:
                os.replace(tmp, final)
            fsync_dir(self.directory)
            return manifest
        finally:
            if self.writer and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def restore(
        self, like: PyTree, grows: Callable[[dict[str, Any]], PyTree | None] | None = None
    ) -> PyTree | None:
        """The newest good checkpoint, read into the shape of `like`; `None` if none. One
        that is truncated or corrupt is skipped with a warning, falling back to the one
        before it. One from another configuration raises `ValueError`, unless `grows`
        (called with its configuration) gives the shape to read it into instead: a
        shorter run's that this one continues.
        """
        waited_for(self.directory)  # a run's last write, going on after it (a replay's)
        for _, folder, manifest in self._checkpoints():
            shape, saved = like, manifest["config"]
            if without_fingerprints(saved) != without_fingerprints(self.config):
                shape = None if grows is None else grows(saved)
                if shape is None:
                    raise ValueError(_mismatch(folder, saved, self.config))
            differs = changed(saved, self.config, self.allow)
            if differs is not None:
                raise ValueError(_changed(folder, *differs, self.directory, self.allow))
            if manifest.get("storage") != self.storage:
                raise ValueError(_other_storage(folder, manifest.get("storage"), self.storage))
            try:
                state = self._read_state(folder, manifest, shape)
                self.restored = saved
                return state
            except NotLike:
                raise
            except Exception as e:  # changed since it was checked, or another layout
                self._warn(folder, f"its state does not read back ({type(e).__name__}: {e})")
        return None

    # How the state is kept: one file, `state.eqx`, written by the writer from the state on
    # the host.

    def _position(self, state: PyTree) -> int:
        """Where `state` stands (see `position`), which names its checkpoint."""
        return position(state)

    def _encode(self, state: PyTree) -> Any:
        """What `_write_state` writes, made once per checkpoint (a retry writes it again):
        here the state itself, whose arrays are written from their own buffers.
        """
        return state

    def _temporary(self, final: Path) -> Path:
        """A new temporary folder in the directory, to be renamed to `final`."""
        return Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.directory))

    def _write_state(self, folder: Path, payload: Any) -> dict[str, Any]:
        """Writes the state into the temporary checkpoint folder `folder` (`_sync_state`
        then waits for the disk).

        **Returns:**

        The manifest's fields that describe it, its checksum (`crc32`) among them.
        """
        with open(folder / "state.eqx", "wb") as f:
            crc = write_leaves(f, payload).crc
        return {"crc32": f"{crc:08x}"}

    def _sync_state(self, folder: Path) -> dict[str, Any]:
        """Waits for the disk to hold what `_write_state` wrote into `folder` (in the
        commit, which may run in another thread); returns the manifest's fields it found
        (which replace `_write_state`'s).
        """
        with open(folder / "state.eqx", "rb") as f:
            os.fsync(f.fileno())
        return {}

    def _size(self, payload: Any, head: dict[str, Any]) -> int:
        """The bytes a checkpoint takes, for the message of a full disk."""
        manifest = {**head, "crc32": "0" * 8, "config": self.config, "versions": versions()}
        return write_leaves(None, payload).size + len(json.dumps(manifest, indent=1).encode())

    def _check_state(self, folder: Path, manifest: dict[str, Any]) -> None:
        """Refuses (`ValueError`) a checkpoint whose state file is missing or does not
        match its manifest's checksum (`crc32`, or an earlier eqfit's `sha256`).
        """
        kind = next(kind for kind in CHECKSUMS if kind in manifest)
        try:
            checksum = file_checksum(folder / "state.eqx", kind)
        except OSError as e:
            raise ValueError(f"its state cannot be read ({e.strerror})") from None
        if checksum != manifest[kind]:
            raise ValueError("its contents do not match the checksum in its manifest")

    def _read_state(self, folder: Path, manifest: dict[str, Any], like: PyTree) -> PyTree:
        """The checkpoint's state, read into the shape of `like`. Raises `NotLike` where
        `like` cannot describe it (the caller's mistake); any other error skips the
        checkpoint as damaged.
        """
        data = (folder / "state.eqx").read_bytes()
        return read_leaves(io.BytesIO(data), like)


class NotLike(ValueError):
    """`like` does not describe a checkpoint's state: a mistake of the caller's, refused,
    where a damaged checkpoint is skipped.
    """


_NO_SPACE = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def newest_config(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The configuration of the newest checkpoint in `directory` whose manifest reads, or
    `None`; read before the run is planned (a loader's epoch length), its state unchecked.
    """
    found, path = [], Path(directory)
    waited_for(path)  # an earlier run's last write, going on after it
    for folder in path.iterdir() if path.is_dir() else ():
        if _NAME.match(folder.name) and folder.is_dir():
            try:
                manifest = _read_manifest(folder)
            except ValueError:
                continue  # skipped, with a warning, when the run restores
            found.append((manifest["sequence"], manifest["config"]))
    return max(found, key=lambda entry: entry[0])[1] if found else None


def _read_manifest(folder: Path) -> dict[str, Any]:
    """A checkpoint's manifest, checked to hold what a checkpoint needs."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except OSError as e:
        raise ValueError(f"its manifest cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("its manifest is not JSON (a write cut short?)") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"its manifest is a JSON {type(manifest).__name__}, not an object")
    kinds = {"sequence": int, "epoch": int, "step": int, "config": dict}
    for name, kind in kinds.items():
        value = manifest.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"its manifest has no {kind.__name__} {name!r}")
    sums = [kind for kind in CHECKSUMS if kind in manifest]
    if not sums or not all(isinstance(manifest[kind], str) for kind in sums):
        raise ValueError("its manifest has no checksum (a str 'crc32' or 'sha256')")
    return manifest


def _mismatch(folder: Path, saved: dict[str, Any], now: dict[str, Any]) -> str:
    saved, now = without_fingerprints(saved), without_fingerprints(now)
    keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    details = "; ".join(
        f"{k}: checkpoint {_short(saved.get(k))}, now {_short(now.get(k))}" for k in keys
    )
    return (
        f"The checkpoint {folder} was written by a different training configuration, so it "
        f"is not loaded. What differs: {details}. Use another `checkpoint` directory, or "
        "the configuration that wrote it (a run resumed with more `epochs` continues it, "
        "but nothing else may change)."
    )


def _changed(
    folder: Path, names: list[str], differs: str, directory: Path, allowed: Collection[str]
) -> str:
    allow = ", ".join(json.dumps(n) for n in (*allowed, *names))
    allow += "," if len(allowed) + len(names) == 1 else ""
    return (
        f"The checkpoint {folder} was written by a run that differs from this one, so it is "
        f"not resumed: {differs}. Resume with what wrote it; or, if the change is meant, say "
        f"so: `checkpoint=eqfit.Checkpoint({str(directory)!r}, allow_changes=({allow}))` "
        "(the run goes on from the checkpoint with this run's data, metrics and optimizer; "
        "its history holds the values of both); or use another `checkpoint` directory."
    )


def _other_storage(folder: Path, saved: str | None, now: str | None) -> str:
    return (
        f"The checkpoint {folder} keeps its state as {_storage_name(saved)}, but this run "
        f"keeps {_storage_name(now)}, so it is not loaded. Resume with the sharding it was "
        "written with (`shard=` keeps Orbax checkpoints), or use another `checkpoint` "
        "directory."
    )


def _storage_name(storage: str | None) -> str:
    if storage is None:
        return "one file, `state.eqx`"
    if storage == "orbax":
        return "an Orbax checkpoint (a run with `shard=`)"
    return repr(storage)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."
