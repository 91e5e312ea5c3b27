"""A character-level transformer language model, trained on text that scikit-learn ships.

The corpus is the dataset descriptions bundled inside scikit-learn (`sklearn/datasets/descr/
*.rst`, about 43,000 characters of English and reStructuredText), so nothing is downloaded.
A small decoder-only transformer (causal self-attention, learned positions, dropout) learns
to predict each next character. The run reports the validation perplexity next to a
unigram baseline (the character frequencies alone), then samples some text.

    python examples/char_transformer.py             # the full run
    python examples/char_transformer.py --quick     # a smoke test: a tiny model, 2 short epochs
"""

from __future__ import annotations

import argparse
import importlib.resources
import math

import flax.linen as nn
import jax
import numpy as np
import optax
from _args import at_least

import fuseloop as fl


def corpus() -> str:
    """The dataset descriptions that scikit-learn installs with itself."""
    folder = importlib.resources.files("sklearn.datasets") / "descr"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".rst"))
    if not names:
        raise FileNotFoundError(f"no .rst file in {folder}: is scikit-learn installed?")
    return "\n".join((folder / name).read_text(encoding="utf-8") for name in names)


class Block(nn.Module):
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, mask, train: bool):
        width = x.shape[-1]
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout)(
            h, h, mask=mask, deterministic=not train
        )
        x = x + h
        h = nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))
        return x + nn.Dropout(self.dropout, deterministic=not train)(h)


class CharTransformer(nn.Module):
    vocab: int
    context: int
    width: int = 96
    depth: int = 2
    heads: int = 4
    dropout: float = 0.2

    @nn.compact
    def __call__(self, tokens, train: bool):
        positions = self.param(
            "positions", nn.initializers.normal(0.02), (self.context, self.width)
        )
        x = nn.Embed(self.vocab, self.width)(tokens) + positions[: tokens.shape[-1]]
        mask = nn.make_causal_mask(tokens)  # position t sees positions <= t only
        for _ in range(self.depth):
            x = Block(self.heads, self.dropout)(x, mask, train)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))  # next-character logits


def windows(ids: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Overlapping windows: inputs ids[s:s+T] and targets ids[s+1:s+T+1]."""
    starts = np.arange(0, len(ids) - context - 1, context // 2)
    index = starts[:, None] + np.arange(context + 1)[None]
    chunks = ids[index]
    return chunks[:, :-1], chunks[:, 1:]


def unigram_perplexity(train_ids: np.ndarray, val_ids: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train_ids, minlength=vocab) + 1.0  # add-one smoothing
    log_p = np.log(counts / counts.sum())
    return float(math.exp(-log_p[val_ids].mean()))


def sample(
    model, params, prompt_ids: np.ndarray, length: int, seed: int = 0, temperature: float = 0.8
) -> np.ndarray:
    """Draws `length` characters after the prompt, one at a time, from a sliding window of
    the model's context size (one compiled program for every position)."""
    next_logits = jax.jit(lambda p, w: model.apply(p, w, train=False)[0, -1])
    window, out = np.array(prompt_ids[-model.context :]), []
    key = jax.random.PRNGKey(seed)
    for i in range(length):
        logits = next_logits(params, window[None])
        token = int(jax.random.categorical(jax.random.fold_in(key, i), logits / temperature))
        out.append(token)
        window = np.append(window[1:], token)
    return np.array(out)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=at_least(1), default=30)
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model, 2 epochs of 4 iterations"
    )
    parser.add_argument("--fuse", type=at_least(0), default=16, help="chunk size (0: unfused)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--sample", type=at_least(0), default=300, help="characters to generate")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    text = corpus()
    alphabet = sorted(set(text))
    ids = np.array([alphabet.index(c) for c in text], dtype=np.int32)
    cut = int(0.9 * len(ids))
    if args.quick:
        model = CharTransformer(len(alphabet), context=32, width=32, depth=1, heads=2)
        epochs, iterations, length = 2, 4, 20
    else:
        model = CharTransformer(len(alphabet), context=64)
        epochs, iterations, length = args.epochs, None, args.sample
    train = fl.data.arrays(*windows(ids[:cut], model.context), batch_size=32, seed=0)
    val = fl.data.arrays(
        *windows(ids[cut:], model.context), batch_size=32, shuffle=False, drop_remainder=False
    )
    steps = epochs * (iterations or len(train))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, max(1, steps // 20), steps)
    loop = (
        fl.trainer(model, "sparse_categorical_cross_entropy", optax.adamw(schedule))
        .metric("accuracy")
        .validate(model, val)
        .early_stop("validation_loss", patience=3)
    )
    state = loop.run(
        train, epochs=epochs, iterations=iterations, fuse=args.fuse or False, progress=args.progress
    )
    best = min(state.history, key=lambda e: state.history[e]["validation_loss"])
    perplexity = math.exp(state.history[best]["validation_loss"])
    baseline = unigram_perplexity(ids[:cut], ids[cut:], len(alphabet))
    print(
        f"corpus: {len(text)} characters, {len(alphabet)} distinct; "
        f"{state.status} after {len(state.history)} epochs"
    )
    print(
        f"best validation perplexity per character: {perplexity:.2f} at epoch {best + 1} "
        f"(unigram baseline: {baseline:.2f}); next-character accuracy "
        f"{state.history[best]['validation_accuracy']:.3f}"
    )
    generated = sample(model, state.params, ids[cut : cut + model.context], length)
    text_out = "".join(alphabet[i] for i in generated)
    print("sample:\n" + text_out)
    return {"state": state, "perplexity": perplexity, "baseline": baseline, "sample": text_out}


if __name__ == "__main__":
    main()
