"""DeepSeek-V3 multi-token prediction (MTP) input combiner.

Depth k predicts token t+k+1 at position t:
  h_k[t] = Block_k( W_k [RMSNorm(h_{k-1}[t]) ; RMSNorm(Emb(tok[t+k]))] ),  h_0 = the main trunk
  logits_k = Head(RMSNorm_k(h_k))          (embedding and output head shared with the trunk)
This module is the bracketed projection; model/transformer.py supplies the block and the head.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from model.layers.linear import dense
from model.layers.norms import RMSNorm


class MTPCombine(nn.Module):
    d_model: int
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, h_prev: jax.Array, emb_next: jax.Array) -> jax.Array:
        """h_prev, emb_next: [B,T,D] -> [B,T,D]."""
        a = RMSNorm(self.eps, self.param_dtype, name="h_norm")(h_prev)
        b = RMSNorm(self.eps, self.param_dtype, name="e_norm")(emb_next)
        return dense(self.d_model, ("embed2", "embed"), "proj", dtype=self.dtype,
                     param_dtype=self.param_dtype)(jnp.concatenate([a, b], axis=-1))
