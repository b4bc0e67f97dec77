"""A real model's slow steps: how soon the bar moves, how soon two Ctrl-Cs end `fit`,
and whether the process then exits cleanly.

The model is an MLP 512-2048x4-512 at batch 256 (about a second or two a step on a 2-core
CPU), with no host callback in its step. A child process trains it with the bar, in a
process that has not measured its speed; its stderr is stamped with the time of every
write. Once the bar has moved (or after `--wait` seconds), the parent sends SIGINT, then a
second one `--gap` seconds later, and times the child's end.

Run: `python benchmarks/slow_steps.py` (about a minute).
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time


def child() -> None:
    import jax
    import numpy as np
    import optax

    import eqfit

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

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 * 40, 512)).astype(np.float32)
    y = rng.normal(size=(256 * 40, 512)).astype(np.float32)
    model = eqfit.models.MLP(512, 512, 2048, 4, key=jax.random.key(0))
    print(f"@{time.monotonic():.3f} start", file=sys.stderr, flush=True)
    sys.stderr = Stamped(sys.stderr)
    try:
        eqfit.fit(
            model,
            (x, y),
            loss=eqfit.losses.mse,
            optimizer=optax.adam(1e-3),
            key=jax.random.key(1),
            epochs=3,
            batch_size=256,
            progress="bar",
        )
    except KeyboardInterrupt as e:
        sys.stderr = sys.stderr.stream
        result = getattr(e, "result", None)
        epochs = None if result is None else result.history.epochs
        print(f"@{time.monotonic():.3f} raised {type(e).__name__} result={epochs}", file=sys.stderr)


def parent(args: argparse.Namespace) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    drawn = moved = first_int = second_int = raised = None
    began = time.monotonic()
    while proc.poll() is None:
        time.sleep(0.02)
        for line in list(lines):
            stamp, _, text = line[1:].strip().partition(" ")
            if not line.startswith("@"):
                continue
            if drawn is None and "0/120" in text:
                drawn = float(stamp)
            elif drawn is not None and moved is None and "/120" in text and "0/120" not in text:
                moved = float(stamp)
        now = time.monotonic()
        if first_int is None and (moved is not None or (drawn and now - drawn > args.wait)):
            proc.send_signal(signal.SIGINT)
            first_int = now
        elif first_int is not None and second_int is None and now - first_int > args.gap:
            proc.send_signal(signal.SIGINT)
            second_int = now
        if now - began > args.timeout:
            proc.kill()
            break
    end = time.monotonic()
    reader.join(timeout=5)
    for line in lines:
        if line.startswith("@") and " raised " in line:
            stamp, _, text = line[1:].strip().partition(" ")
            raised = (float(stamp), text)
    rc = proc.wait()
    print("| figure | value |")
    print("| --- | --- |")
    print(f"| bar drawn to its first move | {_s(drawn, moved)} |")
    print(f"| second Ctrl-C to `fit` raising | {_s(second_int, raised and raised[0])} |")
    print(f"| second Ctrl-C to the process's end | {_s(second_int, end)} |")
    print(f"| what `fit` raised | {raised and raised[1]} |")
    print(f"| exit status | {rc} |")


def _s(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{b - a:.2f} s"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds after the bar is drawn")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between the Ctrl-Cs")
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()
    child() if args.child else parent(args)
