"""`PerStep`'s calls cost the host and the device the same at every step of any run: each
call of its program moves nothing from the host and writes nothing of the run's length
(the table of epochs, of validations) beside the state it donates.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal

import eqfit


FEATURES, BATCH = 3, 8


def problem(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


def with_aux(model, x, y):
    error = jax.vmap(model)(x) - y
    return jnp.mean(error**2), {"mae": jnp.mean(jnp.abs(error))}


def settings(**more):
    return (
        dict(
            loss=with_aux,
            optimizer=optax.adam(1e-2),
            key=jax.random.key(1),
            batch_size=BATCH,
            execution=eqfit.PerStep(),
        )
        | more
    )


def model():
    return eqfit.models.MLP(FEATURES, 1, 4, 1, key=jax.random.key(0))


@pytest.mark.slow
def test_a_per_step_program_writes_nothing_of_the_runs_length_beside_its_state():
    # The state's record (donated, written in place) grows with the run; what the program
    # writes besides it must not: 2 epochs or 40, the same bytes.
    x, y = problem(32)
    validation = dict(validation_data=problem(16), validation_every=3)
    written, accessed = [], []
    for epochs in (2, 40):
        plan = eqfit.plan(model(), (x, y), epochs=epochs, **settings(**validation))
        assert plan.execution == eqfit.PerStep()
        written.append(plan.memory.output - plan.memory.alias)
        accessed.append(plan.compiled.cost_analysis()["bytes accessed"])
    assert written[0] == written[1] and written[0] > 0
    assert accessed[0] == accessed[1]


def transfers(capfd, call):
    """How many implicit host-to-device transfers JAX logs while `call()` runs."""
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log"):
        call()
    return capfd.readouterr().err.count("host-to-device transfer")


@pytest.mark.slow
def test_per_step_calls_move_nothing_from_the_host_at_each_step(capfd):
    # An epoch of 4 steps or of 12, 2 epochs: the same transfers (those of each epoch's
    # end, none of each step's).
    def fit(rows):
        return lambda: jax.block_until_ready(
            eqfit.fit(model(), problem(rows), epochs=2, **settings()).model
        )

    for rows in (32, 96):
        fit(rows)()  # compiled
    counted = [transfers(capfd, fit(rows)) for rows in (32, 96)]
    assert counted[0] == counted[1]
    # What is counted: a value from the host passed to a program is logged.
    add = jax.jit(lambda a, b: a + b)
    ones = jnp.ones(3)
    assert transfers(capfd, lambda: add(ones, np.float32(1)).block_until_ready()) == 1


@pytest.mark.slow
def test_time_never_splits_the_steps_of_one_program_and_the_bits_never_hang_on_it():
    # A program of 3 steps, epochs of 12: every step is computed once, in the one call of
    # its 3 (a call of fewer would compute the program's other steps and drop them). The
    # first fit's calls grow from one step, time sizing them (its speed unknown); the
    # second's are sized by the first's speed: the same steps per call, the same bits.
    computed = []

    def counted(model, x, y):
        jax.debug.callback(lambda: computed.append(1))
        return with_aux(model, x, y)

    x, y = problem(96)
    fits = []
    for _ in range(2):
        computed.clear()
        fit = eqfit.fit(
            model(), (x, y), epochs=2, **settings(loss=counted, execution=eqfit.PerStep(3))
        )
        assert len(computed) == fit.history.step_loss.size == 2 * 12
        fits.append(fit)
    assert_trees_equal(fits[0].model, fits[1].model)
    np.testing.assert_array_equal(fits[0].history.step_loss, fits[1].history.step_loss)
