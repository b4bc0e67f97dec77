"""eqfit on whatever JAX finds (a TPU, a GPU, or the CPU at a small size) against the two
floors of issue 68: the usual loop and a hand-written `jax.jit(lax.scan)`.

Five parts (`--only` picks some), each workload measured in this one process, the three
ways interleaved (`_common.interleave`: medians of `--repeats`), every program compiled
before the clock (eqfit's by `eqfit.plan` with the arguments `fit` then gets: the same
model, loss and optimizer objects, so that `fit` finds them in eqfit's cache):

1. `gpt`: a GPT-2-small-shaped model written plainly in Equinox (12 pre-LN blocks, d 768,
   12 heads, seq 1024, vocab 50,304, the output head tied to the embedding; float32
   parameters, every matmul's operands cast to bfloat16 inside `__call__`, the residual
   stream and the layer norms in float32, `jax.nn.dot_product_attention(...,
   is_causal=True)`), `optax.adamw`, next-token softmax cross-entropy in float32 on
   random int32 tokens, batch 8, 16 steps a run (N = 128 sequences, no shuffle). The
   usual loop is an `eqx.filter_jit` step (the state donated) called from Python for
   each batch (the batches split on the device before the clock); the hand scan a
   `jax.jit` (the state donated) of a `lax.scan` over the epoch's 16 batches; eqfit
   `fit(model, (tokens,), ..., epochs=1, batch_size=8, shuffle=False)`. Reported: ms a
   step, MFU (the FLOPs of XLA's cost analysis of the usual loop's compiled step, one
   step alone, over `plan.peak_flops`), eqfit / the faster floor; `plan.flops_per_step`
   beside those FLOPs (issue 68 item 1: within 2%); `history.throughput`'s `mfu` and
   `flops_per_second`.
2. `mlp`: an `eqx.nn.MLP` 784-512-512-10 on 60,000 random rows, batch 128 (the last,
   smaller batch dropped: 468 steps an epoch), `optax.adam`, shuffled each epoch by all
   three. eqfit and the hand scan (`jit` of a `lax.scan` over epochs of a `lax.scan`
   over steps, `jax.random.permutation` each epoch, each batch gathered inside) at 2 and
   20 epochs: the step is the slope between them, the fixed cost of a call the
   intercept. The usual loop (the batch gathered inside the jitted step by a device
   index made before the clock) only at 2 epochs.
3. `conv`: 4 blocks of a 3x3 convolution of stride 2 and a ReLU (channels 32-64-128-256,
   32x32x3 images down to 2x2), a linear head to 10 classes, float32, `optax.adam`,
   4,096 random images, batch 256, 4 epochs of 16 steps a run, no shuffle; ms a step,
   MFU, the three ways.
4. `first`: in fresh child processes (the environment, `JAX_PLATFORMS` included,
   inherited; run before this process touches the device, which one process holds at a
   time on a TPU): the GPT's first `fit` (1 epoch) against the usual loop's first epoch,
   each timed from before the model is made to the trained model, compilation included;
   the XLA programs the first `fit` compiled, and those of a second `fit` in the same
   child that changes only `epochs` (1 to 2).
5. `checkpoint`: the GPT for about `--checkpoint-seconds` of training (60 on an
   accelerator), `fit(..., checkpoint=<a new temporary folder>, checkpoint_every=k)` with
   `k` epochs making about 10 s, against the same run without; both planned first.
   Reported: wall seconds (to `fit`'s return, which in the background comes before its
   last write is committed; the seconds to that commit too), the sum of
   `history.throughput["epoch_seconds"]` (the training), their ratios, the programs
   compiled inside each timed run, and the seconds the training waited at each checkpoint
   (`history.throughput["checkpoint_blocked_seconds"]` at the epochs that had one: the
   copy queued, and any wait for the write before it).

`--size full` (the default on a GPU or TPU) is the shapes above; `--size tiny` (the
default on a CPU): GPT 2 layers, d 64, 4 heads, seq 64, vocab 256, batch 4; MLP 4,096
rows, 64-64 hidden; conv channels 8-8-16-16, 512 images, batch 32, 2 epochs; a
checkpoint every epoch of 4. The whole `--size full` run is meant to fit in about 8
minutes on one TPU v5e (GPT steps about 100 ms, a GPT program about 30 s to compile); if
a call is limited to less, run it in two: `--only gpt checkpoint` (the checkpoint part
takes the GPT part's step time and programs) and `--only first mlp conv`. Progress goes
to stdout as it happens; the JSON file (`--out`) is rewritten after each part, so a run
cut short keeps what it measured. The checkpoints go to new folders under the system's
temporary directory (`TMPDIR`), removed after each run.

    python benchmarks/accelerator.py [--only gpt mlp conv first checkpoint]
        [--size tiny|full] [--repeats 3] [--checkpoint-seconds 60] [--out PATH]
"""

import argparse
import dataclasses
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import CompileEvents, config, finish, interleave, load_average, table, timed

import eqfit
from eqfit._host._planner import peak_flops  # the table behind `plan.peak_flops`


HERE = Path(__file__).parent
PARTS = ("gpt", "mlp", "conv", "first", "checkpoint")
BF16 = jnp.bfloat16
STARTED = time.perf_counter()


def say(message: str) -> None:
    """A progress line, flushed at once (the output may be a pipe)."""
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


@dataclasses.dataclass(frozen=True)
class GPTShape:
    layers: int
    d: int
    heads: int
    seq: int
    vocab: int
    batch: int
    steps: int  # steps an epoch


@dataclasses.dataclass(frozen=True)
class MLPShape:
    rows: int
    hidden: int
    batch: int


@dataclasses.dataclass(frozen=True)
class ConvShape:
    channels: tuple[int, ...]
    images: int
    batch: int
    epochs: int


SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "gpt": GPTShape(layers=12, d=768, heads=12, seq=1024, vocab=50_304, batch=8, steps=16),
        "mlp": MLPShape(rows=60_000, hidden=512, batch=128),
        "conv": ConvShape(channels=(32, 64, 128, 256), images=4096, batch=256, epochs=4),
    },
    "tiny": {
        "gpt": GPTShape(layers=2, d=64, heads=4, seq=64, vocab=256, batch=4, steps=16),
        "mlp": MLPShape(rows=4096, hidden=64, batch=128),
        "conv": ConvShape(channels=(8, 8, 16, 16), images=512, batch=32, epochs=2),
    },
}
MLP_IN, CLASSES, IMAGE = 784, 10, 32
MLP_EPOCHS = (2, 20)
CHECKPOINT_PERIOD_S = 10.0
TINY_CHECKPOINT = (4, 1)  # epochs, checkpoint_every at the tiny size


# ---------------------------------------------------------------------------------------
# The models


def dense(layer: eqx.nn.Linear, x: jax.Array) -> jax.Array:
    """`layer` on the last axis of `x`, its operands cast to bfloat16."""
    y = x.astype(BF16) @ layer.weight.astype(BF16).T
    return y if layer.bias is None else y + layer.bias.astype(BF16)


def layer_norm(norm: eqx.nn.LayerNorm, x: jax.Array) -> jax.Array:
    """`norm`'s parameters over the last axis of `x`, in float32."""
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    assert norm.weight is not None and norm.bias is not None
    return (x - mean) * jax.lax.rsqrt(var + norm.eps) * norm.weight + norm.bias


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, d: int, heads: int, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.qkv = eqx.nn.Linear(d, 3 * d, key=k1)
        self.out = eqx.nn.Linear(d, d, key=k2)
        self.up = eqx.nn.Linear(d, 4 * d, key=k3)
        self.down = eqx.nn.Linear(4 * d, d, key=k4)
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(dense(self.qkv, layer_norm(self.ln1, x)), 3, axis=-1)
        shape = (b, t, self.heads, d // self.heads)
        attended = jax.nn.dot_product_attention(
            q.reshape(shape), k.reshape(shape), v.reshape(shape), is_causal=True
        )
        x = x + dense(self.out, attended.reshape(b, t, d))
        return x + dense(self.down, jax.nn.gelu(dense(self.up, layer_norm(self.ln2, x))))


class GPT(eqx.Module):
    """GPT-2's shape, pre-LN, the output head tied to the token embedding."""

    wte: jax.Array
    wpe: jax.Array
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm

    def __init__(self, shape: GPTShape, key: jax.Array):
        k1, k2, *keys = jax.random.split(key, 2 + shape.layers)
        self.wte = 0.02 * jax.random.normal(k1, (shape.vocab, shape.d))
        self.wpe = 0.01 * jax.random.normal(k2, (shape.seq, shape.d))
        self.blocks = [Block(shape.d, shape.heads, k) for k in keys]
        self.ln_f = eqx.nn.LayerNorm(shape.d)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.wte[tokens] + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return layer_norm(self.ln_f, x).astype(BF16) @ self.wte.astype(BF16).T


def gpt_loss(model: GPT, tokens: jax.Array) -> jax.Array:
    """Next-token softmax cross-entropy, the logits in float32."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def gpt_tokens(shape: GPTShape) -> jax.Array:
    """An epoch of random tokens: `steps * batch` sequences of `seq + 1` (inputs and the
    targets shifted by one).
    """
    size = (shape.steps * shape.batch, shape.seq + 1)
    return jax.random.randint(jax.random.key(1), size, 0, shape.vocab, jnp.int32)


class ConvNet(eqx.Module):
    convs: list[eqx.nn.Conv2d]
    head: eqx.nn.Linear

    def __init__(self, channels: tuple[int, ...], key: jax.Array):
        keys = jax.random.split(key, len(channels) + 1)
        sizes = (3, *channels)
        self.convs = [
            eqx.nn.Conv2d(a, b, 3, stride=2, padding=1, key=k)
            for a, b, k in zip(sizes, sizes[1:], keys)
        ]
        side = IMAGE // 2 ** len(channels)
        self.head = eqx.nn.Linear(channels[-1] * side * side, CLASSES, key=keys[-1])

    def __call__(self, x: jax.Array) -> jax.Array:
        for conv in self.convs:
            x = jax.nn.relu(conv(x))
        return self.head(x.reshape(-1))


def classify_loss(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ---------------------------------------------------------------------------------------
# The floors


def usual_step(optimizer: optax.GradientTransformation, loss: Callable[..., Any]) -> Any:
    """The usual loop's step: `step(batch, model, opt_state)`, the state donated."""

    @eqx.filter_jit(donate="all-except-first")
    def step(batch: tuple[Any, ...], model: Any, opt_state: Any) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, *batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def gathering_step(optimizer: optax.GradientTransformation, loss: Callable[..., Any]) -> Any:
    """The usual loop's step that gathers its batch by a device index:
    `step((x, y, order, i), model, opt_state)`.
    """

    def gathered(model: Any, x: Any, y: Any, order: Any, i: Any) -> Any:
        return loss(model, x[order[i]], y[order[i]])

    return usual_step(optimizer, gathered)


def fresh_state(model: Any, optimizer: optax.GradientTransformation) -> list[Any]:
    """`[model, opt_state]` on copies of `model`'s arrays, for a loop that donates them."""
    model = jax.tree.map(lambda a: jnp.copy(a) if eqx.is_array(a) else a, model)
    return [model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))]


def scanned_steps(
    static: Any, optimizer: optax.GradientTransformation, loss: Callable[..., Any]
) -> Callable[..., Any]:
    """`steps(carry, batches) -> (carry, losses)`: a `lax.scan` of the step over batches,
    `carry` being `(params, opt_state)`.
    """

    def step(carry: Any, batch: Any) -> Any:
        params, opt_state = carry
        value, grads = jax.value_and_grad(lambda p: loss(eqx.combine(p, static), *batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return lambda carry, batches: jax.lax.scan(step, carry, batches)


def cost_flops(compiled: Any) -> float:
    """XLA's FLOPs of a compiled program (`jax.stages.Compiled` or Equinox's)."""
    compiled = getattr(compiled, "compiled", compiled)
    costs = compiled.cost_analysis()
    if isinstance(costs, list | tuple):  # older JAX: one dict per program
        costs = costs[0] if costs else {}
    return float((costs or {}).get("flops", 0.0))


def ready(tree: Any) -> Any:
    return jax.block_until_ready(tree)


# ---------------------------------------------------------------------------------------
# Part 1: the GPT


@dataclasses.dataclass
class GPTRun:
    """The GPT's model, data and eqfit arguments, kept for the checkpoint part."""

    shape: GPTShape
    model: GPT
    tokens: jax.Array
    optimizer: optax.GradientTransformation
    key: jax.Array
    eqfit_step_s: float | None = None

    def fit_args(self, epochs: int, **extra: Any) -> dict[str, Any]:
        return dict(
            loss=gpt_loss,
            optimizer=self.optimizer,
            key=self.key,
            epochs=epochs,
            batch_size=self.shape.batch,
            shuffle=False,
            **extra,
        )

    def fit(self, epochs: int, **extra: Any) -> eqfit.FitResult:
        return eqfit.fit(self.model, (self.tokens,), **self.fit_args(epochs, **extra))

    def plan(self, epochs: int, **extra: Any) -> eqfit.Plan:
        return eqfit.plan(self.model, (self.tokens,), **self.fit_args(epochs, **extra))


def gpt_run(shape: GPTShape) -> GPTRun:
    tokens = ready(gpt_tokens(shape))
    model = GPT(shape, jax.random.key(0))
    return GPTRun(shape, model, tokens, optax.adamw(3e-4), jax.random.key(2))


def gpt_part(run: GPTRun, repeats: int, events: CompileEvents) -> dict[str, Any]:
    shape = run.shape
    say("gpt: planning eqfit's run (compiles its programs)")
    events.reset()
    start = time.perf_counter()
    plan = run.plan(1)
    planned = {"plan_s": time.perf_counter() - start, **events.breakdown()}
    say(f"gpt: planned in {planned['plan_s']:.1f} s, {events.backend_compiles()} programs")
    runs, floors = gpt_floors(run, events)
    last: dict[str, Any] = {}

    def run_eqfit() -> None:
        # Only the history kept: a result holds a model and an optimizer state.
        last["throughput"] = run.fit(1).history.throughput

    say(f"gpt: timing ({repeats} repeats, {shape.steps} steps a run)")
    events.reset()
    seconds = interleave({"eqfit": run_eqfit, **runs}, repeats, 1)
    compiles_timed = events.backend_compiles()
    per_step = {name: s / shape.steps for name, s in seconds.items()}
    run.eqfit_step_s = per_step["eqfit"]
    flops = floors["compiled_step_flops"]
    # The GPT computes in bfloat16 though its arrays are float32, which is what the plan
    # goes by: the table's bfloat16 peak where it knows the device (on a GPU the two differ).
    peak = peak_flops(str(jax.devices()[0].device_kind), BF16) or plan.peak_flops
    result = {
        "shape": dataclasses.asdict(shape),
        "step_s": per_step,
        "mfu": {k: mfu(flops, s, peak) for k, s in per_step.items()},
        "eqfit_over_floor": per_step["eqfit"] / min(per_step["usual"], per_step["hand"]),
        "plan_flops_per_step": plan.flops_per_step,
        "plan_over_compiled_flops": plan.flops_per_step / flops if flops else None,
        "peak_flops": peak,
        "plan_peak_flops": plan.peak_flops,
        "plan_execution": plan.execution.describe(),
        "eqfit_planned": planned,
        **floors,
        "compiles_while_timed": compiles_timed,
        "history_throughput": {k: np.asarray(v).tolist() for k, v in last["throughput"].items()},
    }
    say(f"gpt: ms a step {fmt_ms(per_step)}; eqfit / floor {result['eqfit_over_floor']:.3f}")
    return result


def gpt_floors(
    run: GPTRun, events: CompileEvents
) -> tuple[dict[str, Callable[[], None]], dict[str, Any]]:
    """The GPT's usual loop and hand scan, compiled: a run of an epoch by each, and the
    compiled step's FLOPs and the compile seconds. Each carries its own copy of the state
    from run to run, donated.
    """
    shape = run.shape
    step = usual_step(run.optimizer, gpt_loss)
    batches = list(run.tokens.reshape(shape.steps, shape.batch, shape.seq + 1))
    usual = fresh_state(run.model, run.optimizer)
    say("gpt: compiling the usual loop's step")
    start = time.perf_counter()
    usual[:] = step((batches[0],), *usual)[:2]
    ready(usual)
    usual_compile_s = time.perf_counter() - start
    events.reset()
    flops = cost_flops(step.lower((batches[0],), *usual).compile())
    analysis_compiles = events.backend_compiles()  # 0 where JAX's caches hold the step

    params, static = eqx.partition(usual[0], eqx.is_inexact_array)
    params = jax.tree.map(jnp.copy, params)
    hand = [(params, run.optimizer.init(params))]
    stacked = run.tokens.reshape(shape.steps, shape.batch, shape.seq + 1)
    epoch = jax.jit(scanned_steps(static, run.optimizer, gpt_loss), donate_argnums=0)
    say("gpt: compiling the hand scan")
    start = time.perf_counter()
    compiled_epoch = epoch.lower(hand[0], (stacked,)).compile()
    hand_compile_s = time.perf_counter() - start

    def run_usual() -> None:
        for batch in batches:
            usual[:] = step((batch,), *usual)[:2]
        ready(usual)

    def run_hand() -> None:
        hand[0], _ = compiled_epoch(hand[0], (stacked,))
        ready(hand[0])

    return {"usual": run_usual, "hand": run_hand}, {
        "compiled_step_flops": flops,
        "usual_first_call_s": usual_compile_s,
        "hand_compile_s": hand_compile_s,
        "compiles_for_cost_analysis": analysis_compiles,
    }


def mfu(flops: float, step_s: float, peak: float | None) -> float | None:
    return None if not peak or not flops else flops / step_s / peak


def fmt_ms(per_step: dict[str, float]) -> str:
    return ", ".join(f"{name} {s * 1e3:.3f}" for name, s in per_step.items())


# ---------------------------------------------------------------------------------------
# Part 2: the MLP


def mlp_part(shape: MLPShape, repeats: int, events: CompileEvents) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(shape.rows, MLP_IN)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, shape.rows).astype(np.int32))
    model = eqx.nn.MLP(MLP_IN, CLASSES, shape.hidden, 2, key=jax.random.key(0))
    optimizer, key = optax.adam(1e-3), jax.random.key(3)
    steps = shape.rows // shape.batch
    ready((x, y))

    def eqfit_args(epochs: int) -> dict[str, Any]:
        return dict(
            loss=classify_loss,
            optimizer=optimizer,
            key=key,
            epochs=epochs,
            batch_size=shape.batch,
            drop_remainder=True,
        )

    events.reset()
    say("mlp: planning eqfit at 2 and 20 epochs, compiling the hand scans and the step")
    for epochs in MLP_EPOCHS:
        eqfit.plan(model, (x, y), **eqfit_args(epochs))
    eqfit_compiles = events.backend_compiles()
    runs: dict[str, Callable[[], Any]] = {}
    for epochs in MLP_EPOCHS:
        runs[f"eqfit@{epochs}"] = lambda e=epochs: eqfit.fit(model, (x, y), **eqfit_args(e))
        runs[f"hand@{epochs}"] = mlp_hand(model, optimizer, shape, (x, y, key), epochs)
    run_usual = mlp_usual(model, optimizer, shape, (x, y, key), MLP_EPOCHS[0])
    say(f"mlp: timing ({repeats} repeats; {steps} steps an epoch)")
    events.reset()
    seconds = interleave(runs, repeats)
    say(f"mlp: timing the usual loop at {MLP_EPOCHS[0]} epochs")
    seconds |= interleave({"usual": run_usual}, repeats, 1)
    compiles_timed = events.backend_compiles()
    fits = {way: slope(seconds, way, steps) for way in ("eqfit", "hand")}
    usual_step_s = seconds["usual"] / (MLP_EPOCHS[0] * steps)
    result = {
        "shape": dataclasses.asdict(shape),
        "steps_per_epoch": steps,
        "run_s": seconds,
        "step_s": {way: fit["step_s"] for way, fit in fits.items()} | {"usual": usual_step_s},
        "fixed_s": {way: fit["fixed_s"] for way, fit in fits.items()},
        "eqfit_over_hand_step": fits["eqfit"]["step_s"] / fits["hand"]["step_s"],
        "eqfit_minus_hand_fixed_s": fits["eqfit"]["fixed_s"] - fits["hand"]["fixed_s"],
        "eqfit_plan_compiles": eqfit_compiles,
        "compiles_while_timed": compiles_timed,
    }
    say(
        f"mlp: µs a step eqfit {fits['eqfit']['step_s'] * 1e6:.2f}, hand "
        f"{fits['hand']['step_s'] * 1e6:.2f}, usual {usual_step_s * 1e6:.1f}; fixed ms eqfit "
        f"{fits['eqfit']['fixed_s'] * 1e3:.2f}, hand {fits['hand']['fixed_s'] * 1e3:.2f}"
    )
    return result


def slope(seconds: dict[str, float], way: str, steps: int) -> dict[str, float]:
    """A way's seconds a step (the slope between its runs of the fewest and the most
    epochs) and the fixed cost of a call (the intercept).
    """
    first, last = MLP_EPOCHS
    step_s = (seconds[f"{way}@{last}"] - seconds[f"{way}@{first}"]) / ((last - first) * steps)
    return {"step_s": step_s, "fixed_s": seconds[f"{way}@{first}"] - first * steps * step_s}


def mlp_hand(
    model: Any, optimizer: Any, shape: MLPShape, data: tuple[Any, ...], epochs: int
) -> Callable[[], Any]:
    """A run of the hand scan over `epochs`, compiled: `jit` of a `lax.scan` over epochs,
    each shuffled by `jax.random.permutation`, of a `lax.scan` over its steps.
    """
    params, static = eqx.partition(model, eqx.is_inexact_array)
    inner = scanned_steps(static, optimizer, classify_loss)
    steps = shape.rows // shape.batch

    def train(params: Any, x: Any, y: Any, key: Any) -> Any:
        def epoch(carry: Any, e: Any) -> Any:
            order = jax.random.permutation(jax.random.fold_in(key, e), shape.rows)
            order = order[: steps * shape.batch].reshape(steps, shape.batch)
            return inner(carry, (x[order], y[order]))

        carry = (params, optimizer.init(params))
        return jax.lax.scan(epoch, carry, jnp.arange(epochs))

    compiled = jax.jit(train).lower(params, *data).compile()
    return lambda: ready(compiled(params, *data))


def mlp_usual(
    model: Any, optimizer: Any, shape: MLPShape, data: tuple[Any, ...], epochs: int
) -> Callable[[], None]:
    """A run of the usual loop over `epochs`, its step compiled: each epoch's order made
    on the device, each batch gathered inside the step by a device index made before.
    """
    x, y, key = data
    steps = shape.rows // shape.batch
    step = gathering_step(optimizer, classify_loss)

    @jax.jit
    def shuffle(key: Any) -> Any:
        order = jax.random.permutation(key, shape.rows)
        return order[: steps * shape.batch].reshape(steps, shape.batch)

    indices = [jnp.asarray(i, jnp.int32) for i in range(steps)]
    epoch_keys = [jax.random.fold_in(key, e) for e in range(epochs)]
    usual = fresh_state(model, optimizer)
    usual[:] = step((x, y, shuffle(key), indices[0]), *usual)[:2]  # compiled before the clock

    def run() -> None:
        for epoch_key in epoch_keys:
            order = shuffle(epoch_key)
            for i in indices:
                usual[:] = step((x, y, order, i), *usual)[:2]
        ready(usual)

    return run


# ---------------------------------------------------------------------------------------
# Part 3: the conv net


def conv_part(shape: ConvShape, repeats: int, events: CompileEvents) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(shape.images, 3, IMAGE, IMAGE)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, CLASSES, shape.images).astype(np.int32))
    model = ConvNet(shape.channels, jax.random.key(0))
    optimizer, key = optax.adam(1e-3), jax.random.key(4)
    total = shape.images // shape.batch * shape.epochs
    args: dict[str, Any] = dict(
        loss=classify_loss,
        optimizer=optimizer,
        key=key,
        epochs=shape.epochs,
        batch_size=shape.batch,
        shuffle=False,
    )
    say("conv: planning eqfit, compiling the step and the hand scan")
    plan = eqfit.plan(model, (x, y), **args)
    runs, flops = conv_floors(model, optimizer, shape, x, y)
    say(f"conv: timing ({repeats} repeats, {total} steps a run)")
    events.reset()
    seconds = interleave({"eqfit": lambda: eqfit.fit(model, (x, y), **args), **runs}, repeats)
    per_step = {name: s / total for name, s in seconds.items()}
    result = {
        "shape": dataclasses.asdict(shape),
        "steps_per_run": total,
        "step_s": per_step,
        "mfu": {k: mfu(flops, s, plan.peak_flops) for k, s in per_step.items()},
        "eqfit_over_floor": per_step["eqfit"] / min(per_step["usual"], per_step["hand"]),
        "compiled_step_flops": flops,
        "plan_flops_per_step": plan.flops_per_step,
        "peak_flops": plan.peak_flops,
        "plan_execution": plan.execution.describe(),
        "compiles_while_timed": events.backend_compiles(),
    }
    say(f"conv: ms a step {fmt_ms(per_step)}; eqfit / floor {result['eqfit_over_floor']:.3f}")
    return result


def conv_floors(
    model: ConvNet, optimizer: Any, shape: ConvShape, x: jax.Array, y: jax.Array
) -> tuple[dict[str, Callable[[], None]], float]:
    """The conv net's usual loop and hand scan, compiled, and the compiled step's FLOPs.
    Both go through the batches in order (no shuffle), split on the device beforehand.
    """
    steps = shape.images // shape.batch
    xs = x.reshape(steps, shape.batch, *x.shape[1:])
    ys = y.reshape(steps, shape.batch)
    batches = list(zip(xs, ys))
    step = usual_step(optimizer, classify_loss)
    usual = fresh_state(model, optimizer)
    usual[:] = step(batches[0], *usual)[:2]
    flops = cost_flops(step.lower(batches[0], *usual).compile())
    params, static = eqx.partition(model, eqx.is_inexact_array)
    inner = scanned_steps(static, optimizer, classify_loss)

    # The batches are the program's arguments, as eqfit's data are: closed over, they
    # would be constants of the program, which XLA lays out as it likes when it compiles.
    def train(params: Any, xs: Any, ys: Any) -> Any:
        def epoch(carry: Any, _: Any) -> Any:
            return inner(carry, (xs, ys))

        return jax.lax.scan(epoch, (params, optimizer.init(params)), None, shape.epochs)

    hand = jax.jit(train).lower(params, xs, ys).compile()

    def run_usual() -> None:
        for _ in range(shape.epochs):
            for batch in batches:
                usual[:] = step(batch, *usual)[:2]
        ready(usual)

    return {"usual": run_usual, "hand": lambda: ready(hand(params, xs, ys))}, flops


# ---------------------------------------------------------------------------------------
# Part 4: the first fit, in child processes


def first_worker(kind: str, size: str) -> dict[str, Any]:
    """In a fresh process: the GPT's first epoch by `kind` ("eqfit" or "usual"), from
    before the model is made to the trained model; for eqfit, then a second `fit` that
    changes only `epochs`.
    """
    if size == "auto":
        size = default_size()
    shape: GPTShape = SIZES[size]["gpt"]
    events = CompileEvents()
    tokens = ready(gpt_tokens(shape))
    optimizer, key = optax.adamw(3e-4), jax.random.key(2)
    out: dict[str, Any] = {"size": size, "backend": jax.default_backend()}
    start = time.perf_counter()
    model = GPT(shape, jax.random.key(0))
    events.reset()  # the programs counted are the loop's or `fit`'s, not the model's
    if kind == "usual":
        step = usual_step(optimizer, gpt_loss)
        state = [model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))]
        for batch in tokens.reshape(shape.steps, shape.batch, shape.seq + 1):
            state[:] = step((batch,), *state)[:2]
        ready(state)
        return out | {"seconds": time.perf_counter() - start, **compiled(events)}
    args: dict[str, Any] = dict(
        loss=gpt_loss, optimizer=optimizer, key=key, batch_size=shape.batch, shuffle=False
    )
    first = eqfit.fit(model, (tokens,), epochs=1, **args)
    ready(first.model)
    out |= {"seconds": time.perf_counter() - start, **compiled(events)}
    events.reset()
    start = time.perf_counter()
    second = eqfit.fit(model, (tokens,), epochs=2, **args)
    ready(second.model)
    seconds = time.perf_counter() - start
    out["second_fit"] = {"epochs": 2, "seconds": seconds, **compiled(events)}
    return out


def compiled(events: CompileEvents) -> dict[str, float]:
    """The compile events' breakdown, and the programs JAX's persistent cache supplied
    (where one is on in the environment, a first fit is not a cold one).
    """
    return {**events.breakdown(), "cache_hits": float(events.cache_hits())}


def run_worker(kind: str, size: str) -> dict[str, Any]:
    """`first_worker(kind, size)` in a child process; its output is passed through."""
    command = [sys.executable, "-u", __file__, "--worker", kind, "--size", size]
    child = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if child.returncode:
        raise RuntimeError(f"the {kind} child failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def first_part(size: str) -> dict[str, Any]:
    say("first: the usual loop's first epoch in a fresh process")
    usual = run_worker("usual", size)
    say(f"first: usual loop {usual['seconds']:.1f} s; eqfit's first fit in a fresh process")
    fitted = run_worker("eqfit", size)
    second = fitted["second_fit"]
    say(
        f"first: eqfit {fitted['seconds']:.1f} s, {fitted['xla_compiles']:.0f} programs; "
        f"epochs 1 -> 2: {second['xla_compiles']:.0f} programs, {second['seconds']:.1f} s"
    )
    return {
        "size": fitted["size"],
        "backend": fitted["backend"],
        "usual": usual,
        "eqfit": fitted,
        "eqfit_over_usual": fitted["seconds"] / usual["seconds"],
    }


# ---------------------------------------------------------------------------------------
# Part 5: checkpoints


def checkpoint_part(
    run: GPTRun, seconds: float | None, repeats: int, events: CompileEvents
) -> dict[str, Any]:
    if run.eqfit_step_s is None:
        say("checkpoint: planning and timing one epoch of the GPT (no gpt part ran)")
        run.plan(1)
        run.fit(1)
        run.eqfit_step_s = timed(lambda: run.fit(1)) / run.shape.steps
    epoch_s = run.eqfit_step_s * run.shape.steps
    if seconds is None:
        epochs, every = TINY_CHECKPOINT
    else:
        epochs = max(2, round(seconds / epoch_s))
        every = max(1, min(epochs, round(CHECKPOINT_PERIOD_S / epoch_s)))
    say(f"checkpoint: planning {epochs} epochs of {epoch_s:.2f} s, a checkpoint every {every}")
    run.plan(epochs)
    samples: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    for r in range(repeats):
        for name in ("without", "with") if r % 2 == 0 else ("with", "without"):
            samples[name].append(checkpoint_run(run, epochs, every, name == "with", events))
            last = samples[name][-1]
            say(f"checkpoint: {name} {last['wall_s']:.1f} s ({last['xla_compiles']:.0f} programs)")

    def median_of(field: str) -> dict[str, float]:
        return {k: float(np.median([s[field] for s in v])) for k, v in samples.items()}

    wall, training = median_of("wall_s"), median_of("training_s")
    committed = median_of("committed_s")
    blocked = [s for run in samples["with"] for s in run["blocked_s"].values()]
    # A program compiled inside a timed run (a copy of the state, say) is not a write.
    less = {
        k: float(np.median([s["wall_s"] - s["xla_compile_s"] for s in v]))
        for k, v in samples.items()
    }
    result = {
        "epochs": epochs,
        "checkpoint_every": every,
        "epoch_s_estimate": epoch_s,
        "runs": samples,
        "wall_s": wall,
        "training_s": training,
        "with_over_without_wall": wall["with"] / wall["without"],
        "committed_s": committed,
        "with_committed_over_without": committed["with"] / wall["without"],
        "with_over_without_training": training["with"] / training["without"],
        "with_over_without_less_compiles": less["with"] / less["without"],
        "blocked_per_checkpoint_s": float(np.median(blocked)) if blocked else None,
    }
    say(
        f"checkpoint: with / without {result['with_over_without_wall']:.3f} (wall; "
        f"{result['with_committed_over_without']:.3f} to the last write's commit), "
        f"{result['with_over_without_training']:.3f} (the epochs' seconds); training blocked "
        f"{fmt_blocked(result['blocked_per_checkpoint_s'])} a checkpoint (median)"
    )
    return result


def fmt_blocked(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f} ms"


def checkpoint_run(
    run: GPTRun, epochs: int, every: int, checkpointed: bool, events: CompileEvents
) -> dict[str, Any]:
    """One timed `fit` of `epochs`, with a checkpoint every `every` epochs into a new
    temporary folder (removed after) or none.
    """
    folder = tempfile.mkdtemp(prefix="eqfit-accelerator-")
    extra = {"checkpoint": folder, "checkpoint_every": every} if checkpointed else {}
    try:
        events.reset()
        start = time.perf_counter()
        result = run.fit(epochs, **extra)
        wall = time.perf_counter() - start
        # In the background `fit` returns with its last write going on: waited for here,
        # outside the timed run, so that the next run does not share the host with it.
        eqfit.wait_for_checkpoints(folder)
        committed = time.perf_counter() - start
        written = sorted(p.name for p in Path(folder).iterdir()) if checkpointed else []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    throughput = result.history.throughput
    epoch_seconds = np.asarray(throughput.get("epoch_seconds", []), dtype=float)
    blocked = np.asarray(throughput.get("checkpoint_blocked_seconds", []), dtype=float)
    # The epochs that had a checkpoint: every `every`-th, and the last (the run's end).
    at = sorted({e for e in range(every, epochs + 1, every)} | {epochs})
    return {
        "wall_s": wall,
        "committed_s": committed,
        "training_s": float(np.nansum(epoch_seconds)),
        "checkpoints_left": written,
        "blocked_s": {e: float(blocked[e - 1]) for e in at} if blocked.size else {},
        **events.breakdown(),
    }


# ---------------------------------------------------------------------------------------
# The report


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def way_cell(step_s: float, share: float | None, unit: str = "ms") -> str:
    scale = 1e3 if unit == "ms" else 1e6
    cell = f"{step_s * scale:,.3f} {unit}"
    return cell if share is None else f"{cell}, MFU {pct(share)}"


def step_row(title: str, part: Any) -> list[list[str]]:
    """A workload's row of a step's time and MFU each way, if its part ran."""
    if not (isinstance(part, dict) and "step_s" in part):
        return []
    s, m = part["step_s"], part["mfu"]
    cells = [way_cell(s[k], m[k]) for k in ("eqfit", "usual", "hand")]
    return [[title, *cells, f"{part['eqfit_over_floor']:.3f}×"]]


def summary_rows(parts: dict[str, Any]) -> list[list[str]]:
    rows = []
    rows += step_row("GPT, a step", parts.get("gpt"))
    if isinstance(mlp := parts.get("mlp"), dict) and "step_s" in mlp:
        s, f = mlp["step_s"], mlp["fixed_s"]
        rows.append(
            ["MLP, a step (slope 2 to 20 epochs)"]
            + [way_cell(s[k], None, "µs") for k in ("eqfit", "usual", "hand")]
            + [f"{mlp['eqfit_over_hand_step']:.3f}× the hand scan"]
        )
        rows.append(
            ["MLP, fixed cost of a call"]
            + [f"{f['eqfit'] * 1e3:.2f} ms", "–", f"{f['hand'] * 1e3:.2f} ms"]
            + [f"{mlp['eqfit_minus_hand_fixed_s'] * 1e3:+.2f} ms"]
        )
    rows += step_row("conv net, a step", parts.get("conv"))
    if isinstance(first := parts.get("first"), dict) and "eqfit" in first:
        e, u = first["eqfit"], first["usual"]
        rows.append(
            ["GPT, first fit / first epoch, compile in"]
            + [f"{e['seconds']:.2f} s ({e['xla_compiles']:.0f} programs)"]
            + [f"{u['seconds']:.2f} s ({u['xla_compiles']:.0f} programs)", "–"]
            + [f"{first['eqfit_over_usual']:.3f}× the usual loop"]
        )
        second = e["second_fit"]
        rows.append(
            ["GPT, a second fit, epochs 1 -> 2"]
            + [f"{second['seconds']:.2f} s ({second['xla_compiles']:.0f} programs)", "–", "–"]
            + ["(aim: 0 programs)"]
        )
    if isinstance(ckpt := parts.get("checkpoint"), dict) and "wall_s" in ckpt:
        w = ckpt["wall_s"]
        rows.append(
            [
                f"GPT, {ckpt['epochs']} epochs, a checkpoint every {ckpt['checkpoint_every']}",
                f"{w['with']:.2f} s with, {w['without']:.2f} s without",
                "–",
                "–",
                f"{ckpt['with_over_without_wall']:.3f}× "
                f"({ckpt['with_over_without_training']:.3f}× the epochs' seconds; "
                f"{ckpt['with_committed_over_without']:.3f}× to the last commit; blocked "
                f"{fmt_blocked(ckpt['blocked_per_checkpoint_s'])} a checkpoint)",
            ]
        )
    return rows


def print_report(parts: dict[str, Any]) -> None:
    print("\n# accelerator\n", flush=True)
    header = ["workload", "eqfit", "usual loop", "hand jit(lax.scan)", "eqfit / faster floor"]
    print(table(header, summary_rows(parts)))
    if isinstance(gpt := parts.get("gpt"), dict) and "step_s" in gpt:
        ratio = gpt["plan_over_compiled_flops"]
        print(
            f"\nGPT FLOPs per step: eqfit.plan {gpt['plan_flops_per_step']:.4g}; XLA's cost "
            f"analysis of the compiled step {gpt['compiled_step_flops']:.4g}; plan / compiled "
            f"{'–' if ratio is None else f'{ratio:.4f}'} (aim: within 2%); peak "
            f"{gpt['peak_flops'] or '–'} FLOP/s"
        )
        t = gpt["history_throughput"]
        print(
            f"GPT history.throughput of eqfit's last timed fit: mfu {t.get('mfu', '–')}, "
            f"flops_per_second {t.get('flops_per_second', '–')}, epoch_seconds "
            f"{t.get('epoch_seconds', '–')}"
        )
    if isinstance(conv := parts.get("conv"), dict) and "step_s" in conv:
        print(
            f"conv FLOPs per step: eqfit.plan {conv['plan_flops_per_step']:.4g}; compiled "
            f"step {conv['compiled_step_flops']:.4g}; eqfit runs it as {conv['plan_execution']}"
        )
    for name in ("gpt", "mlp", "conv"):
        if isinstance(part := parts.get(name), dict) and "compiles_while_timed" in part:
            print(
                f"{name} programs compiled from the timing's warm-up on (untimed runs "
                f"included): {part['compiles_while_timed']}"
            )
    if isinstance(ckpt := parts.get("checkpoint"), dict) and "runs" in ckpt:
        for run in ckpt["runs"]["with"]:
            cells = [f"epoch {e}: {fmt_blocked(s)}" for e, s in run["blocked_s"].items()]
            print(f"checkpoint: the training blocked at each checkpoint: {', '.join(cells)}")
        compiles = {k: [r["xla_compiles"] for r in rs] for k, rs in ckpt["runs"].items()}
        print(
            f"checkpoint: programs compiled inside the timed runs: {compiles}; with / without, "
            f"their compile seconds taken off: {ckpt['with_over_without_less_compiles']:.3f}"
        )
    for name, value in parts.items():
        if isinstance(value, dict) and "error" in value:
            print(f"\n{name} FAILED: {value['error']}")


# ---------------------------------------------------------------------------------------
# Main


def default_size() -> str:
    return "tiny" if jax.default_backend() == "cpu" else "full"


def free() -> None:
    """Frees what the last part left: its programs (eqfit's and JAX's) and arrays."""
    gc.collect()
    eqfit.clear_cache()
    jax.clear_caches()
    gc.collect()


def guarded(name: str, results: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> None:
    """Runs a part; an error is printed and recorded, and the other parts go on."""
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as error:  # one part's failure must not lose the others
        traceback.print_exc()
        results[name] = {"error": f"{type(error).__name__}: {error}"}
    results[name]["part_wall_s"] = time.perf_counter() - start
    say(f"{name}: done in {results[name]['part_wall_s']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description="eqfit against the floors of issue 68")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--size", choices=("tiny", "full", "auto"), default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint-seconds", type=float, default=None)
    parser.add_argument("--checkpoint-repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "accelerator.json")
    parser.add_argument("--worker", choices=("eqfit", "usual"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(first_worker(args.worker, args.size or "auto")), flush=True)
        return
    load_before = load_average()
    parts: dict[str, Any] = {}
    # The children first: on a TPU one process holds the chip, and this one has not yet.
    if "first" in args.only:
        guarded("first", parts, lambda: first_part(args.size or "auto"))
    size = args.size or parts.get("first", {}).get("size") or default_size()
    cfg = {**config(), "size": size, "repeats": args.repeats, "only": args.only}
    say(f"size {size} on {cfg['device']} ({cfg['backend']}), JAX {cfg['jax']}")
    results: dict[str, Any] = {"config": cfg, "parts": parts}
    shapes = SIZES[size]
    events = CompileEvents()
    seconds = args.checkpoint_seconds
    if seconds is None and size == "full":
        seconds = 60.0
    write(args.out, results)
    if "gpt" in args.only or "checkpoint" in args.only:
        run = gpt_run(shapes["gpt"])
        if "gpt" in args.only:
            guarded("gpt", parts, lambda: gpt_part(run, args.repeats, events))
            gc.collect()  # the floors' states; eqfit's programs kept for the checkpoints
            write(args.out, results)
        if "checkpoint" in args.only:
            repeats = args.checkpoint_repeats
            guarded("checkpoint", parts, lambda: checkpoint_part(run, seconds, repeats, events))
        del run
        free()
        write(args.out, results)
    if "mlp" in args.only:
        guarded("mlp", parts, lambda: mlp_part(shapes["mlp"], args.repeats, events))
        free()
        write(args.out, results)
    if "conv" in args.only:
        guarded("conv", parts, lambda: conv_part(shapes["conv"], args.repeats, events))
        free()
    print_report(parts)
    finish(args.out, results, STARTED, load_before)


def write(path: Path, results: dict[str, Any]) -> None:
    """The results so far, so that a run cut short keeps them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
