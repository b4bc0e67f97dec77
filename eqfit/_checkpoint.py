"""Checkpoints that survive a crash: atomic writes, a manifest, and a refusal to mix runs."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from ._version import __version__


FORMAT = 1
KEEP = 2
_NAME = re.compile(r"^ckpt-(\d{6})-(\d{6})$")


def versions() -> dict[str, str]:
    import optax

    return {
        "eqfit": __version__,
        "jax": jax.__version__,
        "equinox": eqx.__version__,
        "optax": optax.__version__,
    }


def describe(tree: PyTree) -> list[list[Any]]:
    """Each array's path, shape and dtype, as JSON: what a checkpoint must match.

    Paths rather than the tree's repr, which holds object addresses that change between
    processes.
    """
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return [[jax.tree_util.keystr(path), list(x.shape), str(x.dtype)] for path, x in leaves]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def serialise(tree: PyTree) -> bytes:
    with tempfile.SpooledTemporaryFile() as f:
        eqx.tree_serialise_leaves(f, tree)
        f.seek(0)
        return f.read()


def write_atomically(path: Path, data: bytes) -> None:
    """Writes `path` through a fsynced temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    os.close(fd)
    _write(Path(tmp), data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def position(state: Any) -> int:
    """Where a run stands, as a global step count: that of the members still training. An
    ensemble's members that stopped early are behind, and stay there; they must not hold
    the others back.
    """
    step = np.asarray(state.step).reshape(-1)
    stopped = np.asarray(state.stopped).reshape(-1)
    return int(step[~stopped].max() if (~stopped).any() else step.max())


class Checkpoints:
    """A directory of training checkpoints, newest last.

    Each checkpoint is a folder `ckpt-<epoch>-<step>` (the epochs done and the steps into
    the next) holding `state.eqx` (the training
    state and record, by `eqx.tree_serialise_leaves`) and `manifest.json` (the run's
    configuration, versions and the state file's SHA-256). It is written into a temporary
    folder, fsynced, then renamed into place, so a crash mid-write never leaves a partial
    checkpoint under a checkpoint's name. The newest `KEEP` are kept.

    **Arguments:**

    - `directory`: where the checkpoints live; created if missing.
    - `config`: what identifies the run (JSON). A checkpoint written under another
        configuration is refused, not loaded.
    - `steps_per_epoch`: to name checkpoints by epoch.
    """

    def __init__(self, directory: str | os.PathLike, config: dict[str, Any], steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config = json.loads(json.dumps(config))  # normalised, as it will read back

    def _names(self) -> list[str]:
        return sorted(p.name for p in self.directory.iterdir() if _NAME.match(p.name))

    def save(self, state: PyTree) -> Path:
        """Writes the training state `state` (on the host) as a checkpoint at its position,
        and prunes old ones.
        """
        epoch, step = divmod(position(state), self.steps_per_epoch)
        data = serialise(state)
        manifest = {
            "format": FORMAT,
            "epoch": epoch,
            "step": step,
            "sha256": hashlib.sha256(data).hexdigest(),
            "config": self.config,
            "versions": versions(),
        }
        final = self.directory / f"ckpt-{epoch:06d}-{step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.directory))
        _write(tmp / "state.eqx", data)
        _write(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():  # the same point saved again (after a resume): replace it
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=self.directory))
            os.replace(final, old / final.name)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.directory)
        for name in self._names()[:-KEEP]:
            shutil.rmtree(self.directory / name, ignore_errors=True)
        return final

    def restore(self, like: PyTree) -> PyTree | None:
        """The newest complete checkpoint, read into the shape of `like`; `None` if none.

        A checkpoint that is truncated or corrupt is skipped with a warning, falling back
        to the one before it. One from another configuration raises `ValueError`.
        """
        for name in reversed(self._names()):
            folder = self.directory / name
            try:
                manifest = json.loads((folder / "manifest.json").read_text())
                data = (folder / "state.eqx").read_bytes()
                if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
                    raise ValueError("its contents do not match the checksum in its manifest")
            except (OSError, ValueError, KeyError) as e:
                warnings.warn(
                    f"Checkpoint {folder} is incomplete or corrupt ({e}); "
                    "falling back to the one before it.",
                    stacklevel=3,
                )
                continue
            if manifest.get("config") != self.config:
                raise ValueError(_mismatch(folder, manifest.get("config") or {}, self.config))
            with open(folder / "state.eqx", "rb") as f:
                return eqx.tree_deserialise_leaves(f, like)
        return None


def _mismatch(folder: Path, saved: dict[str, Any], now: dict[str, Any]) -> str:
    keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    details = "; ".join(
        f"{k}: checkpoint {_short(saved.get(k))}, now {_short(now.get(k))}" for k in keys
    )
    return (
        f"The checkpoint {folder} was written by a different training configuration, so it "
        f"is not loaded. What differs: {details}. Use another `checkpoint` directory, or "
        "the configuration that wrote it."
    )


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "..."


class Interrupt:
    """Defers Ctrl-C (SIGINT) to the next chunk boundary, where `fit` can checkpoint.

    Use as a context manager around training; `requested` turns true when Ctrl-C came.
    A second Ctrl-C interrupts at once. Outside the main thread it does nothing.
    """

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def deferred(self) -> Iterator["Interrupt"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handler(signum: int, frame: Any) -> None:
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def as_plain(value: Any) -> Any:
    """numpy scalars and arrays in a config, as JSON can hold them."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
