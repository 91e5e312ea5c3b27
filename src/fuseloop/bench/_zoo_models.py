"""The model zoo's networks: flax.linen modules for the JAX systems, Keras 3 equivalents.

- `DigitsCNN`: two 3x3 convolutions with BatchNorm on 8x8x1 images (its `train` flag makes
  fuseloop's trainer update `batch_stats`), average pooling, a dense classifier.
- `CharTransformer`: a causal, pre-LayerNorm transformer over characters (learned positions,
  multi-head self-attention with a causal mask, a GELU MLP per layer), next-character logits.
- `CharGRU`: an embedding, a GRU run by `flax.linen.RNN` (an `nn.scan`, i.e. `lax.scan`, over
  the sequence), next-character logits.

The Keras builders make the same layer shapes in Keras 3 (same widths, not the same
initial weights or kernels), so their rows compare loops over comparable work.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

__all__ = ["DigitsCNN", "CharTransformer", "CharGRU", "keras_cnn", "keras_transformer", "keras_gru"]

CNN_WIDTHS = (16, 32)


class DigitsCNN(nn.Module):
    """Conv(16)+BN+ReLU, Conv(32)+BN+ReLU, 2x2 average pool, Dense(classes); 3x3 kernels."""

    classes: int = 10

    @nn.compact
    def __call__(self, x: Any, train: bool = False) -> Any:
        for width in CNN_WIDTHS:
            # No bias: BatchNorm's shift replaces it, and a bias before BatchNorm has a
            # zero gradient that Adam would turn into +-lr steps of rounding noise.
            x = nn.Conv(width, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(self.classes)(x.reshape((x.shape[0], -1)))


class CharTransformer(nn.Module):
    """A causal transformer: `layers` pre-LN blocks of width `width`, `heads` heads."""

    vocab: int
    length: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, tokens: Any) -> Any:
        x = nn.Embed(self.vocab, self.width)(tokens)
        positions = self.param("positions", nn.initializers.normal(0.02), (self.length, self.width))
        x = x + positions[: tokens.shape[1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class CharGRU(nn.Module):
    """Embed(embed) -> GRU(width) scanned over the sequence -> Dense(vocab)."""

    vocab: int
    width: int = 64
    embed: int = 32

    @nn.compact
    def __call__(self, tokens: Any) -> Any:
        x = nn.Embed(self.vocab, self.embed)(tokens)
        x = nn.RNN(nn.GRUCell(self.width))(x)
        return nn.Dense(self.vocab)(x)


def keras_cnn(keras: Any, classes: int = 10) -> Any:
    """`DigitsCNN` in Keras 3."""
    layers: list[Any] = [keras.Input((8, 8, 1))]
    for width in CNN_WIDTHS:
        layers += [
            keras.layers.Conv2D(width, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.ReLU(),
        ]
    layers += [
        keras.layers.AveragePooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(classes),
    ]
    return keras.Sequential(layers)


def keras_gru(keras: Any, vocab: int, length: int, width: int = 64, embed: int = 32) -> Any:
    """`CharGRU` in Keras 3 (its GRU layer, which runs a `lax.scan` on the JAX backend)."""
    return keras.Sequential(
        [
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocab, embed),
            keras.layers.GRU(width, return_sequences=True),
            keras.layers.Dense(vocab),
        ]
    )


def keras_transformer(
    keras: Any, vocab: int, length: int, width: int = 64, heads: int = 4, layers: int = 2
) -> Any:
    """`CharTransformer` in Keras 3 (functional API; learned positions in a small layer)."""

    class AddPositions(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.positions = self.add_weight(
                shape=(shape[1], shape[2]), initializer=keras.initializers.RandomNormal(0.0, 0.02)
            )

        def call(self, x: Any) -> Any:
            return x + self.positions

    tokens = keras.Input((length,), dtype="int32")
    x = AddPositions()(keras.layers.Embedding(vocab, width)(tokens))
    for _ in range(layers):
        h = keras.layers.LayerNormalization()(x)
        attention = keras.layers.MultiHeadAttention(heads, width // heads)
        x = x + attention(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * width, activation="gelu")(h)
        x = x + keras.layers.Dense(width)(h)
    logits = keras.layers.Dense(vocab)(keras.layers.LayerNormalization()(x))
    return keras.Model(tokens, logits)
