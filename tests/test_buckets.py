"""Sequences of many lengths: a loader whose batches come in a few shapes (buckets) trains
in one run, one program per shape, bit for bit as a hand loop of one jitted step per
bucket fed the same batches; `eqfit.Buckets` pads sequences to a few lengths with a mask,
so that a masked `eqfit.Mean` is the mean over the real tokens.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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


def count_compiles():
    """A list that grows by one for each XLA compilation from now on."""
    seen = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    return seen


def test_buckets_train_as_a_hand_loop_one_program_each(sequences):
    model, optimizer = GRU(jax.random.key(1)), optax.adam(1e-2)
    kwargs = dict(loss=masked_loss, optimizer=optimizer, key=jax.random.key(0), epochs=2)
    eqfit.clear_cache()
    compiles = count_compiles()
    one = eqfit.fit(model, buckets(sequences, lengths=(64,)), **kwargs)
    alone = len(compiles)
    eqfit.clear_cache()
    data = buckets(sequences)
    result = eqfit.fit(model, data, **kwargs)
    # One program more for each bucket more: the step compiled once per shape.
    assert len(compiles) - alone == alone + len(LENGTHS) - 1
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
