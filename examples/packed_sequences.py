"""Packed sequences: several sentences in one row, a transformer that sees each alone.

Sentences of the Python Language Reference (`pydoc_data.topics`, the text that ships with
Python) vary in length (those of 8 to 128 characters are kept). Rather than padding each
to the longest, this packs them into rows of 256 characters, as grain's packing writes them:
each row holds several sentences one after another, with `segments` numbering them
(1, 2, ...; 0 for the row's padding) and `positions` counting each one's characters from
0. A small character-level transformer attends only within a sentence (a causal mask
that also requires the same segment), and its positions restart with each sentence, so
each sentence is read exactly as it would be alone.

The loss weighs each next-character prediction by whether it is a real one (inside a
sentence: not across a boundary, not padding), an `eqfit.Mean`: the epoch's loss is the
mean over the real predictions. Before training, the example checks that the packed
rows' loss equals the same sentences' loss unpacked (each padded alone to 128), then
trains on the packed rows: fewer rows to compute than padding each sentence to the
longest (128).

Run: `python examples/packed_sequences.py [--epochs N] [--quick]`
"""

import argparse
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

import eqfit


ALPHABET = "\n" + "".join(chr(i) for i in range(32, 127))  # 96 characters
ROW, LONGEST, WIDTH, HEADS = 256, 128, 64, 4  # a packed row; the longest sentence


def sentences(limit: int) -> list[np.ndarray]:
    """Sentences of the Language Reference, 8 to `LONGEST` characters, as ids."""
    from pydoc_data.topics import topics

    text = " ".join(topics.values())
    text = "".join(c if c in ALPHABET else " " for c in re.sub(r"\s+", " ", text))
    found = [s.strip() + "." for s in text.split(". ")]
    kept = [s for s in found if 8 <= len(s) <= LONGEST][:limit]
    lookup = {c: i for i, c in enumerate(ALPHABET)}
    return [np.array([lookup[c] for c in s], np.int32) for s in kept]


def pack(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`seqs` packed greedily into rows of `ROW`: tokens, segment ids (1, 2, ... in a row,
    0 for padding) and positions (from 0 in each sequence).
    """
    rows: list[list[np.ndarray]] = [[]]
    for s in seqs:
        if sum(map(len, rows[-1])) + len(s) > ROW:
            rows.append([])
        rows[-1].append(s)
    tokens = np.zeros((len(rows), ROW), np.int32)
    segments = np.zeros((len(rows), ROW), np.int32)
    positions = np.zeros((len(rows), ROW), np.int32)
    for r, row in enumerate(rows):
        at = 0
        for k, s in enumerate(row):
            tokens[r, at : at + len(s)] = s
            segments[r, at : at + len(s)] = k + 1
            positions[r, at : at + len(s)] = np.arange(len(s))
            at += len(s)
    return tokens, segments, positions


def unpacked(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sequence alone in a row of `LONGEST` (padded to the longest), in the same
    form: one segment a row.
    """
    tokens = np.zeros((len(seqs), LONGEST), np.int32)
    segments = np.zeros((len(seqs), LONGEST), np.int32)
    positions = np.zeros((len(seqs), LONGEST), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)], segments[r, : len(s)] = s, 1
        positions[r, : len(s)] = np.arange(len(s))
    return tokens, segments, positions


class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(self, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, 1, key=k2)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)

    def __call__(self, x: Float[Array, "n d"], mask: Bool[Array, "n n"]) -> Float[Array, "n d"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    """A causal character model whose attention stays inside each packed segment."""

    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: tuple[Block, Block]
    out: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        k = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(len(ALPHABET), WIDTH, key=k[0])
        self.position = eqx.nn.Embedding(LONGEST, WIDTH, key=k[1])  # restarts each sentence
        self.blocks = (Block(k[2]), Block(k[3]))
        self.out = eqx.nn.Linear(WIDTH, len(ALPHABET), key=k[4])

    def __call__(
        self, tokens: Int[Array, " n"], segments: Int[Array, " n"], positions: Int[Array, " n"]
    ) -> Float[Array, "n v"]:
        n = tokens.shape[0]
        causal = jnp.tril(jnp.ones((n, n), bool))
        same = segments[:, None] == segments[None, :]
        mask = causal & same  # a padding position sees only padding: its output is unused
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.position)(positions)
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.out)(x)


def loss(
    model: Transformer,
    tokens: Int[Array, "b n"],
    segments: Int[Array, "b n"],
    positions: Int[Array, "b n"],
) -> eqfit.Mean:
    """Next-character cross-entropy, weighted by whether the next character is in the
    same sentence: a mean over the real predictions, however the rows are packed.
    """
    logits = jax.vmap(model)(tokens, segments, positions)[:, :-1]
    targets = tokens[:, 1:]
    real = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return eqfit.Mean.of(per_token, real.astype(jnp.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description="Packed sequences: a transformer on packed rows.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seqs = sentences(256 if args.quick else 2048)
    packed, alone = pack(seqs), unpacked(seqs)
    real = sum(len(s) - 1 for s in seqs)
    print(
        f"{len(seqs)} sentences, {real} next-character predictions: {len(packed[0])} packed "
        f"rows of {ROW} against {len(alone[0])} rows of {LONGEST}, one sentence each"
    )
    model = Transformer(jax.random.key(0))
    before = eqfit.evaluate(model, packed, loss=loss, batch_size=32)["loss"]
    each = eqfit.evaluate(model, alone, loss=loss, batch_size=32)["loss"]
    print(f"loss before training: packed {before:.6f}, unpacked {each:.6f}")
    assert abs(before - each) <= 1e-5 * abs(each), "packing changed the loss"
    result = eqfit.fit(
        model, packed, loss=loss, optimizer=optax.adamw(3e-3), key=jax.random.key(1),
        epochs=args.epochs, batch_size=32,
    )  # fmt: skip
    after = eqfit.evaluate(result.model, alone, loss=loss, batch_size=32)["loss"]
    print(f"losses by epoch: {np.round(result.history.loss, 4).tolist()}")
    print(f"unpacked loss after training: {after:.4f} (from {each:.4f})")


if __name__ == "__main__":
    main()
