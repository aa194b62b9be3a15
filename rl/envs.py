"""Multi-step environments: a Gymnasium-like `Env` over a sandbox session, with tools.

    env = SessionEnv(tasks, executor=pool, config=EnvConfig(max_turns=4))
    prompt = env.reset(seed=3)                      # the task's instruction; a fresh session
    obs, reward, terminated, truncated, info = env.step(assistant_text)
    ...                                             # until terminated or truncated
    env.close()

A batched rollout engine (generate -> execute -> append observation -> generate, rows finishing
turns at different times) drives many envs at once without blocking on the sandbox:

    envs = [SessionEnv(tasks, executor=pool, config=cfg) for _ in range(B)]
    prompts = reset_batch(envs, seeds)             # sessions opened (concurrently for HTTP)
    pending = {}                                   # row -> Future[StepResult]
    # when row i ends a turn (e.g. it emitted </tool_call> or EOS):
    pending[i] = envs[i].submit_step(text_i)       # returns at once; the commands queue in the
                                                   # sandbox pool while other rows generate
    # between decode steps:
    for i, f in list(pending.items()):
        if f.done():
            obs, r, term, trunc, info = pending.pop(i).result()
            # append obs tokens to row i (masked out of the loss), or retire the row

`submit_step` never blocks: parsing is immediate, the turn's commands (and at the episode's end
the check) are chained through Future callbacks; `step(a)` is `submit_step(a).result()`;
`step_batch(envs, actions)` submits all, then waits. One turn at a time per env: a second
submit_step or a reset() while a turn runs raises EnvError; close() stops a running turn (its
Future then ends the episode, truncated, status sandbox_error). Opening a session can raise
SessionCapReached (the pool's max_sessions): size the batch to the cap.

An episode (one task, one session):
  - reset(seed): closes the previous session, picks the task (`tasks[seed % len(tasks)]`, or
    `tasks(seed)` for a callable; seed None takes the next one), opens a session with the
    task's files (SessionLimits from the config), runs the task's `setup` (a task run, not the
    policy's budget; a failing setup raises EnvError: the task is broken, not the policy), and
    returns the task's prompt.
  - step(action): the assistant's turn text. Its tool calls (rl/tools.py) run in order in the
    session; the observation is their `<tool_response>` blocks (errors included). A turn with no
    call and nothing malformed is the model's last word: the episode terminates. A malformed
    call, an unknown tool, bad arguments, a command that hangs (killed at `command_timeout_s`),
    floods output (killed at `output_limit_bytes`, shown cut to `observation_tokens`) or prints
    binary all become observations; the episode goes on. The episode is truncated when it used
    `max_turns` turns (the config's, or the task's meta["max_turns"] when lower) or
    `max_episode_tokens` tokens (actions + observations, `count_tokens`;
    a turn that starts at the cap runs nothing), or when the session refuses a command (its
    limits) or fails (sandbox_error: `info["sandbox_error"]`, for the trainer to drop).
  - tasks written for a container say so in their meta: meta["workspace"] (the session's
    sandbox.session.Workspace: working directory, HOME, persistent directories, root inside),
    meta["start"] (a start command run with `Session.start` after setup: what it leaves in the
    background runs for the whole episode), meta["max_task_runs"] (setup, start, reference and
    check; default 2).
  - answer tasks (meta["answer_task"]): the model's last turn is its answer (`final_answer`:
    the inside of a trailing `answer(...)`, else the whole text, stripped; "" when the episode
    is truncated). The expected answer is `Task.answer`, or the stdout of meta["reference"] run
    right after setup, before the model acts (a failing or silent reference raises EnvError:
    the task is broken here). The check receives [answer, expected] as JSON on stdin.
  - reward: at the end, the task's `check` runs isolated on the session's final state
    (`Session.check`, the terminal verifier's rules): 1.0 if it exits 0, else 0.0; with
    `check_on_truncation` (default) a truncated episode is checked too. A turn with any
    malformed part (parse error, unknown tool, bad arguments) costs `format_penalty` on that
    step's reward, so the rewards of an episode sum to check - penalty * malformed turns
    (`info["episode_return"]` on the last step). The session is closed when the episode ends.

Tools implement `Tool`: a name, a JSON-schema (`schema()`, OpenAI/Hermes function format for
chat templates) and `submit(session, arguments, config) -> Future[ExecutionResult]`, raising
ToolArgumentError for arguments it cannot run. `BashTool` ({"command": str}) is the first.

Not covered: the chat template and the token masks (the rollout engine's), tools that are not
sandbox commands, partial (streamed) turns.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

from sandbox.result import ExecutionResult, InvalidRequest
from sandbox.session import SessionError, SessionLimits
from sandbox.tasks.schema import Task

from .tools import byte_count, format_error, format_result, format_tool_call, parse_tool_calls_as

DONE_TEXT = "done"  # the final assistant turn of demonstrations (no tool call: episode ends)


class StepResult(NamedTuple):
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict


class Env(Protocol):
    """Gymnasium-like: reset(seed) -> observation (the prompt); step(action) -> StepResult."""

    def reset(self, seed: int | None = None) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def submit_step(self, action: str) -> Future: ...

    def close(self) -> None: ...


class EnvError(RuntimeError):
    """The environment cannot run an episode (a broken task, a misused env): never the model's
    doing, which always becomes an observation."""


class ToolArgumentError(ValueError):
    """A tool call's arguments cannot be run (the message is shown to the model)."""


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Per-episode caps and per-command limits of a SessionEnv (validated on construction)."""

    max_turns: int = 8  # assistant turns; a task's meta["max_turns"] may only lower it
    max_episode_tokens: int = 2048  # action + observation tokens (count_tokens)
    max_calls_per_turn: int = 1  # more calls in one turn are refused (an error observation)
    observation_tokens: int = 100  # stdout + stderr of one command, cut with a marker
    command_timeout_s: float = 5.0
    command_memory_mb: int = 256
    output_limit_bytes: int = 64 << 10  # a command printing more is killed (output_limit)
    format_penalty: float = 0.0  # per turn with a malformed call, unknown tool or bad arguments
    check_on_truncation: bool = True  # truncated episodes are checked (reward) too
    session_disk_mb: int = 16
    session_idle_timeout_s: float = 600.0  # generation between turns counts as idle

    def __post_init__(self) -> None:
        for name, lo in (("max_turns", 1), ("max_episode_tokens", 16), ("max_calls_per_turn", 1),
                         ("observation_tokens", 16), ("command_memory_mb", 16),
                         ("output_limit_bytes", 64), ("session_disk_mb", 1)):
            v = getattr(self, name)
            if type(v) is not int or v < lo:
                raise ValueError(f"EnvConfig.{name} must be an int >= {lo}, got {v!r}")
        for name in ("command_timeout_s", "session_idle_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"EnvConfig.{name} must be a positive number, got {v!r}")
        if isinstance(self.format_penalty, bool) or not isinstance(self.format_penalty, (int, float)) \
                or not 0.0 <= self.format_penalty <= 1.0:
            raise ValueError(f"EnvConfig.format_penalty must be in [0, 1], got {self.format_penalty!r}")


# ---- tools ----------------------------------------------------------------------------------


class Tool(Protocol):
    name: str

    def schema(self) -> dict: ...

    def submit(self, session, arguments: dict, config: EnvConfig) -> Future: ...


class BashTool:
    """Runs {"command": str} with bash in the episode's session (sandbox.run's isolation and the
    config's per-command limits)."""

    name = "bash"

    def schema(self) -> dict:
        return {"type": "function", "function": {
            "name": self.name, "description": "Run a bash command in the task's working directory.",
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string", "description": "the command line"}},
                "required": ["command"]}}}

    def submit(self, session, arguments: dict, config: EnvConfig) -> Future:
        extra = sorted(set(arguments) - {"command"})
        if extra:
            raise ToolArgumentError(f"bash takes only \"command\", got {extra}")
        cmd = arguments.get("command")
        if not isinstance(cmd, str) or not cmd.strip():
            raise ToolArgumentError("bash needs \"command\": a non-empty string")
        return session.submit(cmd, language="bash", timeout_s=config.command_timeout_s,
                              memory_mb=config.command_memory_mb,
                              output_limit_bytes=config.output_limit_bytes)


# ---- the environment --------------------------------------------------------------------------


def final_answer(text: str) -> str:
    """The answer in a final turn: the inside of a trailing `answer(...)` (AgentBench's
    protocol) when the text ends with one, else the whole text; surrounding whitespace removed."""
    found = re.findall(r"answer\((.*)\)\s*$", text.strip(), flags=re.S)
    return (found[-1] if found else text).strip()


def _short(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more chars]"


class SessionEnv:
    """One episode at a time over a sandbox session (see the module docstring).

    tasks: a sequence of terminal-family Tasks (prompt, files, setup, check, check_language,
    timeout_s/memory_mb for the check; meta["max_turns"], ["agent_timeout_s"], ["disk_mb"]
    optional) or a callable seed -> Task.
    executor: a SandboxPool or SandboxClient (anything with `session()`); None: the default pool.
    count_tokens: tokens of a text (default: UTF-8 bytes, the byte tokenizer's count).
    tool_syntax: how the model writes tool calls (rl.tools.parse_tool_calls_as: None / "hermes",
    "kimi", "deepseek"; a checkpoint tokenizer's chat template decides it).
    """

    def __init__(self, tasks: Sequence[Task] | Callable[[int], Task], executor=None,
                 config: EnvConfig | None = None, tools: Sequence[Tool] | None = None,
                 count_tokens: Callable[[str], int] = byte_count,
                 tool_syntax: str | None = None) -> None:
        if executor is None:
            from sandbox.pool import default_pool

            executor = default_pool()
        if not callable(tasks) and not len(tasks):
            raise EnvError("SessionEnv needs at least one task")
        self.tasks, self.executor = tasks, executor
        self.config = config or EnvConfig()
        tools = list(tools) if tools is not None else [BashTool()]
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise EnvError(f"tool names must be unique, got {[t.name for t in tools]}")
        self.count_tokens = count_tokens
        parse_tool_calls_as("", tool_syntax)  # an unknown syntax fails here
        self.tool_syntax = tool_syntax
        self.session = None
        self.task: Task | None = None
        self._next_seed = 0
        self._lock = threading.Lock()
        self._over = True
        self._turn_future: Future | None = None

    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def session_limits(self, task: Task, max_turns: int) -> SessionLimits:
        """max_turns * max_calls_per_turn commands; their wall time (the task's
        meta["agent_timeout_s"], else every command's whole timeout); disk (meta["disk_mb"], else
        the config's); two task runs (setup and check)."""
        c = self.config
        n = max_turns * c.max_calls_per_turn
        wall = float(task.meta.get("agent_timeout_s", n * c.command_timeout_s + 1.0))
        return SessionLimits(max_commands=n, max_wall_s=wall,
                             disk_mb=int(task.meta.get("disk_mb", c.session_disk_mb)),
                             idle_timeout_s=c.session_idle_timeout_s,
                             max_task_runs=int(task.meta.get("max_task_runs", 2)))

    # ---- reset ------------------------------------------------------------------------------
    def _pick(self, seed: int | None) -> Task:
        if seed is None:
            seed, self._next_seed = self._next_seed, self._next_seed + 1
        task = self.tasks(seed) if callable(self.tasks) else self.tasks[seed % len(self.tasks)]
        if not isinstance(task, Task) or task.family != "terminal":
            raise EnvError(f"SessionEnv runs terminal-family Tasks, got {task!r:.100}")
        return task

    def reset(self, seed: int | None = None) -> str:
        if self._turn_future is not None and not self._turn_future.done():
            raise EnvError("a turn is still running: wait for its Future before reset() (close() "
                           "stops it)")
        self.close()
        task = self._pick(seed)
        self.max_turns = min(self.config.max_turns,
                             int(task.meta.get("max_turns", self.config.max_turns)))
        if self.max_turns < 1:
            raise EnvError(f"task {task.id}: max_turns must be >= 1")
        extra = {"workspace": task.meta["workspace"]} if task.meta.get("workspace") else {}
        self.session = self.executor.session(files=task.files,
                                             limits=self.session_limits(task, self.max_turns),
                                             **extra)
        self.expected = task.answer

        def task_run(what: str, code: str, start: bool = False) -> ExecutionResult:
            kw = dict(language="bash", timeout_s=task.timeout_s, memory_mb=task.memory_mb)
            r = self.session.start(code, **kw) if start else self.session.run(code, budget=False, **kw)
            if r.status != "ok":
                self.close()
                raise EnvError(f"task {task.id}: {what} failed ({r.status}, exit {r.exit_code}): "
                               f"{_short(r.stderr or r.message)}")
            return r

        if task.setup:
            task_run("setup", task.setup)
        if task.meta.get("start"):
            task_run("start", task.meta["start"], start=True)
        if task.meta.get("reference"):
            self.expected = task_run("reference", task.meta["reference"]).stdout.strip()
            if not self.expected:
                self.close()
                raise EnvError(f"task {task.id}: the reference printed nothing, so no answer "
                               "can match it here")
        self.task = task
        self.turn = self.tokens = self.malformed = 0
        self.penalties = 0.0
        self._over = False
        self.tokens = self.count_tokens(task.prompt)
        return task.prompt

    def close(self) -> None:
        s, self.session = self.session, None
        self._over = True
        if s is not None:
            s.close()

    # ---- step -------------------------------------------------------------------------------
    def step(self, action: str) -> StepResult:
        return self.submit_step(action).result()

    def submit_step(self, action: str) -> Future:
        """Starts one turn; Future[StepResult] (see the module docstring). Raises EnvError when
        no episode is running (call reset first)."""
        with self._lock:
            if self._over or self.session is None:
                raise EnvError("no episode is running: call reset() first (the last one ended)")
            if self._turn_future is not None and not self._turn_future.done():
                raise EnvError("the previous turn is still running: wait for its Future first")
            if not isinstance(action, str):
                raise EnvError(f"an action is the assistant's text, got {type(action).__name__}")
            c = self.config
            out: Future = Future()
            out.set_running_or_notify_cancel()
            self.turn += 1
            self.tokens += self.count_tokens(action)
            parsed = parse_tool_calls_as(action, self.tool_syntax, c.max_calls_per_turn)
            info: dict[str, Any] = {"task_id": self.task.id, "turn": self.turn, "calls": [],
                                    "errors": list(parsed.errors)}
            turn = _Turn(self, out, info, parsed)
            self._turn_future = out
        turn.start()
        return out

    # called by _Turn when the episode ends (from a Future callback)
    def _end(self, turn: _Turn, observation: str, terminated: bool, reason: str) -> None:
        info, c = turn.info, self.config
        self._over = True
        info["end"] = reason
        session = turn.session

        def finish(check: ExecutionResult | None, status: str) -> None:
            score = 1.0 if check is not None and check.status == "ok" else 0.0
            info["status"] = status
            if check is not None:
                info["check"] = {"status": check.status, "exit_code": check.exit_code,
                                 "wall_s": round(check.wall_s, 4), "stdout": _short(check.stdout),
                                 "stderr": _short(check.stderr)}
            info["episode_return"] = score - self.penalties
            info["malformed_turns"] = self.malformed
            info["tokens"] = self.tokens
            if session is not None:
                try:
                    session.close()
                except Exception as e:  # noqa: BLE001 - the episode's result stands
                    info["close_error"] = f"{type(e).__name__}: {e}"
            turn.out.set_result(StepResult(observation, score - turn.penalty, terminated,
                                           not terminated, info))

        if info.get("sandbox_error") or (not terminated and not c.check_on_truncation):
            return finish(None, "sandbox_error" if info.get("sandbox_error") else "unchecked")
        t = self.task
        kw = {}
        if t.meta.get("answer_task"):
            info["answer"] = final_answer(turn.parsed.text) if terminated else ""
            kw["stdin"] = json.dumps([info["answer"], self.expected])
        try:
            fut = session.submit_check(t.check, language=t.check_language, timeout_s=t.timeout_s,
                                       memory_mb=t.memory_mb, **kw)
        except Exception as e:  # noqa: BLE001 - e.g. the pool closed under us
            info["sandbox_error"] = f"check not run: {type(e).__name__}: {e}"
            return finish(None, "sandbox_error")

        def on_check(f: Future) -> None:
            try:
                r = f.result()
            except SessionError as e:
                info["sandbox_error"] = f"check not run: {e}"
                return finish(None, "sandbox_error")
            if r.status == "sandbox_error":
                info["sandbox_error"] = f"check: {r.message}"
                return finish(r, "sandbox_error")
            finish(r, "pass" if r.status == "ok" else ("fail" if r.status == "error" else r.status))

        fut.add_done_callback(turn.guard(on_check))


class _Turn:
    """One assistant turn in flight: runs its calls one after another through Future callbacks
    (never blocking the caller or a pool thread), then answers `out`."""

    def __init__(self, env: SessionEnv, out: Future, info: dict, parsed) -> None:
        self.env, self.out, self.info, self.parsed = env, out, info, parsed
        self.session = env.session  # this episode's, even if the env is closed meanwhile
        self.parts = [format_error(e) for e in parsed.errors]
        self.malformed = bool(parsed.errors)
        self.stop: str | None = None
        self.penalty = 0.0

    def guard(self, fn: Callable) -> Callable:
        def run(*a):
            try:
                fn(*a)
            except BaseException as e:  # noqa: BLE001 - a bug must not leave the Future hanging
                if not self.out.done():
                    self.out.set_exception(e)
        return run

    def start(self) -> None:
        env = self.env
        if self.parsed.is_final:
            return self.guard(self._final)()
        if env.tokens >= env.config.max_episode_tokens:
            self.info["errors"].append("token cap reached: the turn was not run")
            return self.guard(self._after)(True)
        self.guard(self._next)(0)

    def _final(self) -> None:
        self.env._end(self, "", True, "final answer")

    def _next(self, i: int) -> None:
        calls, env = self.parsed.calls, self.env
        while i < len(calls) and self.stop is None:
            call = calls[i]
            tool = env.tools.get(call.name)
            if tool is None:
                self._refuse(f"unknown tool {call.name!r}; the tools are {sorted(env.tools)}")
                i += 1
                continue
            try:
                fut = tool.submit(self.session, call.arguments, env.config)
            except (ToolArgumentError, InvalidRequest) as e:
                self._refuse(f"{call.name}: {e}")
                i += 1
                continue
            fut.add_done_callback(self.guard(lambda f, i=i: self._done(f, i)))
            return
        self._after(False)

    def _refuse(self, message: str) -> None:
        self.parts.append(format_error(message))
        self.info["errors"].append(message)
        self.malformed = True

    def _done(self, f: Future, i: int) -> None:
        env, call = self.env, self.parsed.calls[i]
        try:
            r: ExecutionResult = f.result()
        except SessionError as e:
            self.parts.append(format_error(f"session: {e}"))
            self.info["calls"].append({"name": call.name, "status": "refused", "error": str(e)})
            self.stop = f"session refused the command: {e}"
            return self._after(False)
        self.parts.append(format_result(r, env.config.observation_tokens, env.count_tokens))
        self.info["calls"].append({"name": call.name, "status": r.status, "exit_code": r.exit_code,
                                   "wall_s": round(r.wall_s, 4)})
        if r.status == "sandbox_error":
            self.info["sandbox_error"] = r.message
            self.stop = "sandbox error"
        self._next(i + 1)

    def _after(self, capped: bool) -> None:
        env, c = self.env, self.env.config
        obs = "\n".join(self.parts)
        env.tokens += env.count_tokens(obs)
        if self.malformed:
            env.malformed += 1
            self.penalty = c.format_penalty
            env.penalties += c.format_penalty
        self.info["tokens"] = env.tokens
        if self.stop is None and self.session.closed:  # env.close() (or an idle timeout) meanwhile
            self.stop = "the session was closed"
        if self.stop is not None:
            return env._end(self, obs, False, self.stop)
        if capped or env.tokens >= c.max_episode_tokens:
            return env._end(self, obs, False, "token cap")
        if env.turn >= env.max_turns:
            return env._end(self, obs, False, "turn cap")
        self.out.set_result(StepResult(obs, 0.0 - self.penalty, False, False, self.info))


# ---- batches and demonstrations -----------------------------------------------------------------


def step_batch(envs: Sequence[SessionEnv], actions: Sequence[str]) -> list[StepResult]:
    """Every env's turn submitted first (the pool runs them side by side), then awaited."""
    futs = [e.submit_step(a) for e, a in zip(envs, actions, strict=True)]
    return [f.result() for f in futs]


def reset_batch(envs: Sequence[SessionEnv], seeds: Sequence[int | None], max_workers: int = 16) -> list[str]:
    """reset(seed) for every env, concurrently (opening a session over HTTP is a round trip)."""
    if len(envs) != len(seeds):
        raise ValueError(f"{len(envs)} envs but {len(seeds)} seeds")
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(envs)))) as ex:
        return list(ex.map(lambda es: es[0].reset(es[1]), zip(envs, seeds)))


def demo_turns(task: Task, config: EnvConfig | None = None, turns: list[dict] | None = None,
               count_tokens: Callable[[str], int] = byte_count) -> list[tuple[str, str | None]]:
    """A demonstration as (assistant text, observation) pairs, rendered exactly as SessionEnv
    renders them: each structured turn {"command", "exit_code", "stdout", "stderr"} (default:
    task.meta["demo_turns"]) becomes a bash tool call and its `<tool_response>`; the last pair is
    (DONE_TEXT, None), the turn that ends the episode."""
    cfg = config or EnvConfig()
    turns = turns if turns is not None else task.meta.get("demo_turns")
    if not turns:
        raise EnvError(f"task {task.id} has no demo_turns")
    out: list[tuple[str, str | None]] = []
    for t in turns:
        r = ExecutionResult(status="ok" if t.get("exit_code", 0) == 0 else "error",
                            exit_code=t.get("exit_code", 0), stdout=t.get("stdout", ""),
                            stderr=t.get("stderr", ""))
        out.append((format_tool_call("bash", {"command": t["command"]}),
                    format_result(r, cfg.observation_tokens, count_tokens)))
    out.append((DONE_TEXT, None))
    return out


def play(env: SessionEnv, seed: int | None, actions: Sequence[str]) -> list[StepResult]:
    """Plays `actions` as the assistant's turns of one episode (for tests, and for recording a
    reference solution's transcript); stops at the episode's end. If the actions run out
    first, a final turn DONE_TEXT ends it."""
    env.reset(seed)
    steps: list[StepResult] = []
    for a in list(actions) + [DONE_TEXT]:
        steps.append(env.step(a))
        if steps[-1].terminated or steps[-1].truncated:
            break
    return steps


def play_reference(env: SessionEnv, seed: int | None, empty: bool = False) -> list[StepResult]:
    """Plays the task's reference solution as one episode (the harness's own check: every
    runnable task should score 1 this way, and 0 with empty=True, a final turn at once):
    meta["solution"] commands as bash tool calls; for answer tasks the solution's command runs
    in the session and its stdout, as `answer(...)`, is the final turn (meta["solution_answer"]
    when the task has only a match)."""
    env.reset(seed)
    task = env.task
    if empty:
        return [env.step(DONE_TEXT)]
    sol = list(task.meta.get("solution") or [])
    if task.meta.get("answer_task"):
        text = task.meta.get("solution_answer", "")
        if sol:
            r = env.session.run(sol[0], language="bash", timeout_s=task.timeout_s,
                                memory_mb=task.memory_mb)
            text = r.stdout.strip()
        return [env.step(f"answer({text})")]
    steps = []
    for cmd in sol + [None]:
        action = DONE_TEXT if cmd is None else format_tool_call("bash", {"command": cmd})
        steps.append(env.step(action))
        if steps[-1].terminated or steps[-1].truncated:
            break
    return steps
