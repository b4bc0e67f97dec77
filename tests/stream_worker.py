"""Trains on a memmap much larger than the memory it may use; prints the RSS it used.

Usage: python stream_worker.py DIRECTORY GIGABYTES
"""

import sys

import jax
import numpy as np
import optax

import eqfit


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


directory, gigabytes = sys.argv[1], float(sys.argv[2])
features = 4096  # 16 KiB a row
rows = int(gigabytes * 2**30 / (features * 4))
x = np.lib.format.open_memmap(f"{directory}/x.npy", "w+", np.float32, (rows, features))
y = np.lib.format.open_memmap(f"{directory}/y.npy", "w+", np.float32, (rows,))
for start in range(0, rows, 8192):  # written in pieces, never whole in memory
    stop = min(rows, start + 8192)
    block = np.random.default_rng(start).normal(size=(stop - start, features)).astype(np.float32)
    x[start:stop] = block
    y[start:stop] = block[:, :8].sum(axis=1)
    x.flush()
del x, y
x = np.load(f"{directory}/x.npy", mmap_mode="r")
y = np.load(f"{directory}/y.npy", mmap_mode="r")
model = eqfit.models.LinearRegression(features, key=jax.random.key(0))
# A first, tiny run compiles everything, so the measured run below is steady state.
small = (x[:2048], y[:2048])
kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(1e-3), key=jax.random.key(1))
eqfit.fit(model, small, batch_size=512, epochs=1, **kwargs)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current RSS: writing the file counted
before = status_mb("VmRSS")
result = eqfit.fit(model, (x, y), batch_size=512, epochs=1, **kwargs)
peak = status_mb("VmHWM")
print(f"file_mb={x.nbytes / 2**20:.0f} before_mb={before:.0f} peak_mb={peak:.0f}")
print(f"loss={result.history.loss[0]:.4f} steps={result.history.step_loss.shape[1]}")
