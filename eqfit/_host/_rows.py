"""A memmap's rows, read from its file: copied (`read_rows`, with `np.fromfile`, as
training reads them), or read in place by the device, the kernel advised on their pages
(`advise_rows`): mapped in ahead by the reading thread, dropped once done with.
"""

import mmap

import jax
import numpy as np
from jaxtyping import PyTree


# Linux's `MADVPOPULATE_READ` (5.14 on; Python's `mmap` names it from 3.13): maps a
# range's pages into the process now, so that the reading thread takes the page faults
# rather than the program that reads the rows.
POPULATE_READ = getattr(mmap, "MADVPOPULATE_READ", 22)


def advise_rows(data: PyTree, start: int, stop: int, advice: int = mmap.MADV_DONTNEED) -> None:
    """Advises the kernel on the pages of rows `start` to `stop` of each memmap of
    `data`: by default drops them from the process's memory (`MADV_DONTNEED`). A
    read-only mapping of a file reads them again from the file (the page cache) if they
    are touched after, so advice changes what memory holds, never what the rows are; a
    kernel that does not know the advice is not asked again.
    """
    for a in jax.tree.leaves(data):
        if not (isinstance(a, np.memmap) and isinstance(a.base, mmap.mmap)):
            continue
        row = a.dtype.itemsize * int(np.prod(a.shape[1:]))
        begin = a.offset % mmap.ALLOCATIONGRANULARITY + start * row  # in the mapping
        aligned = begin - begin % mmap.PAGESIZE
        if advice in _UNKNOWN_ADVICE:
            continue
        try:
            a.base.madvise(advice, aligned, (stop - start) * row + begin - aligned)
        except OSError:
            _UNKNOWN_ADVICE.add(advice)


_UNKNOWN_ADVICE: set[int] = set()


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
