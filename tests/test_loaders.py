"""Loaders as users have them, PyTree batches, stateful inference, and the ready losses and
metrics with keys and state.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, assert_trees_equal

import eqfit


ADAM = optax.adam(1e-2)
N, BATCH = 96, 16


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0) + np.sin(x[:, 0])).astype(np.float32)
    return x, y


@pytest.fixture(scope="module")
def model():
    return eqfit.models.MLP(4, "scalar", 8, 1, key=jax.random.key(1))


KWARGS = dict(loss=eqfit.losses.mse, optimizer=ADAM, key=jax.random.key(2), shuffle=False)


class Batches:
    """A re-iterable loader: in order, counting its passes and `set_epoch` calls."""

    def __init__(self, x, y, batch=BATCH, with_len=True):
        self.x, self.y, self.batch = x, y, batch
        self.passes, self.epochs_set, self.with_len = 0, [], with_len

    def __len__(self):
        if not self.with_len:
            raise TypeError("no len")
        return -(-len(self.x) // self.batch)

    def set_epoch(self, epoch):
        self.epochs_set.append(epoch)

    def __iter__(self):
        self.passes += 1
        for i in range(0, len(self.x), self.batch):
            yield self.x[i : i + self.batch], self.y[i : i + self.batch]


def endless(x, y, batch=BATCH):
    """An endless generator, in order, pass after pass."""
    while True:
        for i in range(0, len(x) - batch + 1, batch):
            yield x[i : i + batch], y[i : i + batch]


@pytest.mark.parametrize("progress", [False, True])
def test_re_iterable_loader_trains_as_arrays_without_a_counting_pass(arrays, model, progress):
    loader = Batches(*arrays)
    # 2 epochs: the in-memory run is the reference of the endless and PyTree tests below.
    result = eqfit.fit(model, loader, epochs=2, progress=progress, **KWARGS)
    expected = eqfit.fit(model, arrays, epochs=2, batch_size=BATCH, **KWARGS)
    assert_trees_equal(result.model, expected.model)
    assert loader.passes == 2  # with `len`, no pass only to count the batches
    assert loader.epochs_set == [0, 1]  # told before each pass how many came before


class Many:
    """A loader of batches of 2: more than a chunk's 128 steps per pass, a last batch of 1.
    With `len` or without, and once (a generator) or re-iterable.
    """

    def __init__(self, x, y, with_len):
        self.x, self.y, self.with_len, self.passes = x, y, with_len, 0

    def __len__(self):
        if not self.with_len:
            raise TypeError("no len")
        return -(-len(self.x) // 2)

    def __iter__(self):
        self.passes += 1
        for i in range(0, len(self.x), 2):
            yield self.x[i : i + 2], self.y[i : i + 2]


def _learned_problem():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(301, 4)).astype(np.float32)  # 151 batches: 150 of 2, one of 1
    y = x.sum(axis=1)
    kwargs = KWARGS | dict(optimizer=optax.sgd(0.01), metrics={"mae": eqfit.metrics.mae})
    return x, y, kwargs


def _same_run(a, b):
    """Two results alike in everything: model, every value, step records, stop reason."""
    assert_trees_equal(a.model, b.model)
    assert a.history.values.keys() == b.history.values.keys()
    for name in a.history.values:
        np.testing.assert_array_equal(a.history[name], b.history[name])
    np.testing.assert_array_equal(a.history.step_loss, b.history.step_loss)
    np.testing.assert_array_equal(a.history.batch_sizes, b.history.batch_sizes)
    assert a.history.stop_reason == b.history.stop_reason


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_a_loader_without_len_learns_its_epoch_from_the_first(model, progress):
    """No counting pass: the first pass trains as it is read, over several calls of the
    program, and the run is then what it is with `len`: the same history to the step.
    """
    x, y, kwargs = _learned_problem()
    kwargs |= dict(validation_data=(x[:40], y[:40] + 1))
    loader = Many(x, y, with_len=False)
    result = eqfit.fit(model, loader, epochs=3, progress=progress, **kwargs)
    assert loader.passes == 3  # one per epoch, none to count
    expected = eqfit.fit(model, Many(x, y, with_len=True), epochs=3, **kwargs)
    _same_run(result, expected)
    assert result.history.step_loss.shape == (3, 151)
    assert result.history.batch_sizes[0, -1] == 1 and np.all(np.isfinite(result.history.loss))
    assert np.all(np.isfinite(result.history["val_mae"]))


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_a_generator_with_one_epoch_trains_to_its_end(model, progress):
    """As Keras does: an iterator of unknown length, `epochs=1`, is one epoch to its end,
    whose history row is the mean of its batches.
    """
    x, y, kwargs = _learned_problem()
    once = iter(Many(x, y, with_len=False))
    result = eqfit.fit(model, once, epochs=1, progress=progress, **kwargs)
    assert next(once, None) is None  # used up
    _same_run(result, eqfit.fit(model, Many(x, y, with_len=True), epochs=1, **kwargs))
    sizes, steps = result.history.batch_sizes[0], result.history.step_loss[0]
    np.testing.assert_allclose(result.history.loss, [np.sum(sizes * steps) / 301], rtol=1e-5)


@pytest.mark.heavy
def test_an_ensemble_learns_its_epoch_and_stops_inside_it(model):
    """Members each keep their steps while the length is learned; a run stopped by a
    NaN inside the first epoch ends as the run with `len` does.
    """
    x, y, kwargs = _learned_problem()
    members = eqx.filter_vmap(lambda k: eqfit.models.MLP(4, "scalar", 8, 1, key=k))(
        jax.random.split(jax.random.key(5), 2)
    )
    for data_y, on_nan in [(y, "raise"), (np.where(np.arange(301) == 261, np.nan, y), "stop")]:
        runs = [
            eqfit.fit(
                members, Many(x, data_y, with_len), epochs=2, ensemble=True, on_nan=on_nan,
                **kwargs,
            )
            for with_len in (False, True)
        ]  # fmt: skip
        _same_run(*runs)
    assert runs[0].history.stop_reason == ("non_finite_loss", "non_finite_loss")
    assert np.isnan(runs[0].history.step_loss[0, 130:]).all()


def test_what_needs_the_epochs_length_first_names_steps_per_epoch(arrays, model, tmp_path):
    """Refused before a batch is read: the generator loses none."""
    x, y = arrays
    once = iter(Batches(x, y, with_len=False))
    message = r"`epochs`=2, but it is an iterator \(or generator\).*Pass `steps_per_epoch=`"
    with pytest.raises(ValueError, match=message):
        eqfit.fit(model, once, epochs=2, checkpoint=tmp_path / "run", **KWARGS)
    assert not (tmp_path / "run").exists()
    result = eqfit.fit(model, once, epochs=1, **KWARGS)
    np.testing.assert_array_equal(result.history.batch_sizes, [[BATCH] * (N // BATCH)])


class _StopAfter:
    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs):
        return epoch == self.epoch


@pytest.fixture(scope="module")
def learned_whole(model):
    """4 epochs of 151 steps (more than a chunk's 128) over a loader without `len`."""
    x, y, kwargs = _learned_problem()
    return eqfit.fit(model, Many(x, y, with_len=False), epochs=4, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_a_loader_without_len_resumes_from_its_checkpoint_bit_for_bit(
    model, learned_whole, progress, tmp_path
):
    """The checkpoints keep the learned length: the resumed run starts from it (the bar
    knows its total) and reads the 2 passes trained before to find its place.
    """
    x, y, kwargs = _learned_problem()
    kwargs |= dict(epochs=4, checkpoint=tmp_path, progress=progress)
    cut = eqfit.fit(model, Many(x, y, with_len=False), callbacks=[_StopAfter(2)], **kwargs)
    assert cut.history.epochs == 2
    newest = tmp_path / "ckpt-000002-000000"  # named by the epochs of the learned length
    assert json.loads((newest / "manifest.json").read_text())["config"]["steps_per_epoch"] == 151
    loader = Many(x, y, with_len=False)
    resumed = eqfit.fit(model, loader, **kwargs)
    assert loader.passes == 4
    _same_run(resumed, learned_whole)
    assert_trees_equal(resumed.opt_state, learned_whole.opt_state)


def test_a_resumed_loader_whose_first_pass_differs_is_refused(model, tmp_path):
    """Before any step trains: the passes read to find the place are the check."""
    x, y, kwargs = _learned_problem()
    kwargs |= dict(epochs=4, checkpoint=tmp_path)
    eqfit.fit(model, Many(x, y, with_len=False), callbacks=[_StopAfter(1)], **kwargs)
    written = sorted(p.name for p in tmp_path.glob("ckpt-*"))
    stored = r"epochs were as long as its first pass, 151 batches, when the checkpoints in .*"
    for rows, now in [(299, "150 batches"), (303, "more than 151 batches")]:
        other = Many(np.resize(x, (rows, 4)), np.resize(y, rows), with_len=False)
        with pytest.raises(ValueError, match=f"`data` .*{stored}now its first pass yields {now}"):
            eqfit.fit(model, other, **kwargs)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == written  # nothing trained


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_initial_epoch_with_a_loader_without_len_reads_the_passes_before(
    model, learned_whole, progress, tmp_path
):
    """As with `len`: the passes before `initial_epoch` are read, not trained, the first
    giving the length; then epochs 3 and 4 train as in the 4 epochs' run. Its checkpoints
    keep the length too.
    """
    x, y, kwargs = _learned_problem()
    first = eqfit.fit(model, Many(x, y, with_len=False), epochs=2, **kwargs)
    kwargs |= dict(opt_state=first.opt_state, initial_epoch=2, epochs=4, progress=progress)
    loader = Many(x, y, with_len=False)
    more = eqfit.fit(first.model, loader, **kwargs)
    assert loader.passes == 4
    np.testing.assert_array_equal(more.history.epoch, [3, 4])
    assert_trees_equal(more.model, learned_whole.model)
    assert_trees_equal(more.opt_state, learned_whole.opt_state)
    np.testing.assert_array_equal(more.history.step_loss, learned_whole.history.step_loss[2:])
    _same_run(more, eqfit.fit(first.model, Many(x, y, with_len=True), **kwargs))
    cut = eqfit.fit(first.model, loader, checkpoint=tmp_path, callbacks=[_StopAfter(3)], **kwargs)
    assert cut.history.epochs == 1 and (tmp_path / "ckpt-000003-000000").is_dir()
    _same_run(eqfit.fit(first.model, loader, checkpoint=tmp_path, **kwargs), more)


@pytest.mark.parametrize("progress", [False, True])
def test_endless_iterator_with_steps_per_epoch(arrays, model, progress):
    result = eqfit.fit(
        model, endless(*arrays), steps_per_epoch=4, epochs=3, progress=progress, **KWARGS
    )
    # 12 steps of the endless stream are two passes over the 96 samples in order.
    expected = eqfit.fit(model, arrays, epochs=2, batch_size=BATCH, **KWARGS)
    assert_trees_equal(result.model, expected.model)
    np.testing.assert_array_equal(result.history.epoch, [1, 2, 3])
    assert result.history.stop_reason is None


def test_a_generator_is_used_once(arrays, model):
    x, y = arrays

    def once():
        for i in range(0, N, BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]

    # With a step budget it trains; running out stops training, with a warning.
    with pytest.warns(UserWarning, match=r"The data ran out after 1 of the 2 epochs"):
        result = eqfit.fit(model, once(), steps_per_epoch=6, epochs=2, **KWARGS)
    assert result.history.stop_reason == "out_of_data" and result.history.epochs == 1


def test_fit_refuses_a_generator_that_plan_read_from(arrays, model):
    x, y = arrays

    def once():
        for i in range(0, N, BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]

    batches, steps = once(), -(-N // BATCH)
    eqfit.plan(model, batches, epochs=1, steps_per_epoch=steps, **KWARGS)
    message = r"`data` is an iterator that `eqfit.plan` has read its first batches from"
    with pytest.raises(ValueError, match=message):
        eqfit.fit(model, batches, epochs=1, steps_per_epoch=steps, **KWARGS)
    with pytest.raises(ValueError, match=message):
        eqfit.plan(model, batches, epochs=1, steps_per_epoch=steps, **KWARGS)
    # A fresh one trains every batch.
    result = eqfit.fit(model, once(), epochs=1, steps_per_epoch=steps, **KWARGS)
    assert (result.history.batch_sizes > 0).sum() == steps


def test_batch_size_comes_from_the_loader(arrays, model):
    loader = Batches(*arrays, batch=24)
    result = eqfit.fit(model, loader, epochs=1, **KWARGS)
    np.testing.assert_array_equal(result.history.batch_sizes, [[24] * 4])
    with pytest.raises(ValueError, match=r"`batch_size`=16, but the loader yields batches of 24"):
        eqfit.fit(model, loader, batch_size=16, **KWARGS)


def test_every_batch_is_checked(arrays, model):
    x, y = arrays

    def loader(batches):
        class Loader:
            def __iter__(self):
                return iter(batches)

        return Loader()

    good = (x[:16], y[:16])
    cases = [
        ([good, (x[:16], y[:15])], r"batch 1 has arrays of different lengths, \[\[16, 4\], \[15"),
        # Another length along a sample's axis is a bucket (`test_buckets.py`); another
        # number of axes is not.
        ([good, (x[:16, :, None], y[:16])], r"batch 1 has samples of shapes and dtypes"),
        ([good, (x[:16].astype(np.float64), y[:16])], r"batch 1 has samples of shapes and dtypes"),
        ([good, (x[:32], y[:32])], r"batch 1 has 32 samples, more than its first batch's 16"),
        ([good, (x[:8], y[:8]), good], r"batch 2 follows a batch of 8 samples in the same pass"),
        ([good, {"x": x[:16]}], r"batch 1 has the structure"),
    ]
    for batches, match in cases:
        with pytest.raises(ValueError, match=match):
            eqfit.fit(model, loader(batches), **KWARGS)


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_pytree_batches_are_passed_whole(arrays, model, progress):
    x, y = arrays

    def loss(model, batch, *, key=None):
        return eqfit.losses.mse(model, batch["inputs"], batch["targets"], key=key)

    def size(model, batch):
        return jnp.mean(batch["targets"] ** 2)

    data = {"inputs": x, "targets": y}
    kwargs = {**KWARGS, "loss": loss, "metrics": {"size": size}}
    result = eqfit.fit(model, data, epochs=2, batch_size=BATCH, progress=progress, **kwargs)
    expected = eqfit.fit(model, arrays, epochs=2, batch_size=BATCH, **KWARGS)
    assert_trees_equal(result.model, expected.model)
    np.testing.assert_allclose(result.history["size"][0], np.mean(y**2), rtol=1e-5)

    # A loader of dicts, validation data as a dict, evaluate and predict on dicts.
    class Dicts:
        def __iter__(self):
            for i in range(0, N, BATCH):
                yield {"inputs": x[i : i + BATCH], "targets": y[i : i + BATCH]}

    streamed = eqfit.fit(model, Dicts(), epochs=2, validation_data=data, **kwargs)
    assert_trees_equal(streamed.model, expected.model)
    values = eqfit.evaluate(result.model, data, loss=loss, batch_size=40)
    assert values["loss"] == pytest.approx(float(eqfit.losses.mse(result.model, x, y)), rel=1e-5)

    class Sum(eqx.Module):
        def __call__(self, sample):
            return sample["a"].sum() + sample["b"]

    out = eqfit.predict(Sum(), {"a": x, "b": y}, batch_size=40)
    np.testing.assert_allclose(out, x.sum(1) + y, rtol=1e-5)


@pytest.mark.heavy
def test_a_real_grain_pipeline_reshuffled_each_pass(model):
    import grain

    n, batch = 64, 8
    pipeline = (
        grain.MapDataset.range(n)
        .shuffle(seed=3)
        .repeat()  # reshuffled on each pass, endless
        .map(lambda i: (np.int32(i),))
        .batch(batch)
    )
    visited = []

    def loss(weights, i):
        visited.append(i)  # runs while tracing only; the order is read below
        return jnp.sum(weights[i])

    result = eqfit.fit(
        jnp.zeros(n),
        pipeline,
        loss=loss,
        optimizer=optax.sgd(1.0),
        key=jax.random.key(0),
        steps_per_epoch=n // batch,
        epochs=3,
    )
    np.testing.assert_array_equal(-np.asarray(result.model), np.full(n, 3.0))  # once a pass
    first, second = (np.concatenate([b[0] for b in pipeline[k * 8 : (k + 1) * 8]]) for k in (0, 1))
    assert sorted(first) == sorted(second) == list(range(n)) and not np.array_equal(first, second)


class BatchNormNet(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key, classes=3):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(4, 8, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(8, classes, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(jax.nn.relu(self.linear(x)), state)
        return self.head(h), state


@pytest.mark.slow
@pytest.mark.parametrize("progress", [False, True])
def test_stateful_models_with_the_ready_loss_and_metrics(arrays, progress):
    x, y = arrays
    labels = (np.digitize(y, [-2.0, 2.0])).astype(np.int32)
    net, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(3))
    result = eqfit.fit(
        net,
        (x, labels),
        state=state,
        loss=eqfit.losses.softmax_cross_entropy,
        metrics={"accuracy": eqfit.metrics.accuracy},
        validation_data=(x[:32], labels[:32]),
        optimizer=ADAM,
        key=jax.random.key(4),
        epochs=4,
        batch_size=BATCH,
        progress=progress,
    )
    h = result.history
    assert h.loss[-1] < h.loss[0] and 0 <= h["val_accuracy"][-1] <= 1
    # Inference with the state: `predict` and `evaluate` take `state=`.
    trained, trained_state = eqx.nn.inference_mode(result.model), result.state
    direct, _ = jax.vmap(trained, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        jnp.asarray(x[:32]), trained_state
    )
    predicted = eqfit.predict(result.model, x[:32], batch_size=10, state=trained_state)
    np.testing.assert_allclose(predicted, direct, rtol=1e-5, atol=1e-6)
    values = eqfit.evaluate(
        result.model,
        (x[:32], labels[:32]),
        loss=eqfit.losses.softmax_cross_entropy,
        metrics={"accuracy": eqfit.metrics.accuracy},
        state=trained_state,
        batch_size=32,
    )
    assert values["accuracy"] == pytest.approx(float(h["val_accuracy"][-1]), abs=1e-6)


def test_a_metric_with_the_wrong_signature_is_named(arrays, model):
    def two_arguments(model, x):
        return jnp.mean(x)

    with pytest.raises(TypeError, match=r"metric 'bad' is called as fn\(model, \*batch\)"):
        eqfit.fit(model, arrays, metrics={"bad": two_arguments}, **KWARGS)


class _NeedsKey(eqx.Module):
    """A model whose call requires a key, even in inference mode."""

    linear: eqx.nn.Linear

    def __call__(self, x, *, key):
        return self.linear(x)[0]


@pytest.mark.slow
def test_validation_passes_a_key_only_where_one_is_required(arrays):
    x, y = arrays
    validation = (x[:40], y[:40])
    given = {"train": set(), "val": set()}

    def optional(model, x, y, *, key=None):  # records, while traced, what it was given
        phase = "val" if _inference(model) else "train"
        given[phase].add(key is not None)
        return eqfit.losses.mse(model, x, y, key=key)

    model = eqfit.models.MLP(4, "scalar", 8, 1, dropout=0.5, key=jax.random.key(5))
    kwargs = dict(optimizer=ADAM, epochs=2, batch_size=BATCH, validation_data=validation)
    result = eqfit.fit(model, arrays, loss=optional, key=jax.random.key(6), **kwargs)
    # Training steps get a key for dropout; inference needs none, so none is passed.
    assert given == {"train": {True}, "val": {False}}
    val = eqfit.evaluate(result.model, validation, loss=eqfit.losses.mse, batch_size=BATCH)
    np.testing.assert_allclose(result.history.val_loss[-1], val["loss"], rtol=1e-6)

    # A loss or a model that requires a key gets one in validation too.
    def required(model, x, y, *, key):
        return eqfit.losses.mse(model, x, y, key=key)

    needs = _NeedsKey(eqx.nn.Linear(4, 1, key=jax.random.key(7)))
    for loss, net in [(required, needs), (eqfit.losses.mse, needs)]:
        result = eqfit.fit(net, arrays, loss=loss, key=jax.random.key(6), **kwargs)
        assert np.isfinite(result.history.val_loss).all()


def _inference(model):
    return any(
        getattr(m, "inference", False)
        for m in jax.tree.leaves(model, is_leaf=lambda m: isinstance(m, eqx.nn.Dropout))
        if isinstance(m, eqx.nn.Dropout)
    )


@pytest.mark.slow
def test_ready_losses_give_dropout_models_a_key(arrays):
    dropout = eqfit.models.MLP(4, "scalar", 8, 1, dropout=0.5, key=jax.random.key(5))
    kwargs = dict(optimizer=ADAM, epochs=2, batch_size=BATCH)
    a = eqfit.fit(dropout, arrays, loss=eqfit.losses.mse, key=jax.random.key(6), **kwargs)
    b = eqfit.fit(dropout, arrays, loss=eqfit.losses.mse, key=jax.random.key(7), **kwargs)
    assert not np.array_equal(a.model.layers[0].weight, b.model.layers[0].weight)
    # Inference mode ignores the key: deterministic.
    x = jnp.asarray(arrays[0][:8])
    inference = eqx.nn.inference_mode(a.model)
    key = jax.random.key(0)
    first = eqfit.losses.mse(inference, x, x[:, 0], key=key)
    again = eqfit.losses.mse(inference, x, x[:, 0], key=jax.random.key(1))
    assert float(first) == float(again)
    labels = np.arange(N, dtype=np.int32) % 3
    classifier = eqfit.models.MLP(4, 3, 16, 1, dropout=0.3, key=jax.random.key(8))
    result = eqfit.fit(
        classifier,
        (arrays[0], labels),
        loss=eqfit.losses.softmax_cross_entropy,
        key=jax.random.key(9),
        **kwargs,
    )
    assert np.isfinite(result.history.loss).all()
    assert_trees_close(a.model, a.model)
