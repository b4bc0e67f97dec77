"""The batch plan and the epoch order: every sample, once, in every epoch."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from eqfit._data import epoch_order, plan_batches, shuffle_seed


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    batch_size=st.integers(1, 64),
    drop_remainder=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    epoch=st.integers(0, 1000),
)
def test_plan_covers_every_sample_once(n, batch_size, drop_remainder, seed, epoch):
    if drop_remainder and n < batch_size:
        return  # refused with an error; tested in test_errors
    plan = plan_batches(n, batch_size, drop_remainder)
    order = np.asarray(epoch_order(shuffle_seed(jax.random.key(seed)), jnp.asarray(epoch), n, True))
    # The order is a permutation of the samples.
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    # Cut exactly as the loop cuts it: full batches, then the remainder.
    full = order[: plan.num_full * plan.batch_size].reshape(plan.num_full, batch_size)
    remainder = order[plan.num_full * batch_size :][: plan.remainder]
    seen = np.concatenate([full.ravel(), remainder])
    assert plan.steps_per_pass == plan.num_full + (plan.remainder > 0)
    if drop_remainder:
        assert len(seen) == n - n % batch_size and plan.remainder == 0
    else:
        np.testing.assert_array_equal(np.sort(seen), np.arange(n))
        assert plan.remainder == n % batch_size
    assert len(np.unique(seen)) == len(seen)


def test_order_depends_on_key_and_epoch():
    key = shuffle_seed(jax.random.key(0))
    a = epoch_order(key, jnp.asarray(0), 100, True)
    b = epoch_order(key, jnp.asarray(1), 100, True)
    c = epoch_order(shuffle_seed(jax.random.key(1)), jnp.asarray(0), 100, True)
    again = epoch_order(key, jnp.asarray(0), 100, True)
    np.testing.assert_array_equal(a, again)
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    np.testing.assert_array_equal(epoch_order(key, jnp.asarray(0), 10, False), np.arange(10))


def test_order_is_roughly_uniform():
    # Where does sample 0 land? Over many epochs every position should be about as likely.
    seed = shuffle_seed(jax.random.key(7))
    orders = jax.vmap(lambda e: epoch_order(seed, e, 8, True))(jnp.arange(4000))
    positions = np.argmax(np.asarray(orders) == 0, axis=1)
    counts = np.bincount(positions, minlength=8)
    assert counts.min() > 400 and counts.max() < 600  # expected 500 each
