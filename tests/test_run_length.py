"""A step's cost does not grow with the run's length: the compiled programs never copy,
select or scatter a whole record of the run's steps, whatever is recorded and however the
steps run; an ensemble's members, while all of them run, step with no mask; and a check
of labels costs a step a few kernels. Read from the compiled program's HLO
(`eqfit.plan(...).compiled`), not timed.
"""

import collections
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import eqfit


EPOCHS, BATCH, N = 37, 8, 96  # 12 steps an epoch
# The record's rows: the 37 epochs rounded up to a power of two (runs of 33 to 64 epochs
# share the program), `(64, 12)` cells: shapes no other array has.
OPTIMIZER = optax.adam(1e-2)  # one object for the module: fits share their programs


def arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.float32)
    return x, y


def bce(model, x, y):
    return optax.sigmoid_binary_cross_entropy(jax.vmap(model)(x), y).mean()


def bce_aux(model, x, y):
    logits = jax.vmap(model)(x)
    accuracy = ((logits > 0) == (y > 0.5)).mean()
    return optax.sigmoid_binary_cross_entropy(logits, y).mean(), {"acc": accuracy}


def precision(model, x, y):
    predicted = jax.vmap(model)(x) > 0
    return jnp.sum(predicted & (y > 0.5)) / jnp.maximum(jnp.sum(predicted), 1)


def mlp(key=jax.random.key(0)):
    return eqx.nn.MLP(3, "scalar", 8, 1, key=key)


CASES = {
    "loss": {"loss": bce},
    "aux": {"loss": bce_aux},
    "metric": {"loss": bce, "metrics": {"p": precision}},
    "stateful metric": {"loss": bce, "metrics": {"p": eqfit.metrics.Precision()}},
    "norms": {"loss": bce_aux, "norms": True},
    "schedules": {"loss": bce_aux, "schedules": {"lr": optax.constant_schedule(1e-2)}},
    "log_every": {"loss": bce_aux, "log_every": 5},
    "validation_every": {"loss": bce_aux, "validation_every": 7},
    "updates": {"updates": [eqfit.Update("m", bce_aux, OPTIMIZER)]},
    "per step": {"loss": bce_aux, "execution": eqfit.PerStep()},
    "ensemble": {"loss": bce_aux, "ensemble": True},
    "ensemble per step": {"loss": bce_aux, "ensemble": True, "execution": eqfit.PerStep()},
    "shuffled remainder": {"loss": bce_aux, "batch_size": 7, "shuffle": True},
}

# An instruction over a whole record: the steps' losses, values or batch sizes, `(epochs,
# steps)` (a member axis first, values last), or their cells end to end.
WHOLE = re.compile(r"\[(\d+,)?64,(12|14)(,\d+)?\]|\[(\d+,)?(768|896)(,\d+)?\]")
PASSES = ("copy(", "select(", "scatter(", "concatenate(")


def whole_record_instructions(hlo: str) -> list[str]:
    found = []
    for line in hlo.splitlines():
        if "=" not in line:
            continue
        result, op = line.split("=", 1)
        shape = op.strip().split(" ", 1)[0]
        empty = re.search(r"[\[,]0[\],]", shape)  # a record of no values
        if WHOLE.search(shape) and not empty and any(p in op for p in PASSES):
            found.append(line.strip()[:160])
    return found


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_no_step_passes_over_the_whole_record(case):
    kwargs = dict(CASES[case])
    x, y = arrays()
    model = mlp()
    if kwargs.pop("ensemble", False):
        model = eqx.filter_vmap(mlp)(jax.random.split(jax.random.key(0), 3))
        kwargs["ensemble"] = True
    if "updates" not in kwargs:
        kwargs["optimizer"] = OPTIMIZER
    if "validation_every" in kwargs:
        kwargs["validation_data"] = arrays()
    kwargs.setdefault("batch_size", BATCH)
    kwargs.setdefault("shuffle", False)
    plan = eqfit.plan(model, (x, y), key=jax.random.key(1), epochs=EPOCHS, **kwargs)
    hlo = plan.compiled.as_text()
    assert re.search(r"64,(12|14)", hlo), "the record is not where the test looks"
    assert whole_record_instructions(hlo) == []
    if "log_every" in kwargs:  # the call's n-th steps, not the run's: no (154, 5) of every one
        assert not re.search(r"\[(154,5|770)(,\d+)?\]", hlo)


def test_members_stopped_apart_record_as_each_alone():
    """An ensemble's steps run while any member runs, each member's masked by its own
    state: a member stopped early records as it would alone, and nothing after.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    near = eqfit.models.LinearRegression(3, key=jax.random.key(0))
    near = eqx.tree_at(lambda m: m.weight, near, jnp.array([[1.0, -2.0, 0.5]]) + 0.01)
    far = eqx.tree_at(lambda m: m.weight, near, jnp.array([[5.0, 5.0, 5.0]]))
    kwargs = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.sgd(0.02),
        key=jax.random.key(1),
        epochs=8,
        batch_size=BATCH,
        shuffle=False,
        early_stopping=eqfit.EarlyStopping(monitor="loss", min_delta=0.01, restore_best=False),
    )
    members = jax.tree.map(lambda *a: jnp.stack(a), near, far)
    together = eqfit.fit(members, (x, y), ensemble=True, **kwargs).history
    runs = []
    for i, member in enumerate((near, far)):
        alone = eqfit.fit(member, (x, y), **kwargs).history  # its epochs, to its stop
        ran = len(alone.epoch)
        np.testing.assert_allclose(together.step_loss[:ran, :, i], alone.step_loss, 1e-5)
        np.testing.assert_array_equal(together.batch_sizes[:ran, :, i], alone.batch_sizes)
        assert np.isnan(together.step_loss[ran:, :, i]).all()
        assert (together.batch_sizes[ran:, :, i] == 0).all()
        runs.append(ran)
    assert runs[0] < runs[1]  # the near member stops first, the far one later


def step_loop_bodies(hlo: str) -> list[list[str]]:
    """The bodies of the compiled program's loops of steps: the while loops whose body
    computes a matrix product (the step) and holds no loop of its own.
    """
    computations: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)

    def calls(lines: list[str]) -> set[str]:
        return set(re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", "".join(lines)))

    def reaches(body: str, seen: set[str] | None = None) -> list[str]:
        seen = set() if seen is None else seen
        lines = list(computations.get(body, []))
        for called in calls(lines) - seen:
            seen.add(called)
            lines += reaches(called, seen)
        return lines

    bodies = []
    for lines in computations.values():
        for line in lines:
            found = re.search(r" while\(.*body=%?([\w.\-]+)", line)
            if found:
                body = found.group(1)
                inside = computations.get(body, [])
                whole = reaches(body)
                if not any(" while(" in x for x in inside) and any("dot(" in x for x in whole):
                    bodies.append(inside)
    return bodies


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["loss", "aux", "metric", "norms", "schedules", "validation_every", "updates"]
)
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_step_writes_its_record_and_leaves_the_rest_to_its_stretchs_end(case, shuffle):
    """One model's step, in a run that stops at a non-finite loss, writes its loss and
    values, nothing else of the run's: the batch sizes, the reason to stop and the step
    of a non-finite loss are written once, where its stretch of steps ends (what a step
    of small kernels would otherwise pay a kernel for each), and the epoch's mean loss so
    far (the bar's) is read from the record once a call, not summed at every step.
    """
    kwargs = dict(CASES[case])
    x, y = arrays()
    if "updates" not in kwargs:
        kwargs["optimizer"] = OPTIMIZER
    if "validation_every" in kwargs:
        kwargs["validation_data"] = arrays()
    plan = eqfit.plan(
        mlp(),
        (x, y),
        key=jax.random.key(1),
        epochs=EPOCHS,
        batch_size=BATCH,
        shuffle=shuffle,
        **kwargs,
    )
    bodies = step_loop_bodies(plan.compiled.as_text())
    assert bodies, "no loop of steps where the test looks"
    for body in bodies:
        shapes = [line.split("=", 1)[1].strip().split(" ", 1)[0] for line in body if " = " in line]
        assert "s32[64,12]{1,0}" not in shapes  # the batch sizes
        # The step's count, and its reason to stop (made with its finiteness): no
        # reason and step of a non-finite loss kept apart.
        counts = [line for line in body if re.search(r"= s32\[\] (fusion|select)\(", line)]
        assert len(counts) <= 2, counts
        assert "f32[2]{0}" not in shapes  # the running mean's two sums


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"progress": True, "validation_every": 5},
        {"batch_size": 7, "shuffle": True, "loss": bce_aux},
        {"loss": "weighted"},
    ],
    ids=["plain", "bar and validation_every", "shuffled remainder", "weighted"],
)
def test_the_stretchs_bookkeeping_is_the_steps_bit_for_bit(extra):
    """A run's history is the same, bit for bit, whether each step writes its batch size,
    reason to stop (`on_nan="skip"`, which goes on past a non-finite step) or its
    stretch of steps writes them at its end (`"raise"`).
    """
    x, y = arrays()
    w = (np.arange(N) % 3 != 0).astype(np.float32)

    def weighted(model, x, y, w):
        losses = optax.sigmoid_binary_cross_entropy(jax.vmap(model)(x), y)
        return eqfit.Mean(jnp.sum(losses * w), jnp.sum(w))

    kwargs = dict(optimizer=OPTIMIZER, key=jax.random.key(1), epochs=4, batch_size=BATCH)
    kwargs |= {"loss": bce, "shuffle": False} | extra
    data = (x, y)
    if kwargs["loss"] == "weighted":
        kwargs["loss"], data = weighted, (x, y, w)
    if "validation_every" in kwargs:
        kwargs["validation_data"] = arrays()
    runs = [eqfit.fit(mlp(), data, on_nan=on_nan, **kwargs) for on_nan in ("skip", "raise")]
    skip, stretch = (r.history for r in runs)
    for name in ("step_loss", "batch_sizes"):
        np.testing.assert_array_equal(getattr(skip, name), getattr(stretch, name))
    assert skip.values.keys() == stretch.values.keys()
    for name, values in skip.values.items():
        np.testing.assert_array_equal(values, stretch.values[name], err_msg=name)


@pytest.mark.slow
def test_a_non_finite_step_inside_a_stretch_stops_the_run_there():
    """The step whose loss is not finite is the last one run, recorded with its batch
    size, and the run says why it stopped (`on_nan="stop"`).
    """
    x, y = arrays()
    x[43] = np.nan  # in the sixth batch of 8

    result = eqfit.fit(
        mlp(),
        (x, y),
        loss=bce,
        optimizer=OPTIMIZER,
        key=jax.random.key(1),
        epochs=3,
        batch_size=BATCH,
        shuffle=False,
        on_nan="stop",
    )
    history = result.history
    assert history.stop_reason == "non_finite_loss"
    flat_loss, flat_sizes = history.step_loss.reshape(-1), history.batch_sizes.reshape(-1)
    assert np.isnan(flat_loss[5]) and np.isfinite(flat_loss[:5]).all()
    assert np.isnan(flat_loss[6:]).all()
    assert (flat_sizes[:6] == BATCH).all() and (flat_sizes[6:] == 0).all()


# -- An ensemble's members step unmasked while every one of them runs.


def computations(hlo: str) -> dict[str, list[tuple[str, str, list[str]]]]:
    """The compiled program's computations by name: each instruction's shape, operation
    and operands' shapes, and (as an operand `calls=...`) the computation a fusion calls.
    """
    found: dict[str, list[tuple[str, str, list[str]]]] = {}
    shapes: dict[str, str] = {}
    lines = None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            lines = found[head.group(1)] = []
            continue
        made = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\(([^)]*)\)(.*)", line)
        if lines is None or made is None:
            continue
        name, shape, op, args, rest = made.groups()
        shapes[name] = shape
        operands = [shapes.get(a.strip().lstrip("%"), "") for a in args.split(",")]
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        lines.append((shape, op, operands + ([f"calls={calls.group(1)}"] if calls else [])))
    return found


def loop_bodies(hlo: str) -> list[list[tuple[str, str, list[str]]]]:
    """The instructions of each while loop's body, those of the fusions it calls among
    them.
    """
    found = computations(hlo)

    def inside(name: str) -> list[tuple[str, str, list[str]]]:
        out = []
        for shape, op, operands in found[name]:
            out.append((shape, op, operands))
            out += [i for o in operands if o.startswith("calls=") for i in inside(o[6:])]
        return out

    return [inside(body) for body in re.findall(r" while\(.*?body=%?([\w.\-]+)", hlo)]


@pytest.mark.slow
def ensemble_plan(members, loss):
    """The plan of `members` trained together on `arrays()` with `loss`."""
    x, y = arrays()
    return eqfit.plan(
        members,
        (x, y),
        key=jax.random.key(1),
        epochs=EPOCHS,
        batch_size=BATCH,
        loss=loss,
        optimizer=OPTIMIZER,
        ensemble=True,
    )


def hlo_f32(array) -> str:
    """A float32 array's shape as HLO writes it: `f32[3,4,5]`."""
    return "f32[" + ",".join(map(str, array.shape)) + "]"


def reads_record(body) -> bool:
    """Whether a loop's body reads a record's cell back (a masked step's)."""
    reads = ("dynamic-slice", "gather")
    return any(op in reads and WHOLE.search(args[0]) for _, op, args in body if args)


def test_members_that_all_run_step_unmasked():
    """While every member of an ensemble runs, its steps run in a loop of their own, with
    no mask of each member's step: each weight matrix and its optimizer state selected
    once (by the NaN guard, which keeps an update that is not finite out), not again by
    the mask, and each record's cell written as one place, not read back first (as the
    mask reads it, or a scatter's check that the place is in range).
    """
    make = lambda key: eqx.nn.MLP(3, 4, 5, 1, key=key)  # noqa: E731
    members = eqx.filter_vmap(make)(jax.random.split(jax.random.key(0), 3))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x).sum(axis=1) - y) ** 2)

    plan = ensemble_plan(members, loss)
    # The weight matrices' shapes, a member axis first: (3, 5, 3) and (3, 4, 5).
    weights = [a for a in jax.tree.leaves(eqx.filter(members, eqx.is_array)) if a.ndim == 3]
    shapes = {hlo_f32(a) for a in weights}
    kept = 3 * len(weights)  # each matrix, and Adam's two moments of it

    def selects(body):
        return sum(op == "select" and shape.split("{")[0] in shapes for shape, op, _ in body)

    bodies = loop_bodies(plan.compiled.as_text())
    steps = [body for body in bodies if any(op == "dot" for _, op, _ in body)]
    assert any(selects(body) == kept and not reads_record(body) for body in steps)


def test_members_update_their_optimizer_state_in_place():
    """While every member of an ensemble runs, its step updates Adam's moments in place:
    no array of a parameter's shape is copied more often than the parameters of that
    shape (a parameter that the forward pass and its update both read is copied once, as
    a hand `vmap` of the same step copies it). Before, the NaN guard's select, made as
    the `vmap` makes a `cond`'s, left each parameter's kernel reading the moments that
    their own kernels overwrite, and XLA copied both moments of every parameter each step.
    """
    members = eqx.filter_vmap(mlp)(jax.random.split(jax.random.key(0), 3))
    plan = ensemble_plan(members, bce_aux)
    params = collections.Counter(map(hlo_f32, jax.tree.leaves(eqx.filter(members, eqx.is_array))))
    steps = [
        body  # a loop of steps that reads no record's cell back (no mask)
        for body in loop_bodies(plan.compiled.as_text())
        if any(op == "dot" for _, op, _ in body) and not reads_record(body)
    ]
    assert steps, "no loop of unmasked steps where the test looks"
    for body in steps:
        copies = collections.Counter(shape.split("{")[0] for shape, op, _ in body if op == "copy")
        assert all(copies[shape] <= n for shape, n in params.items()), copies


@pytest.mark.slow
def test_members_stopped_apart_by_a_nan_record_and_train_as_each_alone():
    """A row that makes the loss NaN, which each member's own shuffle puts at its own
    step: each member stops there, mid-epoch, having recorded and trained as it would
    alone, while the others train on (unmasked until the first stops, then masked).
    """
    x, y = arrays()
    x[41, 0] = np.nan
    members = eqx.filter_vmap(mlp)(jax.random.split(jax.random.key(0), 3))
    kwargs = dict(loss=bce, optimizer=OPTIMIZER, epochs=2, batch_size=BATCH, on_nan="stop")
    key = jax.random.key(2)
    together = eqfit.fit(members, (x, y), key=key, ensemble=True, **kwargs)
    stops = []
    for i, k in enumerate(jax.random.split(key, 3)):
        member = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, members)
        alone = eqfit.fit(member, (x, y), key=k, **kwargs)
        losses = alone.history.step_loss.reshape(-1)
        stops.append(int(np.flatnonzero(np.isnan(losses))[0]))  # its NaN step
        mine = together.history.step_loss[..., i].reshape(-1)
        np.testing.assert_allclose(mine[: stops[-1]], losses[: stops[-1]], rtol=1e-5)
        assert np.isnan(mine[stops[-1] :]).all()  # nothing after it
        trained = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, together.model)
        assert_trees_close(trained, alone.model)  # the last finite step's
    assert len(set(stops)) == 3  # apart: each at its own step


# The instructions of a loop body that run no kernel.
FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}


def step_kernels(hlo: str) -> int:
    """How many kernels (fusions, dots, copies, ...) the compiled run's step runs: the
    instructions of its innermost loop's body, less those that run none.
    """
    computations: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            computations[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            computations[name].append(line)
    bodies = {
        b
        for lines in computations.values()
        for b in re.findall(r"body=%([\w.\-]+)", "".join(lines))
    }
    inner = [b for b in bodies if not any(" while(" in line for line in computations[b])]
    body = computations[max(inner, key=lambda b: len(computations[b]))]
    ops = [re.search(r"= (?:\([^=]*\)|\S+) ([\w\-]+)\(", line) for line in body]
    return sum(1 for op in ops if op and op.group(1) not in FREE)


def kernels(model, data, **kwargs):
    kwargs.update(optimizer=OPTIMIZER, key=jax.random.key(1), epochs=3, batch_size=BATCH)
    plan = eqfit.plan(model, data, shuffle=False, **kwargs)
    return step_kernels(plan.compiled.as_text())


@pytest.mark.slow
def test_a_label_check_costs_a_step_a_reduction_and_a_select():
    """Labels checked in a step (a stateful metric's, a ready loss's) cost it a reduction
    over the batch and the select that keeps the first bad label, carried as one array
    and made in place (before: a select, and a kernel, for each of its six arrays), and
    for a metric's confusion counts, the one-hot matrices, their product and its sum.
    """
    x, y = arrays()
    counts = kernels(mlp(), (x, y), loss=bce, metrics={"p": eqfit.metrics.Precision()})
    # Two one-hots, their product, its sum; the check's reduction (the NaN outputs' too)
    # and the select of the first bad label. Before: 13.
    assert counts - kernels(mlp(), (x, y), loss=bce) <= 6
    classes = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0)
    model = eqx.nn.MLP(3, 3, 8, 1, key=jax.random.key(0))

    def unchecked(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y).mean()

    checked = kernels(model, (x, classes), loss=eqfit.losses.softmax_cross_entropy)
    # The reduction, the NaN logits where a label is bad, and the select. Before: 9.
    assert checked - kernels(model, (x, classes), loss=unchecked) <= 3


def test_members_write_an_epochs_and_a_validations_values_in_place():
    """An ensemble's epoch end writes its values into the epochs' table (and a validation
    after an n-th step into the validations' table) at one row for all members, in
    place: no loop of the program copies, selects or scatters a whole table, whose length
    is the run's (a pass over it each epoch would grow a step's cost with the run).
    """
    x, y = arrays()
    keys = jax.random.split(jax.random.key(0), 3)
    members = eqx.filter_vmap(mlp)(keys)
    kwargs = dict(
        loss=bce_aux,
        optimizer=OPTIMIZER,
        validation_data=arrays(),
        validation_every=7,
        key=jax.random.key(1),
        batch_size=BATCH,
        shuffle=False,
    )
    plan = eqfit.plan(members, (x, y), ensemble=True, epochs=EPOCHS, **kwargs)
    # (3 members, 64 epochs' rows, 4 values) and (3 members, 110 validations' rows (the
    # most 768 steps reach), 2 values).
    tables = re.compile(r"\[3,(64,4|110,2)\]")
    hlo = plan.compiled.as_text()
    assert tables.search(hlo), "the tables are not where the test looks"
    passes = [
        (shape, op)
        for body in loop_bodies(hlo)
        for shape, op, _ in body
        if tables.search(shape) and f"{op}(" in PASSES
    ]
    assert passes == []
    result = eqfit.fit(members, (x, y), ensemble=True, epochs=3, **kwargs)
    alone = eqfit.fit(mlp(keys[1]), (x, y), epochs=3, **kwargs)
    # Each member's rows as it alone writes them (the same values, up to the vmap's
    # arithmetic), where a write at another member's row would show.
    together, one = result.history, alone.history
    np.testing.assert_allclose(together.loss[:, 1], one.loss, rtol=1e-5)
    np.testing.assert_allclose(together.values["acc"][:, 1], one.values["acc"], rtol=1e-5)
    for name in ("val_loss", "val_acc"):
        np.testing.assert_allclose(together.validations[name][:, 1], one.validations[name], 1e-5)
