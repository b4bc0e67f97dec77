"""A small character-level transformer language model, its arrays sharded over 8 devices.

A decoder-only transformer written here from `eqx.nn` layers learns to write like the
Python Language Reference, the text that ships with Python itself (`pydoc_data.topics`,
what `help("assert")` prints: about 460 KB of English prose and grammar). It trains over
a mesh of 8 simulated CPU devices with `fit(..., mesh=, shard=)`, so that no device holds
the whole model and optimizer state, printing a line of the model's at each epoch's end
(a callback that sees the model), then writes a sample.

- `--layout fsdp` (the default): a `(8,)` mesh, axis "data": each batch split over the
  8 devices, and each large array split along its largest dimension (FSDP, ZeRO-3).
- `--layout tp`: a `(2, 4)` mesh, axes ("data", "model"): each batch split over the 2
  rows, and the attention heads and MLP hidden units over the 4 columns, as Megatron-LM
  splits them (tensor parallelism).

It trains as a real model would: the forward and backward passes in bfloat16 over float32
weights (`precision=`), a moving average of the weights beside them (`ema=`), the norms
of each step's gradient and update recorded (`norms=True`), and the loss returning its
next-character accuracy, read from the same forward pass. `--no-bf16`, `--no-ema`,
`--no-norms` and `--no-aux` turn each off. At the end it prints the validation loss of
the weights and of their average, on the last tenth of the text, held out.

On a machine with several GPUs, drop the config line below.
Before it trains it prints its plan (`eqfit.plan`): each array's layout (its two blocks
folded into one row per array), the memory per device and what holds it, the precision
and the FLOPs per step; `--plan` prints it and trains nothing.

Run: `python examples/transformer_lm.py [--layout fsdp|tp] [--epochs N] [--quick]
[--no-bf16] [--no-ema] [--no-norms] [--no-aux] [--plan]`
"""

import argparse

import jax


jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts: 8 simulated CPU devices

import re  # noqa: E402
from typing import Any  # noqa: E402

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
from jaxtyping import Array, Float, Int, PRNGKeyArray  # noqa: E402

import eqfit  # noqa: E402


# The alphabet: a newline and printable ASCII, 96 characters; a multiple of 8, so that
# the vocabulary axis splits evenly over the devices.
ALPHABET = "\n" + "".join(chr(i) for i in range(32, 127))
CONTEXT, WIDTH, HEADS, LAYERS = 64, 64, 4, 2
TEMPERATURE = 0.8  # below 1, the sample keeps to likelier characters
PROMPT = "The "
STEPS_PER_EPOCH = 25
# The average covers about the last 1 / (1 - m) = 50 steps. The 0.999 usual for runs of
# many thousand steps would, over the 150 steps here, leave 0.999**150 = 86% of the
# initial weights in it, and its loss would say little but that. (`--quick`'s 20 steps are
# too few for any average: its line there shows mostly the initial weights' loss, and
# `fit` warns of it.)
EMA = 0.98
# Typographic characters the text uses, written in ASCII; any other is dropped.
ASCII = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\t": " "})


def load_text() -> str:
    """The Python Language Reference's topics, as ASCII."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise SystemExit(
            "This example trains on the Python Language Reference, which ships with Python "
            "as the module `pydoc_data.topics`; this Python has been installed without it."
        ) from None
    text = "\n\n".join(topics.values()).translate(ASCII)
    return "".join(c for c in text if c in ALPHABET)


def encode(text: str) -> np.ndarray:
    table = np.zeros(128, np.int32)
    table[[ord(c) for c in ALPHABET]] = np.arange(len(ALPHABET))
    return table[np.frombuffer(text.encode("ascii"), np.uint8)]


def decode(tokens: np.ndarray) -> str:
    return "".join(ALPHABET[t] for t in tokens)


class Block(eqx.Module):
    """Causal self-attention and an MLP, each on a LayerNorm of its input, added back."""

    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        attention_key, in_key, out_key = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(WIDTH)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=attention_key)
        self.mlp_norm = eqx.nn.LayerNorm(WIDTH)
        self.mlp_in = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=in_key)
        self.mlp_out = eqx.nn.Linear(4 * WIDTH, WIDTH, key=out_key)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, h, h, mask=causal)
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(h)))


class TransformerLM(eqx.Module):
    """Logits for the next character at each position of a sequence."""

    token_embedding: eqx.nn.Embedding
    position_embedding: eqx.nn.Embedding
    blocks: list[Block]
    final_norm: eqx.nn.LayerNorm
    unembedding: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        token_key, position_key, head_key, *block_keys = jax.random.split(key, 3 + LAYERS)
        self.token_embedding = eqx.nn.Embedding(len(ALPHABET), WIDTH, key=token_key)
        self.position_embedding = eqx.nn.Embedding(CONTEXT, WIDTH, key=position_key)
        self.blocks = [Block(k) for k in block_keys]
        self.final_norm = eqx.nn.LayerNorm(WIDTH)
        self.unembedding = eqx.nn.Linear(WIDTH, len(ALPHABET), key=head_key)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.token_embedding)(tokens)
        x = x + self.position_embedding.weight[: tokens.shape[0]]
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.unembedding)(jax.vmap(self.final_norm)(x))


def logits_of(model: TransformerLM, x: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
    # The softmax in float32 whatever the model computes in: bfloat16's 8 bits of
    # mantissa would round the loss's log-probabilities.
    return jax.vmap(model)(x).astype(jnp.float32)


def loss(
    model: TransformerLM, x: Int[Array, "batch seq"], y: Int[Array, "batch seq"]
) -> Float[Array, ""]:
    """Cross-entropy of the next character, in nats, averaged over every position."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(model, x), y).mean()


def loss_and_accuracy(
    model: TransformerLM, x: Int[Array, "batch seq"], y: Int[Array, "batch seq"]
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The cross-entropy, and as aux how often the likeliest next character is the right
    one: both from one forward pass. `fit` differentiates the first and records the second
    as `"acc"`.
    """
    logits = logits_of(model, x)
    value = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return value, {"acc": jnp.mean(jnp.argmax(logits, axis=-1) == y)}


def windows(tokens: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Every `stride`-th window of `CONTEXT + 1` characters: the inputs, and each shifted
    by one, the characters to predict.
    """
    starts = np.arange(0, len(tokens) - CONTEXT - 1, stride)
    sequences = tokens[starts[:, None] + np.arange(CONTEXT + 1)]
    return sequences[:, :-1], sequences[:, 1:]


@eqx.filter_jit
def generate(
    model: TransformerLM, prompt: Int[Array, " prompt"], length: int, key: PRNGKeyArray
) -> Int[Array, " total"]:
    """`prompt` and `length` characters after it, each drawn from the model's prediction
    given the `CONTEXT` characters before it. One compiled loop: the window has a fixed
    size, and positions after the one read are hidden by the causal mask anyway.
    """
    text = jnp.zeros(prompt.shape[0] + length, jnp.int32).at[: prompt.shape[0]].set(prompt)

    def step(i: Int[Array, ""], text: Int[Array, " total"]) -> Int[Array, " total"]:
        start = jnp.maximum(i - CONTEXT, 0)
        logits = model(jax.lax.dynamic_slice(text, (start,), (CONTEXT,)))[i - 1 - start]
        token = jax.random.categorical(jax.random.fold_in(key, i), logits / TEMPERATURE)
        return text.at[i].set(token)

    return jax.lax.fori_loop(prompt.shape[0], text.shape[0], step, text)


class PrintSample(eqfit.ModelCallback[TransformerLM]):
    """Prints a line that the model writes at each epoch's end, as it stands then: `fit`
    hands it the model (of this class, laid out as trained) at the epoch's end.
    """

    # It never stops training: the device trains on while it writes.
    stops_training = False

    def __init__(self, key: PRNGKeyArray):
        self.key = key

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        pass

    def on_epoch_model(
        self, epoch: int, model: TransformerLM, ema_model: TransformerLM | None
    ) -> None:
        # The same key each epoch: the lines differ by what the model learned. As few
        # characters as `generate`'s window takes, to keep it quick.
        length = CONTEXT - len(PROMPT)
        text = generate(model, jnp.asarray(encode(PROMPT)), length, self.key)
        print(f"epoch {epoch} writes: {decode(np.asarray(text))!r}")


def layouts(model: TransformerLM) -> list[str]:
    """Each array's layout, the blocks (all laid out alike) shown once as `blocks[*]`."""
    rows = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]:
        where = re.sub(r"\[\d+\]", "[*]", jax.tree_util.keystr(path))
        spec = leaf.sharding.spec
        rows[where] = f"{where:42} {str(tuple(leaf.shape)):10} {spec if spec else 'replicated'}"
    return list(rows.values())


def layout(name: str) -> tuple[Mesh, eqfit.sharding.Shard]:
    """The mesh and the layout rule of `--layout fsdp` or `--layout tp`."""
    devices = np.array(jax.devices())
    if name == "fsdp":
        mesh = Mesh(devices, ("data",))
        shard = eqfit.sharding.fsdp("data")
    else:
        mesh = Mesh(devices.reshape(2, 4), ("data", "model"))
        # Megatron's split: q, k, v and the first MLP layer column-parallel (each device
        # computes its heads, its hidden units), the attention output and the second MLP
        # layer row-parallel (each adds its part, one all-reduce per sublayer). An
        # `eqx.nn.Linear`'s weight is `(out, in)`. The embeddings split their features.
        shard = eqfit.sharding.rules(
            (r"\.attention\.(query|key|value)_proj\.weight$", P("model", None)),
            (r"\.attention\.output_proj\.weight$", P(None, "model")),
            (r"\.mlp_in\.weight$", P("model", None)),
            (r"\.mlp_in\.bias$", P("model")),
            (r"\.mlp_out\.weight$", P(None, "model")),
            (r"_embedding\.weight$", P(None, "model")),
            (r"^\.unembedding\.weight$", P("model", None)),
            (r"^\.unembedding\.bias$", P("model")),
            default=None,
        )
    return mesh, shard


def main() -> None:
    parser = argparse.ArgumentParser(description="A character-level transformer over 8 devices.")
    parser.add_argument("--layout", choices=("fsdp", "tp"), default="fsdp")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a short run, for the tests")
    parser.add_argument("--no-bf16", action="store_true", help="compute in float32")
    parser.add_argument("--no-ema", action="store_true", help="keep no moving average")
    parser.add_argument("--no-norms", action="store_true", help="record no norms")
    parser.add_argument("--no-aux", action="store_true", help="a loss without its accuracy")
    parser.add_argument("--plan", action="store_true", help="print the plan, train nothing")
    args = parser.parse_args()
    epochs, steps_per_epoch = (2, 10) if args.quick else (args.epochs, STEPS_PER_EPOCH)

    tokens = encode(load_text())
    # The last tenth of the text is held out, whole: windows overlap, so windows drawn
    # from the same text would repeat training characters.
    split = len(tokens) * 9 // 10
    x, y = windows(tokens[:split], stride=CONTEXT // 2)
    val_x, val_y = windows(tokens[split:], stride=CONTEXT)
    # Whole batches of 256 (`evaluate`'s default): its program then has one batch shape.
    held = len(val_x) // 256 * 256
    val_x, val_y = val_x[:held], val_y[:held]
    print(f"{len(tokens):,} characters, {len(x):,} windows of {CONTEXT}, {len(val_x):,} held out")

    mesh, shard = layout(args.layout)
    model_key, fit_key, sample_key = jax.random.split(jax.random.key(0), 3)
    model = eqfit.sharding.init(TransformerLM, model_key, mesh=mesh, shard=shard)
    size = sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(f"{size:,} parameters, over a mesh {dict(mesh.shape)}")

    # The forward and backward passes in bfloat16, the weights and the optimizer's state in
    # float32. On a CPU bfloat16 runs slower than float32, not faster, and the epochs here
    # are short to keep the run quick: the gain is on GPUs and TPUs, whose matrix units
    # take bfloat16 natively.
    precision = None if args.no_bf16 else "bfloat16"
    arguments: dict[str, Any] = dict(
        loss=loss if args.no_aux else loss_and_accuracy,
        optimizer=optax.adamw(1e-2),
        key=fit_key,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,  # an epoch of 25 steps: an eighth of a pass
        batch_size=64,
        mesh=mesh,
        shard=shard,
        precision=precision,
        ema=None if args.no_ema else EMA,
        norms=not args.no_norms,
    )
    # What the run will need, from its compiled programs, before it trains: each array's
    # layout, the memory per device, the FLOPs. `fit` then compiles nothing more.
    print(eqfit.plan(model, (x, y), **arguments))
    if args.plan:
        return
    # A line of the model's at each epoch's end, as training goes.
    result = eqfit.fit(model, (x, y), callbacks=[PrintSample(sample_key)], **arguments)
    history = result.history
    for i, epoch in enumerate(history.epoch):
        line = f"epoch {epoch}: loss {history.loss[i]:.3f} nats per character"
        if not args.no_aux:
            line += f", accuracy {history['acc'][i]:.1%}"
        if not args.no_norms:
            # Epoch means of each step's global L2 norm, before the optimizer and after.
            line += f", gradient norm {history['grad_norm'][i]:.3f}"
            line += f", update norm {history['update_norm'][i]:.4f}"
        print(line)

    # In the same precision as training, so that the figures compare with its loss.
    def validation_loss(trained: TransformerLM) -> float:
        values = eqfit.evaluate(trained, (val_x, val_y), loss=loss, precision=precision)
        return values["loss"]

    print(f"validation loss: {validation_loss(result.model):.3f} nats per character")
    if result.ema_model is not None:
        average = validation_loss(result.ema_model)
        print(f"validation loss of the average (ema={EMA}): {average:.3f} nats per character")

    print("layouts of the trained model's arrays:")
    print("\n".join(f"  {row}" for row in layouts(result.model)))
    trained = (eqx.filter(result.model, eqx.is_array), result.opt_state)
    held = "model and optimizer state"
    if result.ema_model is not None:  # the average is part of the training state too
        trained += (eqx.filter(result.ema_model, eqx.is_array),)
        held = "model, optimizer state and average"
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(trained) if isinstance(leaf, jax.Array))
    fullest = max(eqfit.sharding.bytes_per_device(trained).values())
    print(f"{held}: {whole:,} bytes, the fullest device holds {fullest:,}")

    sample = generate(result.model, jnp.asarray(encode(PROMPT)), 200, sample_key)
    print("sample:")
    print(decode(np.asarray(sample)))


if __name__ == "__main__":
    main()
