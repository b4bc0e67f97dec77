"""A survey of bad and edge inputs to validation and logs every n steps,
`eqfit.ValidationSets`, inference on loaders, generators and memmaps, `eqfit.Buckets`,
metrics with state (eqfit's and metrax's) and the NaN found by replay, as a user would
make them (issue 71): each answered by an error that names the argument and says what
was expected and what came, or by the right value, against a hand computation.

One table of cases: each a call on a small shared problem and its answer, `Raises`
(the error's type and words) or `Gives` (a check of the value). The model is tiny and
the optimizer one object, so that fits share their compiled programs.
"""

# ruff: noqa: E501  (the table of cases keeps each case on a line or two)

import contextlib
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import metrax
import numpy as np
import optax
import pytest
from jaxtyping import TypeCheckError

import eqfit
from eqfit.metrics import AbstractMetric, ConfusionMatrix, F1, Metrax, Precision, TopKAccuracy


SGD = optax.sgd(0.1)  # one object for the module: fits share their compiled programs
FIXED = optax.sgd(0.0)  # the model stays as it is
N, BATCH, CLASSES = 12, 4, 3
RNG = np.random.default_rng(71)
X = RNG.normal(size=(N, 2)).astype(np.float32)
Y = np.array([0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 2, 1], np.int32)
YR = X.sum(1).astype(np.float32)
SEQS = [RNG.normal(size=(n,)).astype(np.float32) for n in (3, 7, 5, 2, 8, 6, 4, 1)]
LABELS = np.arange(8, dtype=np.int32) % 2
KEY = jax.random.key(0)


def linear(out=CLASSES):
    """A fixed linear classifier (or regressor, `out="scalar"`)."""
    return eqx.nn.Linear(2, out, key=jax.random.key(1))


CLF, REG = linear(), linear("scalar")
CE, MSE = eqfit.losses.softmax_cross_entropy, eqfit.losses.mse


def predicted(model=CLF, x=X):
    return np.asarray(jax.vmap(model)(jnp.asarray(x))).argmax(-1)


def hand_confusion(pred, y=Y, classes=CLASSES):
    counts = np.zeros((classes, classes))
    for t, p in zip(y, pred):
        counts[t, p] += 1
    return counts


@dataclasses.dataclass(frozen=True)
class Raises:
    kind: type[BaseException]
    words: str  # a regular expression the message must match


@dataclasses.dataclass(frozen=True)
class Gives:
    check: Callable[[Any], bool]


def fit(model=CLF, data=None, **kwargs):
    data = (X, Y) if data is None else data
    given = dict(loss=CE, optimizer=SGD, key=KEY, batch_size=BATCH, epochs=1) | kwargs
    return eqfit.fit(model, data, **given)


def buckets(data=None, **kwargs):
    given = dict(lengths=(4, 8), batch_size=2, key=KEY) | kwargs
    return eqfit.Buckets((SEQS, LABELS) if data is None else data, **given)


class Batches:
    """A re-iterable loader of `data` in batches of `size`, in order."""

    def __init__(self, data, size=BATCH):
        self.data, self.size = data, size

    def __len__(self):
        return -(-len(self.data[0]) // self.size)

    def __iter__(self):
        for i in range(0, len(self.data[0]), self.size):
            yield tuple(a[i : i + self.size] for a in self.data)


def generator(data, size=BATCH):
    return (tuple(a[i : i + size] for a in data) for i in range(0, len(data[0]), size))


def memmaps(tmp, *arrays):
    out = []
    for i, a in enumerate(arrays):
        path = tmp / f"survey_{i}.npy"
        np.save(path, a)
        out.append(np.load(path, mmap_mode="r"))
    return tuple(out)


class PerRow(AbstractMetric):
    def statistics(self, model, x, y):
        return {"err": (jax.vmap(model)(x) - y) ** 2}

    def compute(self, s):
        return jnp.mean(s["err"])


class Text(AbstractMetric):
    def statistics(self, model, x, y):
        return {"n": jnp.sum(y), "name": np.array(["a", "b"])}

    def compute(self, s):
        return s["n"]


class NumpyCount(AbstractMetric):
    def statistics(self, model, x, y):
        return {"n": jnp.sum(y), "count": np.float32(3.0)}

    def compute(self, s):
        return s["n"] / s["count"]


def evaluate(metrics, model=CLF, data=None, loss=CE):
    return eqfit.evaluate(model, (X, Y) if data is None else data, loss=loss, metrics=metrics,
                          batch_size=BATCH)  # fmt: skip


def mse_of(model=REG):
    return float(np.mean((np.asarray(jax.vmap(model)(X)) - YR) ** 2))


def top2(model=CLF):
    logits = np.asarray(jax.vmap(model)(X))
    return float(np.mean([y in np.argsort(-row)[:2] for row, y in zip(logits, Y)]))


def close(a, b, tol=1e-5):
    return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol))


VE = "validation_every"
# Each case: its id, a call of `tmp` (a folder), and its answer.
# fmt: off
CASES: list[tuple[str, Callable[[Any], Any], Raises | Gives]] = [
    # -- validation and logs every n steps: checked before any data is read.
    ("every-0", lambda t: fit(validation_data=(X, Y), validation_every=0),
     Raises(ValueError, r"`validation_every` must be a whole number of steps, 1 or more.*got 0")),
    ("every--3", lambda t: fit(validation_data=(X, Y), validation_every=-3),
     Raises(ValueError, r"`validation_every` must be .* 1 or more.*got -3")),
    ("every-2.5", lambda t: fit(validation_data=(X, Y), validation_every=2.5),
     Raises(TypeCheckError, r"`fit`'s argument `validation_every` must be a whole number.*2\.5")),
    ("every-str", lambda t: fit(validation_data=(X, Y), validation_every="2"),
     Raises(TypeCheckError, r"`fit`'s argument `validation_every` must be a whole number.*'2'")),
    ("every-bool", lambda t: fit(validation_data=(X, Y), validation_every=True),
     Raises(ValueError, r"`validation_every` must be a whole number.*got True")),
    ("every-1e30", lambda t: fit(validation_data=(X, Y), validation_every=10**30),
     Raises(ValueError, r"`validation_every` must be a number of steps at most 2147483647.*got 10{30}")),
    ("every-2**31", lambda t: fit(validation_data=(X, Y), validation_every=2**31),
     Raises(ValueError, r"`validation_every` must be .* at most 2147483647.*got 2147483648")),
    ("every-float-inf", lambda t: fit(validation_data=(X, Y), validation_every=float("inf")),
     Raises(TypeCheckError, r"`fit`'s argument `validation_every` must be a whole number.*inf")),
    ("every-no-validation", lambda t: fit(validation_every=2),
     Raises(ValueError, r"`validation_every=2` says how often to validate, but this run validates "
                        r"nothing: give `validation_data`")),
    ("every-np-int", lambda t: fit(validation_data=(X, Y), validation_every=np.int64(2), epochs=1),
     Gives(lambda r: list(r.history.validation_steps) == [2])),
    ("every-with-freq", lambda t: fit(validation_data=(X, Y), validation_every=2, validation_freq=2),
     Raises(ValueError, r"validation_freq")),
    ("log-every-0", lambda t: fit(log_every=0),
     Raises(ValueError, r"`log_every` must be a whole number of steps, 1 or more.*got 0")),
    ("log-every-2**40", lambda t: fit(log_every=2**40),
     Raises(ValueError, r"`log_every` must be .* at most 2147483647.*got 1099511627776")),
    ("log-every-float", lambda t: fit(log_every=1.5),
     Raises(TypeCheckError, r"`fit`'s argument `log_every` must be a whole number.*1\.5")),
    ("freq-0", lambda t: fit(validation_data=(X, Y), validation_freq=0),
     Raises(ValueError, r"`validation_freq`.*got 0")),
    # -- ValidationSets.
    ("sets-empty", lambda t: eqfit.ValidationSets(),
     Raises(ValueError, r"`eqfit.ValidationSets\(\)` holds no set")),
    ("sets-bad-name", lambda t: eqfit.ValidationSets(**{"2nd": (X, Y)}),
     Raises(ValueError, r"set named '2nd'.*a letter")),
    ("sets-as-fit-data", lambda t: fit(data=eqfit.ValidationSets(a=(X, Y))),
     Raises(TypeError, r"`fit`'s `data` is an `eqfit.ValidationSets` \(a\).*validation_data")),
    ("sets-as-evaluate-data", lambda t: eqfit.evaluate(CLF, eqfit.ValidationSets(a=(X, Y)), loss=CE),
     Raises(TypeError, r"`evaluate`'s `data` is an `eqfit.ValidationSets`.*one dataset")),
    ("sets-as-predict-x", lambda t: eqfit.predict(CLF, eqfit.ValidationSets(a=(X,))),
     Raises(TypeError, r"`predict`'s `x` is an `eqfit.ValidationSets`")),
    ("sets-list", lambda t: fit(validation_data=[(X, Y), (X, Y)]),
     Raises(TypeError, r"`validation_data`.*list")),
    ("sets-ragged", lambda t: fit(validation_data=eqfit.ValidationSets(a=(X, Y[:5]))),
     Raises(ValueError, r"`validation_data\['a'\]`")),
    ("sets-bad-label", lambda t: fit(validation_data=eqfit.ValidationSets(a=(X, Y), b=(X, Y + 5))),
     Raises(ValueError, r"label [5-7] .*outside \[0, 3\).*Found in the validation set 'b'")),
    ("one-set-bad-label", lambda t: fit(validation_data=(X, Y - 1)),
     Raises(ValueError, r"label -1 .*outside \[0, 3\).*Found in `validation_data`")),
    ("sets-values", lambda t: fit(validation_data=eqfit.ValidationSets(a=(X, Y), b=(X[:5], Y[:5])),
                                  optimizer=FIXED).history,
     Gives(lambda h: close(h["val_b_loss"][0], eqfit.evaluate(CLF, (X[:5], Y[:5]), loss=CE)["loss"]))),
    ("sets-monitor-plain", lambda t: fit(validation_data=eqfit.ValidationSets(a=(X, Y)),
                                         early_stopping=eqfit.EarlyStopping()),
     Raises(ValueError, r"'val_loss'.*val_a_loss")),
    # -- monitors of values that are arrays.
    ("monitor-cm", lambda t: fit(metrics={"cm": ConfusionMatrix(3)}, validation_data=(X, Y),
                                 early_stopping=eqfit.EarlyStopping(monitor="val_cm")),
     Raises(ValueError, r"'val_cm', a value that is an array each epoch.*monitor one entry")),
    ("keep-best-cm", lambda t: fit(metrics={"cm": ConfusionMatrix(3)}, validation_data=(X, Y),
                                   checkpoint=eqfit.Checkpoint(t / "ck", keep_best="val_cm")),
     Raises(ValueError, r"`keep_best` is 'val_cm', a value that is an array")),
    ("monitor-cm-entry", lambda t: fit(metrics={"cm": ConfusionMatrix(3)}, validation_data=(X, Y),
                                       early_stopping=eqfit.EarlyStopping(monitor="val_cm/0/0"),
                                       optimizer=FIXED, epochs=2).history,
     Gives(lambda h: h["val_cm"][0, 0, 0] == hand_confusion(predicted())[0, 0])),
    ("monitor-typo", lambda t: fit(validation_data=(X, Y), early_stopping=eqfit.EarlyStopping(monitor="val_los")),
     Raises(ValueError, r"'val_los', which this run does not compute")),
    # -- eqfit.Buckets: its arguments.
    ("buckets-lengths-int", lambda t: buckets(lengths=16),
     Raises(TypeError, r"`Buckets`'s `lengths` must be a sequence .*got 16")),
    ("buckets-lengths-none", lambda t: buckets(lengths=None),
     Raises(TypeError, r"`Buckets`'s `lengths` must be a sequence .*got None")),
    ("buckets-lengths-str", lambda t: buckets(lengths=("a", 16)),
     Raises(TypeError, r"`Buckets`'s `lengths` must be a sequence .*got \('a', 16\)")),
    ("buckets-lengths-text", lambda t: buckets(lengths="16"),
     Raises(TypeError, r"`Buckets`'s `lengths` must be a sequence .*got '16'")),
    ("buckets-lengths-empty", lambda t: buckets(lengths=()),
     Raises(TypeError, r"`Buckets`'s `lengths` must be a sequence .*got \(\)")),
    ("buckets-lengths-down", lambda t: buckets(lengths=(8, 4)),
     Raises(ValueError, r"`lengths` must be increasing .*got \(8, 4\)")),
    ("buckets-lengths-twice", lambda t: buckets(lengths=(4, 4, 8)),
     Raises(ValueError, r"`lengths` must be increasing")),
    ("buckets-lengths-0", lambda t: buckets(lengths=(0, 8)),
     Raises(ValueError, r"`lengths` must be increasing lengths of 1 or more")),
    ("buckets-too-short", lambda t: buckets(lengths=(4, 6)),
     Raises(ValueError, r"sample 1 has length 7, longer than the longest bucket, 6")),
    ("buckets-lengths-array", lambda t: buckets(lengths=np.array([4, 8])).bucket_lengths,
     Gives(lambda b: b == (4, 8))),
    ("buckets-batch-0", lambda t: buckets(batch_size=0),
     Raises(ValueError, r"`batch_size` must be a whole number of samples, 1 or more; got 0")),
    ("buckets-batch-float", lambda t: buckets(batch_size=2.0),
     Raises(ValueError, r"`batch_size` must be a whole number of samples.*got 2\.0")),
    ("buckets-batch-str", lambda t: buckets(batch_size="2"),
     Raises(ValueError, r"`batch_size` must be a whole number.*got '2'")),
    ("buckets-batch-bool", lambda t: buckets(batch_size=True),
     Raises(ValueError, r"`batch_size` must be a whole number.*got True")),
    ("buckets-batch-np", lambda t: len(buckets(batch_size=np.int64(3))),
     Gives(lambda n: n == 2 + 2)),  # 4 samples in each bucket: 2 batches of 3 or fewer each
    ("buckets-key-int", lambda t: buckets(key=0),
     Raises(TypeError, r"`Buckets`'s `key` must be a single PRNG key.*got an int")),
    ("buckets-key-none", lambda t: buckets(key=None),
     Raises(ValueError, r"`Buckets` shuffles with `key=`")),
    ("buckets-key-raw", lambda t: len(list(buckets(key=jax.random.PRNGKey(0)))),
     Gives(lambda n: n == 4)),
    ("buckets-key-shape", lambda t: buckets(key=jnp.zeros(3, jnp.uint32)),
     Raises(TypeError, r"`Buckets`'s `key` must be a single PRNG key")),
    ("buckets-no-shuffle", lambda t: [b[0].shape for b in buckets(key=None, shuffle=False)],
     Gives(lambda s: s == [(2, 4), (2, 4), (2, 8), (2, 8)])),
    ("buckets-data-empty", lambda t: buckets(data=()),
     Raises(TypeError, r"`data` must be a tuple of one or more fields .*got an empty tuple")),
    ("buckets-data-list", lambda t: buckets(data=[SEQS, LABELS]),
     Raises(TypeError, r"`data` must be a tuple .*got a list")),
    ("buckets-data-array", lambda t: buckets(data=X),
     Raises(TypeError, r"`data` must be a tuple .*got a ndarray")),
    ("buckets-no-sequences", lambda t: buckets(data=(X, Y)),
     Raises(ValueError, r"no field of sequences")),
    ("buckets-counts", lambda t: buckets(data=(SEQS, LABELS[:5])),
     Raises(ValueError, r"fields hold \[5, 8\] samples")),
    ("buckets-scalar-sample", lambda t: buckets(data=([1.0, 2.0], LABELS[:2])),
     Raises(ValueError, r"field 0 holds a scalar")),
    ("buckets-scalar-field", lambda t: buckets(data=(SEQS, 3)),
     Raises(ValueError, r"field 1 is a scalar")),
    ("buckets-3-features", lambda t: buckets(data=([*SEQS[:7], np.ones((3, 3), np.float32)], LABELS)),
     Raises(ValueError, r"field 0: sample 7 has shape \(3, 3\), sample 0 \(3,\).*shape \(\)")),
    ("buckets-mixed-dtypes", lambda t: buckets(data=([*SEQS[:7], SEQS[7].astype(np.float64)], LABELS)),
     Raises(TypeError, r"field 0: sample 7 is float64, sample 0 float32")),
    ("buckets-field-lengths", lambda t: buckets(data=(SEQS, [s[:1] for s in SEQS])),
     Raises(ValueError, r"sample 0 has sequences of lengths 3 and 1 in two fields")),
    ("buckets-pad-nan", lambda t: buckets(pad=float("nan")),
     Raises(ValueError, r"`pad` must be a finite number.*got nan")),
    ("buckets-pad-inf", lambda t: buckets(pad=-np.inf),
     Raises(ValueError, r"`pad` must be a finite number.*got -inf")),
    ("buckets-pad-str", lambda t: buckets(pad="0"),
     Raises(ValueError, r"`pad` must be a finite number.*got '0'")),
    ("buckets-pad-none", lambda t: buckets(pad=None),
     Raises(ValueError, r"`pad` must be a finite number.*got None")),
    ("buckets-pad-value", lambda t: next(iter(buckets(pad=-1, shuffle=False, key=None))),
     Gives(lambda b: b[0][1, 3] == -1 and b[2][1].tolist() == [1, 1, 0, 0] and close(b[0][1, :2], SEQS[3]))),
    ("buckets-mask", lambda t: sum(float(b[-1].sum()) for b in buckets()),
     Gives(lambda total: total == sum(len(s) for s in SEQS))),
    ("buckets-len", lambda t: len(buckets()),
     Gives(lambda n: n == 2 + 2)),  # 4 samples of length <= 4, 4 longer: 2 batches each
    ("buckets-shapes", lambda t: buckets().shapes(),
     Gives(lambda s: s == [((4,), (), (4,)), ((8,), (), (8,))])),
    ("buckets-same-key", lambda t: [b[1].tolist() for b in buckets()] == [b[1].tolist() for b in buckets()],
     Gives(lambda same: same)),
    ("buckets-set-epoch", lambda t: _epochs_differ(),
     Gives(lambda differ: differ)),
    ("buckets-fit-batch-size", lambda t: fit(_Mean(), buckets(), loss=_masked, batch_size=16),
     Raises(ValueError, r"`batch_size`=16, but the loader yields batches of 2")),
    ("buckets-fit-mean", lambda t: eqfit.evaluate(_Mean(), buckets(), loss=_masked)["loss"],
     Gives(lambda v: close(v, np.mean(np.concatenate(SEQS))))),
    # -- inference on loaders, generators and memmaps.
    ("evaluate-loader", lambda t: eqfit.evaluate(CLF, Batches((X, Y)), loss=CE)["loss"],
     Gives(lambda v: close(v, eqfit.evaluate(CLF, (X, Y), loss=CE)["loss"]))),
    ("evaluate-generator", lambda t: eqfit.evaluate(CLF, generator((X, Y)), loss=CE)["loss"],
     Gives(lambda v: close(v, eqfit.evaluate(CLF, (X, Y), loss=CE)["loss"]))),
    ("evaluate-memmaps", lambda t: eqfit.evaluate(CLF, memmaps(t, X, Y), loss=CE, batch_size=5)["loss"],
     Gives(lambda v: close(v, eqfit.evaluate(CLF, (X, Y), loss=CE)["loss"]))),
    ("evaluate-list-of-batches", lambda t: eqfit.evaluate(CLF, list(generator((X, Y), 5)), loss=CE)["loss"],
     Gives(lambda v: close(v, eqfit.evaluate(CLF, (X, Y), loss=CE)["loss"]))),
    ("evaluate-empty-loader", lambda t: eqfit.evaluate(CLF, [], loss=CE),
     Raises(ValueError, r"empty|no batch")),
    ("evaluate-batch-0", lambda t: eqfit.evaluate(CLF, (X, Y), loss=CE, batch_size=0),
     Raises(ValueError, r"`batch_size` must be at least 1, got 0")),
    ("evaluate-ragged", lambda t: eqfit.evaluate(CLF, (X, Y[:7]), loss=CE),
     Raises(ValueError, r"`data.*` must share their leading \(sample\) axis")),
    ("evaluate-list-data", lambda t: eqfit.evaluate(CLF, [X, Y], loss=CE),
     Raises(TypeError, r"`data` must be a tuple of arrays .*got a list")),
    ("evaluate-bad-label", lambda t: eqfit.evaluate(CLF, (X, Y + 3), loss=CE),
     Raises(ValueError, r"`softmax_cross_entropy`: label [3-5] .*outside \[0, 3\)")),
    ("evaluate-changing-dtype", lambda t: eqfit.evaluate(CLF, [(X[:4], Y[:4]), (X[4:8], Y[4:8] * 1.0)], loss=CE),
     Raises(ValueError, r"batch \d has samples of shapes and dtypes .*float64.*first batch had .*int32")),
    ("predict-1d", lambda t: eqfit.predict(eqx.nn.MLP(2, 1, 4, 1, key=KEY), X[:, 0]),
     Raises(ValueError, r"`x` has shape \(12,\), so each example is a scalar.*x\[:, None\]")),
    ("predict-dict", lambda t: eqfit.predict(eqx.nn.MLP(2, 1, 4, 1, key=KEY), {"x": X}),
     Raises(ValueError, r"`x` is a dict, so each example is \{'x': 'float32\[2\]'\}")),
    ("predict-1d-scalar-model", lambda t: eqfit.predict(eqx.nn.Linear("scalar", 1, key=KEY), X[:, 0]).shape,
     Gives(lambda s: s == (N, 1))),
    ("predict-memmap", lambda t: eqfit.predict(CLF, memmaps(t, X)[0], batch_size=5),
     Gives(lambda p: close(p, jax.vmap(CLF)(X)))),
    ("predict-generator", lambda t: eqfit.predict(CLF, generator((X, Y), 5)),
     Gives(lambda p: close(p, jax.vmap(CLF)(X)))),
    ("predict-loader-of-x", lambda t: eqfit.predict(CLF, Batches((X,), 5)),
     Gives(lambda p: close(p, jax.vmap(CLF)(X)))),
    ("predict-batch-neg", lambda t: eqfit.predict(CLF, X, batch_size=-1),
     Raises(ValueError, r"`batch_size` must be at least 1, got -1")),
    ("predict-int-x", lambda t: eqfit.predict(CLF, np.arange(N * 2, dtype=np.int32).reshape(N, 2)),
     Gives(lambda p: close(p, jax.vmap(CLF)(jnp.arange(N * 2.0).reshape(N, 2)), 1e-4))),
    # -- eqfit's metrics with state: their arguments.
    ("f1-float-classes", lambda t: F1(4.0, average="macro"),
     Raises(ValueError, r"`F1`'s `classes` must be the number of classes.*got 4\.0")),
    ("f1-str-classes", lambda t: F1("4", average="macro"),
     Raises(ValueError, r"`F1`'s `classes` must be .*got '4'")),
    ("f1-one-class", lambda t: F1(1, average="macro"),
     Raises(ValueError, r"`F1`'s `classes` must be .* 2 or more; got 1")),
    ("f1-bool-classes", lambda t: F1(True),
     Raises(ValueError, r"`F1`'s `classes` must be .*got True")),
    ("f1-binary-of-3", lambda t: F1(3),
     Raises(ValueError, r"`average='binary'` scores class 1 of two, but `classes` is 3")),
    ("f1-weighted", lambda t: F1(3, average="weighted"),
     Raises(ValueError, r"`average` must be 'binary', 'macro', 'micro' or None, got 'weighted'")),
    ("precision-np-classes", lambda t: Precision(np.int64(3), average="macro").classes,
     Gives(lambda c: c == 3 and type(c) is int)),
    ("cm-float-classes", lambda t: ConfusionMatrix(4.0),
     Raises(ValueError, r"`ConfusionMatrix`'s `classes` must be .*got 4\.0")),
    ("cm-zero-classes", lambda t: ConfusionMatrix(0),
     Raises(ValueError, r"`ConfusionMatrix`'s `classes` must be .*got 0")),
    ("cm-normalize-rows", lambda t: ConfusionMatrix(3, normalize="rows"),
     Raises(ValueError, r"`normalize` must be 'true' \(each row\).*got 'rows'")),
    ("cm-normalize-bool", lambda t: ConfusionMatrix(3, normalize=True),
     Raises(ValueError, r"`normalize` must be .*got True")),
    ("metrax-instance", lambda t: Metrax(metrax.MSE),
     Gives(lambda m: m.metric is metrax.MSE)),
    ("metrax-not-a-class", lambda t: Metrax("MSE"),
     Raises(TypeError, r"`Metrax` takes a metrax metric class.*got 'MSE'")),
    # -- metrics with state, computed (a fixed model: against a hand computation).
    ("cm-value", lambda t: evaluate({"cm": ConfusionMatrix(3)})["cm"],
     Gives(lambda cm: close(cm, hand_confusion(predicted())))),
    ("cm-normalize-true", lambda t: evaluate({"cm": ConfusionMatrix(3, normalize="true")})["cm"],
     Gives(lambda cm: close(cm, _rows_normalized(hand_confusion(predicted()))))),
    ("cm-loader", lambda t: evaluate({"cm": ConfusionMatrix(3)}, data=Batches((X, Y), 5))["cm"],
     Gives(lambda cm: close(cm, hand_confusion(predicted())))),
    ("f1-macro-value", lambda t: evaluate({"f1": F1(3, average="macro")})["f1"],
     Gives(lambda v: close(v, _macro_f1(hand_confusion(predicted()))))),
    ("f1-micro-value", lambda t: evaluate({"f1": F1(3, average="micro")})["f1"],
     Gives(lambda v: close(v, np.mean(predicted() == Y)))),
    ("topk-value", lambda t: evaluate({"top2": TopKAccuracy(2)})["top2"],
     Gives(lambda v: close(v, top2()))),
    ("topk-more-than-classes", lambda t: evaluate({"top": TopKAccuracy(9)}),
     Raises(ValueError, r"`TopKAccuracy`'s `k` is 9, but the model gives 3 logits .*at most 3")),
    ("topk-equal-classes", lambda t: evaluate({"top": TopKAccuracy(3)})["top"],
     Gives(lambda v: v == 1.0)),
    ("cm-wrong-classes", lambda t: evaluate({"cm": ConfusionMatrix(4)}),
     Raises(ValueError, r"the model gives 3 logits per example .*but `classes` is 4")),
    ("cm-bad-label", lambda t: evaluate({"cm": ConfusionMatrix(3)}, data=(X, Y * 2), loss=_zero),
     Raises(ValueError, r"`ConfusionMatrix`: label 4 .*outside \[0, 3\)")),
    ("per-row-statistics", lambda t: evaluate({"pr": PerRow()}, model=REG, data=(X, YR), loss=MSE),
     Raises(ValueError, r"metric 'pr': its statistics `statistics\['err'\]` have shape \(4,\) .*\(3,\)")),
    ("text-statistics", lambda t: evaluate({"s": Text()}, data=(X, Y), loss=CE),
     Raises(TypeError, r"metric 's': its statistics hold a numpy <U1\[2\] at `statistics\['name'\]`")),
    ("numpy-statistics", lambda t: evaluate({"s": NumpyCount()}, data=(X, Y), loss=CE),
     Raises(TypeError, r"metric 's': .*numpy float32\[\] at `statistics\['count'\]`.*jnp.asarray")),
    # -- metrax's metrics.
    ("metrax-mse", lambda t: evaluate({"m": metrax.MSE}, model=REG, data=(X, YR), loss=MSE)["m"],
     Gives(lambda v: close(v, mse_of()))),
    ("metrax-mapping-tuple", lambda t: evaluate({"m": Metrax(metrax.MSE, lambda o, y: (o, y))}, model=REG,
                                               data=(X, YR), loss=MSE),
     Raises(TypeError, r"`Metrax\(MSE\)`'s `inputs` must return .* as a dict .*got a tuple")),
    ("metrax-mapping-one-arg", lambda t: evaluate({"m": Metrax(metrax.MSE, lambda o: {"predictions": o})},
                                                 model=REG, data=(X, YR), loss=MSE),
     Raises(TypeError, r"`Metrax\(MSE\)`'s `inputs` is called `inputs\(outputs, y\)`.*takes \(o\)")),
    ("metrax-mapping-n1", lambda t: evaluate({"m": Metrax(metrax.AUCROC, lambda o, y: {"predictions": o[:, :1],
                                                                                        "labels": y})}),
     Raises(ValueError, r"`Metrax\(AUCROC\)`: its `predictions` have shape \(4, 1\) and its "
                        r"`labels` \(4,\)")),
    ("metrax-precision-multiclass", lambda t: evaluate({"p": metrax.Precision}),
     Raises(ValueError, r"`Metrax\(Precision\)`.*predictions=float32\[4, 3\], labels=int32\[4\].*"
                        r"eqfit.metrics.Precision\(classes")),
    ("metrax-fbeta", lambda t: evaluate({"f": Metrax(metrax.FBetaScore, lambda o, y: {
        "predictions": jax.nn.sigmoid(o[:, 0]), "labels": (y > 0).astype(jnp.float32)})}),
     Raises(ValueError, r"metric 'f': FBetaScore has no `merge`.*eqfit's `F1`")),
    ("metrax-unknown-option", lambda t: evaluate({"m": Metrax(metrax.MSE, bogus=1)}, model=REG, data=(X, YR),
                                                loss=MSE),
     Raises(TypeError, r"`Metrax\(MSE\)`: `MSE.from_model_output\(.*failed: .*bogus")),
    # -- the NaN found by replay.
    ("nan-in-gradient-only", lambda t: fit(_Mean(), (X, YR), loss=_sqrt_loss, on_nan="raise"),
     Raises(eqfit.NonFiniteLossError, r"not finite before the step: \.w.*`norms=True`")),
    ("nan-gradient-norms", lambda t: fit(_Mean(), (X, YR), loss=_sqrt_loss, on_nan="raise", norms=True),
     Raises(eqfit.NonFiniteLossError, r"at epoch 1, step 1 of 3")),
    ("nan-rows", lambda t: fit(_Mean(), (X, np.where(np.arange(N) == 6, np.nan, YR).astype(np.float32)),
                               loss=_row_loss, on_nan="raise", shuffle=False),
     Raises(eqfit.NonFiniteLossError, r"step 2 of 3.*rows whose loss is not finite: 6\b")),
    ("nan-stop", lambda t: fit(_Mean(), (X, np.full(N, np.nan, np.float32)), loss=_row_loss,
                               on_nan="stop").history.stop_reason,
     Gives(lambda r: r == "non_finite_loss")),
]
# fmt: on


class _Mean(eqx.Module):
    """One trained number."""

    w: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(()))


def _masked(model, tokens, labels, mask):
    return eqfit.Mean.of(tokens + 0 * model.w, mask)


def _sqrt_loss(model, x, y):
    # Finite, but its gradient at 0 is not: sqrt's derivative there is infinite.
    return jnp.mean(jnp.sqrt(jnp.abs(model.w) * x[:, 0] ** 2 * 0.0) + 0 * y)


def _row_loss(model, x, y):
    return jnp.mean((model.w - y) ** 2)


def _zero(model, x, y):
    return jnp.zeros(())


def _rows_normalized(counts):
    total = counts.sum(1, keepdims=True)
    return np.where(total == 0, 0.0, counts / np.where(total == 0, 1, total))


def _macro_f1(counts):
    tp = np.diag(counts)
    denominator = counts.sum(0) + counts.sum(1)
    safe = np.where(denominator == 0, 1, denominator)
    return float(np.mean(np.where(denominator == 0, 0.0, 2 * tp / safe)))


def _epochs_differ():
    loader = buckets()
    first = [b[1].tolist() for b in loader]
    loader.set_epoch(1)
    return first != [b[1].tolist() for b in loader]


# Constructors whose annotations the suite's jaxtyping hook (pyproject's
# `--jaxtyping-packages`) checks before their own checks run: a user, without the hook,
# meets their own checks, which these cases try, with jaxtyping's runtime checks off.
AS_A_USER = ("buckets-", "f1-", "cm-normalize", "cm-float", "cm-zero", "metrax-not")


@contextlib.contextmanager
def without_the_hook(name):
    if not name.startswith(AS_A_USER):
        yield
        return
    was = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", was)


@pytest.mark.slow
@pytest.mark.parametrize("name, call, answer", CASES, ids=[c[0] for c in CASES])
def test_survey(name, call, answer, tmp_path):
    with without_the_hook(name):
        if isinstance(answer, Raises):
            with pytest.raises(answer.kind, match=re.compile(answer.words, re.DOTALL)):
                call(tmp_path)
        else:
            assert answer.check(call(tmp_path)), name


def test_the_survey_holds_a_hundred_inputs():
    assert len({c[0] for c in CASES}) == len(CASES) >= 100
