"""GPT-2-small, written plainly in Equinox, trained by `eqfit.fit` at the device's speed.

The model is GPT-2's: pre-LN blocks (causal self-attention, then a GELU MLP four times
as wide, each on a LayerNorm of its input and added back), learned positions, and the
output head tied to the token embedding. `--size small` is GPT-2-small (12 layers, width
768, 12 heads, context 1024, 124 M parameters; the vocabulary 50,304, GPT-2's 50,257
rounded up to a multiple of 128), batch 8; `--size tiny` (2 layers, width 64, 4 heads,
context 64, vocabulary 256, batch 4) runs on a CPU in seconds, as a test.

Attention goes through the fastest kernel JAX ships for the device (`--attention auto`):
on a TPU, Pallas's splash attention (a flash attention that skips the blocks the causal
mask hides); on a GPU, cuDNN's, through `jax.nn.dot_product_attention`; elsewhere XLA's.
`--attention xla|cudnn|splash` picks one; splash on another device than a TPU runs in
Pallas's interpreter, slowly, to check it against XLA's.

It trains with `fit(..., precision="bfloat16")`: the weights and Adam's state in float32,
the forward and backward passes in bfloat16, the LayerNorms' statistics, the residual
stream and the loss's softmax in float32. The data: random tokens by default (an epoch of
`--steps` batches, made on the device), whose loss stays near log(vocabulary), or with
`--text PATH` a file's bytes as tokens (windows of context + 1 bytes), whose loss falls.

At the end it prints one line: the steps, the seconds a step, the tokens a second, the
MFU as `history.throughput["mfu"]` reads it (eqfit knows the peak of the common GPUs and
TPUs; `--peak-tflops` gives another's), and the loss; `--json PATH` writes them. The
figures are the median of the epochs after the first, which also holds the calls that
measure the run's speed.

Run: `python examples/gpt2.py [--size small|tiny] [--batch B] [--steps S] [--epochs E]
[--attention auto|xla|cudnn|splash] [--precision bfloat16|float32] [--text PATH]
[--peak-tflops T] [--remat none|nothing|dots|dots_no_batch|blocks] [--microbatches K|auto]
[--progress] [--json PATH]`
"""

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, cast, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqfit


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    context: int
    vocab: int
    batch: int
    learning_rate: float
    steps: int  # an epoch's, by default
    epochs: int


SIZES = {
    "small": Size(12, 768, 12, 1024, 50_304, 8, 6e-4, steps=50, epochs=4),
    "tiny": Size(2, 64, 4, 64, 256, 4, 3e-3, steps=10, epochs=3),
}

Kernel = Literal["xla", "cudnn", "splash"]
# Splash attention's blocks are multiples of 128 positions (a TPU vector register's lanes).
SPLASH_BLOCKS = (512, 256, 128)


# ---------------------------------------------------------------------------------------
# Attention


def kernel_for(choice: str, platform: str, context: int) -> Kernel:
    """The attention kernel of `--attention choice` on `platform`'s devices."""
    named: dict[str, Kernel] = {"xla": "xla", "cudnn": "cudnn", "splash": "splash"}
    if choice in named:
        return named[choice]
    if platform == "tpu" and context % SPLASH_BLOCKS[-1] == 0:
        return "splash"
    return "cudnn" if platform == "gpu" else "xla"


def splash_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    *,
    interpret: bool = False,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention through Pallas's splash attention kernel (TPU only, unless
    `interpret`), one sequence at a time.
    """
    # Imported here: Pallas's TPU kernels need not import, nor be importable, elsewhere.
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _, seq, heads, head_dim = q.shape
    if seq % SPLASH_BLOCKS[-1]:
        raise ValueError(
            f"Splash attention takes sequences of a multiple of {SPLASH_BLOCKS[-1]} "
            f"positions, got {seq}: give `--attention xla`."
        )
    block = next(b for b in SPLASH_BLOCKS if seq % b == 0)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        # dq, dk and dv in one kernel of the backward pass, not two: faster on a v5e
        # (`benchmarks/transformer.py`).
        use_fused_bwd_kernel=True,
    )
    mask = splash.MultiHeadMask([splash.CausalMask((seq, seq)) for _ in range(heads)])
    kernel = splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )

    # The kernel takes one sequence's (heads, seq, head_dim), and does not scale the
    # queries itself.
    def heads_first(x: Array) -> Array:
        return x.transpose(0, 2, 1, 3)

    q = q * (1 / math.sqrt(head_dim))
    out = jax.vmap(kernel)(heads_first(q), heads_first(k), heads_first(v))
    return heads_first(cast(Array, out))  # its residuals too only with `save_residuals`


def xla_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
) -> Float[Array, "batch seq heads head_dim"]:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq heads head_dim"],
    v: Float[Array, "batch seq heads head_dim"],
    kernel: Kernel,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal self-attention, softmax(q k^T / sqrt(head_dim)) v, through `kernel`."""
    if kernel == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if kernel == "xla":
        return xla_attention(q, k, v)
    if jax.devices()[0].platform != "tpu":
        return splash_attention(q, k, v, interpret=True)
    # eqfit counts a step's FLOPs on the step lowered for the CPU, where this takes XLA's
    # attention: the model's FLOPs, its full score matrices counted as MFU's usual formula
    # (PaLM's) counts them. The kernel's own program has no count of its own.
    return jax.lax.platform_dependent(q, k, v, tpu=splash_attention, default=xla_attention)


# ---------------------------------------------------------------------------------------
# The model


class Dense(eqx.Module):
    """`x @ weight + bias` over the last axis, `x` cast to the weight's dtype."""

    weight: Float[Array, "fan_in fan_out"]
    bias: Float[Array, " fan_out"]

    def __init__(self, fan_in: int, fan_out: int, std: float, key: PRNGKeyArray):
        self.weight = std * jax.random.normal(key, (fan_in, fan_out))
        self.bias = jnp.zeros(fan_out)

    def __call__(self, x: Float[Array, "*batch fan_in"]) -> Float[Array, "*batch fan_out"]:
        return x.astype(self.weight.dtype) @ self.weight + self.bias


class LayerNorm(eqx.Module):
    """A LayerNorm over the last axis, in float32 whatever the dtypes of `x` and its
    parameters: bfloat16's 8 bits of mantissa would round the variance.
    """

    weight: Float[Array, " width"]
    bias: Float[Array, " width"]

    def __init__(self, width: int):
        self.weight = jnp.ones(width)
        self.bias = jnp.zeros(width)

    def __call__(self, x: Float[Array, "*batch width"]) -> Float[Array, "*batch width"]:
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        variance = jnp.square(x - mean).mean(-1, keepdims=True)
        normed = (x - mean) * jax.lax.rsqrt(variance + 1e-5)
        return normed * self.weight.astype(jnp.float32) + self.bias.astype(jnp.float32)


class Block(eqx.Module):
    """Causal self-attention and an MLP, each on a LayerNorm of its input, added back."""

    attention_norm: LayerNorm
    qkv: Dense
    out: Dense
    mlp_norm: LayerNorm
    up: Dense
    down: Dense
    heads: int = eqx.field(static=True)
    kernel: Kernel = eqx.field(static=True)

    def __init__(self, size: Size, kernel: Kernel, key: PRNGKeyArray):
        qkv_key, out_key, up_key, down_key = jax.random.split(key, 4)
        width = size.width
        # GPT-2's initialisation: the layers that add to the residual stream scaled down
        # by the square root of their number, so that the stream's variance stays put.
        residual = 0.02 / math.sqrt(2 * size.layers)
        self.attention_norm = LayerNorm(width)
        self.qkv = Dense(width, 3 * width, 0.02, qkv_key)
        self.out = Dense(width, width, residual, out_key)
        self.mlp_norm = LayerNorm(width)
        self.up = Dense(width, 4 * width, 0.02, up_key)
        self.down = Dense(4 * width, width, residual, down_key)
        self.heads = size.heads
        self.kernel = kernel

    def __call__(self, x: Float[Array, "batch seq width"]) -> Float[Array, "batch seq width"]:
        batch, seq, width = x.shape
        qkv = self.qkv(self.attention_norm(x))
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * self.heads, -1), 3, axis=2)
        x = x + self.out(attention(q, k, v, self.kernel).reshape(batch, seq, width))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class GPT(eqx.Module):
    """Logits for the next token at each position of a batch of sequences."""

    token_embedding: Float[Array, "vocab width"]
    position_embedding: Float[Array, "context width"]
    blocks: list[Block]
    final_norm: LayerNorm

    def __init__(self, size: Size, kernel: Kernel, key: PRNGKeyArray):
        token_key, position_key, *block_keys = jax.random.split(key, 2 + size.layers)
        self.token_embedding = 0.02 * jax.random.normal(token_key, (size.vocab, size.width))
        self.position_embedding = 0.01 * jax.random.normal(position_key, (size.context, size.width))
        self.blocks = [Block(size, kernel, k) for k in block_keys]
        self.final_norm = LayerNorm(size.width)

    def __call__(self, tokens: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
        # The residual stream in float32; each matmul in the weights' dtype.
        x = self.token_embedding[tokens].astype(jnp.float32)
        x = x + self.position_embedding[: tokens.shape[1]]
        for block in self.blocks:
            # Named, so that `--remat blocks` keeps each block's output and computes the
            # rest again in the backward pass (a name alone changes nothing).
            x = checkpoint_name(block(x), "block")
        # The head tied to the embedding.
        embedding = self.token_embedding
        return self.final_norm(x).astype(embedding.dtype) @ embedding.T


def loss(model: GPT, tokens: Int[Array, "batch seq_plus_1"]) -> Float[Array, ""]:
    """Cross-entropy of the next token, in nats, averaged over every position; the softmax
    in float32 whatever the model computes in.
    """
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# ---------------------------------------------------------------------------------------
# The run


def random_tokens(size: Size, rows: int, key: PRNGKeyArray) -> Int[Array, "rows seq_plus_1"]:
    """`rows` sequences of `context + 1` random tokens (inputs and targets shifted by one),
    made on the device.
    """
    return jax.random.randint(key, (rows, size.context + 1), 0, size.vocab, jnp.int32)


def text_tokens(size: Size, path: Path) -> np.ndarray:
    """The bytes of the file at `path` as tokens, in windows of `context + 1`."""
    tokens = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)
    windows = (len(tokens) - 1) // size.context
    if windows < size.batch:
        raise SystemExit(
            f"--text: {path} holds {len(tokens):,} bytes, too few for a batch of "
            f"{size.batch} windows of {size.context + 1}."
        )
    starts = np.arange(windows) * size.context
    return tokens[starts[:, None] + np.arange(size.context + 1)]


def optimizer(size: Size, total_steps: int) -> optax.GradientTransformation:
    """AdamW as GPT-2's reproductions use it: a linear warmup over a tenth of the run,
    then a cosine to a tenth of the peak rate; no weight decay on the vectors (biases,
    LayerNorms); the gradient clipped to a global norm of 1.
    """
    warmup = max(1, total_steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, size.learning_rate, warmup, max(total_steps, warmup + 1), size.learning_rate / 10
    )

    def matrices(params: Any) -> Any:
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=matrices)
    return optax.chain(optax.clip_by_global_norm(1.0), adamw)


def median_after_first(values: np.ndarray) -> float:
    """The median of the epochs after the first (of the only one, if one), NaN left out."""
    values = values[1:] if len(values) > 1 else values
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else float("nan")


def summary(result: eqfit.FitResult[GPT], size: Size, batch: int) -> dict[str, Any]:
    """The run's figures, from its history."""
    history = result.history
    throughput = history.throughput
    seconds_per_step = 1 / median_after_first(throughput["steps_per_second"])
    mfu = median_after_first(throughput["mfu"]) if "mfu" in throughput else None
    flops = throughput.get("flops_per_second")
    return {
        "steps": int(np.sum(history.batch_sizes > 0)),
        "seconds_per_step": seconds_per_step,
        "tokens_per_second": batch * size.context / seconds_per_step,
        "flops_per_second": None if flops is None else median_after_first(flops),
        "mfu": mfu,
        "first_loss": float(history.step_loss[0, 0]),
        "final_loss": float(history.loss[-1]),
        "epoch_loss": [float(x) for x in history.loss],
    }


def fit_options(args: argparse.Namespace) -> dict[str, Any]:
    """`remat=` and `microbatches=` for `fit`, each only where the command line moved it
    from its default.
    """
    options: dict[str, Any] = {}
    if args.remat == "blocks":  # each block's output kept, as the model names it
        options["remat"] = jax.checkpoint_policies.save_only_these_names("block")
    elif args.remat != "none":
        options["remat"] = args.remat
    if args.microbatches != 1:
        options["microbatches"] = args.microbatches
    return options


def count_or_auto(text: str) -> int | str:
    """`--microbatches`: a positive integer, or `auto`."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive integer or auto, not {text!r}")
    return int(text)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="GPT-2-small trained by eqfit.fit.")
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--batch", type=int, help="sequences a step (small: 8, tiny: 4)")
    parser.add_argument("--steps", type=int, help="steps an epoch (small: 50, tiny: 10)")
    parser.add_argument("--epochs", type=int, help="(small: 4, tiny: 3)")
    parser.add_argument("--attention", choices=("auto", "xla", "cudnn", "splash"), default="auto")
    parser.add_argument("--precision", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--text", type=Path, help="a file whose bytes to train on")
    parser.add_argument("--peak-tflops", type=float, help="one device's peak, for the MFU")
    parser.add_argument(
        "--remat",
        choices=("none", "nothing", "dots", "dots_no_batch", "blocks"),
        default="none",
    )
    parser.add_argument("--microbatches", type=count_or_auto, default=1, help="K or auto")
    parser.add_argument("--progress", action="store_true", help="fit's plan, lines, bar")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    return parser.parse_args()


def main() -> None:
    args = parse()
    size = SIZES[args.size]
    batch = args.batch or size.batch
    steps = args.steps or size.steps
    epochs = args.epochs or size.epochs
    device = jax.devices()[0]
    kernel = kernel_for(args.attention, device.platform, size.context)

    model_key, data_key, fit_key = jax.random.split(jax.random.key(0), 3)
    model = GPT(size, kernel, model_key)
    parameters = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"GPT {args.size}: {parameters:,} parameters, batch {batch} x {size.context} "
        f"tokens, {kernel} attention, on {device.device_kind}"
    )
    tokens = (
        random_tokens(size, steps * batch, data_key)
        if args.text is None
        else text_tokens(size, args.text)
    )

    arguments: dict[str, Any] = dict(
        loss=loss,
        optimizer=optimizer(size, steps * epochs),
        key=fit_key,
        epochs=epochs,
        steps_per_epoch=steps,
        batch_size=batch,
        # Random tokens need no shuffle: each batch is then a slice, not a gather.
        shuffle=args.text is not None,
        precision=None if args.precision == "float32" else args.precision,
        peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
        progress=args.progress,
        **fit_options(args),
    )
    # The plan compiles the run's programs into eqfit's cache (`fit` then compiles
    # nothing), and says the memory they need on the device.
    plan = eqfit.plan(model, (tokens,), **arguments)
    print(plan.summary())
    result = eqfit.fit(model, (tokens,), **arguments)

    figures = summary(result, size, batch)
    stats = device.memory_stats() or {}  # the CPU keeps none
    # The device's peak: its arrays' (`peak_bytes_in_use`), and what its runtime reserved
    # for the programs' temporaries (`peak_bytes_reserved`, a TPU's), which the arrays'
    # figure leaves out.
    peak = stats.get("peak_bytes_in_use")
    figures.update(
        plan_memory_bytes=plan.memory.total,
        peak_bytes=None if peak is None else peak + stats.get("peak_bytes_reserved", 0),
        memory_stats=stats,
        microbatches=result.history.microbatches,
        microbatches_why=plan.microbatches_why,
    )
    mfu = (
        "MFU unknown (no peak: --peak-tflops)"
        if figures["mfu"] is None
        else (f"MFU {figures['mfu']:.1%}")
    )
    print(
        f"{figures['steps']} steps: {figures['seconds_per_step'] * 1e3:.1f} ms a step, "
        f"{figures['tokens_per_second']:,.0f} tokens/s, {mfu}; "
        f"loss {figures['first_loss']:.3f} -> {figures['final_loss']:.3f}"
    )
    if args.json is not None:
        figures.update(size=args.size, batch=batch, attention=kernel, device=device.device_kind)
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
