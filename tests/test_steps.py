"""Step budgets, continuing runs, one numbering of epochs, Keras-grade early stopping, and
the ready callbacks: each on the compiled path and the bar path.
"""

import csv
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, regression_data

import eqfit


ADAM = optax.adam(1e-2)  # one object for the module: fits share their compiled programs
PROGRESS = [False, True]


@pytest.fixture(scope="module")
def problem():
    key = jax.random.key(0)
    data = regression_data(jax.random.fold_in(key, 1), 100)
    val = regression_data(jax.random.fold_in(key, 2), 30)
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=jax.random.fold_in(key, 3))
    kwargs = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=jax.random.fold_in(key, 4))
    return model, data, val, kwargs


def visits(n, **fit_kwargs):
    """How often each of `n` samples was trained on: one weight per sample, lowered by
    exactly 1 at each visit (SGD with learning rate 1 on the sum of the batch's weights).
    """
    result = eqfit.fit(
        jnp.zeros(n),
        (jnp.arange(n),),
        loss=lambda w, i: jnp.sum(w[i]),
        optimizer=optax.sgd(1.0),
        **fit_kwargs,
    )
    return -np.asarray(result.model), result


@pytest.mark.slow
@pytest.mark.parametrize("progress", PROGRESS)
def test_steps_per_epoch_draws_from_continuing_passes(progress):
    # 10 samples in batches of 4: a pass is 4, 4 and a remainder of 2. Epochs of 3 steps
    # cut across passes: 4 epochs are 12 steps, 4 whole passes.
    counts, result = visits(
        10, key=jax.random.key(0), epochs=4, batch_size=4, steps_per_epoch=3, progress=progress
    )
    np.testing.assert_array_equal(counts, np.full(10, 4.0))  # each sample once per pass
    assert result.history.step_loss.shape == (4, 3)
    np.testing.assert_array_equal(result.history.batch_sizes, [[4, 4, 2]] * 4)
    # 13 steps: the 13th opens a fifth pass, its batch of 4 is new samples.
    counts, _ = visits(10, key=jax.random.key(0), epochs=13, batch_size=4, steps_per_epoch=1)
    assert counts.sum() == 4 * 10 + 4 and set(counts.tolist()) == {4.0, 5.0}


@pytest.mark.slow
@pytest.mark.parametrize("progress", PROGRESS)
def test_an_epoch_of_whole_passes_is_those_passes(progress):
    # 10 samples in batches of 4: a pass is 4, 4 and a remainder of 2. Epochs of two whole
    # passes end only where passes end.
    common = dict(key=jax.random.key(0), batch_size=4, progress=progress)
    common.update(validation_data=(jnp.arange(10),))
    counts, two = visits(10, steps_per_epoch=6, epochs=2, **common)
    np.testing.assert_array_equal(counts, np.full(10, 4.0))  # each sample once per pass
    np.testing.assert_array_equal(two.history.batch_sizes, [[4, 4, 2] * 2] * 2)
    _, one = visits(10, epochs=4, **common)  # the same 12 steps, an epoch a pass
    assert_trees_equal(two.model, one.model)
    np.testing.assert_array_equal(two.history.step_loss.ravel(), one.history.step_loss.ravel())
    assert two.history.val_loss is not None and one.history.val_loss is not None
    np.testing.assert_array_equal(two.history.val_loss, one.history.val_loss[1::2])


@pytest.mark.slow
@pytest.mark.parametrize("progress", PROGRESS)
def test_every_epoch_happens_every_steps_per_epoch(problem, progress):
    """Validation, metrics, the history, callbacks and checkpoints go by the step budget."""
    model, data, val, kwargs = problem
    seen = []

    class Record:
        def on_epoch_end(self, epoch, logs):
            seen.append(epoch)

    result = eqfit.fit(
        model,
        data,
        validation_data=val,
        metrics={"mae": eqfit.metrics.mae},
        batch_size=10,
        steps_per_epoch=4,
        epochs=5,  # 20 steps: two passes of 10
        callbacks=[Record()],
        progress=progress,
        **kwargs,
    )
    h = result.history
    assert seen == [1, 2, 3, 4, 5]
    assert h.val_loss is not None and h.val_loss.shape == (5,) and h["val_mae"].shape == (5,)
    np.testing.assert_array_equal(h.epoch, [1, 2, 3, 4, 5])
    # The same 20 steps as two epochs of a pass each.
    passes = eqfit.fit(model, data, batch_size=10, epochs=2, **kwargs)
    assert_trees_equal(result.model, passes.model)
    np.testing.assert_array_equal(h.step_loss.ravel(), passes.history.step_loss.ravel())


def test_initial_epoch_continues_the_run_bit_for_bit(problem):
    model, data, val, kwargs = problem
    common = dict(validation_data=val, batch_size=16, **kwargs)
    # 3 + 3 epochs (the first 3: test_csv_logger_writes_each_epoch's program).
    six = eqfit.fit(model, data, epochs=6, **common)
    three = eqfit.fit(model, data, epochs=3, **common)
    rest = eqfit.fit(
        three.model, data, opt_state=three.opt_state, initial_epoch=3, epochs=6, **common
    )
    assert_trees_equal(rest.model, six.model)
    assert_trees_equal(rest.opt_state, six.opt_state)
    np.testing.assert_array_equal(rest.history.epoch, np.arange(4, 7))
    np.testing.assert_array_equal(rest.history.val_loss, six.history.val_loss[3:])
    with pytest.raises(ValueError, match=r"`epochs`=3 is the number of the last epoch.*>= 5"):
        eqfit.fit(model, data, initial_epoch=5, epochs=3, **common)


def test_epochs_are_counted_from_one_everywhere(problem, tmp_path, capsys):
    model, data, val, kwargs = problem

    def closeness(model, x, y):
        return -eqfit.metrics.mae(model, x, y)

    result = eqfit.fit(
        model,
        data,
        validation_data=val,
        metrics={"closeness": closeness},
        batch_size=16,
        epochs=4,
        early_stopping=eqfit.EarlyStopping(10, monitor="val_closeness", mode="max"),
        progress="bar",
        **kwargs,
    )
    h = result.history
    best = int(np.argmax(h["val_closeness"])) + 1
    assert h.best_epoch == best  # the epoch's number, its row + 1
    assert h.to_dict()["epoch"] == [1, 2, 3, 4]
    h.to_csv(tmp_path / "h.csv")
    with open(tmp_path / "h.csv") as f:
        assert [int(row["epoch"]) for row in csv.DictReader(f)] == [1, 2, 3, 4]
    lines = capsys.readouterr().err.replace("\r", "\n")
    assert "epoch 4/4" in lines and "epoch 0/" not in lines
    # Each epoch's values are on a line that names it; the last is the last epoch's.
    last = [line for line in lines.splitlines() if "val_loss" in line][-1]
    assert last.startswith("epoch 4/4: ")
    assert f"loss={h.loss[-1]:.4g} " in last and f"val_loss={h.val_loss[-1]:.4g}" in last
    # The bar has the loss of the epoch it names (the last, at the end) and no others.
    bar = [line for line in lines.splitlines() if " samples/s" in line][-1]
    assert bar.startswith("epoch 4/4") and f"loss={h.loss[-1]:.4g}," in bar
    assert "val_loss" not in bar
    pytest.importorskip("matplotlib")  # the plot alone needs the extra `eqfit[plot]`
    fig = h.plot()
    assert list(fig.axes[0].lines[0].get_xdata()) == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("progress", PROGRESS)
def test_early_stopping_infers_the_direction_from_the_name(problem, progress):
    """Accuracy-like names are maximised, as Keras infers: minimised, an accuracy that
    rises would look like no improvement and stop training at once.
    """
    model, (x, y), _, kwargs = problem
    labels = (y > 0).astype(jnp.int32)
    classifier = eqfit.models.MLP(4, 2, 8, 1, key=jax.random.key(5))
    common = dict(loss=eqfit.losses.softmax_cross_entropy, optimizer=ADAM, key=kwargs["key"])
    result = eqfit.fit(
        classifier,
        (x, labels),
        metrics={"accuracy": eqfit.metrics.accuracy},
        validation_data=(x[:30], labels[:30]),
        batch_size=16,
        epochs=6,
        early_stopping=eqfit.EarlyStopping(2, monitor="val_accuracy"),
        progress=progress,
        **common,
    )
    accuracy = result.history["val_accuracy"]
    assert result.history.best_epoch == int(np.argmax(accuracy)) + 1
    assert eqfit.EarlyStopping(1, monitor="val_accuracy").maximise
    assert not eqfit.EarlyStopping(1, monitor="val_loss").maximise
    # An RL update's return and reward (the PPO example's `ppo_return`) are maximised too.
    for name in ("ppo_return", "episode_reward", "val_auc", "val_f1"):
        assert eqfit.EarlyStopping(1, monitor=name).maximise, name
    assert not eqfit.EarlyStopping(1, monitor="ppo_loss").maximise
    assert eqfit.EarlyStopping(1, monitor="loss", mode="max").maximise


def early_stopping_run(stopping, values):
    """Early stopping on a given sequence of monitored values: a metric that reads the
    epoch's value from a table by the model's epoch counter.
    """
    table = jnp.asarray(values, jnp.float32)

    def score(count, i):
        return table[jnp.clip(count[0].astype(jnp.int32), 0, len(values) - 1)]

    def loss(count, i):  # one step an epoch; the "model" counts the epochs
        return -jnp.sum(count) + 0.0 * jnp.sum(i)

    return eqfit.fit(
        jnp.zeros(1),
        (jnp.arange(1),),
        loss=loss,
        optimizer=optax.sgd(1.0),
        key=jax.random.key(0),
        metrics={"score": score},
        epochs=len(values),
        batch_size=1,
        early_stopping=stopping,
    ).history


@pytest.mark.slow
def test_early_stopping_patience_baseline_and_start_from_epoch():
    # The metric sees the model before the epoch's step, so epoch e sees values[e - 1].
    # patience=0: stop at the first epoch that does not improve.
    h = early_stopping_run(eqfit.EarlyStopping(0, monitor="score", mode="min"), [3, 2, 2, 1])
    assert h.epochs == 3 and h.best_epoch == 2 and h.stop_reason == "early_stopping"
    # min_delta: 2 -> 1.9 is no improvement of more than 0.5.
    stopping = eqfit.EarlyStopping(1, monitor="score", mode="min", min_delta=0.5)
    h = early_stopping_run(stopping, [3, 2, 1.9, 1.8, 1.0])
    assert h.epochs == 3 and h.best_epoch == 2
    # baseline: an improvement that does not beat it does not reset the count, so the
    # first epoch counts, and the run stops an epoch sooner than without one.
    plain = eqfit.EarlyStopping(2, monitor="score", mode="min")
    assert early_stopping_run(plain, [5, 6, 7, 8]).epochs == 3
    with_baseline = eqfit.EarlyStopping(2, monitor="score", mode="min", baseline=1.0)
    assert early_stopping_run(with_baseline, [5, 6, 7, 8]).epochs == 2
    # start_from_epoch: the first epochs are not watched.
    stopping = eqfit.EarlyStopping(0, monitor="score", mode="min", start_from_epoch=3)
    h = early_stopping_run(stopping, [1, 2, 3, 4, 5])
    assert h.epochs == 5 and h.best_epoch == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(patience=-1), r"`EarlyStopping.patience` must be an integer of 0 or more, got -1"),
        (dict(patience="3"), r"patience"),
        (dict(patience=1, min_delta=-0.1), r"`EarlyStopping.min_delta` must be a number >= 0"),
        (dict(patience=1, mode="maximum"), r"mode"),
        (dict(patience=1, baseline=float("nan")), r"`EarlyStopping.baseline` must be a finite"),
        (dict(patience=1, start_from_epoch=-2), r"`EarlyStopping.start_from_epoch` must be an"),
    ],
)
def test_early_stopping_checks_its_fields(kwargs, match):
    # A value of the wrong type is a TypeError, a bad value a ValueError.
    with pytest.raises((TypeError, ValueError), match=match):
        eqfit.EarlyStopping(**kwargs)


def logged(problem, callback):
    """The three epochs of `problem` with `callback` (each the same program)."""
    model, data, val, kwargs = problem
    return eqfit.fit(
        model, data, validation_data=val, batch_size=16, epochs=3, callbacks=[callback], **kwargs
    )


def test_csv_logger_writes_each_epoch(problem, tmp_path):
    result = logged(problem, eqfit.callbacks.CSVLogger(tmp_path / "log.csv"))
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    np.testing.assert_allclose([float(r["val_loss"]) for r in rows], result.history.val_loss)
    # append=True continues a file. (The same run again: the same program.)
    logged(problem, eqfit.callbacks.CSVLogger(tmp_path / "log.csv", append=True))
    with open(tmp_path / "log.csv") as f:
        assert len(list(csv.DictReader(f))) == 6


def test_tensorboard_writes_each_epoch(problem, tmp_path):
    pytest.importorskip("tensorboardX")  # the extra `eqfit[tensorboard]`
    result = logged(problem, eqfit.callbacks.TensorBoard(tmp_path / "tb"))
    scalars = read_tensorboard(tmp_path / "tb")
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["val_loss"]], result.history.val_loss)


def read_tensorboard(logdir):
    """{tag: [(step, value)]} from the event files: TFRecord frames of `Event` protos."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(logdir.iterdir()):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
