"""`microbatches="auto"`: the fewest microbatches with which the compiled run fits a
device's memory, as the plan's memory analysis says.
"""

import jax
import numpy as np
import optax
import pytest

import eqfit


MiB = 2**20


def _run() -> tuple[eqfit.models.MLP, tuple[np.ndarray, np.ndarray], dict]:
    # Activations dominate: a wide batch through a narrow MLP, so that each microbatch
    # holds less.
    x = np.random.default_rng(0).normal(size=(2048, 32)).astype(np.float32)
    model = eqfit.models.MLP(32, 1, 256, 2, key=jax.random.key(0))
    common = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=jax.random.key(1),
        epochs=2,
        batch_size=1024,
    )
    return model, (x, x[:, :1]), common


@pytest.mark.slow
def test_auto_chooses_the_fewest_microbatches_the_plan_says_fit():
    model, data, common = _run()
    totals = {
        k: eqfit.plan(model, data, microbatches=k, **common).memory.total for k in (1, 2, 4, 8)
    }
    assert totals[1] > totals[2] > totals[4]  # each microbatch holds less
    for memory, expected in [
        (totals[1], 1),
        (totals[1] - 1, 2),
        ((totals[2] + totals[4]) // 2, 4),
    ]:
        auto = eqfit.AutoMicrobatches(memory=memory, margin=0.0)
        plan = eqfit.plan(model, data, microbatches=auto, **common)
        assert plan.microbatches == expected
        assert plan.memory.total == totals[expected]
        assert plan.microbatches_why is not None
        assert plan.microbatches_why.startswith(f"{expected}:")
        assert "microbatches" in str(plan) and "microbatches" in plan.summary()
    # The margin keeps its share free: the memory of one microbatch is not enough.
    auto = eqfit.AutoMicrobatches(memory=totals[1], margin=0.25)
    assert eqfit.plan(model, data, microbatches=auto, **common).microbatches > 1


def test_fit_trains_with_the_chosen_count_as_with_it_given():
    model, data, common = _run()
    total = eqfit.plan(model, data, microbatches=1, **common).memory.total
    auto = eqfit.AutoMicrobatches(memory=total - 1, margin=0.0)
    chosen = eqfit.fit(model, data, microbatches=auto, **common)
    count = chosen.history.microbatches
    assert count > 1
    given = eqfit.fit(model, data, microbatches=count, **common)
    assert given.history.microbatches == count
    np.testing.assert_array_equal(chosen.history.step_loss, given.history.step_loss)
    for a, b in zip(jax.tree.leaves(chosen.model), jax.tree.leaves(given.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_auto_on_the_cpu_reads_the_machines_memory():
    model, data, common = _run()
    result = eqfit.fit(model, data, microbatches="auto", **common)
    assert result.history.microbatches == 1
    plan = eqfit.plan(model, data, microbatches="auto", **common)
    assert plan.microbatches_why is not None and "the machine's" in plan.microbatches_why


def test_none_fits_is_refused_saying_what_each_count_needs():
    model, data, common = _run()
    auto = eqfit.AutoMicrobatches(memory=MiB // 4, margin=0.0)
    with pytest.raises(ValueError, match=r'`microbatches="auto"`.*1: .*MiB'):
        eqfit.fit(model, data, microbatches=auto, **common)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ("many", TypeError, r"`microbatches` must be a whole number .*, \"auto\" or an"),
        (0, ValueError, r"`microbatches` must be an integer of 1 or more, got 0"),
    ],
)
def test_a_bad_microbatches_is_refused_by_name(bad, error, match):
    model, data, common = _run()
    with pytest.raises(error, match=match):
        eqfit.fit(model, data, microbatches=bad, **common)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(memory=0), r"`AutoMicrobatches\(memory=\)` must be a number of bytes above 0"),
        (dict(memory=-5), r"`AutoMicrobatches\(memory=\)`.*got -5"),
        (dict(margin=1.0), r"`AutoMicrobatches\(margin=\)` must be a share.*got 1.0"),
        (dict(margin=-0.1), r"`AutoMicrobatches\(margin=\)`.*got -0.1"),
    ],
)
def test_a_bad_auto_microbatches_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        eqfit.AutoMicrobatches(**kwargs)
