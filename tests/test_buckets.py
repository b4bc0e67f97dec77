"""Sequences of many lengths: a loader whose batches come in a few shapes (buckets) trains
in one run, one program per shape, as a hand loop of one jitted step per bucket fed the
same batches (bit for bit with `PerStep()`; the default way's program may round
otherwise); `eqfit.Buckets` pads sequences to a few lengths with a mask, so that a masked
`eqfit.Mean` is the mean over the real tokens, and a classifier's ready losses and
metrics count each real sequence once.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import metrax
import numpy as np
import optax
import pytest
from helpers import programs_compiled

import eqfit


class GRU(eqx.Module):
    """A GRU reading a sequence of 3 features, predicting a value at each position."""

    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(3, 8, key=k1)
        self.head = eqx.nn.Linear(8, 1, key=k2)

    def __call__(self, xs):
        def step(h, x):
            h = self.cell(x, h)
            return h, self.head(h)[0]

        return jax.lax.scan(step, jnp.zeros(8), xs)[1]


def masked_loss(model, x, y, mask):
    return eqfit.Mean.of((jax.vmap(model)(x) - y) ** 2, mask)


LENGTHS = (16, 32, 48, 64)


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 65, 120)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in lengths]
    ys = [(np.cumsum(x[:, 0]) / 4).astype(np.float32) for x in xs]
    return xs, ys


def buckets(sequences, lengths=LENGTHS, **more):
    more = {"key": jax.random.key(3)} | more
    return eqfit.Buckets(sequences, lengths=lengths, batch_size=8, **more)


@pytest.mark.slow
def test_buckets_train_as_a_hand_loop_one_program_each(sequences):
    model, optimizer = GRU(jax.random.key(1)), optax.adam(1e-2)
    kwargs = dict(loss=masked_loss, optimizer=optimizer, key=jax.random.key(0), epochs=2)
    eqfit.clear_cache()
    with programs_compiled() as alone:
        one = eqfit.fit(model, buckets(sequences, lengths=(64,)), **kwargs)
    eqfit.clear_cache()
    data = buckets(sequences)
    with programs_compiled() as compiles:
        result = eqfit.fit(model, data, **kwargs)
    # One program more for each bucket more: the step compiled once per shape.
    assert len(compiles) == len(alone) + len(LENGTHS) - 1
    assert one.history.epochs == result.history.epochs == 2
    # A hand loop of one jitted step (`Update.apply`, which is `fit`'s own) per batch.
    update = eqfit.Update("u", masked_loss, optimizer)
    apply = eqx.filter_jit(
        lambda m, s, b: update.apply(m, s, b, model_state=None, key=jax.random.key(0))
    )
    hand, state = model, update.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for epoch in range(2):
        data.set_epoch(epoch)
        for batch in data:
            out = apply(hand, state, batch)
            hand, state = out.model, out.state
            losses.append(out.values["loss"])
    for a, b in zip(jax.tree.leaves(eqx.filter(hand, eqx.is_array)), jax.tree.leaves(result.model)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(result.history.step_loss.reshape(-1), losses)


def test_every_sample_once_a_pass_and_the_same_for_the_same_key(sequences):
    xs, _ = sequences
    data = buckets(sequences)
    seen = []
    for batch in data:
        x, _, mask = batch
        assert x.shape[0] == 8 and x.shape[1] in LENGTHS and mask.shape == x.shape[:2]
        for row, m in zip(x, mask):
            n = int(m.sum())
            if n:  # a padding row has mask 0
                seen.append(row[:n])
                assert np.all(row[n:] == 0)
                # Its bucket is the shortest that holds it.
                assert LENGTHS.index(x.shape[1]) == int(np.searchsorted(LENGTHS, n))
    assert sorted(map(len, seen)) == sorted(map(len, xs))
    assert {a.tobytes() for a in seen} == {np.asarray(a).tobytes() for a in xs}
    again = [b[0] for b in buckets(sequences)]
    assert all(np.array_equal(a, b[0]) for a, b in zip(again, data))
    data.set_epoch(1)  # another pass, another order
    assert not all(np.array_equal(a, b[0]) for a, b in zip(again, data))


@pytest.mark.heavy  # a program per bucket for evaluate and for validation: whole suite
def test_evaluating_buckets_is_the_unpadded_token_mean(sequences):
    xs, ys = sequences
    model = GRU(jax.random.key(1))
    data = buckets(sequences)
    got = eqfit.evaluate(model, data, loss=masked_loss)
    errors = np.concatenate([(np.asarray(model(x)) - y) ** 2 for x, y in zip(xs, ys)])
    np.testing.assert_allclose(got["loss"], errors.mean(), rtol=1e-6)
    # And as validation, after each epoch.
    result = eqfit.fit(
        model, data, loss=masked_loss, optimizer=optax.adam(1e-2), key=jax.random.key(0),
        validation_data=buckets(sequences, shuffle=False, key=None),
    )  # fmt: skip
    again = eqfit.evaluate(result.model, data, loss=masked_loss)
    np.testing.assert_allclose(result.history.val_loss[0], again["loss"], rtol=1e-6)


@pytest.mark.slow
def test_a_resume_mid_epoch_equals_the_run_never_stopped(sequences, tmp_path):
    import shutil

    model, kwargs = (
        GRU(jax.random.key(1)),
        dict(loss=masked_loss, optimizer=optax.adam(1e-2), key=jax.random.key(0), epochs=2),
    )
    whole = eqfit.fit(model, buckets(sequences), **kwargs)
    policy = eqfit.Checkpoint(tmp_path / "all", every_epochs=None, every_steps=5, keep=100)
    eqfit.fit(model, buckets(sequences), checkpoint=policy, **kwargs)
    # 16 batches an epoch: the checkpoint after step 25 is inside the second epoch.
    name = "ckpt-000001-000009"
    assert (tmp_path / "all" / name).is_dir()
    shutil.copytree(tmp_path / "all" / name, tmp_path / "alone" / name)
    again = eqfit.Checkpoint(tmp_path / "alone", every_epochs=None, every_steps=5)
    resumed = eqfit.fit(model, buckets(sequences), checkpoint=again, **kwargs)
    for a, b in zip(jax.tree.leaves(whole.model), jax.tree.leaves(resumed.model)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.history.step_loss, resumed.history.step_loss)


@pytest.mark.slow
def test_a_loader_of_many_shapes_warns_once():
    rng = np.random.default_rng(1)

    class Lengths:
        def __len__(self):
            return 10

        def __iter__(self):
            for n in range(2, 12):  # ten lengths
                x = rng.normal(size=(4, n)).astype(np.float32)
                yield x, x.sum(axis=1)

    def loss(model, x, y):
        return jnp.mean((jnp.sum(x, axis=1) * model.weight.sum() - y) ** 2)

    model = eqx.nn.Linear(1, 1, key=jax.random.key(0))
    with pytest.warns(RuntimeWarning, match=r"batches of more than 8 shapes"):
        eqfit.fit(model, Lengths(), loss=loss, optimizer=optax.sgd(1e-3), key=jax.random.key(0))


def test_buckets_are_checked(sequences):
    xs, ys = sequences
    with pytest.raises(ValueError, match=r"sample \d+ has length \d+, longer than the longest"):
        eqfit.Buckets((xs, ys), lengths=(16, 32), batch_size=8, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`lengths` must be increasing"):
        eqfit.Buckets((xs, ys), lengths=(32, 16), batch_size=8, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"share their length"):
        eqfit.Buckets((xs, ys[1:] + ys[:1]), lengths=LENGTHS, batch_size=8, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`key=`"):
        eqfit.Buckets((xs, ys), lengths=LENGTHS, batch_size=8)


@pytest.mark.heavy  # a program per bucket, again: the whole suite only
def test_predict_gives_each_batchs_outputs(sequences):
    xs, _ = sequences
    model = GRU(jax.random.key(1))
    data = buckets(sequences)
    outputs = eqfit.predict(model, data)
    order = data.order()  # the samples of each batch, as `predict` read them
    assert len(outputs) == len(order) == len(data)
    for out, (bucket, samples) in zip(outputs, order):
        assert out.shape == (8, LENGTHS[bucket])
        for row, i in enumerate(samples):
            n = len(xs[i])
            np.testing.assert_allclose(out[row, :n], model(xs[i]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"`out=` takes outputs of one shape"):
        eqfit.predict(model, data, out=np.zeros((len(xs), 64), np.float32))


def mesh():
    from jax.sharding import AxisType, Mesh

    return Mesh(np.array(jax.devices()), ("data",), axis_types=(AxisType.Auto,))


WAYS = {
    "per step": dict(execution=eqfit.PerStep(1)),
    "bar": dict(progress=True),
    "devices": dict(devices=4),
    "mesh": {},  # made in the test
    "microbatches": dict(microbatches=2),
}


# Several devices, and microbatches, with the heavy tests: the README's command runs one
# device's ways.
HEAVY = ("bar", "devices", "mesh", "microbatches")


@pytest.mark.slow
@pytest.mark.parametrize(
    "way", [pytest.param(w, marks=pytest.mark.heavy) if w in HEAVY else w for w in WAYS]
)
def test_every_way_of_running_trains_the_buckets_alike(way, sequences, capsys):
    model = GRU(jax.random.key(1))
    kwargs = dict(loss=masked_loss, optimizer=optax.adam(1e-2), key=jax.random.key(0), epochs=2)
    whole = eqfit.fit(model, buckets(sequences), **kwargs)
    more = dict(WAYS[way]) | ({"mesh": mesh()} if way == "mesh" else {})
    other = eqfit.fit(model, buckets(sequences), **kwargs, **more)
    exact = way in ("per step", "bar")
    for a, b in zip(jax.tree.leaves(whole.model), jax.tree.leaves(other.model)):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:  # the batch's mean taken in parts, summed in another order
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    capsys.readouterr()


@pytest.mark.heavy  # a member's run each besides the ensemble's
def test_an_ensemble_trains_each_member_on_the_buckets(sequences):
    keys = jax.random.split(jax.random.key(1), 2)
    stack = eqx.filter_vmap(GRU)(keys)
    kwargs = dict(loss=masked_loss, optimizer=optax.adam(1e-2), epochs=1)
    result = eqfit.fit(stack, buckets(sequences), ensemble=True, key=jax.random.key(0), **kwargs)
    for m in range(2):
        alone = eqfit.fit(
            GRU(keys[m]), buckets(sequences), key=jax.random.split(jax.random.key(0), 2)[m],
            **kwargs,
        )  # fmt: skip
        member = jax.tree.map(lambda a: a[m], jax.tree.leaves(result.model))
        for a, b in zip(member, jax.tree.leaves(alone.model)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_packed_rows_have_the_loss_of_the_sequences_unpacked():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "packed_sequences.py"
    spec = importlib.util.spec_from_file_location("packed_sequences", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    seqs = example.sentences(48)
    packed, alone = example.pack(seqs), example.unpacked(seqs)
    assert len(packed[0]) < len(alone[0])  # several sentences a row
    # Each packed sentence keeps its tokens, numbered positions and a segment of its own.
    tokens, segments, positions = packed
    row = segments[0]
    first = tokens[0][row == 1]
    np.testing.assert_array_equal(first, seqs[0])
    np.testing.assert_array_equal(positions[0][row == 2], np.arange(len(seqs[1])))
    model = example.Transformer(jax.random.key(0))
    got = eqfit.evaluate(model, packed, loss=example.loss, batch_size=16)["loss"]
    expected = eqfit.evaluate(model, alone, loss=example.loss, batch_size=16)["loss"]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # The weights count the real predictions: every sentence's length less one.
    mean = example.loss(model, *packed)
    assert float(jnp.sum(mean.weight)) == sum(len(s) - 1 for s in seqs)


def test_the_plan_lists_the_buckets(sequences):
    model = GRU(jax.random.key(1))
    plan = eqfit.plan(
        model, buckets(sequences), loss=masked_loss, optimizer=optax.adam(1e-2),
        key=jax.random.key(0),
    )  # fmt: skip
    assert plan.bucket_shapes == tuple(((n, 3), (n,), (n,)) for n in LENGTHS)
    assert "data in 4 buckets, a program each when first met" in str(plan)
    assert "[64, 3] [64] [64]" in str(plan)


# A classifier over buckets: one label per sequence, `(batch,)`, beside the `(batch,
# length)` mask; the ready losses and metrics weigh each sequence by whether any of its
# positions is real (a bucket's last batch is filled up with rows of padding).


class Pooled(eqx.Module):
    """The mean of a sequence's real tokens' embeddings (token 0 is padding, as `Buckets`
    pads), then one logit: a binary classifier of sequences.
    """

    embed: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(20, 8, key=k1)
        self.head = eqx.nn.Linear(8, "scalar", key=k2)

    def __call__(self, tokens):
        real = (tokens != 0).astype(jnp.float32)
        pooled = real @ jax.vmap(self.embed)(tokens) / jnp.maximum(real.sum(), 1.0)
        return self.head(pooled)


@pytest.fixture(scope="module")
def reviews():
    """`(tokens, labels)` of 90 sequences of 3 to 40 tokens in 1..19, labelled 1 where
    more than half of them exceed 10; and of 50 more.
    """
    rng = np.random.default_rng(5)

    def made(n):
        tokens = [rng.integers(1, 20, m).astype(np.int32) for m in rng.integers(3, 41, n)]
        return tokens, np.array([(t > 10).mean() > 0.5 for t in tokens], np.int32)

    return made(90), made(50)


def classified(fields, **more):
    more = {"key": jax.random.key(4)} | more
    return eqfit.Buckets(fields, lengths=(16, 32, 40), batch_size=16, **more)


def real_outputs(model, data):
    """The model's logits and the labels of `data`'s real sequences (its rows of padding
    left out), bucket by bucket.
    """
    logits, labels = [], []
    call = jax.jit(jax.vmap(model))
    for tokens, y, mask in data:
        real = mask.any(axis=1)
        logits.append(np.asarray(call(tokens))[real])
        labels.append(y[real])
    return np.concatenate(logits), np.concatenate(labels)


@pytest.mark.slow
@pytest.mark.parametrize(
    "validated", [False, pytest.param(True, marks=pytest.mark.heavy)], ids=["train", "validation"]
)
def test_a_classifier_over_buckets_gets_the_ready_metrics_of_its_real_sequences(reviews, validated):
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    train, val = reviews
    probabilities = lambda logits, y: {"predictions": jax.nn.sigmoid(logits), "labels": y}  # noqa: E731
    metrics = {
        "f1": eqfit.metrics.F1(),
        "cm": eqfit.metrics.ConfusionMatrix(2),
        "accuracy": eqfit.metrics.binary_accuracy,
        "auc": eqfit.metrics.Metrax(metrax.AUCROC, probabilities),  # the guide's, two arguments
    }
    model = Pooled(jax.random.key(6))
    sets = [("", train)]
    more = {}
    if validated:  # a program more per bucket: validation's
        sets.append(("val_", val))
        more = dict(validation_data=classified(val, shuffle=False))
    result = eqfit.fit(
        model, classified(train), loss=eqfit.losses.binary_cross_entropy,
        optimizer=optax.sgd(0.0),  # the model stays as it is: its epoch is computable
        metrics=metrics, key=jax.random.key(7), **more,
    )  # fmt: skip
    h = result.history
    for prefix, fields in sets:
        logits, labels = real_outputs(model, classified(fields))
        assert len(labels) == len(fields[1])  # every sequence once, no row of padding
        predicted = logits > 0
        cm = confusion_matrix(labels, predicted)
        assert cm.sum() == len(labels) and cm[:, 1].sum() and cm[1].sum()  # both classes
        np.testing.assert_array_equal(h[prefix + "cm"][-1], cm)
        np.testing.assert_allclose(h[prefix + "f1"][-1], f1_score(labels, predicted), rtol=1e-6)
        accuracy = accuracy_score(labels, predicted)
        np.testing.assert_allclose(h[prefix + "accuracy"][-1], accuracy, rtol=1e-6)
        p = 1 / (1 + np.exp(-logits))
        by_hand = np.log1p(np.exp(-np.abs(logits))) + np.maximum(logits, 0) - logits * labels
        np.testing.assert_allclose(h[prefix + "loss"][-1], by_hand.mean(), rtol=1e-5)
        # metrax's AUC of every real sequence at once: counts summed over the batches.
        # (Given itself, `metrax.AUCROC` would take the logits, and is refused for them.)
        whole = metrax.AUCROC.from_model_output(jnp.asarray(p), jnp.asarray(labels))
        np.testing.assert_allclose(h[prefix + "auc"][-1], whole.compute(), rtol=1e-5)


def test_a_metrax_metric_without_weights_over_buckets_is_refused_naming_it(reviews):
    train, _ = reviews
    probabilities = lambda logits, y: {"predictions": jax.nn.sigmoid(logits), "labels": y}  # noqa: E731
    # metrax's `Precision` takes no `sample_weights`: the padding rows would count.
    precision = eqfit.metrics.Metrax(metrax.Precision, probabilities)
    arguments = dict(loss=eqfit.losses.binary_cross_entropy, metrics={"precision": precision})
    with pytest.raises(TypeError, match=r"`Metrax\(Precision\)`.*takes no `sample_weights`.*F1"):
        eqfit.evaluate(Pooled(jax.random.key(6)), classified(train), **arguments)
    # Weights that are neither per sequence nor a mask over its positions: named too.
    tokens = np.ones((16, 8), np.int32)
    odd = (tokens, np.zeros(16, np.int32), np.ones((16, 8, 2), np.float32))
    for metric in (eqfit.metrics.ConfusionMatrix(2), eqfit.metrics.F1()):
        name = type(metric).__name__
        with pytest.raises(ValueError, match=rf"`{name}`: `weights` must have shape \(batch,\)"):
            eqfit.evaluate(
                Pooled(jax.random.key(6)), odd, loss=lambda m, x, y, w: jnp.mean(jax.vmap(m)(x)),
                metrics={"m": metric}, batch_size=8,
            )  # fmt: skip


@pytest.mark.slow
def test_a_classifier_over_buckets_trains_per_step_bit_for_bit_as_a_hand_loop(reviews):
    train, _ = reviews
    model, optimizer = Pooled(jax.random.key(8)), optax.adam(3e-2)
    loss = eqfit.losses.binary_cross_entropy
    kwargs = dict(loss=loss, optimizer=optimizer, key=jax.random.key(0), epochs=2)
    per_step = eqfit.fit(model, classified(train), execution=eqfit.PerStep(), **kwargs)
    default = eqfit.fit(model, classified(train), **kwargs)
    # A hand loop of one jitted step (`Update.apply`, `fit`'s own) per batch.
    update = eqfit.Update("u", loss, optimizer)
    apply = eqx.filter_jit(
        lambda m, s, b: update.apply(m, s, b, model_state=None, key=jax.random.key(0))
    )
    hand, state = model, update.init(eqx.filter(model, eqx.is_inexact_array))
    data = classified(train)
    for epoch in range(2):
        data.set_epoch(epoch)
        for batch in data:
            out = apply(hand, state, batch)
            hand, state = out.model, out.state
    arrays = [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (hand, per_step.model)]
    for a, b, c in zip(*arrays, jax.tree.leaves(default.model)):
        np.testing.assert_array_equal(a, b)
        # The default way's program (each bucket's batch a call of the run's loop) is
        # compiled otherwise than a jitted step, and may round otherwise.
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
