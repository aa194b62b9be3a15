"""MXFP4 experts: parameter conversion (PTQ), the MXFP4 inference model, QAT, expert bytes.

Layouts. Expert matrices in bf16/f32 are stored [E, in, out] (x @ W); packed MXFP4 experts are
stored in the kernels' x @ W.T layout, quantised along `in`: `<name>_blocks` uint8
[E, out, in/32, 16] and `<name>_scales` uint8 [E, out, in/32] (OCP MX v1.0, the gpt-oss layout,
see pallas_kernels/mxfp4/reference.py). `<name>` is w_gate, w_up (in = d_model, out =
expert_dim) or w_down (in = expert_dim, out = d_model).

    cfg_q = mxfp4_config(cfg)                     # experts packed, everything else as before
    q_vars = ptq_variables(variables)             # bf16/f32 model -> MXFP4-expert variables
    Model(cfg_q).apply(q_vars, tokens)            # grouped MXFP4 matmul on the packed experts
    dequantize_experts(q_vars["params"])          # back to [E, in, out] (exact on the grid)

Which modules stay high precision is a list of module groups (`MODULE_GROUPS`, config field
`quant.high_precision` in configs/rl.py). Only the routed experts have an MXFP4 path in the model
(model/layers/moe.py); every other group must stay in the list, and `check_high_precision`
raises, naming the group, when one is left out. "experts" in the list keeps the experts in
bf16 too (then nothing is quantised).

QAT (`model.moe.qat=True`): the bf16/f32 master experts go through `fake_quant` in the forward
(value = dequantize(quantize(W)), gradient = identity: straight-through), so the trained model's
forward equals the forward of its PTQ export (tests/model/test_mxfp4_e2e.py). SFT and RL pick it
up from the model config.

Not covered: MXFP4 for anything but routed experts (shared experts, dense FFNs, attention
projections have no packed path); per-layer mixed formats (the format is one MoEConfig field).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from model.config import SPAN_NAME_RE
from pallas_kernels.mxfp4 import ops as mx
from pallas_kernels.mxfp4.reference import BLOCK

EXPERT_KEYS = ("w_gate", "w_up", "w_down")
# Module groups of the model, for the high-precision list (names as in configs and config.json).
MODULE_GROUPS = ("experts", "shared_experts", "dense_ffn", "router", "attention", "embeddings",
                 "lm_head", "norms")
MXFP4_CAPABLE = ("experts",)  # groups with a packed MXFP4 path in the model
DEFAULT_HIGH_PRECISION = tuple(g for g in MODULE_GROUPS if g not in MXFP4_CAPABLE)
EXPERT_FORMATS = ("bf16", "mxfp4")


def parse_modules(spec) -> tuple[str, ...]:
    """A module-group list from a comma-separated string or a sequence (order kept)."""
    if isinstance(spec, str):
        return tuple(s.strip() for s in spec.split(",") if s.strip())
    return tuple(spec)


def check_high_precision(high_precision) -> tuple[str, ...]:
    """Validate a high-precision module list; returns the groups that become MXFP4.

    Raises ValueError for an unknown group, or for a group left out of the list that has no
    MXFP4 path in the model (it cannot be quantised, so leaving it out would be a silent no-op).
    """
    hp = parse_modules(high_precision)
    unknown = [g for g in hp if g not in MODULE_GROUPS]
    if unknown:
        raise ValueError(f"quant.high_precision: unknown module group {unknown[0]!r}; valid "
                         f"groups: {', '.join(MODULE_GROUPS)}")
    quantised = tuple(g for g in MODULE_GROUPS if g not in hp)
    missing = [g for g in quantised if g not in MXFP4_CAPABLE]
    if missing:
        raise ValueError(
            f"quant.high_precision leaves out {missing[0]!r}, which has no MXFP4 path in this "
            f"model (only {', '.join(MXFP4_CAPABLE)} can be MXFP4): add it back to the list, "
            f"e.g. quant.high_precision={','.join(DEFAULT_HIGH_PRECISION)}")
    return quantised


def mxfp4_config(cfg, high_precision=DEFAULT_HIGH_PRECISION):
    """The inference ModelConfig whose experts are packed MXFP4 (qat off: the packed weights are
    already on the grid). With "experts" in `high_precision` the experts stay bf16/f32 (the
    config is returned with qat off)."""
    quantised = check_high_precision(high_precision)
    fmt = "mxfp4" if "experts" in quantised else "bf16"
    if fmt == "mxfp4" and (cfg.d_model % BLOCK or cfg.moe.expert_dim % 32):
        raise ValueError(f"MXFP4 experts need d_model ({cfg.d_model}) and moe.expert_dim "
                         f"({cfg.moe.expert_dim}) to be multiples of 32")
    return cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format=fmt, qat=False))


def _is_expert_kernel(path, v) -> bool:
    """A routed expert kernel: [E, in, out], or [repeats, E, in, out] inside a scanned span
    (model.config.span_name: `layers_<first>_<last>`)."""
    stacked = any(isinstance(k, str) and SPAN_NAME_RE.fullmatch(k) for k in path)
    return path[-1] in EXPERT_KEYS and len(v.shape) == 3 + stacked


def _packed_name(name) -> str | None:
    """'w_up_blocks' -> 'w_up' (and for _scales); None for any other name."""
    if isinstance(name, str) and name.endswith(("_blocks", "_scales")) and name[:-7] in EXPERT_KEYS:
        return name[:-7]
    return None


def quantize_kernel(w: jax.Array) -> mx.MXFP4:
    """One expert kernel [E, in, out] (bf16/f32) -> MXFP4 logical [E, out, in] along `in`."""
    return mx.quantize(jnp.swapaxes(w.astype(jnp.float32), -1, -2), axis=-1)


def quantize_experts(params):
    """Replace every expert kernel [E,in,out] by its packed MXFP4 pair (see module doc)."""
    flat = flatten_dict(params)
    out = {}
    for path, v in flat.items():
        if _is_expert_kernel(path, v):
            q = quantize_kernel(v)
            out[path[:-1] + (f"{path[-1]}_blocks",)] = q.blocks
            out[path[:-1] + (f"{path[-1]}_scales",)] = q.scales
        else:
            out[path] = v
    return unflatten_dict(out)


def dequantize_experts(params, dtype=jnp.bfloat16):
    """Inverse of quantize_experts (exact on the MXFP4 grid): packed pairs -> [E, in, out]."""
    flat = flatten_dict(params)
    out = {}
    for path, v in flat.items():
        base = _packed_name(path[-1])
        if base is None:
            out[path] = v
        elif path[-1].endswith("_blocks"):
            s = flat[path[:-1] + (f"{base}_scales",)]
            w = mx.dequantize(mx.MXFP4(v, s), dtype)
            out[path[:-1] + (base,)] = jnp.swapaxes(w, -1, -2)
    return unflatten_dict(out)


def fake_quant_experts(params):
    """Every expert kernel replaced by dequantize(quantize(kernel)) in its own dtype (the QAT
    forward's weights, also what a PTQ export decodes to)."""
    flat = flatten_dict(params)
    return unflatten_dict({p: (jnp.swapaxes(mx.fake_quant(jnp.swapaxes(v, -1, -2), axis=-1),
                                            -1, -2) if _is_expert_kernel(p, v) else v)
                           for p, v in flat.items()})


def has_packed_experts(params) -> bool:
    return any(_packed_name(p[-1]) for p in flatten_dict(params))


def has_float_experts(params) -> bool:
    return any(_is_expert_kernel(p, v) for p, v in flatten_dict(params).items())


def _ptq(variables):
    return {k: (quantize_experts(v) if k == "params" else v) for k, v in variables.items()}


_PTQ = jax.jit(_ptq)


def ptq_variables(variables, *, out_shardings=None):
    """Post-training quantisation of a variables dict ({"params", "router_state", ...}): every
    expert kernel becomes its packed pair, nothing else changes. One jitted program; only the
    packed experts come out (no float copy of the experts is kept). out_shardings: the MXFP4
    model's variable shardings (model.sharding.model_shardings) when the variables live on a
    mesh. Variables that already hold packed experts are returned as they are."""
    if has_packed_experts(variables.get("params", {})) and not has_float_experts(
            variables.get("params", {})):
        return variables
    if out_shardings is None:
        return _PTQ(variables)
    return jax.jit(_ptq, out_shardings=out_shardings)(variables)


def make_ptq_fn(mxfp4_model, mesh=None, rules=None):
    """A reusable PTQ function for the RL loop: variables of the bf16/QAT model -> variables of
    `mxfp4_model` (model.transformer.Model with MXFP4 experts), placed in that model's shardings
    on `mesh` when one is given (one compiled program, called once per rollout batch)."""
    if mesh is None:
        return ptq_variables
    from model import sharding as shd

    var_sh = shd.model_shardings(mxfp4_model, mesh, rules)
    prog = {}

    def fn(variables):
        key = tuple(sorted(variables))
        if key not in prog:
            prog[key] = jax.jit(_ptq, out_shardings=shd.variables_shardings(
                var_sh, {k: variables[k] for k in key}, mesh))
        return prog[key](variables)
    return fn


def expert_bytes(params) -> dict:
    """Bytes of the routed experts, the rest, and the expert ratio against bf16 storage:
    {"experts": int, "other": int, "expert_ratio_vs_bf16": float}. Float experts count at
    their dtype; packed experts at 4.25 bits per weight (uint8 blocks + scales)."""
    e = o = n_weights = 0
    for p, v in flatten_dict(params).items():
        nb = int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
        if _is_expert_kernel(p, v):
            e += nb
            n_weights += int(np.prod(v.shape))
        elif _packed_name(p[-1]):
            e += nb
            if p[-1].endswith("_blocks"):
                n_weights += int(np.prod(v.shape)) * 2
        else:
            o += nb
    return {"experts": e, "other": o,
            "expert_ratio_vs_bf16": e / max(2 * n_weights, 1)}


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def inference_model(cfg, variables, *, experts: str = "mxfp4",
                    high_precision=DEFAULT_HIGH_PRECISION, out_shardings=None):
    """(Model, variables) to sample or evaluate with: experts="mxfp4" gives the MXFP4 model and
    its packed variables (PTQ of float experts, packed experts as they are); "bf16" the model as
    trained (a QAT model keeps its fake-quantised forward; packed variables are dequantised to
    the param dtype)."""
    from model.transformer import Model

    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r}: must be one of {EXPERT_FORMATS}")
    params = variables.get("params", {})
    if experts == "mxfp4":
        cfg_q = mxfp4_config(cfg, high_precision)
        if cfg_q.moe.expert_format != "mxfp4":
            return Model(cfg_q), variables
        return Model(cfg_q), ptq_variables(variables, out_shardings=out_shardings)
    if has_packed_experts(params):
        pd = jnp.dtype(cfg.param_dtype)
        variables = dict(variables, params=jax.jit(
            lambda p: dequantize_experts(p, pd))(params))
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, expert_format="bf16"))
    return Model(cfg), variables
