"""A training run for test_checkpoint.py to kill, interrupt or starve.

Usage: python checkpoint_worker.py DIRECTORY|- (compiled | progress)
    [limit BYTES | nobody | long | nosignals | steps N | epochs E | background | inthread
     | perstep]...

It prints "epoch N" after each epoch, and how it ended: "finished", "interrupted after N
epochs, S steps, by SIGNAL" (exit code 3) or "checkpoint error: ..." (exit code 4). With
`limit`, files over BYTES cannot be written (RLIMIT_FSIZE); with `nobody`, it drops root's
privileges first; with `long`, its epochs are a million steps (minutes), not one pass of
the test problem; with `nosignals`, `fit` handles no signal but Ctrl-C; with `steps N`, a
checkpoint falls every N steps too; `epochs E` trains E epochs (200); with `background`,
checkpoints are written in a background thread, with `inthread` wholly at their step in
the training thread (`background=False`), else as the CPU's default (the state's file in
the training thread, its commit in a thread); `perstep` runs the steps as
`eqfit.PerStep()`, a call each.
"""

import os
import resource
import signal
import sys
import time

import jax


jax.config.update("jax_num_cpu_devices", 8)  # as in the tests' own process

from shared_problem import checkpoint_problem  # noqa: E402

import eqfit  # noqa: E402


class Announce:
    # May stop training (the default): told at each epoch's end as it ends, so that the
    # tests' signals land mid-run. (One that never stops is told of the epochs a call
    # reached once it is read, which, for this small problem, can be the whole run.)

    def on_epoch_end(self, epoch, logs):
        print(f"epoch {epoch}", flush=True)


directory, mode, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
if "limit" in flags:
    limit = int(flags[flags.index("limit") + 1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
if "nobody" in flags and os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
epochs = int(flags[flags.index("epochs") + 1]) if "epochs" in flags else 200
model, data, kwargs = checkpoint_problem(epochs)
if "long" in flags:
    kwargs.update(epochs=2, steps_per_epoch=10**6)
if "perstep" in flags:
    kwargs.update(execution=eqfit.PerStep())
if "nosignals" in flags:
    kwargs.update(signals=())
checkpoint = None
if directory != "-":
    every = int(flags[flags.index("steps") + 1]) if "steps" in flags else None
    background = True if "background" in flags else False if "inthread" in flags else None
    checkpoint = eqfit.Checkpoint(directory, every_steps=every, background=background)
print("starting", flush=True)
try:
    eqfit.fit(
        model,
        data,
        checkpoint=checkpoint,
        progress=mode == "progress",
        callbacks=[Announce()],
        **kwargs,
    )
except eqfit.TrainingInterrupted as e:
    # When `fit` answered, on the clock every process shares: the tests time the answer,
    # not the process's exit (which tears JAX down, slowly on a loaded machine).
    print(f"answered at {time.monotonic()}", flush=True)
    # As a script that handles it would: a second Ctrl-C that comes once `fit` has
    # answered the first (within a call) finds the run over, and is let be.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    history = e.result.history
    steps = int((history.batch_sizes > 0).sum())
    print(f"interrupted after {history.epochs} epochs, {steps} steps, by {e.signal}", flush=True)
    sys.exit(3)
except eqfit.CheckpointError as e:
    epochs = "none" if e.result is None else e.result.history.epochs
    print(f"checkpoint error: {e} (result: {epochs} epochs)", flush=True)
    sys.exit(4)
print("finished", flush=True)
