"""The shuffle: a permutation for every size, and statistics a true permutation passes.

Each statistical test runs on eqfit's shuffle and on `jax.random.permutation` side by
side, with the same threshold: |z| < 4.5 for a statistic whose distribution under a
uniformly random permutation is known (a chance failure about once in 150,000 runs).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from eqfit._core._data import epoch_order, shuffle_seed
from eqfit._program._schedule import plan_passes


SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 97, 127, 128, 129, 1000, 1009, 4095]
SIZES += [4096, 4097, 8008, 65535, 65536, 65537, 2**20 - 1, 2**20, 2**20 + 1]
Z_MAX = 4.5


@functools.cache
def _orders(n: int, epochs: int):
    return jax.jit(jax.vmap(lambda seed, e: epoch_order(seed, e, n, True), in_axes=(None, 0)))


def eqfit_orders(n: int, epochs: int, seed: int = 0) -> np.ndarray:
    """Epochs 0 .. epochs - 1 of eqfit's shuffle of n samples, one row each."""
    key = shuffle_seed(jax.random.key(seed))
    return np.asarray(_orders(n, epochs)(key, jnp.arange(epochs)))


def reference_orders(n: int, epochs: int, seed: int = 0) -> np.ndarray:
    """The same from `jax.random.permutation`, as a hand-written loop would shuffle."""
    keys = jax.vmap(lambda e: jax.random.fold_in(jax.random.key(seed), e))(jnp.arange(epochs))
    return np.asarray(jax.vmap(lambda k: jax.random.permutation(k, n))(keys))


SHUFFLES = {"eqfit": eqfit_orders, "jax.random.permutation": reference_orders}


@pytest.mark.parametrize("n", SIZES)
def test_every_sample_exactly_once(n):
    orders = eqfit_orders(n, 2)
    for order in orders:
        assert order.shape == (n,) and order.dtype == np.uint32
        np.testing.assert_array_equal(np.bincount(order, minlength=n), np.ones(n))


@pytest.mark.heavy
@pytest.mark.parametrize("n", [2**24 - 1, 2**24, 2**24 + 1])
def test_every_sample_exactly_once_at_sixteen_million(n):
    order = eqfit_orders(n, 1)[0]
    np.testing.assert_array_equal(np.bincount(order, minlength=n), np.ones(n))


@settings(max_examples=40, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3, 7, 16, 31, 64, 97, 128, 200]),  # a compilation each
    batch_size=st.integers(1, 64),
    drop_remainder=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_plan_and_the_order_cover_every_sample_once(n, batch_size, drop_remainder, seed):
    if drop_remainder and n < batch_size:
        return  # refused with an error; tested in test_errors
    plan = plan_passes(n, batch_size, drop_remainder)
    # The first epoch's order, as test_every_sample_exactly_once's programs draw it.
    order = eqfit_orders(n, 2, seed)[0]
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


def test_order_depends_on_key_and_epoch_and_shuffle():
    a, b = eqfit_orders(100, 2, seed=0)
    (c,) = eqfit_orders(100, 1, seed=1)
    np.testing.assert_array_equal(a, eqfit_orders(100, 1, seed=0)[0])  # deterministic
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    index = epoch_order(jnp.uint32(0), jnp.asarray(0), 10, False)
    np.testing.assert_array_equal(index, np.arange(10))


def _z_chi_square(statistic: float, dof: float) -> float:
    """A chi-square statistic as a z-score (Wilson and Hilferty's cube-root transform)."""
    x = (statistic / dof) ** (1 / 3)
    return (x - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))


# A square, a prime (walking), 8 x 12, and the lopsided 5 x 10.
@pytest.mark.slow
@pytest.mark.parametrize("n", [64, 61, 96, 50])
@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_where_each_sample_lands_is_uniform(shuffle, n):
    """Pearson's chi-square over the (sample, position) table of many epochs."""
    epochs = 3000
    orders = SHUFFLES[shuffle](n, epochs)
    counts = np.zeros((n, n))
    np.add.at(counts, (orders, np.broadcast_to(np.arange(n), orders.shape)), 1)
    expected = epochs / n
    statistic = ((counts - expected) ** 2 / expected).sum()
    assert abs(_z_chi_square(statistic, (n - 1) ** 2)) < Z_MAX


@pytest.mark.parametrize("n, batch", [(64, 8), (61, 8), (96, 12), (50, 5), (200, 10)])
@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_pairs_share_a_batch_as_often_as_chance_says(shuffle, n, batch):
    """How often each pair of samples shares a batch: each pair's count is binomial with
    p = (batch - 1) / (n - 1) for full batches. Tested over all pairs (chi-square), and for
    neighbouring indices alone (i, i + 1), which a structured shuffle would keep together.
    """
    epochs = 3000
    orders = SHUFFLES[shuffle](n, epochs)
    full = (n // batch) * batch
    batch_of = np.empty_like(orders)
    rows = np.arange(epochs)[:, None]
    batch_of[rows, orders] = np.arange(n) // batch  # the batch each sample lands in
    batch_of[rows, orders[:, full:]] = -1 - np.arange(n - full)  # the remainder: alone
    together = np.zeros((n, n))
    for e in range(epochs):
        together += batch_of[e][:, None] == batch_of[e][None, :]
    pairs = together[np.triu_indices(n, 1)]
    p = (batch - 1) / (n - 1) * full / n  # a pair shares a full batch
    statistic = ((pairs - epochs * p) ** 2 / (epochs * p * (1 - p))).sum()
    assert abs(_z_chi_square(statistic, len(pairs))) < Z_MAX
    neighbours = np.diagonal(together, 1)
    z = (neighbours.sum() - len(neighbours) * epochs * p) / math.sqrt(
        len(neighbours) * epochs * p * (1 - p)
    )
    assert abs(z) < Z_MAX


@pytest.mark.parametrize("n", [1000, 1009])
@pytest.mark.parametrize("shuffle", SHUFFLES)
def test_consecutive_epochs_are_uncorrelated(shuffle, n):
    """Spearman's correlation between where each sample lands in epoch e and in e + 1:
    for independent uniform orders each is about N(0, 1 / (n - 1)).
    """
    epochs = 400
    orders = SHUFFLES[shuffle](n, epochs)
    positions = np.argsort(orders, axis=1).astype(np.float64)
    centred = positions - positions.mean(axis=1, keepdims=True)
    scale = np.sqrt((centred**2).sum(axis=1))
    rho = (centred[:-1] * centred[1:]).sum(axis=1) / (scale[:-1] * scale[1:])
    z_mean = rho.mean() * math.sqrt((n - 1) * len(rho))
    assert abs(z_mean) < Z_MAX
    # Their spread: (n - 1) * sum(rho^2) is about chi-square with one degree per pair.
    statistic = (n - 1) * (rho**2).sum()
    assert abs(_z_chi_square(statistic, len(rho))) < Z_MAX


@pytest.mark.slow
@pytest.mark.parametrize("validation_every", [None, 37])
def test_a_shuffled_pass_trains_on_the_rows_one_step_at_a_time_would(validation_every):
    # A shuffled pass over arrays in memory on the CPU gathers the rows of many steps at
    # once (`_ahead`), and `PerStep` gathers each step's own: each step must see the same
    # rows in the same order. 1,003 rows in batches of 8: 125 full batches and one of 3,
    # more than one stretch of steps gathered at once, the last stretch's rows cut at
    # the pass's end; and validations in the middle of stretches.
    import equinox as eqx
    import optax

    import eqfit

    n = 1003
    ids = np.arange(n, dtype=np.float32)
    data = (ids[:, None], np.arange(n, dtype=np.int32) % 7)

    def loss(model, x, y):
        weights = 1.0 + jnp.arange(x.shape[0], dtype=jnp.float32)  # the rows' order too
        value = jnp.mean((jax.vmap(model)(x) - y[:, None]) ** 2)
        return value, {"rows": jnp.sum(x[:, 0] * weights), "labels": jnp.sum(y * weights)}

    runs = {
        name: eqfit.fit(
            eqx.nn.Linear(1, 1, key=jax.random.key(0)),
            data,
            loss=loss,
            optimizer=optax.sgd(1e-6),
            key=jax.random.key(3),
            epochs=2,
            batch_size=8,
            validation_data=data if validation_every else None,
            validation_every=validation_every,
            execution=execution,
        )
        for name, execution in [("whole", eqfit.WholeRun()), ("per step", eqfit.PerStep())]
    }
    whole, per_step = runs["whole"].history, runs["per step"].history
    for name in ("rows", "labels"):
        np.testing.assert_array_equal(whole.step_values[name], per_step.step_values[name])
    assert whole.step_values["rows"].shape == (2, 126)
    np.testing.assert_array_equal(whole.step_loss, per_step.step_loss)
