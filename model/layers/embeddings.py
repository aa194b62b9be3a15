"""Token embedding and output head, annotated with logical axes for sharding."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class Embedder(nn.Module):
    vocab_size: int
    d_model: int
    tie: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
            (self.vocab_size, self.d_model), self.param_dtype)
        if not self.tie:
            self.head = self.param(
                "head",
                nn.with_logical_partitioning(nn.initializers.normal(self.d_model ** -0.5),
                                             ("embed", "vocab")),
                (self.d_model, self.vocab_size), self.param_dtype)

    def encode(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)  # [B,T,D]

    def decode(self, h: jax.Array) -> jax.Array:
        """Logits in f32: [B,T,D] -> [B,T,V]."""
        w = self.embedding.T * self.d_model ** -0.5 if self.tie else self.head
        return jnp.einsum("btd,dv->btv", h, w.astype(h.dtype),
                          preferred_element_type=jnp.float32)
