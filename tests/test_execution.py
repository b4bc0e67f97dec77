"""The ways of running the steps (`fit(..., execution=)`): every way trains the same run.

`WholeRun` scans every step inside one compiled loop; `PerStep(unroll)` calls programs of
`unroll` steps written out, one after another. The arithmetic of a step is the same, so
their runs agree to float tolerance (XLA may fuse the two programs differently); within
one way, the compiled run and the bar's run, cut into other calls, agree bit for bit.
"""

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_trees_equal, programs_compiled, worker_env

# The problem of test_long_runs: N = 200 at batch 16, 13 steps a pass (12 of 16, one of 8).
from test_long_runs import arrays, BATCH, Batches

import eqfit


HERE = Path(__file__).parent
ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs
PER_STEP = [eqfit.PerStep(), eqfit.PerStep(3)]


def mae(model, x, y):
    return jnp.abs(jax.vmap(model)(x) - y).mean()


def train(execution, kind="arrays", tmp_path=None, progress=False, **kwargs):
    """An MLP trained on `kind` of data for 3 epochs, validated and with a metric."""
    x, y = arrays()
    if kind == "arrays":
        data = (x, y)
    elif kind == "memmap":
        assert tmp_path is not None
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "y.npy", y)
        data = (
            np.load(tmp_path / "x.npy", mmap_mode="r"),
            np.load(tmp_path / "y.npy", mmap_mode="r"),
        )
    else:
        data = Batches(with_len=kind == "loader")
    model = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(1))
    settings = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=jax.random.key(2),
        epochs=3,
        batch_size=BATCH,
        validation_data=(x[:40], y[:40]),
        metrics={"mae": mae},
        execution=execution,
        progress=progress,
    )
    return eqfit.fit(model, data, **{**settings, **kwargs})


def assert_runs_close(a, b):
    assert_trees_close(a.model, b.model)
    assert_trees_close(a.opt_state, b.opt_state)
    np.testing.assert_array_equal(a.history.batch_sizes, b.history.batch_sizes)
    np.testing.assert_allclose(a.history.step_loss, b.history.step_loss, rtol=1e-5, atol=1e-6)
    for name in ("loss", "val_loss", "mae", "val_mae"):
        np.testing.assert_allclose(a.history[name], b.history[name], rtol=1e-5, atol=1e-6)


def assert_runs_equal(a, b):
    assert_trees_equal(a.model, b.model)
    assert_trees_equal(a.opt_state, b.opt_state)
    np.testing.assert_array_equal(a.history.step_loss, b.history.step_loss)
    for name in ("loss", "val_loss", "mae", "val_mae"):
        np.testing.assert_array_equal(a.history[name], b.history[name])


CONFIGURATIONS = {
    "arrays": dict(),
    # Epochs of 5 steps, inside and across passes of 13.
    "epochs-inside-passes": dict(steps_per_epoch=5, epochs=6),
    "unsized-loader": dict(kind="unsized"),
    # The same paths again, with other options (the whole suite only).
    "early-stopping": dict(
        epochs=8, early_stopping=eqfit.EarlyStopping(patience=1, min_delta=0.5, restore_best=True)
    ),
    "no-shuffle": dict(shuffle=False),
    "loader": dict(kind="loader"),
    "ema-and-norms": dict(ema=0.9, norms=True),
}
HEAVY = ("epochs-inside-passes", "early-stopping", "no-shuffle", "loader", "ema-and-norms")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in CONFIGURATIONS],
)
def test_every_way_trains_the_same_run(name):
    settings = CONFIGURATIONS[name]
    whole = train(eqfit.WholeRun(), **settings)
    # Programs of one step; and of three, whose calls stop short at epoch and pass ends.
    for execution in PER_STEP if name == "arrays" else PER_STEP[1:]:
        compiled = train(execution, **settings)
        assert_runs_close(compiled, whole)
        # The bar's calls cut the run elsewhere: within a way, the same bits.
        assert_runs_equal(train(execution, progress="bar", **settings), compiled)
        if name == "early-stopping":  # it did stop early, at the same epoch in every way
            assert whole.history.epochs < 8 and whole.history.stop_reason == "early_stopping"
            assert compiled.history.epochs == whole.history.epochs


@pytest.mark.heavy
@pytest.mark.parametrize(
    "settings",
    [
        dict(kind="memmap"),
        dict(devices=2),
        dict(mesh="mesh"),
        dict(mesh="mesh", shard=eqfit.sharding.fsdp("batch", min_bytes=0)),
    ],
    ids=["memmap", "devices", "mesh", "shard"],
)
def test_every_way_trains_the_same_run_on_memmaps_and_devices(tmp_path, settings):
    if settings.get("mesh") == "mesh":
        settings = {**settings, "mesh": jax.make_mesh((8,), ("batch",))}
    settings = {"tmp_path": tmp_path, "batch_size": 32, **settings}
    whole = train(eqfit.WholeRun(), **settings)
    compiled = train(eqfit.PerStep(), **settings)
    assert_runs_close(compiled, whole)
    assert_runs_equal(train(eqfit.PerStep(), progress="bar", **settings), compiled)


@pytest.mark.heavy
def test_every_way_trains_an_ensemble_the_same():
    def make(key):
        return eqfit.models.MLP(3, "scalar", 8, 1, key=key)

    x, y = arrays()
    models = eqx.filter_vmap(make)(jax.random.split(jax.random.key(3), 3))
    settings = dict(
        loss=eqfit.losses.mse,
        optimizer=ADAM,
        key=jax.random.key(4),
        epochs=2,
        batch_size=BATCH,
        validation_data=(x[:40], y[:40]),
        ensemble=True,
    )
    whole = eqfit.fit(models, (x, y), execution=eqfit.WholeRun(), **settings)
    per_step = eqfit.fit(models, (x, y), execution=eqfit.PerStep(2), **settings)
    assert_trees_close(per_step.model, whole.model)
    np.testing.assert_allclose(per_step.history.val_loss, whole.history.val_loss, rtol=1e-5)


class Slope(eqx.Module):
    """A linear layer then Equinox's PReLU, whose `PReLU(0.2)` holds `jnp.asarray(0.2)`:
    weakly typed.
    """

    linear: eqx.nn.Linear
    prelu: eqx.nn.PReLU

    def __call__(self, x):
        return self.prelu(self.linear(x))[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "execution",
    [eqfit.PerStep(), eqfit.WholeRun(), eqfit.PerStep(guard=True)],
    ids=["per-step", "whole-run", "guarded"],
)
def test_a_weakly_typed_array_compiles_the_step_once_and_trains_strongly_typed(execution):
    x, y = arrays()
    model = Slope(eqx.nn.Linear(3, 1, key=jax.random.key(1)), eqx.nn.PReLU(0.2))
    assert model.prelu.negative_slope.weak_type
    optimizer = optax.adam(1e-2)  # this test's own: its first fit compiles
    settings = dict(
        loss=mae,
        optimizer=optimizer,
        key=jax.random.key(2),
        epochs=2,
        batch_size=40,  # no remainder: `PerStep` would compile a program for it
        validation_data=(x[:40], y[:40]),
        execution=execution,
    )
    with programs_compiled() as first:
        result = eqfit.fit(model, (x, y), **settings)
    # One program of steps, for every call: the state's types were fixed before the first.
    # (`start` is made without compiling: it only copies the model and fills Adam's state.)
    steps = [name for name in first if name in ("jit(run)", "jit(unrolled)", "jit(start)")]
    assert steps == ["jit(run)" if execution == eqfit.WholeRun() else "jit(unrolled)"]
    # What a hand loop's optax update makes of it: a strongly typed float32; and Adam's.
    slope = result.model.prelu.negative_slope
    assert slope.dtype == jnp.float32 and not slope.weak_type
    assert not any(leaf.weak_type for leaf in jax.tree.leaves(result.opt_state))
    assert result.history.epochs == 2 and np.isfinite(result.history.loss).all()
    with programs_compiled() as again:
        eqfit.fit(model, (x, y), **settings)
    assert again == []
    # The same run, the same program, as the slope given strongly typed.
    strong = eqx.tree_at(lambda m: m.prelu.negative_slope, model, jnp.float32(0.2))
    with programs_compiled() as typed:
        from_strong = eqfit.fit(strong, (x, y), **settings)
    assert typed == []
    assert_trees_equal(from_strong.model, result.model)
    assert_trees_equal(from_strong.opt_state, result.opt_state)


@pytest.mark.slow
def test_a_run_stopped_by_a_nan_stops_at_its_step_in_every_way():
    x, y = arrays()
    y[7] = np.nan  # in some batch of the first pass, wherever the shuffle puts it
    raised = []
    for execution in (eqfit.WholeRun(), eqfit.PerStep(3)):
        with pytest.raises(eqfit.NonFiniteLossError) as error:
            eqfit.fit(
                eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(1)),
                (x, y),
                loss=eqfit.losses.mse,
                optimizer=ADAM,
                key=jax.random.key(2),
                epochs=2,
                batch_size=BATCH,
                execution=execution,
            )
        raised.append(error.value)
    whole, per_step = raised
    assert str(per_step) == str(whole)
    trained = [int((e.result.history.batch_sizes > 0).sum()) for e in raised]  # type: ignore
    assert trained[0] == trained[1] < 13  # inside the first pass
    assert_trees_close(per_step.result.model, whole.result.model)  # type: ignore


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [("per-step", "whole"), ("whole", "per-step")])
def test_a_checkpoint_written_in_one_way_resumes_in_the_other(tmp_path, first, then):
    ways = {"per-step": eqfit.PerStep(), "whole": eqfit.WholeRun()}
    uninterrupted = train(ways[then], epochs=4)
    policy = eqfit.Checkpoint(tmp_path / "all", every_epochs=None, every_steps=5, keep=100)
    train(ways[first], epochs=4, checkpoint=policy)
    # Inside the second epoch, after the first pass's smaller last batch.
    name = "ckpt-000001-000007"
    assert (tmp_path / "all" / name).is_dir()
    alone = tmp_path / "alone"
    shutil.copytree(tmp_path / "all" / name, alone / name)
    resumed = train(ways[then], epochs=4, checkpoint=alone)
    assert_runs_close(resumed, uninterrupted)
    assert resumed.history.epochs == 4


class ConvNet(eqx.Module):
    """A small CNN of Equinox's layers, as in Equinox's MNIST example."""

    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.head = eqx.nn.Linear(4, 3, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.conv(x)).mean(axis=(1, 2)))


def conv_problem():
    rng = np.random.default_rng(5)
    images = rng.normal(size=(48, 1, 6, 6)).astype(np.float32)
    labels = rng.integers(0, 3, 48).astype(np.int32)
    model = ConvNet(jax.random.key(6))
    settings = dict(
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=ADAM,
        key=jax.random.key(7),
        epochs=2,
        batch_size=8,
    )
    return model, (images, labels), settings


@pytest.mark.slow
def test_fit_chooses_per_step_for_a_convolution_on_the_cpu_and_the_loop_for_an_mlp():
    model, data, settings = conv_problem()
    planned = eqfit.plan(model, data, **settings)
    platform = jax.default_backend()
    if platform != "cpu":  # the choice is the CPU's: a chip runs convolutions in the loop
        assert planned.execution == eqfit.WholeRun() and f"on {platform}" in planned.execution_why
        return
    # No NaN guard by default, on the CPU too: a non-finite step is replayed.
    assert planned.execution == eqfit.PerStep(1)
    assert "convolves" in planned.execution_why and "CPU" in planned.execution_why
    assert "no NaN guard" in planned.execution_why
    assert "steps run as: a program of one step called from Python" in str(planned)
    x, y = arrays()
    mlp = eqfit.models.MLP(3, "scalar", 8, 1, key=jax.random.key(1))
    planned = eqfit.plan(mlp, (x, y), loss=eqfit.losses.mse, optimizer=ADAM, key=jax.random.key(2))
    assert planned.execution == eqfit.WholeRun()
    assert "no convolution" in planned.execution_why
    # Asked for, either way is taken, and the guard with it.
    forced = eqfit.plan(model, data, execution=eqfit.WholeRun(guard=True), **settings)
    assert forced.execution == eqfit.WholeRun(guard=True) and "asks" in forced.execution_why
    assert "NaN guard's `cond`" in forced.execution_why
    skipping = eqfit.plan(model, data, execution=eqfit.WholeRun(), on_nan="skip", **settings)
    assert "guard" not in skipping.execution_why  # "skip" always guards: nothing to choose


class Recurrent(eqx.Module):
    """A cell scanned over a sequence, as a GRU is: its product runs once an element."""

    cell: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.Linear(8 + 4, 8, key=k1)
        self.head = eqx.nn.Linear(8, "scalar", key=k2)

    def __call__(self, xs):
        def step(h, x):
            return jnp.tanh(self.cell(jnp.concatenate([h, x]))), None

        h, _ = jax.lax.scan(step, jnp.zeros(8), xs)
        return self.head(h)


@pytest.mark.slow
def test_a_small_step_without_the_guard_is_ordered_for_memory_on_the_cpu_with_the_same_bits():
    length, batch = 10, 16
    rng = np.random.default_rng(0)
    data = (
        rng.normal(size=(64, length, 4)).astype(np.float32),
        rng.normal(size=64).astype(np.float32),
    )
    settings = dict(
        loss=eqfit.losses.mse, optimizer=ADAM, key=jax.random.key(1), epochs=2, batch_size=batch
    )
    model = Recurrent(jax.random.key(0))
    planned = eqfit.plan(model, data, **settings)
    # The products a batch, as the step runs them: the cell's at every element, the head's
    # once; two FLOPs a multiply-add.
    flops = 2 * batch * (length * (8 + 4) * 8 + 8)
    if jax.default_backend() == "cpu":  # XLA:CPU's scheduler; a chip's keeps its own
        assert f"a small step ({flops:.3g} FLOPs of products a batch)" in planned.execution_why
        assert "for memory" in planned.execution_why
    else:
        assert "small step" not in planned.execution_why
    # Ordered otherwise, the same arithmetic: the guarded run's bits (XLA's own order).
    ordered = eqfit.fit(model, data, **settings)
    guarded = eqfit.fit(model, data, execution=eqfit.WholeRun(guard=True), **settings)
    assert_trees_equal(ordered.model, guarded.model)
    assert_trees_equal(ordered.opt_state, guarded.opt_state)
    np.testing.assert_array_equal(ordered.history.step_loss, guarded.history.step_loss)
    forced = eqfit.plan(model, data, execution=eqfit.WholeRun(guard=True), **settings)
    assert "small step" not in forced.execution_why
    # A larger step keeps XLA's order for concurrency.
    x, y = arrays()
    wide = eqfit.models.MLP(3, "scalar", 2048, 2, key=jax.random.key(2))
    planned = eqfit.plan(wide, (x, y), loss=eqfit.losses.mse, optimizer=ADAM, key=jax.random.key(3))
    assert "no NaN guard" in planned.execution_why and "small step" not in planned.execution_why


class Rollout(eqfit.AbstractUpdate):
    """An update of one's own whose work (here a long scan, as a rollout's) is not a
    loss's: no loss of its own, and products of a few FLOPs.
    """

    name: str = "rollout"

    def init(self, params):
        return None

    def apply(self, model, state, batch, *, model_state, key):
        def turn(h, _):
            return jnp.tanh(h + 0.01), None

        h, _ = jax.lax.scan(turn, jnp.zeros(()), None, length=512)
        model = jax.tree.map(lambda p: p - 1e-3 * h if eqx.is_inexact_array(p) else p, model)
        return eqfit.Applied(model, state, model_state, {"h": h})


def test_an_update_of_ones_own_keeps_xlas_order_its_work_unknown():
    # Its step's size is not its loss's (it has none): it is not taken for a small step.
    planned = eqfit.plan(
        eqfit.models.MLP(2, 1, 4, 1, key=jax.random.key(0)),
        updates=[Rollout()],
        steps_per_epoch=3,
        key=jax.random.key(1),
    )
    assert "no NaN guard" in planned.execution_why and "small step" not in planned.execution_why


def test_a_conv_net_trains_the_same_in_the_way_chosen_and_in_the_loop():
    model, data, settings = conv_problem()
    chosen = eqfit.fit(model, data, progress="bar", **settings)  # PerStep(1), as planned
    whole = eqfit.fit(model, data, execution=eqfit.WholeRun(), **settings)
    assert_trees_close(chosen.model, whole.model)
    np.testing.assert_allclose(chosen.history.step_loss, whole.history.step_loss, rtol=1e-5)


def noisy_loss(model, x, y, *, key):
    """A loss that requires a key: its value depends on each batch's."""
    noise = 0.1 * jax.random.normal(key, x.shape)
    return eqfit.losses.softmax_cross_entropy(model, x + noise, y)


@pytest.mark.slow
@pytest.mark.parametrize(
    "execution", ["auto", pytest.param(eqfit.PerStep(3), marks=pytest.mark.heavy)]
)
def test_a_conv_nets_validation_runs_as_its_steps_do_with_the_loops_values(execution):
    model, (images, labels), settings = conv_problem()
    rng = np.random.default_rng(8)
    # Validation sets of 30 images, at batch 8: three full batches (a program of three
    # takes them at once; of one, in turn) and one of 6.
    val = (rng.normal(size=(30, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, 30))
    other = (val[0][::-1].copy(), val[1][::-1].copy())
    settings = dict(
        settings,
        epochs=4,
        loss=noisy_loss,
        metrics={"accuracy": eqfit.metrics.accuracy},
        validation_data=eqfit.ValidationSets(a=val, b=other),
        validation_freq=2,
        early_stopping=eqfit.EarlyStopping(monitor="val_a_loss", patience=5, restore_best=True),
    )
    planned = eqfit.plan(model, (images, labels), execution=execution, **settings)
    if execution != "auto":
        way = "a program of 3 batches called from Python"
    elif jax.default_backend() == "cpu":  # PerStep(1): the CPU's choice for a convolution
        way = "a program of one batch called from Python"
    else:
        way = "every batch in one compiled loop"
    assert f"validation runs as: {way}" in str(planned)
    per_step = eqfit.fit(model, (images, labels), execution=execution, **settings)
    whole = eqfit.fit(model, (images, labels), execution=eqfit.WholeRun(), **settings)
    names = [n for n in whole.history.to_dict() if n.startswith("val_")]
    assert len(names) == 4  # each set's loss and accuracy
    for name in names:  # epochs 2 and 4 validated, 1 and 3 not
        assert np.isnan(whole.history[name][[0, 2]]).all()
        np.testing.assert_allclose(per_step.history[name], whole.history[name], rtol=1e-5)
    assert per_step.history.best_epoch == whole.history.best_epoch
    assert_trees_close(per_step.model, whole.model)
    # Within the way, the bar's run agrees bit for bit.
    bar = eqfit.fit(model, (images, labels), execution=execution, progress="bar", **settings)
    for name in names:
        np.testing.assert_array_equal(bar.history[name], per_step.history[name])


@pytest.mark.heavy  # the conv net's validation meets it in the quick suite
def test_evaluate_and_predict_of_a_conv_net_run_as_fits_steps_do_with_the_loops_values():
    model, (images, labels), _ = conv_problem()
    images, labels = images[:45], labels[:45]  # five full batches of 8 and one of 5
    metrics = {"accuracy": eqfit.metrics.accuracy}
    key = jax.random.key(9)
    whole = eqfit.evaluate(
        model,
        (images, labels),
        loss=noisy_loss,
        metrics=metrics,
        batch_size=8,
        key=key,
        execution=eqfit.WholeRun(),
    )
    predicted = eqfit.predict(model, images, batch_size=8, execution=eqfit.WholeRun())
    for execution in ("auto", eqfit.PerStep(2), eqfit.PerStep(9)):
        values = eqfit.evaluate(
            model,
            (images, labels),
            loss=noisy_loss,
            metrics=metrics,
            batch_size=8,
            key=key,
            execution=execution,
        )
        assert values.keys() == whole.keys()
        for name in whole:
            np.testing.assert_allclose(values[name], whole[name], rtol=1e-5)
        out = eqfit.predict(model, images, batch_size=8, execution=execution)
        assert out.shape == predicted.shape == (45, 3)
        np.testing.assert_allclose(out, predicted, rtol=1e-5, atol=1e-6)
    # An ensemble's members each predict every example, in either way.
    models = eqx.filter_vmap(ConvNet)(jax.random.split(jax.random.key(10), 2))
    stacked = eqfit.predict(models, images, batch_size=8, ensemble=True)
    assert stacked.shape == (2, 45, 3)
    looped = eqfit.predict(models, images, batch_size=8, ensemble=True, execution=eqfit.WholeRun())
    np.testing.assert_allclose(stacked, looped, rtol=1e-5, atol=1e-6)
    # A label out of range is found in a program of batches as in the loop.
    bad = labels.copy()
    bad[42] = 7
    for execution in ("auto", eqfit.WholeRun()):
        with pytest.raises(ValueError, match="7"):
            eqfit.evaluate(
                model,
                (images, bad),
                loss=eqfit.losses.softmax_cross_entropy,
                batch_size=8,
                execution=execution,
            )


def test_a_way_that_cannot_run_is_refused_before_compiling():
    with pytest.raises(ValueError, match=r"`PerStep\(unroll=...\)` must be at least 1, got 0"):
        eqfit.PerStep(0)
    with pytest.raises(
        ValueError,
        match=r"`execution=PerStep\(unroll=20\)` asks for programs of 20 steps, but an epoch "
        r"of this run has 13.*at most 13",
    ):
        train(eqfit.PerStep(20))
    with pytest.raises(TypeError, match="`execution`"):
        train("fast")


# What `StepsThenLoop` was asked to make, in order.
ASKED = []


class StepsThenLoop(eqfit.Execution):
    """A way of one's own, made of the makers `fit`, `evaluate` and `predict` hand it:
    `PerStep`'s programs of steps, with an inference's batches in one loop.
    """

    unroll: int = 2

    def describe(self):
        return f"programs of {self.unroll} steps, batches in one loop"

    def steps_per_program(self):
        return self.unroll

    def program(self, whole_run, steps):
        ASKED.append("program")
        return steps(self.unroll)

    def batches(self, scanned, in_calls):
        ASKED.append("batches")
        return scanned()


@pytest.mark.slow
def test_a_way_of_ones_own_runs_the_programs_it_makes_from_the_makers_it_is_handed(tmp_path):
    own, per_step = train(StepsThenLoop()), train(eqfit.PerStep(2))
    assert ASKED[0] == "program" and "batches" in ASKED  # the run's program, validation's
    # The same programs of steps: the same training, bit for bit; validation's batches
    # run a call each (its values to XLA's fusion).
    assert_trees_equal(own.model, per_step.model)
    np.testing.assert_array_equal(own.history.step_loss, per_step.history.step_loss)
    np.testing.assert_allclose(own.history["val_loss"], per_step.history["val_loss"], rtol=1e-5)
    x, y = arrays()
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    for data in (x, mapped):  # in memory, and streamed chunk by chunk
        ASKED.clear()
        got, want = (
            eqfit.predict(own.model, data, batch_size=BATCH, execution=way)
            for way in (StepsThenLoop(), eqfit.WholeRun())
        )
        np.testing.assert_array_equal(got, want)  # the one loop's program: the same bits
        assert ASKED and set(ASKED) == {"batches"}
        got, want = (
            eqfit.evaluate(own.model, (data, y), loss=eqfit.losses.mse, execution=way)
            for way in (StepsThenLoop(), eqfit.WholeRun())
        )
        assert got == want


@pytest.mark.heavy
def test_a_sigterm_in_the_per_step_way_stops_within_steps_with_its_checkpoint(tmp_path):
    """An epoch of a million steps, each a call: SIGTERM stops training a few steps on,
    with the checkpoint at the step the result reached.
    """
    process = subprocess.Popen(
        [sys.executable, str(HERE / "checkpoint_worker.py"), str(tmp_path), "compiled"]
        + ["long", "perstep"],
        env=worker_env(HERE),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("starting")
        time.sleep(4)  # compiled, and training
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 3, err[-3000:]
    words = out.split("interrupted after ")[1].split()
    steps, by = int(words[2]), words[5]
    assert by == "SIGTERM" and 0 < steps < 10**6
    assert sorted(p.name for p in tmp_path.glob("ckpt-*"))[-1] == f"ckpt-000000-{steps:06d}"


def test_per_step_takes_numpy_integers_and_refuses_what_is_no_integer():
    assert eqfit.PerStep(np.int64(3)) == eqfit.PerStep(3)
    assert type(eqfit.PerStep(np.int64(3)).unroll) is int
    with pytest.raises(TypeError, match=r"`PerStep\(unroll=...\)` must be an integer.*2.5"):
        eqfit.PerStep(2.5)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"must be at least 1, got 0"):
        eqfit.PerStep(0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "batches, unroll, words",
    [
        (6, 300, r"but an epoch of this run has 6, .* Give `unroll` at most 6"),
        (300, 200, r"but the data streams in chunks of \d+, .* Give `unroll` at most \d+"),
    ],
)
def test_programs_longer_than_a_loaders_epoch_or_chunk_are_refused_before_tracing(
    batches, unroll, words
):
    """A generator's length is known only as it is read: `PerStep(unroll)` longer than
    its epoch (or than a chunk of its batches, which a call never passes) is refused at
    the first feed, before the program is traced, where it was traced step by step for
    as long as `unroll` said (`PerStep(10**9)`: without end).
    """
    x = np.ones((batches * 4, 2), np.float32)

    def generator():
        for i in range(batches):
            yield x[4 * i : 4 * i + 4], x[4 * i : 4 * i + 4, :1]

    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    kwargs = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(0.1), key=jax.random.key(1))
    with pytest.raises(ValueError, match=rf"`execution=PerStep\(unroll={unroll}\)` .*{words}"):
        eqfit.fit(model, generator(), execution=eqfit.PerStep(unroll), **kwargs)
    result = eqfit.fit(model, generator(), execution=eqfit.PerStep(6), **kwargs)
    assert result.history.step_loss.shape == (1, batches)
