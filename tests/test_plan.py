"""`eqfit.plan`: the run's own programs, what they need, and throughput and MFU."""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import programs_compiled, regression_data
from jax.sharding import PartitionSpec as P

import eqfit
from eqfit._host._plan import _bytes, _flops, folded_rows


def weights(model):
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def test_plan_is_the_runs_program_and_fit_compiles_nothing_more(getkey):
    x, y = regression_data(getkey(), n=256, features=8)
    model = eqfit.models.MLP(8, "scalar", 32, 2, key=getkey())
    arguments = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=getkey(),
        epochs=2,
        batch_size=32,
        validation_data=(x[:64], y[:64]),
    )
    with programs_compiled() as planned:
        plan = eqfit.plan(model, (x, y), **arguments)
    assert planned, "the plan compiles the run"
    stats = plan.compiled.memory_analysis()
    assert plan.memory.temporary == stats.temp_size_in_bytes
    assert plan.memory.argument == stats.argument_size_in_bytes
    assert plan.memory.output == stats.output_size_in_bytes
    assert plan.memory.alias == stats.alias_size_in_bytes
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes
    total += stats.temp_size_in_bytes - stats.alias_size_in_bytes
    assert plan.memory.total == total + stats.generated_code_size_in_bytes
    # The arguments hold at least the data, the weights and Adam's two moments.
    assert plan.memory.argument >= x.nbytes + y.nbytes + 3 * 4 * weights(model)
    with programs_compiled() as compiled:
        result = eqfit.fit(model, (x, y), **arguments)
    assert compiled == [], "fit after plan compiled again"
    assert plan.steps == 2 * 8
    assert result.history.epochs == 2


class Counting(eqfit.AbstractUpdate):
    """An update of one's own with a state of weakly typed scalars (`jnp.asarray(0)`, as
    gymnax's environments' states hold), and no data."""

    name: str = "count"

    def init(self, params):
        return {"n": jnp.asarray(0), "x": jnp.asarray(0.5)}

    def apply(self, model, state, batch, *, model_state, key):
        state = {"n": state["n"] + 1, "x": state["x"] * 2}
        return eqfit.Applied(model, state, model_state, {"x": state["x"]})


def test_fit_after_plan_compiles_nothing_for_an_update_with_weak_types(getkey):
    """The plan's run is the run `fit` calls, with the start program's weak types kept
    (the lowering's shapes drop them, and `fit` then compiled the run again)."""
    model = eqfit.models.MLP(4, "scalar", 8, 1, key=getkey())
    arguments = dict(updates=[Counting()], steps_per_epoch=3, epochs=2, key=getkey())
    with programs_compiled() as planned:
        eqfit.plan(model, **arguments)
    assert planned
    with programs_compiled() as compiled:
        result = eqfit.fit(model, **arguments)
    assert compiled == [], "fit after plan compiled again"
    assert int(result.opt_state["count"]["n"]) == 6


def test_plan_flops_are_six_per_weight_and_sample(getkey):
    x, y = regression_data(getkey(), n=512, features=64)
    model = eqfit.models.MLP(64, "scalar", 256, 3, key=getkey())
    plan = eqfit.plan(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(1e-3),
        key=getkey(),
        batch_size=128,
    )
    expected = 6 * weights(model) * 128  # forward 2, backward 4 per weight and sample
    assert abs(plan.flops_per_step / expected - 1) < 0.10
    assert plan.flops == plan.flops_per_step * plan.steps == plan.flops_per_step * 4
    assert plan.parameters == weights(model)
    assert plan.devices == 1 and plan.memory_limit is None and plan.fits is None


@pytest.mark.heavy
def test_plan_shows_what_precision_and_accumulation_save(getkey):
    """The issue's MLP of 12 layers of 256 at batch 8192: bfloat16 needs fewer temporary
    bytes than float32, and the same update as 8 microbatches of 1024
    (`optax.MultiSteps`) at most 0.35x of them.
    """
    model = eqx.nn.MLP(256, 256, 256, 11, key=getkey())
    x = np.zeros((8192, 256), np.float32)

    def loss(model, x, y):
        return ((jax.vmap(model)(x) - y) ** 2).mean()

    def temporary(batch_size, optimizer, precision=None):
        plan = eqfit.plan(
            model,
            (x, x),
            loss=loss,
            optimizer=optimizer,
            key=getkey(),
            batch_size=batch_size,
            shuffle=False,
            precision=precision,
        )
        return plan.memory.temporary

    float32 = temporary(8192, optax.sgd(1e-3))
    bfloat16 = temporary(8192, optax.sgd(1e-3), "bfloat16")
    accumulated = temporary(1024, optax.MultiSteps(optax.sgd(1e-3), every_k_schedule=8))
    assert bfloat16 < float32
    assert accumulated <= 0.35 * float32


@pytest.mark.heavy
def test_plan_table_under_fsdp_names_each_arrays_layout(getkey):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    x, y = regression_data(getkey(), n=256, features=16)
    model = eqfit.models.MLP(16, "scalar", 32, 2, key=getkey())
    arguments = dict(
        loss=eqfit.losses.mse, optimizer=optax.adam(1e-3), key=getkey(), batch_size=64, mesh=mesh
    )
    split = eqfit.plan(model, (x, y), shard=eqfit.sharding.fsdp("data", min_bytes=0), **arguments)
    whole = eqfit.plan(model, (x, y), shard=eqfit.sharding.fsdp("data"), **arguments)
    assert split.devices == 8 and split.sharded
    rows = {a.path: a for a in split.arrays}
    first = rows[".layers[0].weight"]
    assert first.shape == (32, 16) and first.dtype == "float32"
    assert first.spec == jax.sharding.PartitionSpec("data")
    assert first.bytes == 32 * 16 * 4 // 8  # the fullest device holds an eighth
    assert split.split == sum(a.spec is not None and "data" in tuple(a.spec) for a in split.arrays)
    assert split.split >= 4
    # The default `min_bytes` splits none of this small model's arrays, and says so.
    assert whole.split == 0 and f"0 of {len(whole.arrays)} arrays split" in whole.summary()
    assert split.memory.argument < whole.memory.argument
    text = str(split)
    assert ".layers[0].weight" in text and "('data',)" in text
    assert "memory per device" in text and "FLOPs" in text


def test_progress_prints_the_plan_above_the_bar(getkey, capsys):
    x, y = regression_data(getkey(), n=64)
    model = eqfit.models.LinearRegression(4, key=getkey())
    arguments = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(1e-2), key=getkey(), epochs=2)
    plan = eqfit.plan(model, (x, y), **arguments)
    eqfit.fit(model, (x, y), progress=True, **arguments)
    err = capsys.readouterr().err
    assert plan.summary() in err
    assert err.index(plan.summary()) < err.index("epoch 2/2")
    assert "5 parameters" in plan.summary()


def test_throughput_has_flops_and_mfu_from_the_plan(getkey):
    x, y = regression_data(getkey(), n=512, features=16)
    model = eqfit.models.MLP(16, "scalar", 64, 2, key=getkey())
    arguments = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=getkey(),
        epochs=3,
        batch_size=100,  # a smaller last batch: it costs its share of a step
        peak_flops=1e12,
    )
    plan = eqfit.plan(model, (x, y), **arguments)
    assert plan.peak_flops == 1e12
    history = eqfit.fit(model, (x, y), **arguments).history
    figures = history.throughput
    samples = history.batch_sizes.sum(axis=1)
    flops = plan.flops_per_step * samples / 100
    np.testing.assert_allclose(figures["flops_per_second"] * figures["epoch_seconds"], flops)
    np.testing.assert_allclose(figures["mfu"], figures["flops_per_second"] / 1e12)


@pytest.mark.slow
def test_counting_the_flops_compiles_nothing(getkey):
    # The step is lowered for the CPU's cost analysis, on a chip as here: a first fit that
    # counts its FLOPs (a known peak) compiles its run's program and nothing more.
    x, y = regression_data(getkey(), n=256, features=16)
    model = eqfit.models.MLP(16, "scalar", 32, 2, key=getkey())
    arguments = dict(
        loss=eqfit.losses.mse, optimizer=optax.adam(1e-3), key=getkey(), peak_flops=1e12
    )
    with programs_compiled() as names:
        history = eqfit.fit(model, (x, y), epochs=2, batch_size=64, **arguments).history
    assert names == ["jit(run)"] and (history.throughput["mfu"] > 0).all()
    # Counted once: a second fit of new arrays of the same shapes traces nothing.
    traces = []

    def loss(model, x, y):
        traces.append(1)  # runs only while JAX traces
        return eqfit.losses.mse(model, x, y)

    arguments["loss"] = loss
    counts = []
    for seed in range(3):
        eqfit.fit(model, regression_data(jax.random.key(seed), n=256, features=16), **arguments)
        counts.append(len(traces))
    assert counts[0] > 0 and counts[1:] == [counts[0]] * 2


def test_a_plain_fit_on_an_unknown_device_does_not_count_flops(getkey):
    x, y = regression_data(getkey(), n=64)
    model = eqfit.models.LinearRegression(4, key=getkey())
    history = eqfit.fit(
        model, (x, y), loss=eqfit.losses.mse, optimizer=optax.sgd(1e-2), key=getkey()
    ).history
    assert set(history.throughput) == {"epoch_seconds", "steps_per_second", "samples_per_second"}


@pytest.mark.heavy
def test_samples_per_second_agree_with_the_epochs_wall_time(getkey):
    """Each epoch's samples per second are its samples over its seconds, and those are
    wall time: a callback that holds training at each epoch's end sees the ends on the
    host, each after the device finished its epoch and before it finished the next, so
    the epochs' seconds, summed, fall between the callback's times. (Bounds, not a
    tolerance: they hold however busy the machine is.)
    """
    x, y = regression_data(getkey(), n=4096, features=256)
    model = eqfit.models.MLP(256, "scalar", 512, 2, key=getkey())
    ends: list[float] = []

    class Clock:
        stops_training = True  # the driver waits for it at every epoch's end

        def on_epoch_end(self, epoch, logs):
            ends.append(time.perf_counter())

    arguments = dict(
        loss=eqfit.losses.mse, optimizer=optax.adam(1e-3), key=getkey(), batch_size=256
    )
    eqfit.fit(model, (x, y), epochs=1, **arguments)  # compiled, and its speed measured
    history = eqfit.fit(model, (x, y), epochs=4, callbacks=[Clock()], **arguments).history
    seconds = history.throughput["epoch_seconds"]
    np.testing.assert_allclose(history.throughput["samples_per_second"] * seconds, 4096)
    # Epoch k's call is queued after the host saw epoch k - 1 end, and the host sees
    # epoch k end after the device finished it: epochs 2 to k take at least the time
    # from the host's first end to its (k - 1)-th, epochs 3 to k at most that from the
    # first to the k-th.
    since_first = np.asarray(ends) - ends[0]
    from_second, from_third = np.cumsum(seconds[1:]), np.cumsum(seconds[2:])
    assert (since_first[:-1] <= from_second + 1e-6).all(), (seconds, since_first)
    assert (from_third <= since_first[2:] + 1e-6).all(), (seconds, since_first)


def test_plan_of_a_loader_without_len_reads_one_batch(getkey):
    x, y = regression_data(getkey(), n=64)
    read = []

    class Loader:  # re-iterable, without `len`: its epoch is as long as its first pass
        def __iter__(self):
            for i in range(0, 64, 16):
                read.append(i)
                yield x[i : i + 16], y[i : i + 16]

    model = eqfit.models.LinearRegression(4, key=getkey())
    arguments = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(1e-2), key=getkey(), epochs=3)
    plan = eqfit.plan(model, Loader(), **arguments)
    assert read == [0, 16]  # opening a loader without `len` reads a batch ahead
    assert plan.steps is None and plan.flops is None and plan.flops_per_step > 0
    assert "known once the loader's first pass is read" in str(plan)
    result = eqfit.fit(model, Loader(), **arguments)
    assert result.history.step_loss.shape == (3, 4)


def test_bad_peak_flops_is_named():
    with pytest.raises(ValueError, match="`peak_flops`"):
        eqfit.plan(
            eqfit.models.LinearRegression(2, key=jax.random.key(0)),
            (np.zeros((4, 2), np.float32), np.zeros(4, np.float32)),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.1),
            key=jax.random.key(0),
            peak_flops=-1.0,
        )


@pytest.mark.heavy
def test_plan_flops_of_the_transformer_example(getkey):
    """The example's transformer: within 15% of the usual 6 x parameters x tokens, plus
    attention's 12 x layers x width x context per token (its scores and their mix,
    forward and backward).
    """
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "transformer_lm.py"
    spec = importlib.util.spec_from_file_location("transformer_lm", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.TransformerLM(getkey())
    batch, context = 64, example.CONTEXT
    tokens = np.zeros((batch * 2, context), np.int32)
    plan = eqfit.plan(
        model,
        (tokens, tokens),
        loss=example.loss,
        optimizer=optax.adamw(1e-2),
        key=getkey(),
        batch_size=batch,
    )
    parameters = weights(model)
    attention = 12 * example.LAYERS * example.WIDTH * context
    expected = (6 * parameters + attention) * batch * context
    assert abs(plan.flops_per_step / expected - 1) < 0.15
    # Its blocks fold into one row per array of a block in the table, not in `arrays`.
    layers = example.LAYERS
    assert f".blocks[0..{layers - 1}].attention.query_proj.weight  ×{layers}" in str(plan)
    assert sum(".attention.query_proj.weight" in a.path for a in plan.arrays) == layers


def nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))


def test_plan_arguments_are_parameters_optimizer_state_average_data_and_the_rest(getkey):
    """Each part of the argument bytes, counted by hand: the trained arrays, Adam's two
    moments of them and its count, the average, the frozen arrays, the training and the
    validation data; the rest (the run's record, counters and keys) is small, and the
    parts sum to XLA's figure.
    """
    x, y = regression_data(getkey(), n=256, features=8)
    xv, yv = regression_data(getkey(), n=64, features=8)
    model = eqfit.models.MLP(8, "scalar", 32, 2, key=getkey())
    trains = jax.tree.map(eqx.is_inexact_array, model)
    trains = eqx.tree_at(lambda m: m.layers[-1].weight, trains, replace=False)
    trained, frozen = eqx.partition(model, trains)
    plan = eqfit.plan(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=getkey(),
        batch_size=32,
        validation_data=(xv, yv),
        filter_spec=trains,
        ema=0.5,  # its bytes, whatever its rate
    )
    parts = plan.arguments
    assert parts.parameters == nbytes(trained) == 4 * plan.parameters
    assert parts.frozen == nbytes(frozen) == model.layers[-1].weight.nbytes
    assert parts.optimizer_state == 2 * parts.parameters + 4  # mu, nu and an int32 count
    assert parts.average == parts.parameters
    assert parts.model_state == parts.best == 0
    assert parts.data == x.nbytes + y.nbytes
    assert parts.validation_data == xv.nbytes + yv.nbytes
    assert 0 < parts.other < 1024
    assert parts.total == sum(parts) == plan.memory.argument
    line = next(line for line in str(plan).splitlines() if line.startswith("memory per device"))
    assert line == (
        f"memory per device: {_bytes(plan.memory.total)} = parameters "
        f"{_bytes(parts.parameters)} + frozen {_bytes(parts.frozen)} + optimizer state "
        f"{_bytes(parts.optimizer_state)} + average {_bytes(parts.average)} + data "
        f"{_bytes(parts.data)} + validation data {_bytes(parts.validation_data)} + other "
        f"{_bytes(parts.other)} + outputs {_bytes(plan.memory.output)} - aliased "
        f"{_bytes(plan.memory.alias)} + temporaries {_bytes(plan.memory.temporary)}"
        + (f" + code {_bytes(plan.memory.code)}" if plan.memory.code else "")
    )


@pytest.mark.slow
def test_plan_arguments_hold_the_model_state_and_the_best_epochs_copy(getkey):
    from test_features import batchnorm_loss, BatchNormNet

    model, state = eqx.nn.make_with_state(BatchNormNet)(getkey())
    x, y = regression_data(getkey(), n=64)
    plan = eqfit.plan(
        model,
        (x, y),
        state=state,
        loss=batchnorm_loss,
        optimizer=optax.sgd(1e-2),
        key=getkey(),
        batch_size=16,
        validation_split=0.25,
        early_stopping=eqfit.EarlyStopping(restore_best=True),
    )
    parts = plan.arguments
    params = nbytes(eqx.filter(model, eqx.is_inexact_array))
    assert parts.parameters == params and parts.optimizer_state == 0
    assert parts.model_state == nbytes(state)
    assert parts.best == params + nbytes(state)
    # 16 of the 64 rows held out for validation.
    assert parts.data == (x.nbytes + y.nbytes) * 3 // 4
    assert parts.validation_data == (x.nbytes + y.nbytes) // 4
    assert parts.total == plan.memory.argument
    text = str(plan)
    assert f"model state {_bytes(parts.model_state)}" in text
    assert f"best epoch's copy {_bytes(parts.best)}" in text


def test_plan_arguments_under_fsdp_are_each_devices_share(getkey):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    x, y = regression_data(getkey(), n=256, features=16)
    model = eqfit.models.MLP(16, "scalar", 32, 2, key=getkey())
    plan = eqfit.plan(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=getkey(),
        batch_size=64,
        mesh=mesh,
        shard=eqfit.sharding.fsdp("data", min_bytes=0),
    )
    parts = plan.arguments
    assert parts.parameters == sum(a.bytes for a in plan.arrays) < nbytes(model) // 4
    assert parts.optimizer_state == 2 * parts.parameters + 4  # the count is replicated
    assert parts.data == (x.nbytes + y.nbytes) // 8
    assert parts.total == plan.memory.argument


@pytest.mark.slow
def test_plan_says_its_precision_policy(getkey):
    x, y = regression_data(getkey(), n=64)
    model = eqfit.models.LinearRegression(4, key=getkey())
    arguments = dict(loss=eqfit.losses.mse, optimizer=optax.sgd(1e-2), key=getkey())

    def precision(policy):
        plan = eqfit.plan(model, (x, y), precision=policy, **arguments)
        line = next(line for line in str(plan).splitlines() if line.startswith("precision"))
        return plan, line

    plan, line = precision(None)
    assert plan.precision is None and line == "precision: the model's own dtypes (no policy)"
    plan, line = precision("bfloat16")
    assert plan.precision == eqfit.Precision(jnp.bfloat16)
    assert line == (
        "precision: bfloat16 compute, float32 parameters, optimizer state and average, "
        "no loss scaling"
    )
    _, line = precision("float16")
    assert line == (
        "precision: float16 compute, float32 parameters, optimizer state and average, "
        "dynamic loss scaling from 32768 (doubled after 2,000 finite steps in a row)"
    )
    _, line = precision(eqfit.Precision(jnp.bfloat16, keep=("weight",), loss_scaling=True))
    assert "float32 for 'weight', dynamic loss scaling" in line


@pytest.mark.heavy
def test_plan_counts_validation_flops(getkey):
    """A validation pass is a forward pass over the validation set: 2 FLOPs per weight
    and sample; the run's FLOPs add one per validated epoch.
    """
    x, y = regression_data(getkey(), n=512, features=64)
    xv, yv = regression_data(getkey(), n=300, features=64)
    model = eqfit.models.MLP(64, "scalar", 256, 3, key=getkey())
    arguments = dict(
        loss=eqfit.losses.mse, optimizer=optax.sgd(1e-3), key=getkey(), batch_size=128, epochs=5
    )
    plan = eqfit.plan(model, (x, y), validation_data=(xv, yv), validation_freq=2, **arguments)
    assert abs(plan.validation_flops / (2 * weights(model) * 300) - 1) < 0.10
    assert plan.validations == 2  # epochs 2 and 4
    assert plan.flops == plan.flops_per_step * 20 + plan.validation_flops * 2
    text = str(plan)
    assert f"{_flops(plan.validation_flops)} per validation pass" in text
    assert "for the run's 20 steps and 2 validation passes" in text
    sets = eqfit.ValidationSets(a=(xv, yv), b=(xv[:100], yv[:100]))
    two = eqfit.plan(model, (x, y), validation_data=sets, **arguments)
    assert two.validations == 5
    assert abs(two.validation_flops / (plan.validation_flops * 400 / 300) - 1) < 0.02
    alone = eqfit.plan(model, (x, y), **arguments)
    assert alone.validation_flops == 0 and alone.validations == 0
    assert alone.flops == alone.flops_per_step * 20
    assert "validation" not in str(alone)


def layouts(plan):
    """Each row's layout in `print(plan)`'s table (the fourth column, by the header's)."""
    lines = str(plan).splitlines()
    start = lines[0].index("layout")
    end = lines[0].index("bytes/device")
    rows = lines[2 : 2 + len(folded_rows(plan.arrays))]
    return [row[start:end].strip() for row in rows]


@pytest.mark.heavy
def test_replicated_reads_alike_with_and_without_shard(getkey):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    x, y = regression_data(getkey(), n=256, features=16)
    model = eqfit.models.MLP(16, "scalar", 32, 2, key=getkey())
    arguments = dict(
        loss=eqfit.losses.mse, optimizer=optax.sgd(1e-3), key=getkey(), batch_size=64, mesh=mesh
    )
    plain = eqfit.plan(model, (x, y), **arguments)
    whole = eqfit.plan(model, (x, y), shard=eqfit.sharding.fsdp("data"), **arguments)
    assert whole.sharded and whole.split == 0
    assert layouts(plain) == layouts(whole) == ["replicated"] * len(folded_rows(plain.arrays))
    split = eqfit.plan(model, (x, y), shard=eqfit.sharding.fsdp("data", min_bytes=0), **arguments)
    shown = dict(zip((path for path, _, _ in folded_rows(split.arrays)), layouts(split)))
    assert shown[".layers[0].weight"] == "('data',)"
    assert shown[".layers[2].bias"] == "replicated"  # P(): one value, nothing to split


def test_plan_folds_repeated_blocks_in_its_table(getkey):
    model = eqx.nn.MLP(16, 16, 16, 5, key=getkey())  # six layers of 16 by 16
    x = np.zeros((64, 16), np.float32)
    plan = eqfit.plan(
        model,
        (x, x),
        loss=lambda model, x, y: ((jax.vmap(model)(x) - y) ** 2).mean(),
        optimizer=optax.sgd(1e-3),
        key=getkey(),
    )
    assert [a.path for a in plan.arrays] == [
        f".layers[{i}].{name}" for i in range(6) for name in ("weight", "bias")
    ]
    text = str(plan)
    rows = [line.split() for line in text.splitlines()[2:5]]
    # A folded row's bytes are its arrays' together: six of 1 KiB.
    weight = [".layers[0..5].weight", "×6", "(16,", "16)", "float32", "replicated", "6.0", "KiB"]
    assert rows[0] == weight
    assert rows[1] == [".layers[0..5].bias", "×6", "(16,)", "float32", "replicated", "384", "B"]
    assert rows[2][0].startswith("---")  # and no more rows


def test_folded_rows_fold_alike_blocks_only():
    def array(path, shape=(4,), spec=None):
        return eqfit.ArrayPlan(path, shape, "float32", spec, 4 * int(np.prod(shape)), True)

    arrays = [array(".embedding")]
    for block in range(4):
        arrays += [array(f".blocks[{block}].heads[{head}].weight") for head in range(3)]
        arrays.append(array(f".blocks[{block}].norm", (8,) if block == 3 else (4,)))
    arrays += [array(".layers[0].weight", (2, 2)), array(".layers[1].weight", (3, 3))]
    arrays += [array(".split[0]", spec=P("data")), array(".split[1]", spec=P())]
    rows = [(path, count) for path, count, _ in folded_rows(arrays)]
    assert rows == [
        (".embedding", 1),
        (".blocks[0..2].heads[0..2].weight", 9),
        (".blocks[0..2].norm", 3),
        (".blocks[3].heads[0..2].weight", 3),  # the last block's norm is unlike the rest
        (".blocks[3].norm", 1),
        (".layers[0].weight", 1),
        (".layers[1].weight", 1),
        (".split[0]", 1),
        (".split[1]", 1),
    ]


class Looped(eqx.Module):
    """A layer applied 100 times: in a `lax.scan`, a `fori_loop`, or a Python loop
    (written out).
    """

    layer: eqx.nn.Linear
    head: eqx.nn.Linear
    how: str = eqx.field(static=True)

    def __call__(self, x):
        def f(h):
            return jnp.tanh(self.layer(h))

        if self.how == "scan":
            return self.head(jax.lax.scan(lambda h, _: (f(h), None), x, None, length=100)[0])
        if self.how == "fori":
            return self.head(jax.lax.fori_loop(0, 100, lambda i, h: f(h), x))
        for _ in range(100):
            x = f(x)
        return self.head(x)


def _looped_plan(how, getkey):
    k1, k2 = jax.random.split(getkey())
    model = Looped(eqx.nn.Linear(32, 32, key=k1), eqx.nn.Linear(32, "scalar", key=k2), how)
    x, y = regression_data(getkey(), n=64, features=32)
    return eqfit.plan(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(1e-3),
        key=getkey(),
        batch_size=16,
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["scan", "fori"])
def test_plan_counts_a_loops_body_as_often_as_it_runs(how, getkey):
    unrolled = _looped_plan("unrolled", getkey)
    looped = _looped_plan(how, getkey)
    assert abs(looped.flops_per_step / unrolled.flops_per_step - 1) < 0.10
    # XLA's own count, the body once, would be some 100 times less.
    assert looped.flops_per_step > 50 * (6 * 32 * 32 * 16)
    assert looped.flops_lower_bound is None and "at least" not in str(looped)


def test_a_gru_plan_is_within_a_tenth_of_its_count_by_hand(getkey):
    hidden, features, time, batch = 64, 8, 24, 32

    class GRU(eqx.Module):
        cell: eqx.nn.GRUCell
        head: eqx.nn.Linear

        def __call__(self, xs):
            h = jnp.zeros(hidden)
            h, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), h, xs)
            return self.head(h)

    k1, k2 = jax.random.split(getkey())
    model = GRU(eqx.nn.GRUCell(features, hidden, key=k1), eqx.nn.Linear(hidden, 1, key=k2))
    x = np.zeros((batch * 2, time, features), np.float32)
    y = np.zeros((batch * 2, 1), np.float32)
    plan = eqfit.plan(
        model,
        (x, y),
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(1e-3),
        key=getkey(),
        batch_size=batch,
    )
    # Per step of time a GRU cell multiplies its input and its state by three gates'
    # weights each: 2 FLOP per weight forward, 4 backward, as for any dense layer.
    cell = 3 * hidden * (features + hidden)
    expected = 6 * batch * (time * cell + hidden)
    assert abs(plan.flops_per_step / expected - 1) < 0.10


def test_a_while_loop_of_unknown_count_makes_the_flops_a_lower_bound(getkey):
    x, y = regression_data(getkey(), n=64, features=4)
    model = eqfit.models.MLP(4, "scalar", 16, 1, key=getkey())

    def loss(model, x, y):
        # The inputs squashed until they are small: a loop of no known trip count.
        x = jax.lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 0.5, lambda v: v / 2, x)
        return eqfit.losses.mse(model, x, y)

    plan = eqfit.plan(model, (x, y), loss=loss, optimizer=optax.sgd(1e-3), key=getkey())
    assert plan.flops_lower_bound is not None and "while_loop" in plan.flops_lower_bound
    assert "(at least: 1 `while_loop` whose trip count is not known" in str(plan)
