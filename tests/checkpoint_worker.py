"""A training run for test_checkpoint.py to kill or interrupt.

Usage: python checkpoint_worker.py DIRECTORY (compiled | progress)
"""

import sys

import jax


jax.config.update("jax_num_cpu_devices", 8)  # as in the tests' own process

from shared_problem import checkpoint_problem  # noqa: E402

import eqfit  # noqa: E402


class Announce:
    def on_epoch_end(self, epoch, logs):
        print(f"epoch {epoch}", flush=True)


directory, mode = sys.argv[1], sys.argv[2]
model, data, kwargs = checkpoint_problem()
print("starting", flush=True)
try:
    if mode == "progress":
        eqfit.fit(
            model, data, checkpoint=directory, progress=True, callbacks=[Announce()], **kwargs
        )
    else:
        eqfit.fit(model, data, checkpoint=directory, **kwargs)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
print("finished", flush=True)
