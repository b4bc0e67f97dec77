"""`examples/ppo.py`, PureJaxRL's PPO on gymnax's CartPole-v1 through `fit` with no data:
it learns (a mean episodic return of 400 or more), several seeds as an ensemble train as
each alone, and a checkpoint resumes it bit for bit. (With the heavy tests: gymnax is in
the test extra.)
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import assert_trees_close, assert_trees_equal

import eqfit


pytestmark = pytest.mark.heavy
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
spec = importlib.util.spec_from_file_location("ppo_example", EXAMPLES / "ppo.py")
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


SAME_BITS = """
import sys
import equinox as eqx, jax, numpy as np
sys.path.insert(0, sys.argv[1])
import ppo

@eqx.filter_jit
def hand_scan(network, key, iterations):
    runner = ppo.start(eqx.filter(network, eqx.is_inexact_array), key)

    def body(carry, _):
        network, runner, figures = ppo.ppo_iteration(*carry)
        return (network, runner), figures["returns"] / figures["episodes"]

    (network, runner), returns = jax.lax.scan(body, (network, runner), None, iterations)
    return network, returns

result = ppo.train(epochs=1, steps_per_epoch=12)
network_key, key = jax.random.split(jax.random.key(0))
init_key = jax.random.fold_in(jax.random.fold_in(key, 3), 0)
network, returns = hand_scan(ppo.networks(network_key), init_key, 12)
same = np.array_equal(result.history.step_values["ppo_return"][0], returns, equal_nan=True)
pairs = zip(jax.tree.leaves(eqx.filter(result.model, eqx.is_inexact_array)),
            jax.tree.leaves(eqx.filter(network, eqx.is_inexact_array)))
print("returns equal:", same, "networks equal:", all(np.array_equal(a, b) for a, b in pairs))
"""


def test_fit_trains_bit_for_bit_as_a_hand_scan_of_the_same_iterations():
    """With the keys `fit` documents, its run is PureJaxRL's `jit(lax.scan)` bit for bit:
    the returns of every iteration and the network. In a process of its own, compiled as
    a user's is (the suite compiles without LLVM's optimisation): the start program is
    compiled as a `jax.jit` is where an update of one's own makes its state, whose
    environments' reset rounds otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, "-c", SAME_BITS, str(EXAMPLES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "returns equal: True networks equal: True" in run.stdout, run.stdout


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
