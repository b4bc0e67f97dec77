"""`examples/ppo.py`, PureJaxRL's PPO on gymnax's CartPole-v1 through `fit` with no data:
it learns (a mean episodic return of 400 or more), several seeds as an ensemble train as
each alone, and a checkpoint resumes it bit for bit. (With the heavy tests: gymnax is in
the test extra.)
"""

import importlib.util
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import assert_trees_close, assert_trees_equal

import eqfit


pytestmark = pytest.mark.heavy
spec = importlib.util.spec_from_file_location(
    "ppo_example", Path(__file__).resolve().parents[1] / "examples" / "ppo.py"
)
assert spec is not None and spec.loader is not None
ppo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ppo)


def test_ppo_learns_cartpole():
    result = ppo.train(seeds=1)
    returns = result.history["ppo_return"]
    assert returns[-1] >= 400, returns
    # The rollout's environment steps count as the step's samples.
    per_step = ppo.NUM_ENVS * ppo.NUM_STEPS
    throughput = result.history.throughput
    np.testing.assert_allclose(
        throughput["samples_per_second"][-1], per_step * throughput["steps_per_second"][-1]
    )


def test_seeds_as_an_ensemble_train_as_each_alone():
    together = ppo.train(seeds=4, epochs=1, steps_per_epoch=6)
    network_key, key = jax.random.split(jax.random.key(0))
    for m, (net_key, run_key) in enumerate(
        zip(jax.random.split(network_key, 4), jax.random.split(key, 4))
    ):
        alone = eqfit.fit(
            ppo.networks(net_key),
            updates=[ppo.PPO(samples=ppo.NUM_ENVS * ppo.NUM_STEPS)],
            steps_per_epoch=6,
            key=run_key,
        )
        np.testing.assert_allclose(
            together.history.step_values["ppo_return"][..., m],
            alone.history.step_values["ppo_return"],
            rtol=1e-5,
        )
        member = jax.tree.map(lambda x: x[m] if eqx.is_array(x) else x, together.model)
        assert_trees_close(member, alone.model, rtol=1e-4, atol=1e-6)


def test_a_checkpoint_resumes_ppo_bit_for_bit(tmp_path):
    whole = ppo.train(epochs=2, steps_per_epoch=5)

    class StopAfterFirst:
        def on_epoch_end(self, epoch, logs):
            return epoch >= 1  # True: stop

    first = eqfit.fit(
        ppo.networks(jax.random.split(jax.random.key(0))[0]),
        updates=[ppo.PPO(samples=ppo.NUM_ENVS * ppo.NUM_STEPS)],
        steps_per_epoch=5,
        epochs=2,
        key=jax.random.split(jax.random.key(0))[1],
        checkpoint=tmp_path,
        callbacks=[StopAfterFirst()],
    )
    assert first.history.stop_reason == "callback"
    resumed = ppo.train(epochs=2, steps_per_epoch=5, checkpoint=str(tmp_path))
    assert_trees_equal(resumed.model, whole.model)
    assert_trees_equal(unkeyed(resumed.opt_state), unkeyed(whole.opt_state))  # its key too


def unkeyed(tree):
    """`tree` with its PRNG keys as their data, to compare."""
    is_key = lambda x: jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)
