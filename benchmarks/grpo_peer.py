"""`python scripts/bench.py peer`: this project's RL engine against google-tunix 0.1.7 on the same
GRPO work, side by side, each round in fresh processes (peer first in even rounds, project first
in odd ones), medians over rounds.

    bash scripts/setup_peers.sh                           # once: the peer's virtual environment
    python scripts/bench.py peer --quick                  # 1 round, 2 steady iterations
    python -m benchmarks.grpo_peer --rounds 3 --variants hybrid dense --json runs/peer.json
    python -m benchmarks.grpo_peer --set rl.mtp_loss_weight=0.0   # a project-side override

The peer runs with the python of $PEER_VENVS/tunix (default ~/peer-venvs/tunix) on XLA's default
flags; the project side (benchmarks/grpo_matched.py) with this interpreter and the scripts' flags;
neither uses a persistent compilation cache, so each first iteration holds its compiles
(`--warm-cache`: each side with its own cache, filled by one untimed run first: what a re-run
of the same config sees; the issue's first-iteration target stays on the cold runs).

Printed per side (medians over rounds; within a round, steady = the median over the iterations
after the first): the set-up before the first iteration (models, train state, programs built)
and its compile seconds; the first iteration; their sum, the time to the first update (the
project compiles its update from the set-up on where the rollout-time forward has nothing to
run, so part of its compile is in the set-up); the steady iteration and its split: rollout
(prefill = the same rollout call at 1 new token, batch 32; decode = the rest of the rollout),
log-prob passes (old, reference), train step, scoring wait, other (host work: packing,
advantages, transfers); the train step's compile seconds where it compiles at its first call
(`compiled_ahead_s`: the project's update programs compiled on a thread, rl.precompile, which
the first iteration holds only where it waits); decode tokens/s
at batch 32 and 1 (B x 63 / (call at 64 new tokens - call at 1), the same definition on both
sides) and the FLOP/s that decode rate sustains at batch 32 (XLA's count of the operations in
one decode step of the side's model per row, benchmarks/grpo_matched.py:decode_flops_per_token
and benchmarks/peers/tunix_sampler.py:decode_flops_per_token, times the rate; no ratio: the
models differ); the other processes' CPU load during the steady iterations (cores) and the load
average before and after.
Ratios are project / peer (< 1 is faster for seconds, > 1 for tokens/s): of the medians (the
issue's targets are marked on these) and paired (the median of the per-round ratios, each from
two processes run back to back).

Matched (benchmarks/peers:MATCHED): 8 prompts x 4 samples, 32 prompt + exactly 64 generated
tokens (the end-of-sequence id is never sampled), temperature 0.9, k3 KL 0.04 to a frozen
reference with one reference forward per batch, GRPO clip 0.2, AdamW lr 1e-5 (weight decay 1e-4,
no clipping), the reward on the host, f32, jax 0.10.2 on both sides, ~4.46M parameters. Both
skip the separate old-log-prob forward when a batch serves a single update (the old log-probs
are the step's own, stop-gradient; in the project rl.old_logp_pass="auto", and
`--set rl.old_logp_pass=always` times the pass). The project's reference forward runs inside its
train step's program (rl.ref_logp_pass="auto": its train_step_s includes it and its logp_s is 0;
`--set rl.ref_logp_pass=separate` times it apart, as tunix runs it).
Not matched: the models (the peer's dense Qwen3-style transformer vs the project's hybrid
KDA/DSA + MoE + MTP, or its dense variant), the project's extra loss terms (MTP, MoE balance, DSA
indexer KL), its truncated importance weight against the sampler's log-probs (rl.algo.tis_cap)
and its one-device mesh programs; tunix computes the rewards inline, the project's rollout
worker submits them to a scorer thread (no sandbox on either side: the reward is a host
function). Not measured here: speculative decoding's trunk passes per token (`scripts/bench.py
spec`) and the KDA kernel against ejkernel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.peers import MATCHED, loadavg

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PEER_VENVS_ENV = "PEER_VENVS"
SIDE_TIMEOUT_S = 900

# (metric, better when (None: no ratio: a load reading, or a rate of different models' work),
# the target on project / peer (DESIGN.md section 5) or None)
TABLE = (
    ("setup_s", "lower", None),
    ("setup_compile_s", "lower", None),
    ("first_iteration_s", "lower", 1.0),
    ("setup_and_first_s", "lower", None),  # the time to the first update, wherever compiles run
    ("iteration_s", "lower", 1.0),
    ("rollout_s", "lower", None),
    ("prefill_s", "lower", None),
    ("decode_s", "lower", None),
    ("logp_s", "lower", None),
    ("logp_old_s", "lower", None),
    ("logp_ref_s", "lower", None),
    ("train_step_s", "lower", None),
    ("score_wait_s", "lower", None),
    ("other_s", "lower", None),
    ("train_step_compile_s", "lower", None),
    ("compiled_ahead_s", "lower", None),
    ("decode_tok_s_b32", "higher", 2.0),
    ("decode_tok_s_b1", "higher", None),
    ("sampler_call_tok_s_b32", "higher", None),
    ("decode_gflop_s_b32", None, None),  # a side's decode step FLOPs per row x its rate
    ("foreign_cores", None, None),
)


class PeerMissing(FileNotFoundError):
    """The peer's virtual environment is not there."""


def peer_python(peer: str = "tunix", venvs: str | None = None) -> str:
    """The peer's interpreter: $PEER_VENVS/<peer>/bin/python (default ~/peer-venvs)."""
    venvs = venvs or os.environ.get(PEER_VENVS_ENV) or os.path.expanduser("~/peer-venvs")
    py = os.path.join(venvs, peer, "bin", "python")
    if not os.access(py, os.X_OK):
        raise PeerMissing(
            f"no {peer} virtual environment at {os.path.join(venvs, peer)} ({py} is missing): "
            f"create it with `bash scripts/setup_peers.sh {peer}` (or point ${PEER_VENVS_ENV} at "
            "the directory that holds it)")
    return py


PEER_MALLOCS = ("system", "jemalloc")


def _child_env(peer: bool, cache_dir: str | None = None, peer_malloc: str = "system") -> dict:
    """The environment of a side's process: none of this interpreter's paths; the peer on XLA's
    default flags (without the project's YNN switch) and, with peer_malloc="jemalloc", on the
    allocator the project's side runs on (runtime/xla_env.py:use_jemalloc; default: the peer as
    installed, glibc's malloc); no persistent compilation cache, or with `cache_dir` jax's
    persistent cache there for every compile (jax reads these variables)."""
    from runtime import xla_env

    if peer_malloc not in PEER_MALLOCS:
        raise ValueError(f"peer_malloc must be one of {PEER_MALLOCS}, got {peer_malloc!r}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if peer and peer_malloc == "jemalloc":
        library = xla_env.find_jemalloc()
        if library is None:
            raise PeerMissing("--peer-malloc jemalloc: libjemalloc.so.2 not found (bash "
                              "scripts/setup.sh installs it)")
        env = xla_env.with_jemalloc(env, library)
    if cache_dir is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if peer:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_cpu_experimental_ynn_fusion_type")]
        env["XLA_FLAGS"] = " ".join(flags)
        if not flags:
            del env["XLA_FLAGS"]
    return env


def side_command(side: str, steps: int, reps: int, out: str, overrides=(), venvs=None) -> list:
    """argv of one side's process ("tunix", or a project variant of benchmarks.grpo_matched)."""
    if side == "tunix":
        return [peer_python("tunix", venvs), "-m", "benchmarks.peers.tunix_grpo",
                "--steps", str(steps), "--reps", str(reps), "--out", out]
    from benchmarks.grpo_matched import VARIANTS

    if side not in VARIANTS:
        raise ValueError(f"side must be 'tunix' or one of {VARIANTS}, got {side!r}")
    cmd = [sys.executable, "-m", "benchmarks.grpo_matched", "--variant", side,
           "--steps", str(steps), "--reps", str(reps), "--out", out]
    return cmd + (["--set", *overrides] if overrides else [])


def run_side(side: str, steps: int, reps: int, overrides=(), venvs=None,
             cache_dir: str | None = None, peer_malloc: str = "system") -> dict:
    """One side in a fresh process (with jax's persistent compilation cache in `cache_dir`, or
    none; the peer on `peer_malloc`); its JSON record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.json")
        cmd = side_command(side, steps, reps, out, overrides, venvs)
        env = _child_env(side == "tunix", cache_dir, peer_malloc)
        proc = subprocess.run(cmd, cwd=ROOT, env=env,
                              text=True, capture_output=True, timeout=SIDE_TIMEOUT_S)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{side} run failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                               f"{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def _steady(xs: list) -> float:
    """Median of the samples after the first (the first compiles); the only one if alone."""
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def summarize(rec: dict, spec: dict = MATCHED) -> dict:
    """One process's record -> flat seconds / tokens-per-second (see the module docstring)."""
    s = rec["clock"]["samples"]
    if len(s.get("iteration", [])) < 2:
        raise ValueError(f"{rec.get('side')}: a record needs >= 2 iterations (the first compiles)"
                         f", got {len(s.get('iteration', []))}")
    G, B = spec["new_tokens"], spec["prompts"] * spec["group"]
    part = {k: _steady(s[k]) if s.get(k) else 0.0
            for k in ("rollout", "logp_old", "logp_ref", "train_step", "score")}
    out = {"first_iteration_s": s["iteration"][0], "iteration_s": _steady(s["iteration"]),
           "rollout_s": part["rollout"], "logp_old_s": part["logp_old"],
           "logp_ref_s": part["logp_ref"], "logp_s": part["logp_old"] + part["logp_ref"],
           "train_step_s": part["train_step"], "score_wait_s": part["score"]}
    n = len(s["iteration"])
    per_iter = [s[k] if s.get(k) else [0.0] * n
                for k in ("rollout", "logp_old", "logp_ref", "train_step", "score")]
    if all(len(x) == n for x in per_iter):  # one sample of each part per iteration
        out["other_s"] = _steady([s["iteration"][i] - sum(x[i] for x in per_iter)
                                  for i in range(n)])
    else:
        out["other_s"] = out["iteration_s"] - (out["rollout_s"] + out["logp_s"] +
                                               out["train_step_s"] + out["score_wait_s"])
    one = s.get(f"sampler_b{B}_g1")
    if one:  # a round without the sampler-alone part has no prefill estimate
        out["prefill_s"] = min(_steady(one), out["rollout_s"])
        out["decode_s"] = out["rollout_s"] - out["prefill_s"]
    for b in (B, 1):
        full, single = s.get(f"sampler_b{b}_g{G}"), s.get(f"sampler_b{b}_g1")
        if full and single:
            dt = _steady(full) - _steady(single)
            out[f"decode_tok_s_b{b}"] = b * (G - 1) / dt if dt > 0 else None
            out[f"sampler_call_tok_s_b{b}"] = b * G / _steady(full)
    rate = out.get(f"decode_tok_s_b{B}")
    if rec.get("decode_flops_per_token") and rate:
        out[f"decode_gflop_s_b{B}"] = rec["decode_flops_per_token"] * rate / 1e9
    if s.get("decode"):  # the peer's own decode function inside the rollout (a cross-check)
        out["decode_fn_s"] = _steady(s["decode"])
        out["prefill_fn_s"] = _steady(s["prefill"])
    out["train_step_compile_s"] = rec["clock"]["compile_s"].get("train_step", 0.0)
    # the update's programs compiled ahead on a thread (rl.precompile; from the set-up on where
    # the rollout-time forward has nothing to run)
    out["compiled_ahead_s"] = rec["clock"]["compile_s"].get("ahead", 0.0)
    if s.get("setup"):
        out["setup_s"] = s["setup"][0]
        out["setup_compile_s"] = rec["clock"]["compile_s"].get("setup", 0.0)
        out["setup_and_first_s"] = out["setup_s"] + out["first_iteration_s"]
    fc = rec["clock"]["foreign_cores"]["iteration"]
    out["foreign_cores"] = statistics.median(fc[1:] if len(fc) > 1 else fc)
    out["params"] = rec["params"]
    return out


def aggregate(summaries: list) -> dict:
    """Per metric, the median over the rounds that measured it (None where one of them has no
    value, e.g. a decode rate whose two calls were too close to tell apart)."""
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    out = {}
    for k in keys:
        vals = [s[k] for s in summaries if k in s]
        out[k] = None if any(v is None for v in vals) else statistics.median(vals)
    return out


def ratios(project: dict, peer: dict) -> dict:
    """project / peer per metric both sides have (None where either is missing or 0, and for
    the other processes' load, foreign_cores: a ratio of two near-zero loads means nothing)."""
    return {k: (project[k] / peer[k] if project.get(k) is not None and peer.get(k) else None)
            for k, better, _ in TABLE if better is not None and k in project and k in peer}


def paired_ratios(project_rounds: list, peer_rounds: list) -> dict:
    """Per metric, the median over rounds of project / peer within the same round (the two
    ran back to back, under about the same load)."""
    per_round = [ratios(a, b) for a, b in zip(project_rounds, peer_rounds)]
    out = {}
    for k in dict.fromkeys(k for r in per_round for k in r):
        vals = [r[k] for r in per_round if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def checks(ratio: dict) -> dict:
    """The speed targets (DESIGN.md section 5) on the ratios: {metric: {"ratio", "target", "met"}}."""
    out = {}
    for k, better, target in TABLE:
        if target is None or ratio.get(k) is None:
            continue
        r = ratio[k]
        out[k] = {"ratio": r, "target": ("<= " if better == "lower" else ">= ") + str(target),
                  "met": r <= target if better == "lower" else r >= target}
    return out


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 100 else f"{x:,.0f}"


def report(result: dict) -> str:
    """The printed table of a run() result."""
    med, sides = result["median"], result["sides"]
    variants = [s for s in sides if s != "tunix"]
    n = result["rounds"]
    head = f"{'metric (median of ' + str(n) + ' rounds)':<34}" + "".join(
        f"{s:>11}" for s in sides) + "".join(f"{v + '/tunix':>15}{'paired':>9}"
                                              for v in variants)
    lines = [head]
    for k, _, target in TABLE:
        if not any(k in med[s] for s in sides):
            continue
        row = f"{k:<34}" + "".join(f"{_fmt(med[s].get(k)):>11}" for s in sides)
        for v in variants:
            r = result["ratios"][v].get(k)
            mark = ""
            if target is not None and r is not None:
                mark = " ok" if result["checks"][v][k]["met"] else " !!"
            row += f"{_fmt(r) + mark:>15}{_fmt(result['paired_ratios'][v].get(k)):>9}"
        lines.append(row)
    if result.get("sampler_rounds", n) < n:
        lines.append(f"prefill, decode and the sampler rates: the first {result['sampler_rounds']}"
                     " round(s) only")
    if result.get("warm_cache"):
        lines.append("warm persistent compilation cache on both sides (each filled by one untimed "
                     "run first): the first-iteration target is on cold runs")
    records = result.get("records", {})
    allocators = {s: records[s][0].get("allocator", "?") if records.get(s) else "?"
                  for s in variants}
    lines.append(f"allocators: tunix {result.get('peer_malloc', 'system')}, "
                 + ", ".join(f"{s} {a}" for s, a in allocators.items()))
    lines.append(f"load average before {result['load_before']}, after {result['load_after']}; "
                 "targets (DESIGN.md section 5, on the ratio of medians): iteration and first iteration "
                 "<= 1x tunix, decode b32 >= 2x; '!!' = not met; paired = median of the "
                 "per-round ratios")
    return "\n".join(lines)


def run(quick: bool = False, rounds: int | None = None, steps: int | None = None,
        reps: int | None = None, variants=("hybrid",), overrides=(), venvs=None,
        sampler_rounds: int | None = None, warm_cache: bool = False,
        peer_malloc: str = "system") -> dict:
    """N rounds of tunix and each project variant in fresh processes; medians and ratios. The
    sampler-alone part (decode tokens/s) runs in the first `sampler_rounds` rounds (default:
    all). warm_cache: each side gets its own persistent compilation cache, filled by one
    untimed run of the same work before the rounds (a re-run of a config, as the project's
    scripts do by default); the issue's first-iteration target is on the cold runs.
    peer_malloc: the peer's allocator ("system": as installed; "jemalloc": the one the project's
    side runs on, `_child_env`)."""
    rounds = (1 if quick else 3) if rounds is None else rounds
    steps = (2 if quick else 3) if steps is None else steps
    reps = (2 if quick else 3) if reps is None else reps
    sampler_rounds = rounds if sampler_rounds is None else sampler_rounds
    if rounds < 1 or steps < 1 or reps < 1 or not 1 <= sampler_rounds <= rounds:
        raise ValueError(f"rounds, steps and reps must be >= 1 and sampler_rounds in 1..rounds, "
                         f"got {rounds}, {steps}, {reps}, {sampler_rounds}")
    peer_python("tunix", venvs)  # fail before anything runs
    _child_env(True, None, peer_malloc)  # a bad or missing allocator fails here too
    sides = ["tunix", *variants]
    for v in variants:
        side_command(v, 1, 1, "-")  # an unknown variant fails here
    result = {"rounds": rounds, "steps": steps, "reps": reps, "sampler_rounds": sampler_rounds,
              "sides": sides, "overrides": list(overrides), "spec": MATCHED,
              "warm_cache": warm_cache, "peer_malloc": peer_malloc,
              "load_before": loadavg(), "per_round": {s: [] for s in sides},
              "records": {s: [] for s in sides}}
    with contextlib.ExitStack() as stack:  # the warm caches go when the rounds end or fail
        root = (stack.enter_context(tempfile.TemporaryDirectory(prefix="grpo_peer_cache_"))
                if warm_cache else None)
        cache_of = (lambda side: os.path.join(root, side)) if root else (lambda side: None)
        for side in sides if root else ():  # untimed: fills the side's cache
            run_side(side, steps, reps, overrides, venvs, cache_of(side), peer_malloc)
            print(f"  {side}: compilation cache filled", flush=True)
        for r in range(rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                rec = run_side(side, steps, reps if r < sampler_rounds else 0, overrides, venvs,
                               cache_of(side), peer_malloc)
                summary = summarize(rec)
                summary.update(load_before=rec["load_before"][0],
                               load_after=rec["load_after"][0])
                result["per_round"][side].append(summary)
                result["records"][side].append(rec)
                print(f"  round {r + 1} {side}: iteration {summary['iteration_s']:.3f} s, first "
                      f"{summary['first_iteration_s']:.2f} s, load {rec['load_before'][0]} -> "
                      f"{rec['load_after'][0]}", flush=True)
    result["load_after"] = loadavg()
    result["median"] = {s: aggregate(result["per_round"][s]) for s in sides}
    result["ratios"] = {v: ratios(result["median"][v], result["median"]["tunix"])
                        for v in variants}
    result["paired_ratios"] = {v: paired_ratios(result["per_round"][v],
                                                result["per_round"]["tunix"]) for v in variants}
    result["checks"] = {v: checks(result["ratios"][v]) for v in variants}
    print(report(result), flush=True)
    return result


def main(argv=None) -> int:
    from benchmarks.grpo_matched import VARIANTS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round, 2 steady iterations")
    p.add_argument("--rounds", type=int, help="alternating rounds (default 3; --quick: 1)")
    p.add_argument("--steps", type=int, help="steady GRPO iterations per process (default 3)")
    p.add_argument("--reps", type=int, help="timed sampler calls per shape (default 3; --quick: 2)")
    p.add_argument("--sampler-rounds", type=int,
                   help="rounds that also time the sampler alone (default: every round)")
    p.add_argument("--variants", nargs="+", default=["hybrid"], choices=VARIANTS)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="project-side config overrides (benchmarks/grpo_matched.py)")
    p.add_argument("--warm-cache", action="store_true",
                   help="each side with its own persistent compilation cache, filled by one "
                        "untimed run first (what a re-run of a config sees)")
    p.add_argument("--peer-malloc", choices=PEER_MALLOCS, default="system",
                   help="the peer's allocator: as installed (system), or jemalloc, which the "
                        "project's side runs on (runtime/xla_env.py)")
    p.add_argument("--json", help="write the result (with every process's record) here")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "reps", "sampler_rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        result = run(args.quick, args.rounds, args.steps, args.reps, tuple(args.variants),
                     tuple(args.set), sampler_rounds=args.sampler_rounds,
                     warm_cache=args.warm_cache, peer_malloc=args.peer_malloc)
    except PeerMissing as e:
        print(f"grpo_peer: {e}", file=sys.stderr)
        return 2
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
