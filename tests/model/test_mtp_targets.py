"""Multi-token prediction pinned to independent float64 computations (model/layers/mtp.py,
model/objectives.py, model/transformer.py).

Covered: the MTP loss (`auxiliary_losses`) against a float64 numpy loop over a loss mask with
holes: depth k+1 at position t is scored on token t+k+2 and its cross-entropy is a mean over
exactly the masked targets t+k+2 of the batch (`target_counts`); the MTP forward against numpy
on the model's own parameters, step by step: depth k+1 combines the previous depth's hidden
state (the trunk's for the first) with the embedding of token t+k+1 (PAD past the end), both
RMS-normalised with their own scales and projected by the combiner's matrix, and its logits are
the shared head on the depth's normed block output.
Not covered: the MTP block's own layer (a trunk block kind, tested in tests/model/test_layers.py).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model import objectives
from model.config import ModelConfig
from model.transformer import PAD_ID, Model, ModelOutput

B, T, V, DEPTH = 2, 9, 7, 2
EPS = 1e-6


def _log_softmax64(z):
    z = np.asarray(z, np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def test_mtp_loss_scores_token_t_plus_k_plus_2_over_its_own_target_count():
    """auxiliary_losses' MTP terms equal a float64 loop written from the definition: depth k+1
    (index k) at position t predicts tokens[t+k+2], counted where loss_mask[t+k+2]; the mask
    has holes (observation tokens), so every shift and every count gives different numbers."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(DEPTH, B, T, V)).astype(np.float32) * 2.0  # [D,B,T,V]
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)  # [B,T]
    mask = np.array([[0, 0, 1, 1, 0, 1, 1, 1, 0],
                     [0, 1, 1, 0, 0, 0, 1, 1, 1]], bool)  # [B,T] prompt, holes, padding
    cfg = ModelConfig.from_dict(models.get_config("test"))
    cfg = cfg.replace(mtp=dataclasses.replace(cfg.mtp, depth=DEPTH, loss_weight=0.7))
    zero = jnp.zeros((), jnp.float32)
    out = ModelOutput(logits=jnp.zeros((B, T, V)), hidden=jnp.zeros((B, T, 4)),
                      mtp_logits=jnp.asarray(logits), balance_loss=zero, indexer_kl=zero,
                      expert_counts=None, router=None)

    want, counts = [], []
    for k in range(DEPTH):
        s, n = 0.0, 0
        for b in range(B):
            for t in range(T):
                j = t + k + 2  # the future token depth k+1 predicts from position t
                if j < T and mask[b, j]:
                    s -= _log_softmax64(logits[k, b, t])[tokens[b, j]]
                    n += 1
        want.append(s / n)
        counts.append(n)
    assert counts == [9, 7]  # hand count: mask entries at positions >= 2 and >= 3

    tc = jax.jit(objectives.target_counts, static_argnums=1)(jnp.asarray(mask), DEPTH)
    np.testing.assert_array_equal(np.asarray(tc["mtp"]), counts)
    assert float(tc["next"]) == 10  # next-token targets: mask entries at positions >= 1
    aux = jax.jit(lambda o, t, m: objectives.auxiliary_losses(o, t, m, cfg))
    total, met = aux(out, jnp.asarray(tokens), jnp.asarray(mask))
    for k in range(DEPTH):
        assert float(met[f"mtp_ce_{k + 1}"]) == pytest.approx(want[k], rel=1e-5)
    assert float(met["mtp_ce"]) == pytest.approx(np.mean(want), rel=1e-5)
    # the balance term is zero here and the DSA indexer weight 0: the total is the MTP term
    assert cfg.dsa.indexer_loss_weight == 0
    assert float(total) == pytest.approx(0.7 * np.mean(want), rel=1e-5)


def _rms64(x, scale):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * np.asarray(scale, np.float64)


@pytest.fixture(scope="module")
def mtp_model():
    """A one-layer KDA trunk (d_model 32, no MoE) with two MTP depths; the norm scales and the
    embedding table perturbed away from their init (ones, unit rows), so a missing norm or a
    swapped scale changes the numbers."""
    c = models.get_config("test")
    c.num_layers, c.layer_pattern, c.d_model = 1, "K", 32
    c.moe.num_experts, c.moe.dense_dim = 0, 32
    c.mtp.depth, c.mtp.layer_kind = DEPTH, "K"
    model = Model(ModelConfig.from_dict(c))
    variables = model.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    params = jax.tree.map(np.asarray, variables["params"])
    params["embed"]["embedding"] = params["embed"]["embedding"] * 3.0
    for k in range(DEPTH):
        for n in ("h_norm", "e_norm"):
            s = params[f"mtp_{k}_combine"][n]["scale"]
            params[f"mtp_{k}_combine"][n]["scale"] = (0.5 + rng.random(s.shape)).astype(s.dtype)
        s = params[f"mtp_{k}_norm"]["scale"]
        params[f"mtp_{k}_norm"]["scale"] = (0.5 + rng.random(s.shape)).astype(s.dtype)
    return model, {**variables, "params": jax.tree.map(jnp.asarray, params)}


def test_mtp_forward_combines_the_embedding_of_token_t_plus_k_plus_1(mtp_model):
    """Each MTP depth's inputs, combination and logits, recorded during the model's forward and
    recomputed in float64 numpy from the parameters: depth k+1's combiner takes the previous
    depth's output (the trunk's hidden state for the first) and Emb(tokens[t+k+1]) (PAD past the
    end), returns W [RMSNorm_h(h); RMSNorm_e(e)], and the depth's logits are the head applied to
    RMSNorm_k of its block's output."""
    model, variables = mtp_model
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), variables["params"])
    tokens = np.random.default_rng(2).integers(3, model.cfg.vocab_size, size=(B, T)).astype(np.int32)

    @jax.jit
    def forward(variables, tokens):  # the output, and each MTP module's inputs and output
        seen = {}

        def record(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            name = context.module.name or ""
            if context.method_name == "__call__" and name.startswith("mtp_"):
                seen[name] = (args, out[0] if name.endswith("_block") else out)
            return out

        with nn.intercept_methods(record):
            out = model.apply(variables, tokens)
        return out, seen

    out, seen = forward(variables, jnp.asarray(tokens))
    assert out.mtp_logits.shape == (DEPTH, B, T, model.cfg.vocab_size)

    E = p["embed"]["embedding"]  # [V,D]
    head = p["embed"]["embedding"].T * model.cfg.d_model ** -0.5 if model.cfg.tie_embeddings \
        else p["embed"]["head"]  # [D,V]
    h_prev = np.asarray(out.hidden, np.float64)  # [B,T,D] the trunk's output
    for k in range(DEPTH):
        (h_in, e_in), combined = seen[f"mtp_{k}_combine"]
        # the embedding of the token k+1 places ahead of each position, PAD past the end
        ahead = np.full((B, T), PAD_ID, np.int32)
        ahead[:, :T - (k + 1)] = tokens[:, k + 1:]
        np.testing.assert_allclose(np.asarray(e_in), E[ahead], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(h_in), h_prev, rtol=1e-5, atol=1e-5)
        c = p[f"mtp_{k}_combine"]
        want = np.concatenate([_rms64(h_prev, c["h_norm"]["scale"]),
                               _rms64(E[ahead], c["e_norm"]["scale"])], axis=-1) \
            @ c["proj"]["kernel"]  # [B,T,D]
        np.testing.assert_allclose(np.asarray(combined), want, rtol=1e-4, atol=1e-4)
        h_prev = np.asarray(seen[f"mtp_{k}_block"][1], np.float64)  # the block's output
        logits = _rms64(h_prev, p[f"mtp_{k}_norm"]["scale"]) @ head  # [B,T,V]
        np.testing.assert_allclose(np.asarray(out.mtp_logits[k]), logits, rtol=1e-4, atol=1e-4)
