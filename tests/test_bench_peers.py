"""The peer benchmark (benchmarks/grpo_peer.py, `python scripts/bench.py peer`) without the peer's
virtual environment: the clear error naming scripts/setup_peers.sh when it is missing, argument and
override handling on both sides, the matched run config, the split / median / ratio math on
records of a real run (tunix 0.1.7 and the hybrid model, `bench.py peer --quick`, trimmed to the
fields the math reads), and that both sides score the same reward on the same prompts.

Not covered: running either side (minutes of compiling on 2 cores: that is the benchmark itself),
and tunix's side, which needs tunix installed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import grpo_matched, grpo_peer
from benchmarks.peers import Clock, tunix_grpo, tunix_sampler

# `python scripts/bench.py peer --quick` (1 round, 2 steady iterations, 2 sampler calls per shape
# after the warm-up), 2026-12-02 01:40 on 2 shared cores at a load average of 8-10; seconds,
# rounded to 4 digits; the fields the math reads.
RECORDED = {
    "tunix": {"side": "tunix", "params": 4459264, "load_before": [9.42], "load_after": [9.75],
              "clock": {"samples": {
                  "prefill": [6.0102, 0.3575, 0.0898],
                  "decode": [5.2754, 0.5949, 0.6267],
                  "rollout": [14.1663, 1.2022, 0.8227],
                  "logp_ref": [4.1057, 0.4626, 0.4697],
                  "score": [0.0015, 0.0009, 0.0011],
                  "train_step": [23.1784, 2.9234, 2.7896],
                  "iteration": [42.4973, 4.6641, 4.0978],
                  "sampler_b32_g64": [8.2472, 0.7523, 1.1344],
                  "sampler_b32_g1": [7.3728, 0.1517, 0.1322],
                  "sampler_b1_g64": [8.4486, 0.0781, 0.0396],
                  "sampler_b1_g1": [8.946, 0.0295, 0.0115]},
                  "foreign_cores": {"iteration": [1.608, 1.497, 1.44]},
                  "compile_s": {"rollout": 2.44, "logp_ref": 3.04, "train_step": 17.59}}},
    "hybrid": {"side": "hybrid", "params": 4433996, "load_before": [9.95], "load_after": [8.22],
               "clock": {"samples": {
                   "rollout": [22.5197, 1.9645, 1.9187],
                   "score": [0.0001, 0.0006, 0.0005],
                   "logp_old": [14.697, 1.2405, 1.1807],
                   "logp_ref": [0.8256, 1.2718, 1.1479],
                   "train_step": [98.7527, 6.6342, 6.9663],
                   "iteration": [138.7029, 11.1276, 11.2589],
                   "sampler_b32_g64": [1.5859, 1.0923, 1.269],
                   "sampler_b32_g1": [26.6199, 0.2343, 0.2755],
                   "sampler_b1_g64": [27.7899, 0.1406, 0.2055],
                   "sampler_b1_g1": [21.2988, 0.0169, 0.0124]},
                   "foreign_cores": {"iteration": [1.573, 1.602, 1.601]},
                   "compile_s": {"rollout": 20.93, "logp_old": 13.89, "train_step": 91.71}}},
}


def test_missing_peer_venv_names_the_setup_script(tmp_path, monkeypatch, capsys):
    with pytest.raises(grpo_peer.PeerMissing, match="bash scripts/setup_peers.sh tunix"):
        grpo_peer.peer_python("tunix", str(tmp_path))
    monkeypatch.setenv(grpo_peer.PEER_VENVS_ENV, str(tmp_path))

    def no_process(*a, **k):
        raise AssertionError("a side was started although the peer is missing")

    monkeypatch.setattr(grpo_peer.subprocess, "run", no_process)
    with pytest.raises(grpo_peer.PeerMissing, match=str(tmp_path)):
        grpo_peer.run(quick=True)
    assert grpo_peer.main(["--quick"]) == 2
    assert "scripts/setup_peers.sh" in capsys.readouterr().err


def test_side_commands_and_arguments(tmp_path):
    py = tmp_path / "tunix" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    cmd = grpo_peer.side_command("tunix", 2, 3, "o.json", venvs=str(tmp_path))
    assert cmd[:3] == [str(py), "-m", "benchmarks.peers.tunix_grpo"]
    assert cmd[3:] == ["--steps", "2", "--reps", "3", "--out", "o.json"]
    cmd = grpo_peer.side_command("dense", 1, 1, "o.json", overrides=("rl.algo.kl_coef=0.0",))
    assert cmd[1:5] == ["-m", "benchmarks.grpo_matched", "--variant", "dense"]
    assert cmd[-2:] == ["--set", "rl.algo.kl_coef=0.0"]
    with pytest.raises(ValueError, match="side must be 'tunix' or one of"):
        grpo_peer.side_command("qwen", 1, 1, "o.json")
    for bad in (dict(steps=0), dict(reps=-1), dict(rounds=2, sampler_rounds=3)):
        with pytest.raises(ValueError, match="rounds, steps and reps must be >= 1"):
            grpo_peer.run(venvs=str(tmp_path), **bad)
    for bad in (["--rounds", "0"], ["--variants", "qwen"], ["--reps", "-2"],
                ["--sampler-rounds", "0"]):
        with pytest.raises(SystemExit) as e:
            grpo_peer.main(bad)
        assert e.value.code == 2
    for bad in (["--steps", "0"], ["--reps", "-1"], ["--variant", "qwen"]):
        with pytest.raises(SystemExit):
            grpo_matched.main(bad)
    for bad in (["--set", "rl.nope=1"], ["--set", "rl.steps"]):
        with pytest.raises(ValueError):  # before jax starts
            grpo_matched.main(bad)


def test_run_config_holds_the_matched_work_and_overrides():
    c = grpo_matched.run_config("hybrid", ["rl.algo.kl_coef=0.0", "rl.overlap_scoring=True",
                                           "model.mtp.loss_weight=0.1", "rl.old_logp_pass=always",
                                           "rl.mtp_loss_weight=0.0"])
    assert (c.rl.prompts_per_batch, c.rl.group_size, c.rl.max_prompt_len,
            c.rl.max_new_tokens) == (8, 4, 32, 64)
    assert (c.rl.temperature, c.rl.top_p, c.rl.init_from) == (0.9, 1.0, "scratch")
    assert (c.optim.lr, c.optim.b2, c.optim.weight_decay, c.optim.clip_norm) == (
        1e-5, 0.999, 1e-4, 0.0)
    assert c.rl.algo.kl_coef == 0.0 and c.rl.overlap_scoring is True
    assert c.model.mtp.loss_weight == 0.1 and c.model.layer_pattern == "KKKD"
    assert c.rl.old_logp_pass == "always" and c.rl.mtp_loss_weight == 0.0  # a None placeholder
    assert grpo_matched.run_config("dense").rl.algo.kl_coef == 0.04
    dense = grpo_matched.model_config("dense")
    assert (dense.layer_pattern, dense.mtp.depth, dense.moe.num_experts) == ("D", 0, 0)
    with pytest.raises(ValueError, match="no field 'model.nope'"):
        grpo_matched.run_config("hybrid", ["model.nope=3"])
    with pytest.raises(ValueError, match="key=value"):
        grpo_matched.run_config("hybrid", ["rl.steps"])
    with pytest.raises(ValueError, match="boolean"):
        grpo_matched.run_config("hybrid", ["rl.overlap_scoring=yes"])
    with pytest.raises(ValueError, match="variant must be one of"):
        grpo_matched.model_config("qwen")


def test_split_medians_and_ratios_of_recorded_runs():
    t = grpo_peer.summarize(RECORDED["tunix"])
    h = grpo_peer.summarize(RECORDED["hybrid"])
    ts = RECORDED["tunix"]["clock"]["samples"]
    assert t["first_iteration_s"] == 42.4973
    assert t["iteration_s"] == pytest.approx((4.6641 + 4.0978) / 2)  # median after the first
    assert t["logp_old_s"] == 0.0 and t["logp_s"] == t["logp_ref_s"]  # tunix skips that pass
    other = [it - (ro + lr + tr + sc) for it, ro, lr, tr, sc in zip(
        *(ts[k][1:] for k in ("iteration", "rollout", "logp_ref", "train_step", "score")))]
    assert t["other_s"] == pytest.approx(statistics.median(other))  # per iteration, then median
    assert t["prefill_s"] == pytest.approx((0.1517 + 0.1322) / 2)  # 1-token call, batch 32
    assert t["decode_s"] == pytest.approx(t["rollout_s"] - t["prefill_s"])
    g64, g1 = statistics.median(ts["sampler_b32_g64"][1:]), statistics.median(
        ts["sampler_b32_g1"][1:])
    assert t["decode_tok_s_b32"] == pytest.approx(32 * 63 / (g64 - g1))
    assert t["decode_fn_s"] == pytest.approx((0.5949 + 0.6267) / 2) and "decode_fn_s" not in h
    assert t["train_step_compile_s"] == 17.59 and h["train_step_compile_s"] == 91.71
    assert h["logp_s"] == pytest.approx((1.2405 + 1.1807) / 2 + (1.2718 + 1.1479) / 2)
    assert h["foreign_cores"] == pytest.approx(1.6015)
    assert "setup_s" not in t  # recorded before the set-up sample existed
    rec = {**RECORDED["tunix"], "clock": {**RECORDED["tunix"]["clock"]}}
    rec["clock"]["samples"] = {**rec["clock"]["samples"], "setup": [12.5]}
    rec["clock"]["compile_s"] = {**rec["clock"]["compile_s"], "setup": 9.8}
    with_setup = grpo_peer.summarize(rec)
    assert (with_setup["setup_s"], with_setup["setup_compile_s"]) == (12.5, 9.8)
    assert with_setup["setup_and_first_s"] == 12.5 + with_setup["first_iteration_s"]

    # medians over rounds, ratios project / peer and the targets
    slower = dict(h, iteration_s=h["iteration_s"] * 3)
    med = grpo_peer.aggregate([h, slower, dict(h, decode_tok_s_b1=None)])
    assert med["iteration_s"] == h["iteration_s"] and med["decode_tok_s_b1"] is None
    no_sampler = {k: v for k, v in slower.items() if "decode" not in k and "prefill" not in k}
    med = grpo_peer.aggregate([no_sampler, dict(h, decode_tok_s_b32=1.0), h])
    assert med["iteration_s"] == h["iteration_s"]  # the rounds without a sampler part count
    assert med["rollout_s"] == h["rollout_s"] and "prefill_s" not in no_sampler
    assert med["decode_tok_s_b32"] == pytest.approx((1.0 + h["decode_tok_s_b32"]) / 2)
    r = grpo_peer.ratios(h, t)
    assert r["iteration_s"] == pytest.approx(h["iteration_s"] / t["iteration_s"])
    assert r["logp_old_s"] is None  # the peer has no such pass
    assert "foreign_cores" not in r  # a load reading: no ratio (two near-zero loads)
    paired = grpo_peer.paired_ratios([h, slower], [t, dict(t, iteration_s=t["iteration_s"] * 2)])
    assert paired["iteration_s"] == pytest.approx(
        (h["iteration_s"] / t["iteration_s"] + 1.5 * h["iteration_s"] / t["iteration_s"]) / 2)
    ok = grpo_peer.checks(r)
    assert set(ok) == {"first_iteration_s", "iteration_s", "decode_tok_s_b32"}
    assert ok["iteration_s"]["met"] is False and ok["iteration_s"]["target"] == "<= 1.0"
    assert grpo_peer.checks({"decode_tok_s_b32": 2.1, "iteration_s": 0.9}) == {
        "decode_tok_s_b32": {"ratio": 2.1, "target": ">= 2.0", "met": True},
        "iteration_s": {"ratio": 0.9, "target": "<= 1.0", "met": True}}
    result = {"rounds": 1, "sides": ["tunix", "hybrid"], "median": {"tunix": t, "hybrid": h},
              "ratios": {"hybrid": r}, "paired_ratios": {"hybrid": paired},
              "checks": {"hybrid": ok}, "load_before": [9.1],
              "load_after": [7.96]}
    table = grpo_peer.report(result)
    assert "hybrid/tunix" in table and "!!" in table and "load average before [9.1]" in table


def test_decode_flops_per_token_and_the_rate_they_give():
    """grpo_matched.decode_flops_per_token: XLA's count for one decode step of the matched
    hybrid, per row, lies between 2 FLOPs per trunk weight the step multiplies (every expert:
    the decode path runs them all; the output head; not the input embedding, a gather, nor the
    MTP module) and 1.25x that (the KDA states, the attention over the cache and the norms are
    the rest); summarize turns a side's count and its batch-32 rate into decode_gflop_s_b32
    (no ratio: the two sides' models do different work per token)."""
    import flax
    import jax

    import train.models

    model = train.models.rl_model(grpo_matched.run_config("hybrid"))
    v = flax.core.meta.unbox(model.abstract_init())
    weights = sum(leaf.size for path, leaf in jax.tree_util.tree_flatten_with_path(v["params"])[0]
                  if not str(path[0].key).startswith("mtp") and leaf.ndim >= 2
                  and "embedding" not in str(path[-1].key))
    got = grpo_matched.decode_flops_per_token(model, v, 32, 96)
    assert 2 * weights <= got <= 1.25 * 2 * weights, (got, weights)
    assert grpo_matched.decode_flops_per_token(model, v, 8, 96) == pytest.approx(got, rel=0.05)

    rec = {**RECORDED["hybrid"], "decode_flops_per_token": got}
    h = grpo_peer.summarize(rec)
    assert h["decode_gflop_s_b32"] == pytest.approx(got * h["decode_tok_s_b32"] / 1e9)
    t = grpo_peer.summarize(RECORDED["tunix"])
    assert "decode_gflop_s_b32" not in t  # a record without the count (older runs)
    t = grpo_peer.summarize({**RECORDED["tunix"], "decode_flops_per_token": 9.1e6})
    assert t["decode_gflop_s_b32"] == pytest.approx(9.1e6 * t["decode_tok_s_b32"] / 1e9)
    assert "decode_gflop_s_b32" not in grpo_peer.ratios(h, t)


def test_summary_needs_a_steady_iteration():
    rec = {"side": "tunix", "clock": {"samples": {"iteration": [40.0]}}}
    with pytest.raises(ValueError, match=">= 2 iterations"):
        grpo_peer.summarize(rec)


def test_peer_runs_on_default_xla_flags_without_a_cache(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type= --xla_foo=1")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/cache")
    peer, project = grpo_peer._child_env(True), grpo_peer._child_env(False)
    assert peer["XLA_FLAGS"] == "--xla_foo=1" and "ynn" in project["XLA_FLAGS"]
    assert "JAX_COMPILATION_CACHE_DIR" not in peer and "JAX_COMPILATION_CACHE_DIR" not in project


def test_warm_cache_env_reaches_jax_in_a_side_process(tmp_path, monkeypatch):
    """--warm-cache hands each side its cache through jax's own environment variables: a child
    started with that environment writes its compile there (and a cold one does not)."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "outer"))
    env = grpo_peer._child_env(False, str(tmp_path / "side"))
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "side")
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()"
    for e in (env, grpo_peer._child_env(False)):
        subprocess.run([sys.executable, "-c", code], env=e, check=True, timeout=120)
    assert list((tmp_path / "side").iterdir()), "the side process wrote no cache entry"
    assert not (tmp_path / "outer").exists()


def test_both_sides_get_the_same_prompts_and_reward():
    from rl.pipeline import encode_prompts

    rng = np.random.default_rng(0)
    texts = tunix_sampler.prompt_texts(rng, 3, grpo_peer.MATCHED)
    tok = grpo_matched.IdTokenizer()
    ids, lens = encode_prompts(tok, texts, 32)  # [3,32], [3]
    assert ids.shape == (3, 32) and list(lens) == [32, 32, 32] and (ids[:, 0] == 1).all()
    assert ((ids[:, 1:] >= 3) & (ids[:, 1:] < 512)).all()
    peer_tok = tunix_sampler.IdTokenizer(512)
    assert [peer_tok.encode(t) for t in texts] == ids[:, 1:].tolist()
    assert tok.decode(ids[0, 1:]) == texts[0] and peer_tok.eos_id() == 512 and tok.eos_id < 0
    completions = ["2 4 5", "7", "", "10 12 14 16"]
    reward = grpo_matched.EvenFractionReward()
    try:
        ours = [reward.submit(None, c).result() for c in completions]
    finally:
        reward.close()
    assert [s for s, _ in ours] == tunix_grpo.even_fraction(None, completions) == [
        2 / 3, 0.0, 0.0, 1.0]
    assert all(d == {"status": "ok"} for _, d in ours)


def test_clock_books_samples_and_compiles_to_the_running_call():
    clock = Clock()

    def compiles(x):
        clock.listen("/jax/core/compile/backend_compile_duration", 0.5)
        clock.listen("/jax/some/other_event", 9.0)
        return np.asarray(x) * 2  # [3]

    def fails():
        raise RuntimeError("boom")

    out = clock.wrap(compiles, "train_step")([1, 2, 3])
    assert out.tolist() == [2, 4, 6]
    with pytest.raises(RuntimeError):
        clock.wrap(fails, "rollout")()
    assert clock.phase == "setup"
    rec = clock.record()
    assert rec["compile_s"] == {"train_step": 0.5}
    assert len(rec["samples"]["train_step"]) == 1 and rec["samples"]["train_step"][0] >= 0
    assert "rollout" not in rec["samples"]  # a failed call is not a sample
    assert rec["foreign_cores"]["train_step"][0] >= 0 and os.getloadavg()


def test_peer_allocator_is_a_choice(monkeypatch):
    """--peer-malloc: the peer as installed (no preload of ours) or on the project's jemalloc;
    the project's side re-executes itself on jemalloc (runtime/xla_env.py) either way."""
    from runtime import xla_env

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "LD_PRELOAD" not in grpo_peer._child_env(True)
    je = grpo_peer._child_env(True, None, "jemalloc")
    assert je["LD_PRELOAD"] == xla_env.find_jemalloc() and os.path.exists(je["LD_PRELOAD"])
    assert je["MALLOC_CONF"] == xla_env.JEMALLOC_CONF
    assert "LD_PRELOAD" not in grpo_peer._child_env(False, None, "jemalloc")
    with pytest.raises(ValueError, match="peer_malloc"):
        grpo_peer._child_env(True, None, "tcmalloc")
