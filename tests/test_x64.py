"""`jax_enable_x64`, which scientific users turn on: a model of float64 arrays trains,
stays float64, and its history is written as without it (the record's float32 tables,
its int32 places), in a process of its own (the flag is global and read at start).
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import worker_env


HERE = Path(__file__).parent

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import jax
    jax.config.update("jax_enable_x64", True)
    import equinox as eqx, jax.numpy as jnp, numpy as np, optax
    import eqfit

    x = np.random.default_rng(0).normal(size=(256, 4))
    y = x @ np.arange(4.0)
    val = (x[:64], y[:64])
    one = eqfit.models.MLP(4, "scalar", 8, 1, key=jax.random.key(0))
    stack = eqx.filter_vmap(lambda k: eqfit.models.MLP(4, "scalar", 8, 1, key=k))(
        jax.random.split(jax.random.key(0), 3)
    )

    def with_aux(model, x, y):
        error = jax.vmap(model)(x) - y
        return jnp.mean(error**2), {"mae": jnp.mean(jnp.abs(error))}

    runs = {
        "plain": (one, {}),
        "aux and a metric": (one, {"loss": with_aux, "metrics": {"m": eqfit.metrics.mae}}),
        "validation_freq": (one, {"validation_data": val, "validation_freq": 2}),
        "validation_every": (one, {"validation_data": val, "validation_every": 5}),
        "the bar, log_every": (one, {"progress": True, "log_every": 3}),
        "PerStep": (one, {"execution": eqfit.PerStep()}),
        "a checkpoint": (one, {"checkpoint": tempfile.mkdtemp()}),
        "an ensemble": (stack, {"ensemble": True, "validation_data": val}),
    }
    out = {}
    for name, (model, extra) in runs.items():
        kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.adam(1e-2), epochs=3,
                      batch_size=32, key=jax.random.key(1))
        result = eqfit.fit(model, (x, y), **{**kwargs, **extra})
        arrays = jax.tree.leaves(eqx.filter(result.model, eqx.is_array))
        history = result.history  # an ensemble's values: (epochs, members)
        by_member = lambda v: np.asarray(v).reshape(3, -1).T.tolist()
        out[name] = {
            "dtypes": sorted({str(a.dtype) for a in arrays}),
            "loss": by_member(history.loss),
            "val_loss": by_member(history.val_loss) if "validation_data" in extra else None,
        }
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_a_float64_model_trains_under_x64_on_every_path():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**worker_env(HERE), "JAX_ENABLE_X64": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.splitlines()[-1])
    assert len(runs) == 8
    for name, run in runs.items():
        assert run["dtypes"] == ["float64"], name
        for member in run["loss"]:  # each epoch's mean loss, falling
            assert all(a > b for a, b in zip(member, member[1:])), (name, member)
    # Validated at epochs 2 only (NaN elsewhere), at every epoch's end with `validation_every`
    # (5 steps of 8 an epoch), and each member's at each epoch's end.
    freq = runs["validation_freq"]["val_loss"][0]
    assert freq[0] != freq[0] and freq[2] != freq[2] and freq[1] == freq[1]
    assert all(v == v for member in runs["an ensemble"]["val_loss"] for v in member)
