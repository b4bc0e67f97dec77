"""One process of the two-process `jax.distributed` tests (run by test_parallel.py).

Usage: python distributed_worker.py PROCESS_ID PORT OUT.npz [CHECKPOINT_DIRECTORY [shard |
    signal]]

Without a directory it trains the shared problem on both paths and saves the results;
with one, it trains a longer run with checkpoints there (printing "epoch N" as it goes),
resuming from them if there are any, and saves the result. With `shard`, each process
has 4 devices, and the model and optimizer state are split over all 8 (FSDP), with
sharded (Orbax) checkpoints that each process writes its part of. With `signal`, it trains
an epoch of a million steps with checkpoints every 50 steps, printing "training" once
begun, until a signal (to either process) stops it: it saves the steps trained and the
signal's name, and exits 3.
"""

import sys

import jax


process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
directory = sys.argv[4] if len(sys.argv) > 4 else None
sharded = len(sys.argv) > 5 and sys.argv[5] == "shard"
signalled = len(sys.argv) > 5 and sys.argv[5] == "signal"
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 4 if sharded else 2)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from shared_problem import problem  # noqa: E402

import eqfit  # noqa: E402


class Announce:
    # May stop training (the default): told at each epoch's end as it ends, so that the
    # kill lands mid-run (one that never stops is told once a call is read).

    def on_epoch_end(self, epoch, logs):
        print(f"epoch {epoch}", flush=True)


model, (x, y), kwargs = problem()
# Devices in process order, so the global data is process 0's rows, then process 1's.
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.array(devices), ("batch",))
half = x.shape[0] // 2
rows = slice(process_id * half, (process_id + 1) * half)
arrays = {}
if directory is None:
    for progress in (False, True):
        result = eqfit.fit(model, (x[rows], y[rows]), mesh=mesh, progress=progress, **kwargs)
        leaves = jax.tree.leaves(eqx.filter(result.model, eqx.is_array))
        arrays[f"loss_{progress}"] = result.history.loss
        arrays.update({f"leaf{i}_{progress}": np.asarray(a) for i, a in enumerate(leaves)})
elif signalled:

    class Training:
        stops_training = False

        def on_train_begin(self, config):
            print("training", flush=True)

        def on_epoch_end(self, epoch, logs):
            pass

    kwargs.update(epochs=1, steps_per_epoch=10**6)
    policy = eqfit.Checkpoint(directory, every_epochs=None, every_steps=50)
    try:
        eqfit.fit(
            model,
            (x[rows], y[rows]),
            mesh=mesh,
            checkpoint=policy,
            callbacks=[Training()],
            **kwargs,
        )
    except eqfit.TrainingInterrupted as e:
        steps = int((e.result.history.batch_sizes > 0).sum())
        np.savez(out, steps=steps, signal=e.signal)
        jax.distributed.shutdown()
        sys.exit(3)
    sys.exit(1)
else:
    kwargs["epochs"] = 120
    if sharded:  # every array split over the 8 devices where a dimension divides
        kwargs["shard"] = eqfit.sharding.fsdp("batch", min_bytes=0)
    result = eqfit.fit(
        model, (x[rows], y[rows]), mesh=mesh, checkpoint=directory, callbacks=[Announce()], **kwargs
    )
    leaves = jax.tree.leaves(eqx.filter(result.model, eqx.is_array))
    arrays["loss"] = result.history.loss
    if sharded:
        arrays["split"] = np.asarray([not a.is_fully_addressable for a in leaves])
    # A split array spans both processes: each gathers the whole of it to compare.
    arrays.update(
        {f"leaf{i}": multihost_utils.process_allgather(a, tiled=True) for i, a in enumerate(leaves)}
    )
np.savez(out, **arrays)
jax.distributed.shutdown()
