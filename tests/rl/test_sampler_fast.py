"""Prefix sharing and row refill in the plain sampler (rl/sampler.py) on the 2-layer test model
(KDA + DSA + MoE + MTP): greedy rollouts equal the plain sampler's token for token (groups of
different prompt lengths, early EOS), sampled ones have the trainer's log-probs (2e-4), the
identical-rows check rejects bad groups, and the refill completion order is consistent.
Not covered here: the mesh sampler (prefix sharing on a mesh runs in tests/rl/test_sharded_rl.py
only through the unshared path; its fallback is a host-side rule in Sampler._mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import models
from model.config import ModelConfig
from model.transformer import Model
from rl.sampler import Sampler, SamplingConfig, pack
from rl.train_step import make_logp_fn

N_NEW, GROUP = 8, 3


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_dict(models.get_config("test"))
    model = Model(cfg)
    return model, model.init(jax.random.key(0))


def _groups():
    """4 distinct prompts of lengths 5, 3, 2, 4, each repeated GROUP times (12 rows)."""
    p = np.array([[1, 40, 41, 42, 43], [1, 50, 51, 0, 0], [1, 60, 0, 0, 0], [1, 70, 71, 72, 0]],
                 np.int32)
    lens = np.array([5, 3, 2, 4], np.int32)
    return np.repeat(p, GROUP, axis=0), np.repeat(lens, GROUP)


def _greedy_eos(model, variables):
    """A greedy config whose EOS id and stop sequence are tokens some rows emit early (so rows
    end at different steps), and the plain sampler's output under it."""
    prompts, lens = _groups()
    probe = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=0.0, eos_id=-1))
    ref = np.asarray(probe.generate(variables, prompts, lens, jax.random.key(0)).tokens)
    eos = int(ref[GROUP, 2])  # the 3rd token of prompt 1's rows
    stop = tuple(int(x) for x in ref[3 * GROUP, 3:5])  # tokens 4-5 of prompt 3's rows
    cfg = SamplingConfig(max_new_tokens=N_NEW, temperature=0.0, eos_id=eos,
                         stop_sequences=(stop,))
    return cfg, Sampler(model, cfg).generate(variables, prompts, lens, jax.random.key(0))


def _assert_same(a, b):
    for f in ("tokens", "mask", "lengths", "finished"):
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), f)


def test_greedy_prefix_sharing_and_refill_equal_plain(setup):
    model, variables = setup
    prompts, lens = _groups()
    cfg, plain = _greedy_eos(model, variables)
    lengths = np.asarray(plain.lengths)
    assert lengths[GROUP] <= 3 and lengths[3 * GROUP] <= 5  # EOS and the stop sequence hit
    assert np.asarray(plain.finished)[[GROUP, 3 * GROUP]].all()
    assert lengths.max() == N_NEW and len(set(lengths.tolist())) > 1
    sampler = Sampler(model, cfg)
    shared = sampler.generate(variables, prompts, lens, jax.random.key(0), group_size=GROUP)
    _assert_same(shared, plain)
    for slots, group in ((5, GROUP), (4, 1)):  # refill with a prompt bank, and without groups
        out = sampler.generate(variables, prompts, lens, jax.random.key(0), group_size=group,
                               slots=slots)
        _assert_same(out, plain)
        order, step = np.asarray(out.finish_order), np.asarray(out.finish_step)
        np.testing.assert_array_equal(np.sort(order), np.arange(len(prompts)))  # a permutation
        assert np.all(np.diff(step[np.argsort(order)]) >= 0)  # order follows the finish steps
        # the first `slots` rows start at step 0; a row of n tokens needs n - 1 decode steps
        # (its first token comes from the prefill), so it ends in step n - 2
        np.testing.assert_array_equal(step[:slots], np.maximum(lengths[:slots] - 2, 0))
        # never more than `slots` rows decode at once: the steps needed cover the tokens
        assert (step.max() + 1) * slots >= (lengths - 1).sum()
        assert step.max() + 1 < (lengths - 1).sum()  # and they overlap


def test_sampled_sharing_and_refill_match_trainer_logprobs(setup):
    model, variables = setup
    prompts, lens = _groups()
    sampler = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=1.0, eos_id=-1))
    plain = sampler.generate(variables, prompts, lens, jax.random.key(7))
    shared = sampler.generate(variables, prompts, lens, jax.random.key(7), group_size=GROUP)
    refill = sampler.generate(variables, prompts, lens, jax.random.key(7), group_size=GROUP,
                              slots=5)
    # each row draws by its id and its tokens' positions: sharing and refill (rows in other
    # slots at other steps) give the plain sampler's tokens
    np.testing.assert_array_equal(np.asarray(shared.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(refill.tokens), np.asarray(plain.tokens))
    # ... while the copies of one prompt draw apart (keys folded with distinct ids)
    toks = np.asarray(plain.tokens).reshape(-1, GROUP, N_NEW)
    assert all(len({r.tobytes() for r in g}) == GROUP for g in toks)
    # rows in another batch (reversed, one group dropped) with their ids: the same tokens
    keep = np.arange(len(prompts))[GROUP:][::-1]
    moved = sampler.generate(variables, prompts[keep], lens[keep], jax.random.key(7),
                             row_ids=keep)
    np.testing.assert_array_equal(np.asarray(moved.tokens), np.asarray(plain.tokens)[keep])
    with pytest.raises(ValueError, match="row_ids must be"):
        sampler.generate(variables, prompts, lens, jax.random.key(7), row_ids=keep)
    logp_fn = make_logp_fn(model)
    for out in (shared, refill):
        tokens, mask, rollout = pack(prompts, lens, out.tokens, out.mask, extras=(out.logprobs,))
        trainer = logp_fn(variables, jnp.asarray(tokens), jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(trainer)[mask], rollout[mask], atol=2e-4)


def test_group_check_rejects_rows_that_are_not_copies(setup):
    model, variables = setup
    prompts, lens = _groups()
    sampler = Sampler(model, SamplingConfig(max_new_tokens=N_NEW, temperature=0.0, eos_id=-1))
    bad = prompts.copy()
    bad[4, 1] = 99  # row 4 of group 1 differs from its group's prompt
    with pytest.raises(ValueError, match="rows 3..5 are not copies"):
        sampler.generate(variables, bad, lens, jax.random.key(0), group_size=GROUP)
    short = lens.copy()
    short[0] = 4  # same tokens, another length
    with pytest.raises(ValueError, match="rows 0..2 are not copies"):
        sampler.generate(variables, prompts, short, jax.random.key(0), group_size=GROUP, slots=4)
    with pytest.raises(ValueError, match="does not divide the batch of 12"):
        sampler.generate(variables, prompts, lens, jax.random.key(0), group_size=5)
    with pytest.raises(ValueError, match="slots must be an int >= 0"):
        sampler.generate(variables, prompts, lens, jax.random.key(0), slots=-1)
    # padding past a row's length is not part of its prompt: rows still share
    pad = prompts.copy()
    pad[GROUP * 2 + 1, 3] = 77  # prompt 2 has length 2
    out = sampler.generate(variables, pad, lens, jax.random.key(0), group_size=GROUP)
    assert out.tokens.shape == (12, N_NEW)


def test_rollout_worker_refill_keeps_task_order(setup):
    """RolloutWorker (rl/pipeline.py) with row refill (over a shared-prefill bank) returns the
    plain worker's greedy completions, in task order, padded batches included (pad_to). (The
    worker's default prefix sharing runs in tests/rl/test_loop.py.)"""
    from model.tokenizer import load_tokenizer
    from rl.pipeline import RolloutWorker
    from sandbox.tasks.sampling import make_split

    model, variables = setup
    tok = load_tokenizer("byte")
    tasks = [t for t, _ in make_split("arithmetic", "val", 2, seed=0)]
    cfg = SamplingConfig(max_new_tokens=N_NEW, temperature=0.0, eos_id=tok.eos_id)
    width = 4 + max(len(tok.encode(tok.chat_prompt(t.prompt), bos=True)) for t in tasks)

    def worker(**kw):
        return RolloutWorker(model, tok, cfg, None, group_size=2, max_prompt_len=width, **kw)

    plain = worker(share_prefix=False).generate(variables, tasks, jax.random.key(0), pad_to=3)
    g = worker(slots=3).generate(variables, tasks, jax.random.key(0), pad_to=3)
    assert [t.prompt for t in g.tasks] == [t.prompt for t in plain.tasks]
    np.testing.assert_array_equal(g.group_ids, plain.group_ids)
    np.testing.assert_array_equal(g.completions, plain.completions)
    np.testing.assert_array_equal(g.completion_mask, plain.completion_mask)
    assert g.texts == plain.texts and len(g.texts) == 4 and g.completion_mask.any()
    with pytest.raises(ValueError, match="slots must be an int >= 0"):
        worker(slots=-2)
