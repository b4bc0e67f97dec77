"""A step's cost does not grow with the run's length: the compiled programs never copy,
select or scatter a whole record of the run's steps, whatever is recorded and however the
steps run; and a check of labels costs a step a few kernels. Read from the compiled
program's HLO (`eqfit.plan(...).compiled`), not timed.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfit


EPOCHS, BATCH, N = 37, 8, 96  # a record of (37, 12) cells: shapes no other array has
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
WHOLE = re.compile(r"\[(\d+,)?37,(12|14)(,\d+)?\]|\[(\d+,)?(444|518)(,\d+)?\]")
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
    assert re.search(r"37,(12|14)", hlo), "the record is not where the test looks"
    assert whole_record_instructions(hlo) == []
    if "log_every" in kwargs:  # the call's n-th steps, not the run's: no (88, 5) of every one
        assert not re.search(r"\[(88,5|440)(,\d+)?\]", hlo)


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
