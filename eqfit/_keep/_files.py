"""A checkpoint's files: its arrays written from their own buffers with a CRC32 taken on
the way, files fsynced and renamed into place, and the checksums a manifest holds.
"""

import hashlib
import io
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree


def folder_name(epoch: int, step: int) -> str:
    """The name of the checkpoint folder of `epoch` epochs done and `step` steps into the
    next.
    """
    return f"ckpt-{epoch:06d}-{step:06d}"


def fsync_dir(path: Path) -> None:
    """Fsyncs the directory `path`: a rename or a new file in it is then on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Writes `data` to `path` and fsyncs it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# The bytes a state file is written and read in at a time, each piece checksummed while
# it is in the CPU's cache: well within a core's L2.
_PIECE = 1 << 20


class _Stream:
    """A file that `eqx.tree_serialise_leaves` writes to, which keeps the CRC32 and the
    length of what goes through it; `leaf` is its filter spec.
    """

    def __init__(self, file: io.BufferedIOBase | None):
        self.file, self.crc, self.size = file, 0, 0
        self.error: OSError | None = None  # the file's, which equinox wraps in its own

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.file is not None:  # else only counted
            # A piece at a time, so that the write copies what the CRC has just read
            # while it is still in the CPU's cache.
            for start in range(0, view.nbytes, _PIECE):
                piece = view[start : start + _PIECE]
                self.crc = zlib.crc32(piece, self.crc)
                try:
                    self.file.write(piece)
                except OSError as e:
                    self.error = e
                    raise
        self.size += view.nbytes
        return view.nbytes

    def leaf(self, f: Any, x: Any) -> None:
        """`x` as `eqx.default_serialise_filter_spec` writes it (`np.save`'s bytes), an
        array of a numpy dtype straight from its own buffer: `np.save` to anything but a
        real file copies it (`tobytes`), and a real file's `tofile` would pass by the CRC.
        """
        if isinstance(x, jax.Array):
            x = np.asarray(x)  # the buffer itself on a CPU, once the device is done
        if not (isinstance(x, np.ndarray) and x.dtype.isbuiltin == 1 and x.flags.c_contiguous):
            eqx.default_serialise_filter_spec(f, x)  # bfloat16, Python scalars, ...
            return
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(x))
        f.write(header.getvalue())
        f.write(x.reshape(-1).view(np.uint8))  # a view: no copy


def write_leaves(file: io.BufferedIOBase | None, tree: PyTree) -> _Stream:
    """Writes `tree`'s leaves to `file` as `eqx.tree_serialise_leaves` does, byte for
    byte, with no copy of an array on the way.

    **Arguments:**

    - `file`: a file open for writing; `None` to count the bytes alone.
    - `tree`: the PyTree (of numpy arrays, usually: the state on the host).

    **Returns:**

    What went through: `.crc` (its CRC32) and `.size` (its length in bytes).
    """
    stream = _Stream(file)
    try:
        eqx.tree_serialise_leaves(stream, keys_as_data(tree), filter_spec=stream.leaf)
    except Exception:
        if stream.error is not None:  # a full disk, say: as the file raised it
            raise stream.error from None
        raise
    return stream


def read_leaves(file: io.BufferedIOBase, like: PyTree) -> PyTree:
    """What `write_leaves` wrote, read into the shape of `like` (as
    `eqx.tree_deserialise_leaves` reads it, PRNG keys as keys again), each array checked
    to be of `like`'s type, shape and dtype. Not by `eqx.tree_deserialise_leaves` itself,
    which makes a JAX array (`jnp.array(0)`) to check against, compiling a program for it.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(keys_as_data(like))
    read = []
    for path, x in leaves:  # in the order `eqx.tree_serialise_leaves` writes them
        y = _as_written(eqx.default_deserialise_filter_spec(file, x), x)
        _check_read(path, y, x)
        read.append(y)
    read = jax.tree_util.tree_unflatten(treedef, read)
    return jax.tree.map(
        lambda x, k: jax.random.wrap_key_data(x, impl=jax.random.key_impl(k)) if _is_key(k) else x,
        read,
        like,
    )


def _as_written(read: Any, like: Any) -> Any:
    """`read` in `like`'s dtype where `np.save` wrote it as raw bytes: a dtype numpy does
    not know by name (bfloat16, float8: `ml_dtypes`'), which `np.load` gives back as
    `|V2`. The same bytes, viewed; anything else as it is.
    """
    dtype = getattr(like, "dtype", None)
    if (
        isinstance(read, np.ndarray)
        and read.dtype.kind == "V"
        and read.dtype.names is None  # raw bytes, not a structured array
        and dtype is not None
        and np.dtype(dtype) != read.dtype
        and np.dtype(dtype).itemsize == read.dtype.itemsize
    ):
        return read.view(dtype)
    return read


def _check_read(path: Any, read: Any, like: Any) -> None:
    """Refuses a leaf `read` from a file that is not of the type of `like`'s (a JAX array
    for a `jax.ShapeDtypeStruct`), or an array not of its shape and dtype.
    """
    where = jax.tree_util.keystr(path)
    if isinstance(like, jax.ShapeDtypeStruct):
        same_type = isinstance(read, jax.Array)
    else:
        same_type = type(read) is type(like)
    if not same_type:
        raise RuntimeError(f"The leaf at `{where}` read as {type(read)}, `like`'s is {type(like)}.")
    if isinstance(read, np.ndarray | jax.Array):
        got, want = f"{read.dtype}{list(read.shape)}", f"{like.dtype}{list(like.shape)}"
        if got != want:
            raise RuntimeError(f"The leaf at `{where}` read as {got}, `like`'s is {want}.")


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def keys_as_data(tree: PyTree) -> PyTree:
    """`tree` with its typed PRNG keys (an update's state that threads a key, as
    PureJaxRL's does) as their data, `uint32` arrays, which a file can hold; the arrays'
    shapes (`jax.ShapeDtypeStruct`s) alike.
    """

    def data(x: Any) -> Any:
        if not _is_key(x):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.eval_shape(jax.random.key_data, x)
        return np.asarray(jax.random.key_data(x))

    return jax.tree.map(data, tree)


def write_atomically(path: Path, prefix: bytes, tree: PyTree) -> None:
    """Writes `prefix` then `tree`'s leaves (`write_leaves`) to `path`, through a
    fsynced temporary file and a rename.
    """
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(prefix)
        write_leaves(f, tree)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# A checkpoint's checksum of its state file, by its name in the manifest: CRC32, which
# runs at the speed of memory, and SHA-256, which checkpoints of eqfit before FORMAT 3
# carry (read and checked still). They guard against a damaged or truncated file, not
# against tampering.
CHECKSUMS = ("crc32", "sha256")


def file_checksum(path: Path, kind: str) -> str:
    """The checksum `kind` (one of `CHECKSUMS`) of the file at `path`, as a manifest
    holds it (hexadecimal).
    """
    crc, digest = 0, hashlib.sha256()
    chunk = bytearray(_PIECE)
    with open(path, "rb", buffering=0) as f:
        while size := f.readinto(chunk):
            part = memoryview(chunk)[:size]
            if kind == "crc32":
                crc = zlib.crc32(part, crc)
            else:
                digest.update(part)
    return f"{crc:08x}" if kind == "crc32" else digest.hexdigest()
