"""MXFP4 parameter conversion for the MoE experts, and the QAT switch.

Expert matrices in bf16/f32 are stored [E, in, out] (x @ W); packed MXFP4 experts are stored in the
kernels' x @ W.T layout, quantised along `in`: `<name>_blocks` uint8 [E, out, in/32, 16] and
`<name>_scales` uint8 [E, out, in/32] (OCP MX v1.0, gpt-oss layout, see pallas_kernels/mxfp4).

    q_params = quantize_experts(params)         # bf16 model -> MXFP4-expert model params
    cfg_q = cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format="mxfp4"))
    Model(cfg_q).apply({"params": q_params, ...}, tokens)

Router, attention, embeddings, lm_head and norms stay in their dtype. QAT (`moe.qat=True`) runs
the bf16 experts through `fake_quant` (straight-through estimator) in the forward.
"""

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from pallas_kernels.mxfp4 import ops as mx

EXPERT_KEYS = ("w_gate", "w_up", "w_down")


def quantize_experts(params):
    """Replace every expert kernel [E,in,out] by its packed MXFP4 pair (see module doc)."""
    flat = flatten_dict(params)
    out = {}
    for path, v in flat.items():
        if path[-1] in EXPERT_KEYS and v.ndim == 3:
            q = mx.quantize(jnp.swapaxes(v.astype(jnp.float32), -1, -2), axis=-1)
            out[path[:-1] + (f"{path[-1]}_blocks",)] = q.blocks
            out[path[:-1] + (f"{path[-1]}_scales",)] = q.scales
        else:
            out[path] = v
    return unflatten_dict(out)


def dequantize_experts(params, dtype=jnp.bfloat16):
    """Inverse of quantize_experts (exact on the MXFP4 grid)."""
    flat = flatten_dict(params)
    out = {}
    for path, v in flat.items():
        name = path[-1]
        if isinstance(name, str) and name.endswith("_blocks") and name[:-7] in EXPERT_KEYS:
            s = flat[path[:-1] + (f"{name[:-7]}_scales",)]
            w = mx.dequantize(mx.MXFP4(v, s), dtype)
            out[path[:-1] + (name[:-7],)] = jnp.swapaxes(w, -1, -2)
        elif isinstance(name, str) and name.endswith("_scales") and name[:-7] in EXPERT_KEYS:
            continue
        else:
            out[path] = v
    return unflatten_dict(out)


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
