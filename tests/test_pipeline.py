"""The host pipeline's promises: every early end finishes, whatever the source; errors are
values that threads do not share; the bar shows the epoch it names; loaders are iterated
once per pass, told the pass first; and the argument checks come before any data is read.
"""

import concurrent.futures
import itertools
import re
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqfit


N, FEATURES, BATCH = 64, 3, 8
# A run that does not finish in this long has hung (each finishes in well under it).
TIMEOUT = 60.0


def _arrays(seed=0, classes=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = (np.arange(N) % classes).astype(np.int32)
    return x, y


def _model():
    return eqx.nn.Linear(FEATURES, 3, key=jax.random.key(0))


def _endless(x, y):
    for i in itertools.count():
        j = (i * BATCH) % N
        yield x[j : j + BATCH], y[j : j + BATCH]


class _Finite:
    """A re-iterable loader with `len`, as a PyTorch `DataLoader` is."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.iterations, self.epochs_told = 0, []

    def __len__(self):
        return N // BATCH

    def set_epoch(self, epoch):
        self.epochs_told.append((epoch, self.iterations))

    def __iter__(self):
        self.iterations += 1
        for j in range(0, N, BATCH):
            yield self.x[j : j + BATCH], self.y[j : j + BATCH]


def _source(kind, x, y, tmp_path):
    if kind == "endless":
        return _endless(x, y)
    if kind == "loader":
        return _Finite(x, y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return (np.load(tmp_path / "x.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r"))


def _in_thread(fn):
    """Runs `fn` in a thread; its result or error, or a failure if it does not end."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(fn)
        try:
            return future.result(timeout=TIMEOUT)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"fit did not finish within {TIMEOUT} s: it hangs")


def _fit(data, **kw):
    settings = dict(
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.sgd(0.1),
        key=jax.random.key(0),
        epochs=50,
        steps_per_epoch=N // BATCH,
    )
    return eqfit.fit(_model(), data, **{**settings, **kw})


class _StopAt:
    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs):
        return epoch >= self.epoch


KINDS = ["endless", "loader", "memmap"]


# One source and path in the quick suite; every other pair with the heavy tests.
EARLY_ENDS = [
    pytest.param(
        kind, progress, marks=[] if (kind, progress) == ("endless", False) else [pytest.mark.heavy]
    )
    for kind in KINDS
    for progress in (False, True)
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, progress", EARLY_ENDS)
def test_early_ends_finish(kind, progress, tmp_path):
    x, y = _arrays()

    def run(x=x, y=y, **kw):
        return _in_thread(lambda: _fit(_source(kind, x, y, tmp_path), progress=progress, **kw))

    bad = y.copy()
    bad[0] = 3  # out of range for 3 classes, in the first batch

    with pytest.raises(ValueError, match=r"label 3 .* outside \[0, 3\)") as e:
        run(y=bad, on_nan="raise")
    assert e.value.result.history.stop_reason == "non_finite_loss"  # pyright: ignore
    with pytest.raises(ValueError, match=r"label 3") as e:
        run(y=bad, on_nan="stop")

    nan_x = x.copy()
    nan_x[:] = np.nan
    with pytest.raises(eqfit.NonFiniteLossError):
        run(x=nan_x, on_nan="raise")
    stopped = run(x=nan_x, on_nan="stop")
    assert stopped.history.stop_reason == "non_finite_loss"

    by_callback = run(callbacks=[_StopAt(2)])
    assert by_callback.history.stop_reason == "callback"
    assert by_callback.history.epochs == 2

    early = run(
        early_stopping=eqfit.EarlyStopping(monitor="loss", min_delta=100.0, restore_best=False)
    )
    assert early.history.stop_reason == "early_stopping"
    assert early.history.epochs == 2


@pytest.mark.parametrize("kind", ["endless", "loader"])
def test_a_loader_that_raises_finishes(kind, tmp_path):
    x, y = _arrays()

    class Broken(Exception):
        pass

    def failing():
        for i, batch in enumerate(_endless(x, y)):
            if i == 20:
                raise Broken("the loader broke")
            yield batch

    class FailingLoader(_Finite):
        def __iter__(self):
            for i, batch in enumerate(super().__iter__()):
                if self.iterations == 3 and i == 2:
                    raise Broken("the loader broke")
                yield batch

    data = failing() if kind == "endless" else FailingLoader(x, y)
    with pytest.raises(Broken):
        _in_thread(lambda: _fit(data))


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_error_finishes(kind, tmp_path):
    x, y = _arrays()
    directory = tmp_path / "a-file"
    directory.write_text("not a directory")  # refused before training
    with pytest.raises(eqfit.CheckpointError):
        _in_thread(lambda: _fit(_source(kind, x, y, tmp_path), checkpoint=directory))


@pytest.mark.slow
def test_threads_do_not_share_label_errors():
    x, y = _arrays()
    bad = y.copy()
    bad[5] = 7
    kw = dict(
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.sgd(0.1),
        key=jax.random.key(0),
        epochs=5,  # test_the_bar_shows_the_epoch_it_names's program
        batch_size=BATCH,
    )
    results = {}

    def clean(i):
        results[("clean", i)] = eqfit.fit(_model(), (x, y), **kw)

    def dirty(i):
        try:
            eqfit.fit(_model(), (x, bad), **kw)
        except ValueError as e:
            results[("bad", i)] = e

    for i in range(20):
        threads = [
            threading.Thread(target=dirty, args=(i,)),
            threading.Thread(target=clean, args=(i,)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert isinstance(results[("clean", i)], eqfit.FitResult)
        assert "label 7" in str(results[("bad", i)])


def test_bad_labels_in_validation_are_reported():
    x, y = _arrays()
    bad = y.copy()
    bad[3] = -1
    # The validation rows and epochs of test_the_bar_shows_the_epoch_it_names: its program.
    with pytest.raises(ValueError, match=r"label -1 \(at \(3,\) of a batch\)") as e:
        _fit(
            (x, y),
            epochs=5,
            steps_per_epoch=None,
            batch_size=BATCH,
            validation_data=(x[:16], bad[:16]),
        )
    assert e.value.result.history.epochs == 5  # pyright: ignore  (training went on)


def test_a_label_error_outside_eqfit_raises_at_run_time():
    x, y = _arrays()
    y = y.copy()
    y[1] = 9
    loss = jax.jit(eqfit.losses.softmax_cross_entropy)
    with pytest.raises(Exception, match=r"softmax_cross_entropy.*outside \[0, 3\)"):
        jax.block_until_ready(loss(_model(), jnp.asarray(x), jnp.asarray(y)))


@pytest.mark.parametrize("validation", [False, True])
def test_the_bar_shows_the_epoch_it_names(capsys, validation):
    x, y = _arrays()
    kw = dict(validation_data=(x[:16], y[:16])) if validation else {}
    result = _fit((x, y), epochs=5, steps_per_epoch=None, batch_size=BATCH, progress="bar", **kw)
    err = capsys.readouterr().err
    last = err.strip().split("\r")[-1]
    assert "epoch 5/5" in last
    shown = re.findall(r"loss=([-0-9.e+na]+)", last)[0]
    assert shown == f"{result.history.loss[-1]:.4g}"
    # The epoch's line above the bar: its values, the history's.
    (line,) = [line for line in err.splitlines() if line.startswith("epoch 5/5: loss=")]
    assert f"loss={result.history.loss[-1]:.4g}" in line
    if validation:
        val = re.findall(r"val_loss=([-0-9.e+na]+)", line)[0]
        assert val == f"{result.history.val_loss[-1]:.4g}"  # pyright: ignore


def test_a_loader_is_iterated_once_per_pass_and_told_first():
    x, y = _arrays()
    loader = _Finite(x, y)
    result = eqfit.fit(
        _model(),
        loader,
        loss=eqfit.losses.softmax_cross_entropy,
        optimizer=optax.sgd(0.1),
        key=jax.random.key(0),
        epochs=3,
    )
    assert result.history.epochs == 3
    assert loader.iterations == 3
    # `set_epoch(k)` came before the k-th iteration, the first included.
    assert loader.epochs_told == [(0, 0), (1, 1), (2, 2)]


def test_checks_come_before_the_data_is_read():
    x, y = _arrays()
    taken = []

    def batches():
        for batch in _endless(x, y):
            taken.append(1)
            yield batch

    data = batches()
    with pytest.raises(ValueError, match="early_stopping.monitor"):
        _fit(data, early_stopping=eqfit.EarlyStopping(monitor="val_accuracy"))
    with pytest.raises(ValueError, match="devices"):
        _fit(data, devices=10_000)
    with pytest.raises(ValueError, match="batch_size"):
        _fit(data, batch_size=2**40)
    assert not taken
    result = _fit(data, epochs=1)  # the generator lost nothing
    assert result.history.epochs == 1 and len(taken) == N // BATCH


def test_an_endless_len_names_steps_per_epoch():
    x, y = _arrays()

    class Repeating(_Finite):
        def __len__(self):
            return 2**59

    with pytest.raises(ValueError, match="steps_per_epoch"):
        _fit(Repeating(x, y), steps_per_epoch=None)
