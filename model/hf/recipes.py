"""Tensor recipes: how a group of checkpoint tensors becomes a group of this model's variables
and back, as pure numpy functions (both directions from one table, so a round trip is exact).

A `Recipe` names its checkpoint tensors with their shapes (`hf`, `hf_shapes`), its variable
leaves as paths in the per-layer layout (`ours`, e.g. ("params", "layer_0", "attn", "qkv",
"kernel")), and `to_ours` / `to_hf`: lists of arrays in, lists out, in those orders. The
helpers below build the recipes every layout uses (a transposed linear, a concatenation of
linears, stacked per-expert matrices, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Recipe:
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    ours: tuple[Path, ...]
    to_ours: Callable[[list[np.ndarray]], list[np.ndarray]]
    to_hf: Callable[[list[np.ndarray]], list[np.ndarray]]


def copy(hf: str, ours: Path, shape: tuple[int, ...]) -> Recipe:
    """The same array (norm weights, biases)."""
    return Recipe((hf,), (tuple(shape),), (ours,), list, list)


def reshaped(hf: str, ours: Path, hf_shape: tuple[int, ...], our_shape: tuple[int, ...]
             ) -> Recipe:
    """The same values in another shape (e.g. A_log [1,1,H,1] <-> [H])."""
    return Recipe((hf,), (tuple(hf_shape),), (ours,),
                  lambda a: [a[0].reshape(our_shape)], lambda a: [a[0].reshape(hf_shape)])


def linear(hf: str, ours: Path, d_in: int, d_out: int) -> Recipe:
    """torch Linear weight [out, in] <-> kernel [in, out]."""
    return Recipe((hf,), ((d_out, d_in),), (ours,), lambda a: [a[0].T], lambda a: [a[0].T])


def concat_linears(hfs: tuple[str, ...], ours: Path, d_in: int, outs: tuple[int, ...]
                   ) -> Recipe:
    """Several Linear weights [out_i, in] <-> one kernel [in, sum out_i] (columns in order)."""
    cuts = np.cumsum(outs)[:-1]
    return Recipe(tuple(hfs), tuple((o, d_in) for o in outs), (ours,),
                  lambda a: [np.concatenate([w.T for w in a], axis=1)],
                  lambda a: [w.T for w in np.split(a[0], cuts, axis=1)])


def concat_convs(hfs: tuple[str, ...], ours: Path, channels: tuple[int, ...], width: int
                 ) -> Recipe:
    """Depthwise Conv1d weights [C_i, 1, W] <-> one tap table [W, sum C_i] (channels in order;
    tap j multiplies the input j - (W-1) steps back, as torch's causal conv with W-1 padding)."""
    cuts = np.cumsum(channels)[:-1]
    return Recipe(tuple(hfs), tuple((c, 1, width) for c in channels), (ours,),
                  lambda a: [np.concatenate([w[:, 0, :].T for w in a], axis=1)],
                  lambda a: [w.T[:, None, :] for w in np.split(a[0], cuts, axis=1)])


def stacked_linears(hfs: tuple[str, ...], ours: Path, d_in: int, d_out: int) -> Recipe:
    """Per-expert Linear weights [out, in] x E <-> one [E, in, out] kernel."""
    return Recipe(tuple(hfs), tuple((d_out, d_in) for _ in hfs), (ours,),
                  lambda a: [np.stack([w.T for w in a])],
                  lambda a: [w.T for w in a[0]])


def mla_kv_b(hf: str, w_uk: Path, w_uv: Path, heads: int, nope: int, v: int, latent: int
             ) -> Recipe:
    """MLA's kv_b_proj [H*(n+v), L] <-> the absorbed w_uk [H, n, L] and w_uv [H, L, v]: head h's
    key rows are kv_b[h*(n+v) : h*(n+v)+n], its value rows the next v."""
    def to_ours(a):
        r = a[0].reshape(heads, nope + v, latent)
        return [r[:, :nope], r[:, nope:].transpose(0, 2, 1)]

    def to_hf(a):
        uk, uv = a
        return [np.concatenate([uk, uv.transpose(0, 2, 1)], axis=1).reshape(
            heads * (nope + v), latent)]

    return Recipe((hf,), ((heads * (nope + v), latent),), (w_uk, w_uv), to_ours, to_hf)
