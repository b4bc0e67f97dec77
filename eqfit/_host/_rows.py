"""A memmap's rows, read from its file: copied (`read_rows`, with `np.fromfile`, as
training reads them), or read in place by the device, the kernel advised on their pages
(`advise_rows`): mapped in ahead by the reading thread, dropped once done with.
"""

import mmap

import jax
import numpy as np
from jaxtyping import PyTree


# Linux's `MADV_POPULATE_READ` (5.14 on; Python's `mmap` names it from 3.13): maps a
# range's pages into the process now, so that the reading thread takes the page faults
# rather than the program that reads the rows.
POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def advise_rows(data: PyTree, start: int, stop: int, advice: int = mmap.MADV_DONTNEED) -> None:
    """Advises the kernel on the pages of rows `start` to `stop` of each memmap of
    `data`: by default drops them from the process's memory (`MADV_DONTNEED`). A
    read-only mapping of a file reads them again from the file (the page cache) if they
    are touched after, so advice changes what memory holds, never what the rows are; a
    kernel that does not know the advice is not asked again.
    """
    for a in jax.tree.leaves(data):
        mapped = _mapping(a)
        if mapped is None or advice in _UNKNOWN_ADVICE:
            continue
        mapping, first = mapped
        row = a.dtype.itemsize * int(np.prod(a.shape[1:]))
        begin = first + start * row  # in the mapping
        aligned = begin - begin % mmap.PAGESIZE
        try:
            mapping.madvise(advice, aligned, (stop - start) * row + begin - aligned)
        except OSError:
            _UNKNOWN_ADVICE.add(advice)


_UNKNOWN_ADVICE: set[int] = set()


def _mapping(a: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """The mapping that the rows of `a` lie in, a memmap or a view of one (`x[-1000:]`),
    and where its first row starts there; `None` for anything else, or rows not laid
    out one after the other. (A view's `offset` is its parent's: the place is found from
    the data pointers instead.)
    """
    if not isinstance(a, np.memmap) or not a.flags.c_contiguous:
        return None
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap) or not isinstance(root.base, mmap.mmap):
        return None
    pointer = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return root.base, root.offset % mmap.ALLOCATIONGRANULARITY + pointer


def read_rows(a: np.ndarray, start: int, stop: int) -> np.ndarray:
    if (
        isinstance(a, np.memmap)
        and isinstance(a.base, mmap.mmap)
        and a.filename is not None
        and a.flags.c_contiguous
    ):
        row = int(np.prod(a.shape[1:]))
        offset = a.offset + start * row * a.dtype.itemsize
        out = np.fromfile(a.filename, dtype=a.dtype, count=(stop - start) * row, offset=offset)
        return out.reshape(stop - start, *a.shape[1:])
    return np.array(a[start:stop])
