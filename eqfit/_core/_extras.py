"""Optional extras: found without being imported, so that `import eqfit` stays lean."""

import importlib.util


def require_orbax() -> None:
    """Refuses, with what to install, when `orbax-checkpoint` is not there (found, not
    imported: `import eqfit` stays free of it).
    """
    try:
        found = importlib.util.find_spec("orbax.checkpoint") is not None
    except ModuleNotFoundError:  # no `orbax` package at all
        found = False
    if not found:
        raise ImportError(
            "Checkpoints of a run under `shard=` are Orbax checkpoints, and "
            "`orbax-checkpoint` is not installed: `pip install 'eqfit[sharding]'` (or "
            "`pip install orbax-checkpoint`), or train without `checkpoint=`."
        )
