"""Observers of long runs: a profile of chosen steps, and callbacks that see the model."""

import gzip
import json
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, programs_made, regression_data

import eqfit


ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs
# 120 samples in batches of 16: 8 steps an epoch, the last of 8 samples.
STEPS_PER_EPOCH = 8


@pytest.fixture(scope="module")
def problem():
    key = jax.random.key(0)
    data = regression_data(key, 120)
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=jax.random.key(1))
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=jax.random.key(2), batch_size=16)
    return model, data, kwargs


def _same_results(a, b):
    assert_trees_equal(a.model, b.model)
    assert_trees_equal(a.opt_state, b.opt_state)
    for name in a.history.values:
        np.testing.assert_array_equal(a.history[name], b.history[name])
    np.testing.assert_array_equal(a.history.step_loss, b.history.step_loss)


def _trace_events(directory: Path) -> list[str]:
    """The names of the events of the one trace written under `directory`."""
    (trace,) = directory.glob("plugins/profile/*/*.trace.json.gz")
    return [e.get("name", "") for e in json.loads(gzip.open(trace).read())["traceEvents"]]


# -- Profiles.


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_a_profile_traces_its_steps_and_changes_no_bit(problem, progress, tmp_path):
    model, data, kwargs = problem
    kwargs = dict(kwargs, epochs=4, progress=progress)
    plain = eqfit.fit(model, data, **kwargs)
    profile = eqfit.Profile(tmp_path, start_step=10, steps=3)  # inside epoch 2
    profiled = eqfit.fit(model, data, profile=profile, **kwargs)
    _same_results(plain, profiled)
    # The trace holds the run's program (`jax.jit` names it after `_loop.run`) and its
    # XLA operations: the loops over steps, the fused kernels of the step.
    (xplane,) = tmp_path.glob("plugins/profile/*/*.xplane.pb")
    assert b"jit_run" in xplane.read_bytes()
    names = _trace_events(tmp_path)
    assert "PjitFunction(run)" in names
    assert any(n.startswith("while") for n in names)
    assert any("fusion" in n for n in names)
    # The host waited for the device at the first edge: the program that makes the
    # training state ran before the trace began.
    assert "PjitFunction(start)" not in names


def test_a_profile_past_the_end_of_the_run_is_traced_to_its_end(problem, tmp_path):
    """And the trace is stopped: another can start."""
    model, data, kwargs = problem
    profile = eqfit.Profile(tmp_path / "a", start_step=2 * STEPS_PER_EPOCH - 1, steps=100)
    eqfit.fit(model, data, epochs=2, profile=profile, **kwargs)
    assert "PjitFunction(run)" in _trace_events(tmp_path / "a")
    profile = eqfit.Profile(tmp_path / "b", start_step=0, steps=1)  # from the first step
    eqfit.fit(model, data, epochs=2, profile=profile, **kwargs)
    assert "PjitFunction(run)" in _trace_events(tmp_path / "b")


class _Raises:
    def on_epoch_end(self, epoch, logs):
        raise RuntimeError("a callback's bug")


def test_a_trace_stops_on_every_way_out(problem, tmp_path):
    model, data, kwargs = problem
    profile = eqfit.Profile(tmp_path / "a", start_step=1, steps=100)
    with pytest.raises(RuntimeError, match="a callback's bug"):
        eqfit.fit(model, data, epochs=2, profile=profile, callbacks=[_Raises()], **kwargs)
    jax.profiler.start_trace(str(tmp_path / "b"))  # none is running any more
    jax.profiler.stop_trace()


def test_a_profile_outside_the_run_is_refused_before_anything_compiles(problem, tmp_path):
    model, data, kwargs = problem

    def refused(match, **more):
        def call():
            with pytest.raises(ValueError, match=match):
                eqfit.fit(model, data, **kwargs, **more)

        assert programs_made(call) == 0

    total = 3 * STEPS_PER_EPOCH
    refused(
        rf"`profile` starts at step {total}, outside this run's steps: 0 to {total - 1}, 8 per ",
        epochs=3,
        profile=eqfit.Profile(tmp_path, total, 1),
    )
    # Steps count from the first epoch ever: a continued run's start from there.
    refused(
        r"`profile` starts at step 7, outside this run's steps: 8 to 23, .*`initial_epoch`'s",
        epochs=3,
        initial_epoch=1,
        profile=eqfit.Profile(tmp_path, 7, 2),
    )
    with pytest.raises(
        TypeError, match=r"`profile`.*an `eqfit.Profile\(directory, start_step, steps\)`"
    ):
        eqfit.fit(model, data, profile=str(tmp_path), **kwargs)


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ((3, 0, 1), TypeError, "`Profile`'s `directory` must be a path"),
        (("d", -1, 1), ValueError, "`Profile`'s `start_step` must be a whole number of 0 or more"),
        (("d", 0, 0), ValueError, "`Profile`'s `steps` must be a whole number of 1 or more"),
        (("d", True, 1), ValueError, "`start_step`"),
    ],
)
def test_profile_is_checked_as_it_is_made(arguments, error, match):
    with pytest.raises(error, match=match):
        eqfit.Profile(*arguments)


class _StopsAfterFirst:
    def on_epoch_end(self, epoch, logs):
        return True


def test_a_run_resumed_past_its_profile_warns_that_it_traced_nothing(problem, tmp_path):
    model, data, kwargs = problem
    kwargs = dict(kwargs, epochs=2, checkpoint=tmp_path / "ckpt")
    eqfit.fit(model, data, callbacks=[_StopsAfterFirst()], **kwargs)
    profile = eqfit.Profile(tmp_path / "trace", start_step=2, steps=3)
    with pytest.warns(UserWarning, match="asked for steps 2 to 4, but this run trained steps 8"):
        eqfit.fit(model, data, profile=profile, **kwargs)
    assert not (tmp_path / "trace").exists()


class _Config:
    def on_train_begin(self, config):
        self.config = config

    def on_epoch_end(self, epoch, logs):
        pass


def test_the_callbacks_config_names_the_profile(problem, tmp_path):
    model, data, kwargs = problem
    callback = _Config()
    profile = eqfit.Profile(tmp_path, 3, 2)
    eqfit.fit(model, data, profile=profile, callbacks=[callback], **kwargs)
    assert callback.config["profile"] == {"directory": str(tmp_path), "start_step": 3, "steps": 2}
    json.dumps(callback.config)


def test_the_callbacks_config_names_the_checkpoints(problem, tmp_path):
    model, data, kwargs = problem
    names = (
        "checkpoint",
        "checkpoint_every",
        "checkpoint_every_steps",
        "checkpoint_every_seconds",
    )
    none, kept = _Config(), _Config()
    eqfit.fit(model, data, callbacks=[none], **kwargs)
    assert [none.config[name] for name in names] == [None, None, None, None]
    policy = eqfit.Checkpoint(tmp_path, every_epochs=2, every_steps=5, every_seconds=30.0)
    eqfit.fit(model, data, checkpoint=policy, callbacks=[kept], **kwargs)
    assert [kept.config[name] for name in names] == [str(tmp_path), 2, 5, 30.0]
    assert list(kept.config) == list(none.config)  # the same names, in the same order
    json.dumps(kept.config)


# -- Callbacks that see the model.


class Sees(eqfit.ModelCallback[eqfit.models.MLP]):
    """Keeps the model and the average it sees at each epoch's end, and each epoch's logs."""

    def __init__(self, stops_training=True):
        self.stops_training = stops_training
        self.models, self.logs, self.order = {}, {}, []

    def on_epoch_end(self, epoch, logs):
        self.logs[epoch] = logs
        self.order.append(("end", epoch))

    def on_epoch_model(self, epoch, model, ema_model):
        self.models[epoch] = (model, ema_model)
        self.order.append(("model", epoch))


class Plain:
    def __init__(self):
        self.seen = []

    def on_epoch_end(self, epoch, logs):
        self.seen.append(epoch)


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
@pytest.mark.parametrize("ema", [None, 0.9])
def test_a_callback_sees_the_model_at_each_epochs_end(problem, progress, ema):
    model, data, kwargs = problem
    kwargs = dict(kwargs, ema=ema)
    sees, plain, behind = Sees(), Plain(), Sees(stops_training=False)
    result = eqfit.fit(
        model, data, epochs=3, progress=progress, callbacks=[sees, plain, behind], **kwargs
    )
    assert plain.seen == [1, 2, 3]  # a callback without the method, as before
    assert sees.order == [(what, e) for e in (1, 2, 3) for what in ("end", "model")]
    for callback in (sees, behind):
        assert sorted(callback.models) == [1, 2, 3]
        for epoch in (1, 2):
            trained = eqfit.fit(model, data, epochs=epoch, **kwargs)
            seen, seen_average = callback.models[epoch]
            assert type(seen) is eqfit.models.MLP
            assert_trees_equal(seen, trained.model)
            if ema is None:
                assert seen_average is None
            else:
                assert type(seen_average) is eqfit.models.MLP
                assert_trees_equal(seen_average, trained.ema_model)
        assert_trees_equal(callback.models[3][0], result.model)


class StopsAt(Sees):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs):
        super().on_epoch_end(epoch, logs)
        return epoch == self.epoch


def test_a_callback_that_stops_training_sees_the_model_it_stopped_at(problem):
    model, data, kwargs = problem
    callback = StopsAt(2)
    result = eqfit.fit(model, data, epochs=5, callbacks=[callback], **kwargs)
    assert sorted(callback.models) == [1, 2]
    assert_trees_equal(callback.models[2][0], result.model)


@pytest.mark.heavy  # several devices: CI runs it, the README's command leaves it out
@pytest.mark.parametrize("case", ["ensemble", "devices", "bfloat16"])
def test_the_model_a_callback_sees_is_the_one_fit_returns(problem, case):
    """An ensemble's stacked members, one replica of several devices', the caller's dtypes
    under a precision policy.
    """
    model, data, kwargs = problem
    if case == "ensemble":
        make = lambda k: eqfit.models.MLP(4, "scalar", 16, 1, key=k)  # noqa: E731
        model = eqx.filter_vmap(make)(jax.random.split(jax.random.key(3), 2))
        kwargs = dict(kwargs, ensemble=True)
    elif case == "devices":
        kwargs = dict(kwargs, devices=2)
    else:
        kwargs = dict(kwargs, precision="bfloat16", ema=0.9)
    callback = Sees()
    result = eqfit.fit(model, data, epochs=2, callbacks=[callback], **kwargs)
    first = eqfit.fit(model, data, epochs=1, **kwargs)
    assert_trees_equal(callback.models[1][0], first.model)
    assert_trees_equal(callback.models[2][0], result.model)
    if case == "bfloat16":
        assert_trees_equal(callback.models[2][1], result.ema_model)
    dtypes = lambda m: [x.dtype for x in jax.tree.leaves(eqx.filter(m, eqx.is_array))]  # noqa: E731
    assert dtypes(callback.models[2][0]) == dtypes(model)
