"""Runs that end early, for test_early_ends.py, each in a process of its own.

Usage: python early_end_worker.py (raising-loader | raising-len-loader | slow | plan)
           [progress]
       python early_end_worker.py interrupted (memory | stream) EPOCHS STEPS [progress]
           [host-callback]
       python early_end_worker.py log DIRECTORY STEPS

- `raising-loader`: a generator that raises after 25 batches. Prints "raised <type>
  after <epochs> epochs, <steps> steps" and exits 0 when `fit` raises the loader's error
  with the training so far. `raising-len-loader`: the same from a loader with `len` (a
  re-iterable, as PyTorch's `DataLoader`) whose second pass raises after 5 of its 8.
- `interrupted`: a tiny MLP trained on arrays in memory or a loader with `len` (streamed),
  EPOCHS epochs of STEPS steps, until Ctrl-C (with `progress`, the bar). With
  `host-callback` its loss prints every step (`jax.debug.print`, to stdout).
  `eqfit.plan` compiles the run first; stderr then gets "fitting" as `fit` begins and,
  stamped with `@<time.monotonic()>` where the bar wrote, every write of the bar. Prints
  "raised <type> <stop_reason> steps=<steps trained> count=<Adam's step count>
  changed=<bool>" when `fit` raises: the history's steps, the optimizer state's and the
  model's changes must agree.
- `log`: the tiny MLP of `interrupted`, 3 epochs of STEPS steps with `progress=True` and
  checkpoints in DIRECTORY, until a signal. `eqfit.plan` compiles the run first; stdout
  then gets "fitting", and "raised <type> <signal> steps=<steps trained>" when `fit`
  raises.
- `plan`: `eqfit.plan` of a deep MLP (seconds of compilation); prints "planning" first,
  "deferred" once `plan` handles the signals (it traces and compiles from there),
  "compiling" once the run's program is lowered (XLA compiles it for seconds from there),
  then "planned", or "plan raised <type>: <message> @<time.monotonic()>" for a Ctrl-C or
  signal it met.
- `slow`: an MLP 512-2048x4-512 at batch 256, a real model whose steps take about a
  second here (no host callback), trained with the bar (`progress="bar"`). Every write
  to stderr is stamped `@<time.monotonic()>`; it prints "@<time> raised <type> <steps>
  steps" when `fit` raises.
"""

import signal
import sys
import threading
import time

import jax
import numpy as np
import optax

import eqfit


def raising_loader(progress: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x.sum(axis=1)

    def batches():
        for i in range(25):
            yield x[(i % 4) * 16 : (i % 4 + 1) * 16], y[(i % 4) * 16 : (i % 4 + 1) * 16]
        raise RuntimeError("the loader broke")

    model = eqfit.models.LinearRegression(4, key=jax.random.key(0))
    try:
        eqfit.fit(
            model,
            batches(),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.01),
            key=jax.random.key(1),
            epochs=10,
            steps_per_epoch=4,
            progress=progress,
        )
    except RuntimeError as e:
        history = e.result.history  # type: ignore[attr-defined]
        steps = int((history.batch_sizes > 0).sum())
        print(f"raised {type(e).__name__} after {history.epochs} epochs, {steps} steps")


def raising_len_loader(progress: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x.sum(axis=1)

    class Batches:
        """Eight batches a pass; the second pass raises after five."""

        def __init__(self):
            self.passes = 0

        def __len__(self) -> int:
            return 8

        def __iter__(self):
            self.passes += 1
            for i in range(8):
                if self.passes == 2 and i == 5:
                    raise RuntimeError("the loader broke")
                yield x[(i % 4) * 16 : (i % 4 + 1) * 16], y[(i % 4) * 16 : (i % 4 + 1) * 16]

    model = eqfit.models.LinearRegression(4, key=jax.random.key(0))
    try:
        eqfit.fit(
            model,
            Batches(),
            loss=eqfit.losses.mse,
            optimizer=optax.sgd(0.01),
            key=jax.random.key(1),
            epochs=10,
            progress=progress,
        )
    except RuntimeError as e:
        history = e.result.history  # type: ignore[attr-defined]
        steps = int((history.batch_sizes > 0).sum())
        print(f"raised {type(e).__name__} after {history.epochs} epochs, {steps} steps")


def interrupted(data: str, epochs: int, steps: int, progress: bool, host_callback: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)

    class Batches:
        """A loader with `len`: sixteen batches of 32 a pass."""

        def __len__(self) -> int:
            return 16

        def __iter__(self):
            for i in range(16):
                yield x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32]

    def loss(model, x, y, *, key=None):
        value = eqfit.losses.mse(model, x, y, key=key)
        if host_callback:  # a host callback in every step, as users debug with
            jax.debug.print("step loss {}", value)
        return value

    model = eqfit.models.MLP(8, 1, 32, 2, key=jax.random.key(0))
    arguments = dict(
        loss=loss,
        optimizer=optax.adam(1e-3),
        key=jax.random.key(1),
        epochs=epochs,
        steps_per_epoch=steps,
        batch_size=32,
        progress="bar" if progress else False,  # stderr is a pipe: the bar, as asked
    )
    # The run's programs are compiled first: `fit` then compiles nothing, and a Ctrl-C
    # sent soon after it begins lands in training, not in XLA's compiler.
    eqfit.plan(model, (x, y) if data == "memory" else Batches(), **arguments)
    stderr = sys.stderr
    print("fitting", file=stderr, flush=True)
    if progress:
        sys.stderr = Stamped(stderr)
    try:
        eqfit.fit(model, (x, y) if data == "memory" else Batches(), **arguments)
    except KeyboardInterrupt as e:
        # As a script that handles it would: a second Ctrl-C that comes once `fit` has
        # answered the first (within a call) finds the run over, and is let be.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stderr = stderr
        result = e.result  # type: ignore[attr-defined]
        trained = int((result.history.batch_sizes > 0).sum())
        count = int(result.opt_state[0].count)  # Adam's: the steps its state has seen
        changed = not np.array_equal(result.model.layers[0].weight, model.layers[0].weight)
        reason = result.history.stop_reason
        print(
            f"raised {type(e).__name__} {reason} steps={trained} count={count} changed={changed}",
            file=stderr,
            flush=True,
        )


def logged(directory: str, steps: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    model = eqfit.models.MLP(8, 1, 32, 2, key=jax.random.key(0))
    data = (x, x.sum(axis=1, keepdims=True))
    arguments = dict(
        loss=eqfit.losses.mse,
        optimizer=optax.adam(1e-3),
        key=jax.random.key(1),
        epochs=3,
        steps_per_epoch=steps,
        batch_size=32,
        checkpoint=directory,
        progress=True,
    )
    eqfit.plan(model, data, **arguments)  # `fit` then trains from its start
    print("fitting", flush=True)
    try:
        eqfit.fit(model, data, **arguments)
    except eqfit.TrainingInterrupted as e:
        trained = int((e.result.history.batch_sizes > 0).sum())
        print(f"raised {type(e).__name__} {e.signal} steps={trained}", flush=True)


class Stamped:
    """stderr, each write preceded by the time it was made."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if text:
            self.stream.write(f"\n@{time.monotonic():.3f} {text!r}\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def slow() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 * 40, 512)).astype(np.float32)
    y = rng.normal(size=(256 * 40, 512)).astype(np.float32)
    model = eqfit.models.MLP(512, 512, 2048, 4, key=jax.random.key(0))
    stderr = sys.stderr
    sys.stderr = Stamped(stderr)
    try:
        eqfit.fit(
            model,
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-3),
            key=jax.random.key(1),
            epochs=3,
            batch_size=256,
            progress="bar",  # stderr is a pipe: the bar, as asked
        )
    except KeyboardInterrupt as e:
        result = getattr(e, "result", None)
        steps = -1 if result is None else int((result.history.batch_sizes > 0).sum())
        print(f"@{time.monotonic():.3f} raised {type(e).__name__} {steps} steps", file=stderr)


def planned() -> None:
    """`eqfit.plan` of a run whose programs take seconds to compile; a signal meets it
    while XLA compiles.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 64)).astype(np.float32)
    model = eqfit.models.MLP(64, 64, 256, 32, key=jax.random.key(0))

    def watch() -> None:  # says when `plan` has taken the signals over: it compiles then
        while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            time.sleep(0.005)
        print("deferred", flush=True)

    def lowered(event: str, duration: float, **fields: object) -> None:
        if event.endswith("jaxpr_to_mlir_module_duration") and fields.get("fun_name") == "jit(run)":
            print("compiling", flush=True)

    print("planning", flush=True)
    threading.Thread(target=watch, daemon=True).start()
    jax.monitoring.register_event_duration_secs_listener(lowered)
    try:
        eqfit.plan(
            model,
            (x, x),
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-3),
            key=jax.random.key(1),
            precision="bfloat16",
            norms=True,
            ema=0.9,  # 16 steps: 0.99 would be warned of
        )
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run is over: as in `interrupted`
        print(f"plan raised {type(e).__name__}: {e} @{time.monotonic():.3f}", flush=True)
        return
    print("planned", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "raising-loader":
        raising_loader(progress="progress" in sys.argv[2:])
    elif sys.argv[1] == "raising-len-loader":
        raising_len_loader(progress="progress" in sys.argv[2:])
    elif sys.argv[1] == "interrupted":
        data, epochs, steps, *flags = sys.argv[2:]
        interrupted(data, int(epochs), int(steps), "progress" in flags, "host-callback" in flags)
    elif sys.argv[1] == "log":
        logged(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "plan":
        planned()
    else:
        slow()
