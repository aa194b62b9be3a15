r"""Focused mutation check: does a realistic one-line bug make the named tests fail?

    python3 scripts/mutate.py --list                              # the catalogue below
    python3 scripts/mutate.py --list --module rl/advantages.py    # the mutations of one file
    python3 scripts/mutate.py --module rl/advantages.py           # check them: before a change lands
    python3 scripts/mutate.py --module model/ --module rl/losses.py    # files under a folder, and a file
    python3 scripts/mutate.py rope.not_a_rotation                 # one catalogued mutation
    python3 scripts/mutate.py rope.not_a_rotation moe.scaling_dropped --tests tests/model/test_layers.py
    python3 scripts/mutate.py --all                               # every one (about 11 minutes on 2 shared cores, 5 of them the baseline)
    python3 scripts/mutate.py --file model/layers/rope.py --old "x2 * cos + x1 * sin" \
        --new "x2 * cos - x1 * sin" --tests tests/model/test_layers.py     # an ad-hoc mutation

The catalogue, by the module each mutation changes (`--module PATH` selects those whose files
are PATH or lie under the folder PATH; `--list` prints each one's note and its tests):
  model/layers/moe.py          moe.scaling_dropped
  model/layers/rope.py         rope.not_a_rotation
  model/layers/dsa.py          dsa.mask_sees_next_key
  model/layers/mtp.py          mtp.embedding_norm_dropped
  model/objectives.py          mtp.loss_target_shifted, mtp.target_count_shifted
  model/transformer.py         mtp.input_token_shifted, scan.aux_out_of_layer_order
  pallas_kernels/kda/          kda.block_decay_off_by_one, kda.backward_keeps_wrong_pair
  rl/draws.py                  sampler.temperature_ignored, sampler.temperature_after_truncation,
                               sampler.top_p_le
  rl/sampler.py                sampler.refill_first_token_not_done
  rl/losses.py                 losses.old_logp_differentiated,
                               train_step.current_old_logp_differentiated (with rl/train_step.py)
  rl/train_step.py             train_step.guard_checks_loss_only,
                               train_step.sft_guard_checks_loss_only,
                               train_step.current_old_logp_differentiated,
                               scan.router_bias_of_wrong_copy
  rl/advantages.py             advantages.last_token_by_count
  rl/agent.py                  agent.last_step_reward
  rl/envs.py                   envs.return_of_last_turn_penalty
  rl/checkpoint.py             checkpoint.host_digest_ignores_position,
                               checkpoint.data_of_latest_step
  sandbox/verifiers.py         verifiers.terminal_timeout_passes, verifiers.stdio_timeout_passes,
                               verifiers.no_relative_tolerance
train_step.current_old_logp_differentiated changes two files: the train step's
stop-gradient on its own log-probs (old_logp="current") is backed by the policy loss's
stop-gradient on old_logp, so removing either alone leaves the gradient right (an equivalent
mutant); losses.old_logp_differentiated is the policy loss's alone.

The checkout is never modified. The tree is copied once to a temporary directory (tracked and
untracked files that git does not ignore, as `git ls-files` lists them; with --ref REV the files
of that commit instead), the named tests first run there unmodified (the baseline: a failing
baseline stops the check, since every mutation would then look caught), then each mutation is
written into the copy, its tests run, and its files are restored before the next. Tests run with
PYTHONPATH=<the copy> (the scripts they start import the copy, not the editable install's
checkout), PYTHONDONTWRITEBYTECODE=1 (no bytecode of a mutated module can outlive its mutation) and
`-x -n 0 -p no:cacheprovider` (one process: pytest-xdist's shutdown after -x's first failure
loses the report naming the failed test; --every-failure drops -x and -n 0, and the baseline
runs like it); the copy's .cache is the checkout's .cache (a symlink: the JAX compilation cache
is keyed by program, so mutated programs never collide with real ones; --fresh-cache gives the
copy an empty one instead).

A mutation is a list of exact text replacements in one file (plus, for a bug that needs two
places changed, replacements in other files: `also`); each `old` must occur exactly once.
Code in flux can list alternatives (the first whose every `old` is found applies). Verdicts:
  caught       the tests failed (pytest exit 1) or could not be collected (exit 2)
  MISSED       the tests passed with the bug in place
  not applied  no alternative's text is in the file (the code moved on: update the catalogue)
  error        pytest ended otherwise (no tests collected, interrupted, timeout)
Exit status: 0 when every mutation was caught, 1 when one was missed or errored, 2 when one could
not be applied or the baseline failed. Not covered: generating mutations automatically (pick
realistic ones by hand; mutation tools such as mutmut enumerate thousands, too many for this
suite's compile-bound tests on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    alternatives: tuple[tuple[tuple[str, str], ...], ...]  # each: ((old, new), ...)
    tests: tuple[str, ...]
    note: str = ""
    # edits in other files made together with `file`'s: ((path, ((old, new), ...)), ...), each
    # old exactly once (a bug that needs two places changed, e.g. a guard kept in two layers)
    also: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        return (self.file, *(f for f, _ in self.also))


def _m(name, file, edits, tests, note="", alternatives=(), also=()):
    return Mutation(name, file, (tuple(edits), *(tuple(a) for a in alternatives)), tuple(tests),
                    note, tuple((f, tuple(e)) for f, e in also))


SAMPLING = ("tests/rl/test_sampling_dist.py",)
LAYERS = ("tests/model/test_layers.py",)
VERIFIERS = ("tests/sandbox/test_verifier_strength.py",)
MTP = "tests/model/test_mtp_targets.py"
PINNED = "tests/rl/test_pinned_behaviours.py"
AGENT = "tests/sandbox/test_agent_episode_return.py"

# Each entry: a bug that once escaped the suite (or that only one slow or indirect test caught)
# and the tests written to catch it. Entries are grouped by the module they mutate.
CATALOGUE = (
    _m("sampler.temperature_ignored", "rl/draws.py",
       [("logits = logits.astype(jnp.float32) / t", "logits = logits.astype(jnp.float32)")],
       SAMPLING, "sampling ignores the temperature",
       alternatives=[[("z = logits.astype(jnp.float32) / t", "z = logits.astype(jnp.float32)")]]),
    _m("sampler.temperature_after_truncation", "rl/draws.py",
       [("logits = logits.astype(jnp.float32) / t", "logits = logits.astype(jnp.float32)"),
        ("    return jax.nn.log_softmax(logits, axis=-1)\n",
         "    return jax.nn.log_softmax(logits / t, axis=-1)\n")],
       SAMPLING, "top-k/top-p choose the support from the untempered distribution",
       alternatives=[[("z = logits.astype(jnp.float32) / t\n    keep = truncation_mask(z,",
                       "z = logits.astype(jnp.float32)\n    keep = truncation_mask(z,"),
                      ("jax.nn.log_softmax(jnp.where(keep, z, -jnp.inf), axis=-1)",
                       "jax.nn.log_softmax(jnp.where(keep, z / t, -jnp.inf), axis=-1)")]]),
    _m("sampler.top_p_le", "rl/draws.py", [("cum < cfg.top_p", "cum <= cfg.top_p")],
       SAMPLING, "top-p keeps the token whose mass-before equals p",
       alternatives=[[("before < top_p", "before <= top_p")]]),
    _m("sampler.refill_first_token_not_done", "rl/sampler.py",
       [("sdone=jnp.where(refill, done0[newc], sdone)", "sdone=jnp.where(refill, False, sdone)")],
       (PINNED + "::test_refilled_row_whose_first_token_is_eos_ends_there",),
       "a row refilled into a slot decodes on although its first token already ended it"),
    _m("moe.scaling_dropped", "model/layers/moe.py",
       [("return w * scaling, idx.astype(jnp.int32), probs",
         "return w, idx.astype(jnp.int32), probs")],
       LAYERS, "routed_scaling_factor never applied"),
    _m("rope.not_a_rotation", "model/layers/rope.py",
       [("x2 * cos + x1 * sin", "x2 * cos - x1 * sin")], LAYERS, "sign error in the rotation"),
    _m("dsa.mask_sees_next_key", "model/layers/dsa.py",
       [("return jnp.arange(S)[None, None, :] <= t\n",
         "return jnp.arange(S)[None, None, :] <= t + 1\n")],
       LAYERS, "the indexer KL's causal mask lets query t see key t+1"),
    _m("mtp.loss_target_shifted", "model/objectives.py",
       [("sh = k + 2  # depth k+1 predicts t+k+2", "sh = k + 1  # depth k+1 predicts t+k+2")],
       (MTP + "::test_mtp_loss_scores_token_t_plus_k_plus_2_over_its_own_target_count",),
       "MTP depth k+1 is scored on token t+k+1 instead of t+k+2"),
    _m("mtp.target_count_shifted", "model/objectives.py",
       [("jnp.sum(m[:, k + 2:])", "jnp.sum(m[:, k + 1:])")],
       (MTP + "::test_mtp_loss_scores_token_t_plus_k_plus_2_over_its_own_target_count",),
       "each MTP depth's token mean divides by the count of targets one position earlier"),
    _m("mtp.input_token_shifted", "model/transformer.py",
       [("shift = k + 1\n", "shift = k + 2\n")],
       (MTP + "::test_mtp_forward_combines_the_embedding_of_token_t_plus_k_plus_1",),
       "MTP depth k+1 combines the embedding of token t+k+2 (it sees its own target)"),
    _m("mtp.embedding_norm_dropped", "model/layers/mtp.py",
       [("jnp.concatenate([a, b], axis=-1)", "jnp.concatenate([a, emb_next], axis=-1)")],
       (MTP + "::test_mtp_forward_combines_the_embedding_of_token_t_plus_k_plus_1",),
       "the MTP combiner projects the raw embedding, not its RMS-normed copy"),
    _m("verifiers.terminal_timeout_passes", "sandbox/verifiers.py",
       [('ok = setup_ok and check.status == "ok"',
         'ok = setup_ok and check.status in ("ok", "timeout")')],
       VERIFIERS, "a terminal check that times out counts as solved"),
    _m("verifiers.stdio_timeout_passes", "sandbox/verifiers.py",
       [('ok = r.status == "ok" and outputs_match(',
         'ok = r.status in ("ok", "timeout") and outputs_match(')],
       VERIFIERS, "a stdio case that times out after correct output counts as passed"),
    _m("verifiers.no_relative_tolerance", "sandbox/verifiers.py",
       [("if not (d <= tol or d <= tol * max(abs(fx), abs(fy))):", "if not d <= tol:")],
       VERIFIERS, "float_tol only absolute",
       alternatives=[[("if not (abs(fx - fy) <= tol or abs(fx - fy) <= tol * max(abs(fx), abs(fy))):",
                       "if not abs(fx - fy) <= tol:")]]),
    _m("train_step.guard_checks_loss_only", "rl/train_step.py",
       [("gnorm = optax.tree.norm(p_grads)\n        finite = jnp.isfinite(gnorm) & "
         "jnp.isfinite(loss)",
         "gnorm = optax.tree.norm(p_grads)\n        finite = jnp.isfinite(loss)")],
       ("tests/rl/test_train_guard.py",), "RL step: non-finite gradients with a finite loss applied"),
    _m("train_step.sft_guard_checks_loss_only", "rl/train_step.py",
       [("gnorm = optax.tree.norm(grads)\n        finite = jnp.isfinite(gnorm) & "
         "jnp.isfinite(loss)",
         "gnorm = optax.tree.norm(grads)\n        finite = jnp.isfinite(loss)")],
       ("tests/rl/test_train_guard.py",), "SFT step: same"),
    _m("losses.old_logp_differentiated", "rl/losses.py",
       [("old_logp = sg(_masked(old_logp, m))", "old_logp = _masked(old_logp, m)")],
       (PINNED + "::test_on_policy_policy_loss_gradient_is_the_policy_gradient",),
       "the policy loss lets gradient flow through its old_logp argument"),
    _m("train_step.current_old_logp_differentiated", "rl/train_step.py",
       [("old = jax.lax.stop_gradient(logp) if old_logp == \"current\"",
         "old = logp if old_logp == \"current\"")],
       (PINNED + "::test_current_old_logp_step_is_sgd_on_the_reference_objective",),
       "old_logp='current' passes the step's own log-probs to the loss as variables (the "
       "policy loss's stop-gradient removed too: either one alone keeps the gradient right)",
       also=[("rl/losses.py",
              [("old_logp = sg(_masked(old_logp, m))", "old_logp = _masked(old_logp, m)")])]),
    _m("advantages.last_token_by_count", "rl/advantages.py",
       [("last = jnp.max(jnp.where(m, pos, -1), axis=1)", "last = jnp.sum(m, axis=1) - 1")],
       (PINNED + "::test_outcome_reward_sits_on_the_last_valid_position_of_rows_with_holes",),
       "the outcome reward goes to position (valid count - 1), wrong for rows with holes"),
    _m("agent.last_step_reward", "rl/agent.py",
       [('r.reward = float(res.info.get("episode_return", res.reward))',
         "r.reward = float(res.reward)")],
       (AGENT,), "an agent episode is scored by its last step's reward, not its return"),
    _m("envs.return_of_last_turn_penalty", "rl/envs.py",
       [('info["episode_return"] = score - self.penalties',
         'info["episode_return"] = score - turn.penalty')],
       (AGENT,), "the episode return forgets the format penalties of earlier turns"),
    _m("kda.block_decay_off_by_one", "pallas_kernels/kda/reference.py",
       [("Rs = jnp.concatenate([Rs5[:, :, 0], Rs5[:, :, 1] * t2[:, :, 0, None, :]], axis=2)",
         "Rs = jnp.concatenate([Rs5[:, :, 0], Rs5[:, :, 1] * t2[:, :, 1, None, :]], axis=2)")],
       ("tests/pallas_kernels/test_kda.py::test_chunked_matches_recurrent_moderate_gates",),
       "a joined block's right half decays by its own total instead of the left half's (the "
       "-50/token oracle test misses it)"),
    _m("kda.backward_keeps_wrong_pair", "pallas_kernels/kda/chunked_vjp.py",
       [("pairs = (P.A_qk, P.A_kk, P.Tinv)", "pairs = (P.A_qk, P.A_qk, P.Tinv)")],
       ("tests/pallas_kernels/test_kda.py::test_chunked_vjp_matches_oracle_and_autodiff",),
       "the hand-written backward is handed A_qk where it reuses the forward's A_kk"),
    _m("scan.aux_out_of_layer_order", "model/transformer.py",
       [("for t in range(r) for j in range(p)]  # layer order",
         "for j in range(p) for t in range(r)]  # layer order")],
       ("tests/model/test_scan_layers.py::test_training_forward_and_gradients_match_per_layer_model",),
       "a scanned span's MoE statistics come out block-major instead of in layer order"),
    _m("scan.router_bias_of_wrong_copy", "rl/train_step.py",
       [("bias.at[t].set(nb)", "bias.at[0].set(nb)")],
       ("tests/model/test_scan_layers.py::test_sft_step_matches_per_layer_model",),
       "the aux-free bias step writes every copy's new bias into a stacked span's first copy"),
    _m("checkpoint.host_digest_ignores_position", "rl/checkpoint.py",
       [("idx = np.arange(w.size, dtype=np.uint32).reshape(w.shape)",
         "idx = np.zeros(w.shape, np.uint32)")],
       (PINNED + "::test_host_digest_is_position_keyed",),
       "the host-side digest's mixed sum ignores each word's position: swapped blocks collide"),
    _m("checkpoint.data_of_latest_step", "rl/checkpoint.py",
       [("self._mngr.restore(step, args=ocp.args.Composite(\n"
         "                    data=_grain_ckpt.CheckpointRestore(data_iter)))",
         "self._mngr.restore(max(self._mngr.all_steps()), args=ocp.args.Composite(\n"
         "                    data=_grain_ckpt.CheckpointRestore(data_iter)))")],
       ("tests/rl/test_checkpoint.py::test_restore_a_middle_step_of_several",),
       "restoring step s moves the data iterator to the newest step's position"),
    # the code checker's reward paths (tests/sandbox/test_checker_paths.py) and its false
    # negatives (tests/sandbox/test_scoring_false_negatives.py)
    _m("checker.timed_out_solution_passes", "sandbox/python_tests.py",
       [('sol_bad = next((r.status for r in sol if r.status != "ok"), None)', "sol_bad = None")],
       ("tests/sandbox/test_checker_paths.py::test_a_solution_that_times_out_after_its_records_scores_0",),
       "a solution run that timed out after writing its records counts as passed"),
    _m("checker.bad_record_replayed_as_none", "sandbox/python_tests.py",
       [('raise TypeError("the solution returned a value that is not plain data: " + rec["bad"])',
         "return None")],
       ("tests/sandbox/test_checker_paths.py::test_a_result_that_is_not_plain_data_is_never_replayed_as_a_value",),
       "a result that could not cross as plain data is replayed as None"),
    _m("checker.duplicate_records_kept", "sandbox/python_tests.py",
       [("or i in seen:", "or False:")],
       ("tests/sandbox/test_checker_paths.py::test_a_forged_duplicate_record_does_not_stand_in_for_another_call",),
       "a second record of the same call index is kept and replayed for a later call"),
    _m("checker.setup_failure_scored", "sandbox/verifiers.py",
       [('setup_ok = not task.setup or results[0].status == "ok"', "setup_ok = True")],
       ("tests/sandbox/test_checker_paths.py::test_a_task_whose_setup_failed_is_not_scored",),
       "a terminal task whose setup step failed is scored by its check"),
    _m("checker.set_order_not_canonical", "sandbox/plaindata.py",
       [("        items.sort(key=_text)\n", "")],
       ("tests/sandbox/test_checker_paths.py::test_set_elements_cross_in_one_canonical_order",),
       "set elements are encoded in iteration order, so equal sets get different call keys"),
    _m("checker.non_finite_token_within_tolerance", "sandbox/verifiers.py",
       [("if not (math.isfinite(fx) and math.isfinite(fy)):", "if False:")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_non_finite_tokens_match_only_themselves",),
       "stdio tokens: inf (or 1e999) is within any relative tolerance of any number"),
    _m("checker.fenced_solution_drops_prompt", "sandbox/verifiers.py",
       [('return task.prompt.rstrip("\\n") + "\\n\\n\\n" + code', "return code")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_fenced_restatements_keep_the_prompts_helpers",),
       "a fenced restatement of the function loses the prompt's helper functions"),
    _m("checker.last_block_wins", "sandbox/verifiers.py",
       [("        if hits:\n            return hits[-1]\n", "        if hits:\n            return cands[-1]\n")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_fence_rules",),
       "the last fenced block (a usage example) replaces the one defining the entry point"),
    _m("checker.subclass_with_eq_converted", "sandbox/plaindata.py",
       [('if k[:2] == "__" and k[-2:] == "__" and k not in INERT_DUNDERS:', "if False:")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_results_python_accepts_score_1_and_look_alikes_0",),
       "a dict/tuple subclass overriding __eq__ is converted to its builtin value"),
    _m("checker.collect_statement_uncut", "sandbox/python_tests.py",
       [("_ks.setitimer(_ks.ITIMER_REAL, CASE_S)", "pass")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_a_test_that_loops_on_results_is_judged",),
       "a collect run whose test loops on placeholder results runs until the run's timeout"),
    _m("checker.checker_timeout_is_a_fail", "sandbox/python_tests.py",
       [("        elif checker_stopped is not None:\n", "        elif False:\n")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_a_checker_side_timeout_is_no_verdict_and_never_reused",),
       "a test that timed out by itself counts as the completion's failure and is reused"),
    _m("checker.unauthenticated_hold_the_cap", "sandbox/http_protocol.py",
       [("if len(self.connections) > limits.max_connections and not self._evict_one():",
         "if len(self.connections) > limits.max_connections:")],
       ("tests/sandbox/test_sandbox_http_limits.py::test_unauthenticated_connections_cannot_lock_out_authenticated_ones",),
       "stalled unauthenticated connections fill the connection cap: authenticated clients get 503"),
    _m("checker.records_over_pipe_buf", "sandbox/python_tests.py",
       [("if len(text) <= _KIMI_PART:", "if True:")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_solution_threads_writing_to_stdout_cannot_break_records",),
       "a record over PIPE_BUF goes out in one write, so a solution thread's output splits it"),
    _m("checker.verdict_stop_always_dropped", "sandbox/python_tests.py",
       [('kind == "collect" or probe_stopped', "True")],
       ("tests/sandbox/test_scoring_false_negatives.py::test_a_checker_side_timeout_is_no_verdict_and_never_reused",),
       "a verdict stopped by the completion's own values becomes a dropped sandbox_error, not a 0"),
)
BY_NAME = {m.name: m for m in CATALOGUE}


# ------------------------------------------------------------------------------- the copy
def _source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def make_copy(dest: pathlib.Path, ref: str | None, fresh_cache: bool) -> None:
    """The tree into dest: working-tree files git does not ignore, or commit `ref`'s files."""
    if ref is not None:
        archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        for f in _source_files():
            target = dest / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, target)
    if fresh_cache:
        (dest / ".cache").mkdir(exist_ok=True)
    else:
        (ROOT / ".cache").mkdir(exist_ok=True)
        (dest / ".cache").symlink_to(ROOT / ".cache", target_is_directory=True)


# ------------------------------------------------------------------------------- mutating
def mutated_text(text: str, m: Mutation) -> str | None:
    """The file's text with the first fully-applicable alternative applied, or None."""
    for edits in m.alternatives:
        if all(text.count(old) == 1 for old, _ in edits):
            for old, new in edits:
                text = text.replace(old, new)
            return text
    return None


def mutated_files(tree: pathlib.Path, m: Mutation) -> dict[str, str] | None:
    """{path: mutated text} of every file the mutation changes in `tree` (its file, then its
    `also` files, whose edits must each apply exactly once), or None when one does not apply."""
    text = mutated_text((tree / m.file).read_text(), m)
    if text is None:
        return None
    out = {m.file: text}
    for f, edits in m.also:
        t = out.get(f, (tree / f).read_text())
        if not all(t.count(old) == 1 for old, _ in edits):
            return None
        for old, new in edits:
            t = t.replace(old, new)
        out[f] = t
    return out


def select(names=(), modules=(), every=False) -> list[Mutation]:
    """Catalogued mutations: every one, those named, and those touching a file under any of
    `modules` (a file path, or a folder: every file below it; relative to the repository)."""
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown mutation(s) {unknown}; --list shows the catalogue")
    prefixes = [str(pathlib.PurePosixPath(mod)) for mod in modules]
    under = lambda f: any(f == p or f.startswith(p.rstrip("/") + "/") for p in prefixes)
    chosen = {n for n in names}
    chosen |= {m.name for m in CATALOGUE if every or any(under(f) for f in m.files)}
    for p in prefixes:
        if not any(under(f) for m in CATALOGUE for f in m.files):
            raise ValueError(f"no catalogued mutation touches {p!r}; --list shows the catalogue")
    return [m for m in CATALOGUE if m.name in chosen]


def run_tests(tree: pathlib.Path, tests, timeout_s: float, k: str | None, first: bool = True
              ) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    # the copy's packages first, for pytest and for the scripts its tests start (the editable
    # install maps the package names to the checkout, not to the copy)
    env["PYTHONPATH"] = str(tree)
    # -x runs in one process: pytest-xdist's early shutdown after the first failure loses the
    # failure report (and the FAILED lines that name the catching test)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           *(["-x", "-n", "0"] if first else []), *tests] + (["-k", k] if k else [])
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                           timeout=timeout_s)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (
            e.stdout or "")
        return -1, out + f"\n[timeout after {timeout_s:.0f} s]", time.monotonic() - t0


def _failed_ids(output: str) -> list[str]:
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)


def verdict(rc: int) -> str:
    return {0: "MISSED", 1: "caught", 2: "caught"}.get(rc, "error")


def check(mutations, *, ref=None, tests_override=None, timeout_s=900.0, k=None,
          fresh_cache=False, baseline=True, keep=False, first=True) -> int:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="mutate-"))
    tree = tmp / "tree"
    tree.mkdir()
    worst = 0
    try:
        make_copy(tree, ref, fresh_cache)
        print(f"tree copied to {tree}" + (f" (commit {ref})" if ref else " (working tree)"))
        if baseline:
            all_tests = sorted({t for m in mutations for t in (tests_override or m.tests)})
            rc, out, dt = run_tests(tree, all_tests, timeout_s, k, first=False)
            if rc != 0:
                print(f"baseline FAILED in {dt:.0f} s (pytest exit {rc}): fix the tests before "
                      f"measuring mutations\n{out[-3000:]}")
                return 2
            print(f"baseline: the named tests pass unmodified ({dt:.0f} s)")
        for m in mutations:
            texts = mutated_files(tree, m)
            if texts is None:
                print(f"{m.name:42s} not applied: none of its texts is in "
                      f"{', '.join(m.files)} exactly once")
                worst = max(worst, 2)
                continue
            tests = tests_override or m.tests
            originals = {f: (tree / f).read_text() for f in texts}
            try:
                for f, text in texts.items():
                    (tree / f).write_text(text)
                rc, out, dt = run_tests(tree, tests, timeout_s, k, first)
            finally:
                for f, text in originals.items():
                    (tree / f).write_text(text)
            v = verdict(rc)
            failed = _failed_ids(out)
            by = ", ".join(failed) or ("collection error" if rc == 2 else "")
            if not first and failed:
                by = f"{len(failed)} failed: {by}"
            print(f"{m.name:42s} {v:7s} {dt:6.0f} s  {by if v == 'caught' else m.note}")
            if v != "caught":
                print("    " + "\n    ".join(out.strip().splitlines()[-15:]))
                worst = max(worst, 1)
    finally:
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="catalogued mutations to check")
    ap.add_argument("--all", action="store_true", help="every catalogued mutation")
    ap.add_argument("--list", action="store_true", help="print the catalogue (with --module: "
                    "the mutations of those files) and exit")
    ap.add_argument("--module", action="append", default=[], metavar="PATH",
                    help="every catalogued mutation of this file, or of the files under this "
                    "folder (repeatable; relative to the repository)")
    ap.add_argument("--file", help="ad-hoc mutation: the file (relative to the repository)")
    ap.add_argument("--old", help="ad-hoc mutation: the exact text to replace (once in --file; "
                    "backslash escapes such as \\n are interpreted)")
    ap.add_argument("--new", help="ad-hoc mutation: its replacement (escapes interpreted)")
    ap.add_argument("--tests", nargs="+", help="test files / node ids to run (replaces the "
                    "catalogue's; required for an ad-hoc mutation)")
    ap.add_argument("-k", help="pytest -k expression passed through")
    ap.add_argument("--ref", help="mutate this commit's files instead of the working tree")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    ap.add_argument("--fresh-cache", action="store_true",
                    help="an empty JAX compilation cache in the copy (slower, fully isolated)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmodified run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--every-failure", action="store_true",
                    help="run all the tests of a mutation instead of stopping at the first "
                    "failure (lists every test that catches it; slower)")
    a = ap.parse_args(argv)

    try:
        catalogued = select(a.names, a.module, a.all or (a.list and not a.names and not a.module))
    except ValueError as e:
        ap.error(str(e))
    if a.list:
        for m in catalogued:
            print(f"{m.name:42s} {' + '.join(m.files):34s} {m.note}\n"
                  f"{'':42s} tests: {' '.join(m.tests)}")
        return 0
    mutations = []
    if a.file or a.old or a.new:
        if not (a.file and a.old and a.new is not None and a.tests):
            ap.error("an ad-hoc mutation needs --file, --old, --new and --tests")
        unescape = lambda s: s.encode("latin-1", "backslashreplace").decode("unicode_escape")
        mutations.append(_m(f"adhoc:{a.file}", a.file, [(unescape(a.old), unescape(a.new))],
                            a.tests, "ad-hoc"))
    mutations += catalogued
    if not mutations:
        ap.error("name a mutation, or pass --all, --module, --list or --file/--old/--new/--tests")
    return check(mutations, ref=a.ref, tests_override=a.tests, timeout_s=a.timeout, k=a.k,
                 fresh_cache=a.fresh_cache, baseline=not a.no_baseline, keep=a.keep,
                 first=not a.every_failure)


if __name__ == "__main__":
    sys.exit(main())
