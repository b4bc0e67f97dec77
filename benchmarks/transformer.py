"""GPT-2-small trained by `fit` (`examples/gpt2.py`) in a few configurations, each in a
fresh process: its MFU as eqfit reads it, tokens a second, and the plan's memory per
device against the device's measured peak (`jax.Device.memory_stats()`: the arrays' peak
and, on a TPU, the runtime's reservation for the programs' temporaries), which one
process per configuration keeps apart.

Configurations (`--only` picks some; the example's own flags):

- `xla-8`: XLA's attention, batch 8;
- `splash-8`: Pallas's splash attention (on a TPU), batch 8;
- `splash-16`: the same at batch 16;
- `splash-16-blocks`: batch 16, `remat=` keeping each block's output (`--remat blocks`);
- `splash-32-auto`: batch 32, `microbatches="auto"`.

`--size tiny` runs the same at the tiny size (on a CPU: XLA's attention), a smoke test.

    python benchmarks/transformer.py [--only NAME ...] [--steps 20] [--epochs 3]
        [--size small|tiny] [--out PATH]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import config, table, write_json


HERE = Path(__file__).parent
EXAMPLE = HERE.parent / "examples" / "gpt2.py"
CONFIGS: dict[str, list[str]] = {
    "xla-8": ["--attention", "xla", "--batch", "8"],
    "splash-8": ["--attention", "auto", "--batch", "8"],
    "splash-16": ["--attention", "auto", "--batch", "16"],
    "splash-16-blocks": ["--attention", "auto", "--batch", "16", "--remat", "blocks"],
    "splash-32-auto": ["--attention", "auto", "--batch", "32", "--microbatches", "auto"],
}


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in a child process: the example's figures, or its error."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        command = [
            sys.executable,
            "-u",
            str(EXAMPLE),
            *CONFIGS[name],
            *("--size", args.size, "--steps", str(args.steps), "--epochs", str(args.epochs)),
            *("--json", str(out)),
        ]
        child = subprocess.run(command, capture_output=True, text=True, timeout=900)
        print(child.stdout.strip(), flush=True)
        if child.returncode or not out.exists():
            return {"error": child.stderr[-3000:]}
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--size", choices=("small", "tiny"), default="small")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "transformer.json")
    args = parser.parse_args()
    # This process leaves the device alone until the children are done: on a TPU, one
    # process holds the chip.
    results: dict[str, Any] = {}
    for name in args.only:
        print(f"# {name}", flush=True)
        results[name] = run(name, args)
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "error", "", "", "", "", ""])
            print(f"{name}: {r['error']}", file=sys.stderr)
            continue
        peak, planned = r["peak_bytes"], r["plan_memory_bytes"]
        rows.append(
            [
                name,
                f"{r['seconds_per_step'] * 1e3:.1f}",
                f"{r['tokens_per_second']:,.0f}",
                "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
                f"{planned / 2**30:.2f}",
                "-" if peak is None else f"{peak / 2**30:.2f}",
                "-" if peak is None else f"{planned / peak:.3f}",
            ]
        )
    header = ["config", "ms/step", "tokens/s", "MFU", "plan GiB", "peak GiB", "plan/peak"]
    print(table(header, rows))
    write_json(
        args.out,
        {"config": {**config(), "args": vars(args) | {"out": str(args.out)}}, "runs": results},
    )


if __name__ == "__main__":
    main()
