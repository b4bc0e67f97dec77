"""How soon Ctrl-C is answered with a loss that calls the host every step, and without.

On a CPU, XLA runs a program that calls the host (`jax.debug.print`, `jax.debug.callback`)
in the thread that calls it, so each call of the run returns done. A child process trains a
small MLP on arrays in memory with the bar and without, its loss printing every step or
not; the run is planned first (`eqfit.plan`), so `fit` compiles nothing. Once it has
trained for `--wait` seconds (since its first print, or since it called `fit`), the parent
sends one SIGINT (epochs of 200 steps: training stops at the epoch's end) or two, 0.3 s
apart (one epoch of a million steps: the second stops it once the call in flight is done),
and times `fit`'s raise from the last.

Run: `python benchmarks/ctrl_c_host_callback.py [--signals 1]` (about a minute). A run not
answered within `--timeout` seconds is killed (exit status -9).
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time


def child(args: argparse.Namespace) -> None:
    import jax
    import numpy as np
    import optax

    import eqfit

    rng = np.random.default_rng(0)
    x = rng.normal(size=(6400, 32)).astype(np.float32)
    y = x[:, :1] - x[:, 1:2]

    def loss(model, x, y, *, key=None):
        value = eqfit.losses.mse(model, x, y, key=key)
        if args.host_callback:
            jax.debug.print("step loss {}", value)
        return value

    model = eqfit.models.MLP(32, 1, 32, 2, key=jax.random.key(0))
    epochs, steps = (10_000, 200) if args.signals == 1 else (1, 1_000_000)
    arguments = dict(
        loss=loss,
        optimizer=optax.adam(1e-3),
        key=jax.random.key(1),
        epochs=epochs,
        steps_per_epoch=steps,
        batch_size=64,
        progress=args.progress,
    )
    eqfit.plan(model, (x, y), **arguments)
    print("fitting", file=sys.stderr, flush=True)
    try:
        eqfit.fit(model, (x, y), **arguments)
    except KeyboardInterrupt as e:
        result = getattr(e, "result", None)
        steps = -1 if result is None else int((result.history.batch_sizes > 0).sum())
        print(f"raised {type(e).__name__} steps={steps}", file=sys.stderr, flush=True)


def once(args: argparse.Namespace, progress: bool, host_callback: bool) -> tuple[float, int]:
    """Seconds from the last SIGINT to `fit`'s raise, and the exit status."""
    command = [sys.executable, __file__, "--child", "--signals", str(args.signals)]
    command += ["--progress"] * progress + ["--host-callback"] * host_callback
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    lines: list[tuple[float, str]] = []

    def read(stream):
        for line in stream:
            lines.append((time.monotonic(), line))

    readers = [
        threading.Thread(target=read, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)
    ]
    for reader in readers:
        reader.start()
    began = None
    while began is None and proc.poll() is None:
        time.sleep(0.02)
        mark = "step loss" if host_callback else "fitting"
        began = next((t for t, line in list(lines) if line.startswith(mark)), None)
    while proc.poll() is None and time.monotonic() - began < args.wait:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    if args.signals == 2:
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for reader in readers:
        reader.join(timeout=5)
    raised = [t for t, line in lines if line.startswith("raised ")]
    return (raised[-1] - sent if raised else float("inf")), proc.returncode


def parent(args: argparse.Namespace) -> None:
    print(
        f"| SIGINTs: {args.signals} | bar | answer, median (s) | answer, max (s) | exit statuses |"
    )
    print("| --- | --- | --- | --- | --- |")
    for host_callback in (False, True):
        for progress in (False, True):
            runs = [once(args, progress, host_callback) for _ in range(args.runs)]
            answers = [a for a, _ in runs]
            name = "per-step `jax.debug.print`" if host_callback else "no host callback"
            median, most = (_s(x, args.timeout) for x in (statistics.median(answers), max(answers)))
            rcs = sorted({rc for _, rc in runs})
            print(f"| {name} | {progress} | {median} | {most} | {rcs} |", flush=True)


def _s(seconds: float, timeout: float) -> str:
    """Seconds, or that it was not answered before the child was killed (exit -9)."""
    return f"{seconds:.2f}" if seconds < float("inf") else f"> {timeout:.0f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--signals", type=int, default=2, choices=(1, 2))
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--host-callback", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--wait", type=float, default=3.0, help="seconds trained before SIGINT")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    child(args) if args.child else parent(args)
