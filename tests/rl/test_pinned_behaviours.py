"""RL behaviours pinned to independent computations (a reference formula, a numpy loop, a
hand-worked example), not to the code's own helpers.

Covered:
- the policy loss takes old log-probs as constants: called on-policy with old_logp the very
  array it differentiates (what the train step's old_logp="current" shortcut passes), its
  gradient is the policy-gradient formula -A m / n (rl/losses.py);
- the train step with old_logp="current" moves the parameters by exactly SGD on the reference
  objective -mean_i (1/|y_i|) sum_t A_i log pi(y_it), log pi written here from the model's logits
  (rl/train_step.py);
- an outcome reward lands on each row's last valid token by position, for rows with holes
  (masked observation tokens) too, and GAE from it equals a numpy loop (rl/advantages.py);
- row refill: a queued row whose first token is EOS ends there (one token, finished), like the
  plain sampler's row, while rows beside it keep decoding (rl/sampler.py);
- the host-side checkpoint digest equals a plain-Python recomputation of its definition and
  tells apart arrays whose blocks are swapped (rl/checkpoint.py).
Not covered here: the agent's episode score (tests/sandbox/test_agent_episode_return.py, beside
the sandbox pool fixture).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl import advantages as adv
from rl import checkpoint as ck
from rl.algorithms import get_algorithm
from rl.losses import policy_loss
from rl.sampler import Sampler, SamplingConfig
from rl.train_step import init_train_state, make_train_step


# ---------------------------------------------------------------- old log-probs are constants
def test_on_policy_policy_loss_gradient_is_the_policy_gradient():
    """policy_loss(x, old=x): ratio 1 everywhere, and d loss / d x = -A m / n (token mean):
    the gradient of -A exp(x - c) at c = x with c held constant. Were old_logp differentiated
    too, the log-ratio x - x would carry no gradient at all."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(-2.0, 0.5, (3, 6)), jnp.float32)  # [N,L]
    a = np.array([1.5, -0.7, 0.4], np.float32)  # [N]
    m = np.array([[0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]], bool)

    def loss(x):
        return policy_loss(x, x, jnp.asarray(a[:, None]), jnp.asarray(m), agg="token-mean")[0]

    g = np.asarray(jax.grad(loss)(x))
    want = -a[:, None] * m / m.sum()
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)


def test_current_old_logp_step_is_sgd_on_the_reference_objective(small_lm):
    """One train step with old_logp="current" (no separate forward: old = the step's own
    log-probs) and plain SGD ends at params - lr * grad J, where J is written here from the
    model's logits: J = -mean_i (1/|y_i|) sum_t m A_i log softmax(logits)[y_t] (GRPO's
    seq-mean-token-mean at ratio 1, no KL)."""
    model, variables = small_lm
    rng = np.random.default_rng(1)
    N, L, P = 4, 16, 5
    tokens = jnp.asarray(rng.integers(3, 200, (N, L)), jnp.int32)
    mask = np.zeros((N, L), bool)
    for i, end in enumerate((L, L - 3, 9, L - 1)):
        mask[i, P:end] = True
    mask[1, 8:10] = False  # a hole (observation tokens) inside a completion
    adv_rows = np.array([1.0, -0.5, 2.0, -1.5], np.float32)
    batch = {"tokens": tokens, "loss_mask": jnp.asarray(mask),
             "advantages": jnp.asarray(adv_rows[:, None])}
    algo = get_algorithm("grpo", kl_placement="none", kl_coef=0.0)
    lr = 0.1

    def reference(params):
        logits = model.apply({**variables, "params": params}, tokens, with_mtp=False).logits
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # [N,L-1,V]
        lp = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]  # [N,L-1]
        m = jnp.asarray(mask[:, 1:], jnp.float32)
        per_row = jnp.sum(lp * m, axis=1) / jnp.sum(m, axis=1)  # [N]
        return -jnp.mean(jnp.asarray(adv_rows) * per_row)

    g_ref = jax.jit(jax.grad(reference))(variables["params"])
    step = make_train_step(model, algo, optax.sgd(lr), donate=False, old_logp="current")
    state, met = step(init_train_state(variables, optax.sgd(lr)), batch)
    assert float(met["update_finite"]) == 1.0
    moved = 0.0
    for new, old, g in zip(jax.tree.leaves(state.params), jax.tree.leaves(variables["params"]),
                           jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(new), np.asarray(old) - lr * np.asarray(g),
                                   rtol=1e-4, atol=1e-6)
        moved = max(moved, float(jnp.max(jnp.abs(lr * g))))
    assert moved > 1e-3  # the reference gradient is far from zero: the check has teeth


# ---------------------------------------------------------------- advantages
def test_outcome_reward_sits_on_the_last_valid_position_of_rows_with_holes():
    """place_at_last_token on rows whose valid tokens have holes (masked observations) and a
    row with none; then GAE over it equals a numpy loop over each row's valid positions."""
    mask = np.array([[1, 1, 0, 0, 1, 1, 0, 0],     # last valid at 5 (4 valid tokens)
                     [0, 1, 0, 1, 0, 0, 0, 1],     # last valid at 7 (3 valid)
                     [1, 1, 1, 0, 0, 0, 0, 0],     # no hole: last at 2
                     [0, 0, 0, 0, 0, 0, 0, 0]], bool)  # empty row: no reward anywhere
    r = np.array([2.0, -1.0, 0.5, 3.0], np.float32)
    want = np.zeros(mask.shape, np.float32)
    for i in range(len(r)):  # the largest valid position, found by scanning
        last = -1
        for t in range(mask.shape[1]):
            if mask[i, t]:
                last = t
        if last >= 0:
            want[i, last] = r[i]
    assert [int(np.nonzero(w)[0][0]) for w in want[:3]] == [5, 7, 2]  # hand-checked
    got = np.asarray(adv.place_at_last_token(jnp.asarray(r), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)

    values = np.random.default_rng(2).normal(size=mask.shape).astype(np.float32)
    gamma, lam = 0.9, 0.8
    out = adv.compute_advantages("gae", jnp.asarray(r), jnp.asarray(mask),
                                 values=jnp.asarray(values), gamma=gamma, lam=lam)
    exp = np.zeros(mask.shape, np.float64)
    for i in range(len(r)):
        idx = np.nonzero(mask[i])[0]
        a_next, v_next = 0.0, 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            delta = want[i, t] + gamma * v_next - values[i, t]
            a_next = delta + gamma * lam * a_next
            exp[i, t], v_next = a_next, values[i, t]
    np.testing.assert_allclose(np.asarray(out.advantages), exp, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- sampler row refill
def test_refilled_row_whose_first_token_is_eos_ends_there(small_lm):
    """Row refill with 2 slots for 4 rows: rows 2 and 3 enter through a refill. EOS is row 3's
    greedy first token, so row 3 is one token long and finished, exactly as in the plain
    sampler, while a row that does not start with EOS decodes on."""
    model, variables = small_lm
    prompts = np.array([[1, 40, 41, 42], [1, 50, 51, 0], [1, 60, 0, 0], [1, 70, 71, 72]],
                       np.int32)
    lens = np.array([4, 3, 2, 4], np.int32)
    n_new = 5
    probe = Sampler(model, SamplingConfig(max_new_tokens=n_new, temperature=0.0, eos_id=-1))
    first = np.asarray(probe.generate(variables, prompts, lens, jax.random.key(0)).tokens)[:, 0]
    eos = int(first[3])
    others = [i for i in range(4) if first[i] != eos]
    assert others, f"every row starts with the same token {eos}: pick other prompts"
    cfg = SamplingConfig(max_new_tokens=n_new, temperature=0.0, eos_id=eos)
    sampler = Sampler(model, cfg)
    plain = sampler.generate(variables, prompts, lens, jax.random.key(0))
    refill = sampler.generate(variables, prompts, lens, jax.random.key(0), slots=2)
    lengths, finished = np.asarray(refill.lengths), np.asarray(refill.finished)
    assert lengths[3] == 1 and finished[3] and int(np.asarray(refill.tokens)[3, 0]) == eos
    assert max(lengths[i] for i in others) > 1
    for f in ("tokens", "mask", "lengths", "finished"):
        np.testing.assert_array_equal(np.asarray(getattr(refill, f)),
                                      np.asarray(getattr(plain, f)), f)


# ---------------------------------------------------------------- checkpoint digests
def _fmix32_py(h: int) -> int:
    """murmur3's 32-bit finalizer in Python integers."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _digest_py(words: np.ndarray) -> list[int]:
    """The leaf digest's definition, word by word: (sum of the words, sum of
    fmix32(w_i xor fmix32(i + 0x9E3779B9))) mod 2^32, i the row-major position."""
    h1 = h2 = 0
    for i, w in enumerate(int(v) for v in words.reshape(-1)):
        h1 = (h1 + w) & 0xFFFFFFFF
        h2 = (h2 + _fmix32_py(w ^ _fmix32_py((i + 0x9E3779B9) & 0xFFFFFFFF))) & 0xFFFFFFFF
    return [h1, h2]


def test_host_digest_is_position_keyed():
    """The host-side digest of a float32 array equals the definition recomputed in Python, and
    the same blocks in another order (rows swapped, halves swapped) digest differently, in
    _digests and in tree_digest."""
    x = np.random.default_rng(3).normal(size=(4, 6)).astype(np.float32)  # [4,6]
    swapped_rows = x[[1, 0, 2, 3]]
    swapped_halves = np.concatenate([x[:, 3:], x[:, :3]], axis=1)
    d = ck._digests([x, swapped_rows, swapped_halves])
    assert [int(v) for v in d[0]] == _digest_py(x.view(np.uint32))
    assert [int(v) for v in d[1]] == _digest_py(swapped_rows.view(np.uint32))
    assert int(d[0][0]) == int(d[1][0]) == int(d[2][0])  # the plain sum cannot tell them apart
    assert len({int(v[1]) for v in d}) == 3  # the position-keyed sum does
    digests = {ck.tree_digest({"w": a}) for a in (x, swapped_rows, swapped_halves)}
    assert len(digests) == 3
