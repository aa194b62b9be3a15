"""Multi-turn rollouts: the policy acts in sandbox sessions through Hermes tool calls.

    worker = AgentRolloutWorker(model, tokenizer, sampling, pool, group_size=4, width=448,
                                env_config=EnvConfig(max_turns=5))
    group = worker.start(variables, tasks, rng).result()    # a ScoredGroup, like RolloutWorker's
    batch, metrics = rl.pipeline.build_train_batch(group, algo, width, forward=...)

One episode is one row. Its tokens are the chat prompt, then turns:

    BOS "Q: {task prompt}\\nA: " {turn 1} "\\n" {observation 1} "\\nA: " {turn 2} ... "done" EOS
         \\____ prompt ______/    model     \\______ observation (not trained) ______/

Model turns are what the policy sampled (a `<tool_call>` ending at `</tool_call>`, or a last
word ending at EOS); observations are the environment's `<tool_response>` blocks (rl/envs.py,
rl/tools.py) wrapped by `observation_segment`. `ScoredGroup.target_mask` marks the model's
tokens: log-probs, the KL and the policy loss cover those only (the trainer reads observation
tokens as context, never as targets), and `sampler_logp` holds the sampler's log-probs there.
The same rendering gives SFT rows (`encode_episode`), so demonstrations and rollouts agree
token for token.

With a checkpoint's tokenizer (model/hf/tokenizer.py, one with a chat `template`) the episode is
the template's conversation instead: the prompt is its user turn with the generation prompt, a
model turn is what the policy sampled up to the template's end-of-turn token (the tokenizer's
EOS: every turn ends there, no `</tool_call>` stop), tool calls are written in the template's
syntax (`tokenizer.tool_syntax`, parsed by rl.tools.parse_tool_calls_as) and each observation's
`<tool_response>` blocks become `tool` messages (special-token strings in them escaped:
HFTokenizer.escape_specials): the observation segment is the text the
template puts between the end of the model's turn and the next generation prompt
(ChatTemplate.continuation). SFT rows render demonstrations through the same template
(`encode_episode`: turns_to_messages), the mask on the assistant spans.

Batching: a turn is one sampler call over the rows of a half, stopping each row at
`</tool_call>` or EOS. With `cache_turns` (the default; without speculative decoding) each half
keeps its decode cache (KDA state and conv window, DSA latent rows) between turns, and a turn
prefills only the tokens the cache does not hold yet (the turn's last sampled token and the
observation) before decoding: `Sampler.extend`, one compiled program per padded width of those
new tokens (powers of two from 32). Otherwise every turn re-reads its whole context: a fixed
[rows, width - turn_tokens] context batch (one compiled program). The rows are split into two
halves that alternate: while one half's commands run in the sandbox pool, the other half
generates (`overlap_s` in the metrics is the time generation spent with commands in flight).
A row whose episode ended keeps its slot (its context is not generated from) until every row is
done. The reward is the environment's: the task's check on the session's final state minus the
format penalties (`info["episode_return"]`); an episode the sandbox failed is flagged in
`failed` and dropped from the loss, like a one-shot sandbox_error.

On a mesh the sampler runs there (rows over the batch axes, the turn cache laid out like its
programs take it). With several processes each plays its own rows in its own sandbox sessions
and every sampler call is one program over all processes' rows, so they run turns in lockstep:
before each call they agree (one small all-gather) on whether any process still needs the turn,
on the width of the new tokens and on starting a fresh cache; a process whose rows of a half are
all done or waiting joins with rows that sit the call out. Every process passes the same number
of rows (the RL loop's even shares).

Not covered: the turn cache with speculative decoding (every turn re-reads its context there),
and tools other than the environment's.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future

import jax
import numpy as np

from model import sharding as shd
from model.hf.chat_template import assistant_message, tool_messages
from model.tokenizer import ASSISTANT
from rl.envs import EnvConfig, SessionEnv, StepResult, reset_batch
from rl.pipeline import ScoredGroup, pad_row_ids
from rl.sampler import Sampler, SamplingConfig
from rl.tools import parse_tool_calls, parse_tool_calls_as, split_responses
from sandbox.tasks.domains import is_multi_turn_task

TOOL_CALL_END = "</tool_call>"


def _template(tokenizer):
    """The tokenizer's chat template (a checkpoint tokenizer's), None for the byte tokenizers."""
    return getattr(tokenizer, "template", None)


def observation_segment(observation: str) -> str:
    """The text between a tool-call turn and the next model turn: the observation on its own
    line, then the assistant prefix of the chat template."""
    return f"\n{observation}{ASSISTANT}"


def template_overhead(max_turns: int, tokenizer=None) -> int:
    """Tokens (bytes) the chat template adds to an episode beyond the prompt, the model's turns
    and the observations that SessionEnv counts: BOS, "Q: ", "\\nA: ", and 5 per observation.
    With a checkpoint tokenizer's template: the tokens of a conversation of max_turns tool turns
    with empty contents (an upper bound: SessionEnv already counts the observations'
    `<tool_response>` tags), plus 8 per turn for tool-call ids and headers."""
    if _template(tokenizer) is None:
        return 1 + 3 + len(ASSISTANT) + max_turns * (1 + len(ASSISTANT))
    msgs = [{"role": "user", "content": ""}]
    for _ in range(max_turns):
        msgs += [{"role": "assistant", "content": ""}, {"role": "tool", "content": "",
                                                         "tool_call_id": "error",
                                                         "name": "error"}]
    msgs.append({"role": "assistant", "content": ""})
    return len(tokenizer.encode_chat(msgs)[0]) + 8 * (max_turns + 1)


def turns_to_messages(prompt: str, turns, syntax: str | None, *,
                      system: str | None = None, escape=None) -> list[dict]:
    """A demonstration's (assistant text, observation or None) pairs (rl.envs.demo_turns, in the
    Hermes protocol of rl/tools.py) as chat messages: each assistant text's tool calls become
    `tool_calls` (rendered by the template in its own syntax; with syntax None the assistant
    text stays as written, Hermes tags included), each observation's `<tool_response>` blocks
    become `tool` messages answering them (`escape`d: see model.hf.chat_template.tool_messages)."""
    msgs: list[dict] = ([{"role": "system", "content": system}] if system else [])
    msgs.append({"role": "user", "content": prompt})
    n_calls = 0
    for i, (text, obs) in enumerate(turns):
        if obs is None and i != len(turns) - 1:
            raise ValueError("only the last turn may have no observation")
        parsed = parse_tool_calls(text)
        if parsed.errors:
            raise ValueError(f"demonstration turn {i} has malformed tool calls: {parsed.errors}")
        calls = [(c.name, c.arguments) for c in parsed.calls]
        m = assistant_message(parsed.text, calls, n_calls, syntax)
        if syntax is None:  # a template without a tool-call syntax: the Hermes text as written
            m = {"role": "assistant", "content": text}
        msgs.append(m)
        if obs is not None:
            ids = [c["id"] for c in m.get("tool_calls", [])]
            msgs += tool_messages(split_responses(obs), ids, [n for n, _ in calls], escape)
        n_calls += len(calls)
    return msgs


def encode_episode(tokenizer, prompt: str, turns) -> tuple[list[int], list[bool]]:
    """An episode's token ids and target mask (True on the model's tokens). turns: (assistant
    text, observation or None) pairs as rl.envs.demo_turns gives them; the turn with observation
    None is the last and ends with EOS. A checkpoint tokenizer renders them through its chat
    template (module docstring)."""
    if _template(tokenizer) is not None:
        return tokenizer.encode_chat(turns_to_messages(prompt, turns, tokenizer.tool_syntax,
                                                       escape=tokenizer.escape_specials))
    ids = tokenizer.encode(tokenizer.chat_prompt(prompt), bos=True)
    mask = [False] * len(ids)
    for i, (text, obs) in enumerate(turns):
        last = obs is None
        if last and i != len(turns) - 1:
            raise ValueError("only the last turn may have no observation")
        t = tokenizer.encode(text, eos=last)
        ids += t
        mask += [True] * len(t)
        if not last:
            o = tokenizer.encode(observation_segment(obs))
            ids += o
            mask += [False] * len(o)
    return ids, mask


_SEGMENT_MIN = 32  # the narrowest padded width of a turn's new tokens (cached turns)
# decode-cache positions past the episode width: room for a turn's padded new tokens written past
# a row's position (a row whose position + padded width does not fit restarts the half's cache)
_CACHE_SLACK = 128


def _segment_width(n: int, cap: int) -> int:
    """The padded width of n new tokens: the next power of two from _SEGMENT_MIN, at most cap
    (a few widths, so a few compiled programs)."""
    m = _SEGMENT_MIN
    while m < n:
        m *= 2
    return min(m, cap)


@dataclasses.dataclass
class _HalfCache:
    """The decode cache of one half of the rows between its turns, and how many tokens of each
    row it holds (its lengths, read back after each call)."""
    cache: dict | None = None
    fed: np.ndarray | None = None


@dataclasses.dataclass
class _Row:
    env: SessionEnv
    task: object
    ids: list  # every token so far (prompt included)
    target: list  # bool per token: sampled by the model
    logp: list  # sampler log-prob per token (0 off target)
    prompt_len: int
    pending: Future | None = None
    done: bool = False
    reward: float = 0.0
    failed: bool = False
    info: dict | None = None
    turns: int = 0
    messages: list | None = None  # the chat so far (checkpoint templates only)
    calls: int = 0  # tool calls so far (their ids, checkpoint templates only)
    last_ids: tuple = ((), ())  # (ids, names) of the last turn's calls (checkpoint templates only)
    ended: bool = True  # the last model turn ended at EOS


class _Done:
    """A finished rollout with the PendingScores interface (the rewards came with it)."""

    def __init__(self, group: ScoredGroup):
        self._group = group

    def result(self) -> ScoredGroup:
        return self._group


class AgentRolloutWorker:
    """Batched multi-turn episodes over SessionEnvs (see the module docstring).

    sampling: the per-turn SamplingConfig (max_new_tokens = the longest turn, temperature,
    top-k/top-p; its stop_sequences get `</tool_call>` added). executor: a SandboxPool or
    SandboxClient with sessions (`max_sessions` >= the rows of a batch). width: tokens per
    episode row; contexts are generated from at width - max_new_tokens, and the environment's
    token cap is set so that an episode never outgrows it. cache_turns: keep each half's decode
    cache between turns (module docstring); ignored with speculative decoding. mesh/rules: the
    sampler's (on several processes: lockstep turns, module docstring).
    """

    def __init__(self, model, tokenizer, sampling: SamplingConfig, executor, *, group_size: int,
                 width: int, env_config: EnvConfig | None = None, mesh=None, rules=None,
                 cache_turns: bool = True):
        stop = tuple(tokenizer.encode(TOOL_CALL_END))
        self.chat = _template(tokenizer)
        if self.chat is None and stop not in sampling.stop_sequences:
            sampling = dataclasses.replace(sampling,
                                           stop_sequences=sampling.stop_sequences + (stop,))
        if sampling.eos_id != tokenizer.eos_id:
            raise ValueError(f"sampling.eos_id={sampling.eos_id} is not the tokenizer's EOS "
                             f"{tokenizer.eos_id}: the last turn ends at EOS")
        self.context = width - sampling.max_new_tokens
        cfg = env_config or EnvConfig()
        cap = self.context - template_overhead(cfg.max_turns, tokenizer)
        if cap < 16:
            raise ValueError(f"width {width} leaves no room for an episode after "
                             f"{sampling.max_new_tokens} turn tokens and the chat template")
        self.env_config = dataclasses.replace(cfg, max_episode_tokens=min(
            cfg.max_episode_tokens, cap))
        self.model, self.tok, self.executor = model, tokenizer, executor
        self.sampling, self.width, self.group_size = sampling, width, group_size
        self.sampler = Sampler(model, sampling, mesh=mesh, rules=rules)
        self.count_tokens = lambda s: len(tokenizer.encode(s))
        self.cache_turns = bool(cache_turns) and sampling.speculative == "none"
        # several processes share each sampler call (one program over the global batch): they
        # take every decision that starts one together (_agree)
        self.lockstep = mesh is not None and jax.process_count() > 1
        if width > model.cfg.max_seq_len:
            raise ValueError(f"width {width} exceeds the model's max_seq_len "
                             f"{model.cfg.max_seq_len}")
        self.cache_len = width + _CACHE_SLACK  # decode-cache positions per row (cached turns)

    # ------------------------------------------------------------------------------------
    def start(self, variables, tasks: list, rng, group_size: int | None = None,
              pad_to: int | None = None, version: int = 0, row_ids=None) -> _Done:
        """Runs every episode to its end (generation and sandbox commands overlapped across two
        halves of the rows) and returns the scored group (`.result()`); tasks are repeated
        group_size times (GRPO groups), padded to pad_to tasks with dropped rows. row_ids: one
        per episode (rl.pipeline.pad_row_ids); by default an episode draws by its index in the
        global batch."""
        g = self.generate(variables, tasks, rng, group_size, pad_to, row_ids)
        g.policy_version = version
        return _Done(g)

    def generate(self, variables, tasks: list, rng, group_size: int | None = None,
                 pad_to: int | None = None, row_ids=None) -> ScoredGroup:
        G = group_size or self.group_size
        rep = [t for t in tasks for _ in range(G)]
        n = len(rep)
        total = max(n, (pad_to or 0) * G)
        total += total % 2  # two halves of equal size: one compiled program per turn
        t0 = time.perf_counter()
        ids = pad_row_ids(row_ids, n, total)  # checked before any session opens
        rows = self._open(rep) + [self._padding_row(rep[0]) for _ in range(total - n)]
        try:
            overlap, prefilled = self._run(variables, rows, rng, ids)
        finally:
            for r in rows:
                if not r.done and r.env is not None:
                    r.env.close()
        gen_s = time.perf_counter() - t0
        g = self._group(rows[:n], G, len(tasks), gen_s, overlap)
        g.prefill_tokens = prefilled
        return g

    # ------------------------------------------------------------------------------------
    def _open(self, tasks: list) -> list[_Row]:

        envs = [SessionEnv([t], executor=self.executor, config=self.env_config,
                           count_tokens=self.count_tokens,
                           tool_syntax=getattr(self.tok, "tool_syntax", None)) for t in tasks]
        prompts = reset_batch(envs, [0] * len(envs))
        rows = []
        for env, task, p in zip(envs, tasks, prompts):
            ids = self.tok.encode(self.tok.chat_prompt(p), bos=True)
            if len(ids) > self.context:
                raise ValueError(f"task {task.id}: prompt of {len(ids)} tokens exceeds the "
                                 f"context width {self.context}")
            rows.append(_Row(env, task, ids, [False] * len(ids), [0.0] * len(ids), len(ids),
                             messages=[{"role": "user", "content": p}] if self.chat else None))
        return rows

    def _padding_row(self, task) -> _Row:
        """A row that keeps the batch shape fixed (pad_to): no session, never generated for."""
        ids = [self.tok.bos_id]
        return _Row(None, task, ids, [False], [0.0], 1, done=True)

    def _run(self, variables, rows: list[_Row], rng, row_ids=None) -> tuple[float, int]:
        """(seconds generated with commands in flight, context positions prefilled)."""
        half = len(rows) // 2
        halves = [rows[:half], rows[half:]]
        # each row's draws: rng folded with its episode's id (row_ids, default its index in the
        # global batch) and its tokens' positions (rl.sampler.categorical_rows), whichever turn
        # call it is in
        if row_ids is None:
            first = self._first_row(len(rows))
            row_ids = np.arange(first, first + len(rows))
        ids = [row_ids[:half], row_ids[half:]]
        caches = [_HalfCache(), _HalfCache()]
        overlap, prefilled = 0.0, 0
        while self._agree(not all(r.done for r in rows)):
            for h, hi, hc in zip(halves, ids, caches):
                self._collect(h, wait=True)
                if not self._agree(not all(r.done for r in h)):
                    continue
                in_flight = any(r.pending is not None for r in rows)
                t = time.perf_counter()
                prefilled += self._turn(variables, h, rng, hc, hi)
                if in_flight:
                    overlap += time.perf_counter() - t
        return overlap, prefilled

    def _first_row(self, n: int) -> int:
        """The global batch index of this process's first row (0 on one process)."""
        if not self.lockstep:
            return 0
        mesh, rules = self.sampler.mesh, self.sampler.rules
        return shd.host_batch_slice(shd.global_rows(n, mesh, rules), mesh=mesh,
                                    rules=rules).start

    def _turn(self, variables, rows: list[_Row], rng, hc: _HalfCache, row_ids) -> int:
        """One sampler call for the rows of a half whose episode waits for a model turn; returns
        the context positions it prefilled (rows x padded width)."""
        active = [i for i, r in enumerate(rows) if not r.done and r.pending is None]
        if not active and not self.lockstep:  # (in lockstep another process's rows need it)
            return 0
        turn = self._cached_turn if self.cache_turns else self._full_turn
        toks, mask, lps, prefilled = turn(variables, rows, active, rng, hc, row_ids)
        for i in active:
            r = rows[i]
            m = mask[i]
            gen, lp = toks[i][m].tolist(), lps[i][m].tolist()
            r.ids += gen
            r.target += [True] * len(gen)
            r.logp += lp
            r.turns += 1
            text = self.tok.decode(gen)
            if self.chat is not None:
                self._record_turn(r, text, bool(gen) and gen[-1] == self.tok.eos_id)
            r.pending = r.env.submit_step(text)
        return prefilled

    def _agree(self, value) -> int:
        """The largest of every process's `value` (an int or bool) in lockstep, so that they all
        take the same branch (whether to run a turn, the new tokens' width, a fresh cache);
        `value` itself in one process."""
        if not self.lockstep:
            return int(value)
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(np.array([value], np.int32))))

    def _full_turn(self, variables, rows: list[_Row], active: list[int], rng, hc=None,
                   row_ids=None):
        """The turn from scratch: every row's whole context, one [rows, context] program."""
        del hc
        W = self.context
        prompts = np.full((len(rows), W), self.tok.pad_id, np.int32)
        lens = np.ones(len(rows), np.int32)
        prompts[:, 0] = self.tok.bos_id
        for i in active:
            ids = rows[i].ids
            prompts[i, :len(ids)] = ids
            lens[i] = len(ids)
        out = self.sampler.generate(variables, prompts, lens, rng, row_ids=row_ids)
        toks, mask, lps = shd.host_rows((out.tokens, out.mask, out.logprobs))
        return toks, mask, lps, prompts.size

    def _cached_turn(self, variables, rows: list[_Row], active: list[int], rng,
                     hc: _HalfCache, row_ids=None):
        """The turn through the half's decode cache: each active row feeds the tokens its cache
        does not hold yet (its position is read back from the cache after every call). A cache
        that cannot take the padded new tokens for a row whose episode still runs (or none yet)
        is started afresh: every active row then feeds its whole context."""
        live = [i for i, r in enumerate(rows) if not r.done]

        def width(fed):  # the padded width of the longest new segment (of every process's rows)
            need = max((len(rows[i].ids) - fed[i] for i in active), default=0)
            return _segment_width(self._agree(need), self.context)

        M = width(hc.fed) if hc.cache is not None else 0
        if self._agree(hc.cache is None or any(hc.fed[i] + M > self.cache_len for i in live)):
            hc.cache = self.sampler.new_cache(len(rows), self.cache_len)
            hc.fed = np.zeros(len(rows), np.int64)
            M = width(hc.fed)
        tokens = np.full((len(rows), M), self.tok.pad_id, np.int32)
        lens = np.zeros(len(rows), np.int32)
        for i in active:
            seg = rows[i].ids[hc.fed[i]:]
            tokens[i, :len(seg)] = seg
            lens[i] = len(seg)
        out, hc.cache = self.sampler.extend(variables, hc.cache, tokens, lens, rng,
                                            row_ids=row_ids)
        toks, mask, lps, fed = shd.host_rows(
            (out.tokens, out.mask, out.logprobs, hc.cache["lengths"]))
        hc.fed = fed.astype(np.int64)
        return toks, mask, lps, tokens.size

    def _collect(self, rows: list[_Row], wait: bool) -> None:
        for r in rows:
            if r.pending is None or (not wait and not r.pending.done()):
                continue
            res: StepResult = r.pending.result()
            r.pending = None
            if res.terminated or res.truncated:
                r.done = True
                r.info = res.info
                r.failed = bool(res.info.get("sandbox_error"))
                r.reward = float(res.info.get("episode_return", res.reward))
                continue
            seg = (self._chat_observation(r, res.observation) if self.chat is not None
                   else self.tok.encode(observation_segment(res.observation)))
            if len(r.ids) + len(seg) > self.context:  # cannot happen with the env's token cap
                raise RuntimeError(f"episode of task {r.task.id} outgrew its context "
                                   f"({len(r.ids) + len(seg)} > {self.context})")
            r.ids += seg
            r.target += [False] * len(seg)
            r.logp += [0.0] * len(seg)

    def _record_turn(self, r: _Row, text: str, ended: bool) -> None:
        """The model's turn as an assistant message of the row's chat (its calls in the
        template's syntax; ids as the model wrote them, else numbered like demonstrations)."""
        syntax = self.tok.tool_syntax
        parsed = parse_tool_calls_as(text, syntax, self.env_config.max_calls_per_turn)
        m = assistant_message(parsed.text, [(c.name, c.arguments) for c in parsed.calls],
                              r.calls, syntax)
        for tc, cid in zip(m.get("tool_calls", []), parsed.ids):
            if cid:
                tc["id"] = cid
        # the environment answers the malformed parts first, then the calls in order
        err = ["error"] * len(parsed.errors)
        r.last_ids = (err + [tc["id"] for tc in m.get("tool_calls", [])],
                      err + [c.name for c in parsed.calls])
        if syntax is None:  # the template writes no tool calls: the turn as sampled
            m = {"role": "assistant", "content": text}
        r.messages.append(m)
        r.calls += len(parsed.calls)
        r.ended = ended

    def _chat_observation(self, r: _Row, observation: str) -> list[int]:
        """The observation segment through the chat template: the `<tool_response>` blocks as
        tool messages, from the end of the model's turn (its EOS first, as context, when the
        turn was cut at max_new_tokens) to the next generation prompt."""
        new = tool_messages(split_responses(observation), *r.last_ids, self.tok.escape_specials)
        text = self.chat.continuation(r.messages, new)
        r.messages += new
        return ([] if r.ended else [self.tok.eos_id]) + self.tok.encode(text)

    def _group(self, rows: list[_Row], G: int, n_tasks: int, gen_s: float,
               overlap: float) -> ScoredGroup:
        P = max(r.prompt_len for r in rows)
        N, L = len(rows), self.width - min(r.prompt_len for r in rows)
        prompts = np.full((N, P), self.tok.pad_id, np.int32)
        plens = np.array([r.prompt_len for r in rows], np.int32)
        comp = np.full((N, L), self.tok.pad_id, np.int32)
        cmask = np.zeros((N, L), bool)
        target = np.zeros((N, L), bool)
        logp = np.zeros((N, L), np.float32)
        for i, r in enumerate(rows):
            p, c = r.prompt_len, len(r.ids) - r.prompt_len
            prompts[i, :p] = r.ids[:p]
            comp[i, :c] = r.ids[p:]
            cmask[i, :c] = True
            target[i, :c] = r.target[p:]
            logp[i, :c] = r.logp[p:]
        texts = [self.tok.decode(np.asarray(r.ids[r.prompt_len:]), stop_at_eos=False)
                 for r in rows]
        details = []
        for r in rows:
            d = dict(r.info or {})
            d.update(turns=r.turns, episode_tokens=len(r.ids),
                     model_tokens=int(sum(r.target)),
                     status=d.get("status", "sandbox_error" if r.failed else "fail"))
            details.append(d)
        g = ScoredGroup(tasks=[r.task for r in rows], group_ids=np.repeat(np.arange(n_tasks), G),
                        prompts=prompts, prompt_lengths=plens, completions=comp,
                        completion_mask=cmask, sampler_logp=logp, texts=texts,
                        rewards=np.array([r.reward for r in rows], np.float32),
                        failed=np.array([r.failed for r in rows]), details=details, gen_s=gen_s,
                        target_mask=target)
        g.score_s = gen_s
        g.overlap_s = overlap
        return g


class _Merged:
    """Scores of a batch split between a one-shot and an agent worker, rows in task order."""

    def __init__(self, parts, n_tasks: int, group_size: int):
        self._parts, self._n, self._G = parts, n_tasks, group_size

    def result(self) -> ScoredGroup:
        G = self._G
        groups = [(idx, p.result()) for idx, p in self._parts]
        P = max(g.prompts.shape[1] for _, g in groups)
        L = max(g.completions.shape[1] for _, g in groups)
        N = self._n * G
        first = groups[0][1]
        prompts = np.zeros((N, P), first.prompts.dtype)
        plens = np.zeros(N, first.prompt_lengths.dtype)
        comp = np.zeros((N, L), first.completions.dtype)
        cmask = np.zeros((N, L), bool)
        target = np.zeros((N, L), bool)
        logp = np.zeros((N, L), np.float32)
        rewards = np.zeros(N, np.float32)
        failed = np.zeros(N, bool)
        tasks, texts, details = [None] * N, [None] * N, [None] * N
        for idx, g in groups:
            rows = np.array([t * G + j for t in idx for j in range(G)])
            pw, cw = g.prompts.shape[1], g.completions.shape[1]
            prompts[rows, :pw] = g.prompts
            plens[rows] = g.prompt_lengths
            comp[rows, :cw] = g.completions
            cmask[rows, :cw] = g.completion_mask
            target[rows, :cw] = g.completion_mask if g.target_mask is None else g.target_mask
            logp[rows, :cw] = g.sampler_logp
            rewards[rows], failed[rows] = g.rewards, g.failed
            for k, r in enumerate(rows):
                tasks[r], texts[r], details[r] = g.tasks[k], g.texts[k], g.details[k]
        out = ScoredGroup(tasks=tasks, group_ids=np.repeat(np.arange(self._n), G),
                          prompts=prompts, prompt_lengths=plens, completions=comp,
                          completion_mask=cmask, sampler_logp=logp, texts=texts,
                          rewards=rewards, failed=failed, details=details,
                          gen_s=sum(g.gen_s for _, g in groups), target_mask=target,
                          policy_version=first.policy_version)
        out.score_wait_s = sum(g.score_wait_s for _, g in groups)
        out.score_s = max(g.score_s for _, g in groups)
        out.overlap_s = sum(g.overlap_s for _, g in groups)
        out.prefill_tokens = sum(g.prefill_tokens for _, g in groups)
        return out


class RoutingWorker:
    """One rollout interface over two workers: one-shot tasks go to `one_shot`
    (rl.pipeline.RolloutWorker), multi-turn tasks (`is_multi_turn_task`) to `agent`
    (AgentRolloutWorker); the merged group has every row in task order (one-shot rows get an
    all-true target mask). pad_to is passed to both (fixed batch shapes: one compiled sampler
    program each; the agent's padding rows open no session)."""

    def __init__(self, one_shot, agent: AgentRolloutWorker | None):
        self.one_shot, self.agent = one_shot, agent
        self.group_size = one_shot.group_size
        self.mesh, self.rules = getattr(one_shot, "mesh", None), getattr(one_shot, "rules", None)

    def row_blocks(self, n_rows: int):
        return self.one_shot.row_blocks(n_rows)

    def start(self, variables, tasks: list, rng, group_size: int | None = None,
              pad_to: int | None = None, version: int = 0, row_ids=None):
        G = group_size or self.group_size
        agent_idx = [i for i, t in enumerate(tasks) if is_multi_turn_task(t)]
        if agent_idx and self.agent is None:
            raise ValueError(f"task {tasks[agent_idx[0]].id} is a multi-turn task but this run "
                             "has no agent worker (rl.agent)")
        one_idx = [i for i in range(len(tasks)) if i not in set(agent_idx)]
        if self.mesh is not None and jax.process_count() > 1:
            # each kind's worker runs one program over every process's rows: all must call it
            kinds = shd.allgather_json([bool(one_idx), bool(agent_idx)])
            if any(k != kinds[0] for k in kinds):
                raise ValueError(
                    f"the processes' shares of one batch hold different task kinds (one-shot, "
                    f"multi-turn per process: {kinds}); on several processes every batch must "
                    "be of one kind on all of them (the RL loop's batches are; evaluation "
                    "splits its tasks by kind)")
        if row_ids is not None:
            row_ids = np.asarray(row_ids)
            if row_ids.shape != (len(tasks) * G,):
                raise ValueError(f"row_ids must be {len(tasks) * G} ids (one per task and "
                                 f"sample, task-major), got shape {row_ids.shape}")

        def ids(idx):
            return None if row_ids is None else row_ids.reshape(-1, G)[idx].reshape(-1)
        r1, r2 = jax.random.split(rng)
        parts = []
        if one_idx:
            parts.append((one_idx, self.one_shot.start(
                variables, [tasks[i] for i in one_idx], r1, group_size=G, pad_to=pad_to,
                version=version, row_ids=ids(one_idx))))
        if agent_idx:
            parts.append((agent_idx, self.agent.start(
                variables, [tasks[i] for i in agent_idx], r2, group_size=G, pad_to=pad_to,
                version=version, row_ids=ids(agent_idx))))
        return _Merged(parts, len(tasks), G)
