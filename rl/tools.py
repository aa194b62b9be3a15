"""The tool-call protocol of multi-turn episodes: Hermes-style tags, as Qwen-style chat templates,
verl and EasyDeL agent loops use them.

    text = 'ls first\n<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    turn = parse_tool_calls(text)        # ParsedTurn(calls=[ToolCall("bash", {"command": "ls"})],
                                         #            errors=[], text="ls first")
    obs = format_result(result, budget_tokens=100)   # '<tool_response>\nexit 0\n...\n</tool_response>'

Parsing (`parse_tool_calls`) never raises on model text: every problem becomes an entry of
`errors` (shown to the model as an observation, see `format_error`):
  - a `<tool_call>` without `</tool_call>`, a `</tool_call>` without an opening tag, "tool_call"
    written without a well-formed tag;
  - a body that is not JSON, not an object, without a non-empty string "name", with keys other
    than "name" and "arguments", or with "arguments" that is not an object (a JSON string holding
    an object is accepted: some models write arguments that way);
  - more calls than `max_calls` (the extra ones are refused, never silently dropped).
Text outside the tags is kept in `ParsedTurn.text` (thoughts, or the final answer of a turn
without calls).

Observations (`format_result`): `<tool_response>\n{header}\n{stdout}\nstderr:\n{stderr}\n
</tool_response>` where the header is `exit N`, `timeout: killed after Ts (exit N)`, `memory
limit of M MB exceeded (exit N)`, `output limit: killed after B bytes (exit N)` or `sandbox
error: ...`. stdout and stderr together are cut to `budget_tokens` (counted by `count_tokens`,
default UTF-8 bytes: the byte tokenizer's tokens); a cut part ends with `[... N more bytes]`.
Control characters other than newline and tab are shown as `\\xNN`; output that is mostly not
text (more than 10% control or undecodable characters, and more than 4) is replaced by `[binary
output, N characters not shown]`; the protocol's own tags inside output are escaped (`&lt;tool_call>`), so a program
cannot forge a response or a call in the transcript.

Other syntaxes (`parse_tool_calls_as(text, syntax)`, the names of model/hf/chat_template.py):
"hermes" is `parse_tool_calls`; "kimi" parses `<|tool_calls_section_begin|>` sections of
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`
calls (the id is kept in `ParsedTurn.ids`); "deepseek" parses `<｜tool▁calls▁begin｜>` sections
of `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>` calls (and V3's
`function<｜tool▁sep｜>NAME` + fenced json). Their errors are the Hermes ones (JSON, arguments,
`max_calls`), plus an unterminated section or call, a marker outside its place, and a Kimi id
not of the form `functions.NAME:IDX`. `split_responses` takes an observation's
`<tool_response>` blocks apart (the bodies a chat template renders as `tool` messages).

Not covered: the chat template around turns (model/tokenizer.py's "Q: ... A: ", or a
checkpoint's template: model/hf/chat_template.py), streaming parses of partial text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sandbox.result import ExecutionResult

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_TAG_RE = re.compile(r"<(/?)(tool_call|tool_response)>")
_CTRL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def byte_count(text: str) -> int:
    """Tokens of the byte-level tokenizer (model/tokenizer.py): one per UTF-8 byte."""
    return len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """One assistant turn: the well-formed calls in order, one error per malformed part, and
    the text outside the tags (stripped)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    text: str = ""
    ids: list[str] = field(default_factory=list)  # the calls' ids where the syntax has them

    @property
    def is_final(self) -> bool:
        """No call and nothing malformed: the turn is the model's last word."""
        return not self.calls and not self.errors


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical, compact text of one call (what demonstrations teach)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False,
                      separators=(",", ":"))
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def _parse_body(body: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except ValueError as e:
        msg = getattr(e, "msg", str(e))
        pos = getattr(e, "pos", None)
        return f"tool call is not valid JSON ({msg}{f' at character {pos}' if pos is not None else ''})"
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object with name and arguments, got {type(obj).__name__}"
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return f"tool call has unknown key(s) {extra}; expected name and arguments"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return "tool call needs a non-empty string \"name\""
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return "tool call \"arguments\" is a string that is not a JSON object"
    if not isinstance(args, dict):
        return f"tool call \"arguments\" must be an object, got {type(args).__name__}"
    return ToolCall(name.strip(), args)


def _add_call(out, parsed, max_calls) -> bool:
    """Append a parsed call to `out` (True), or its error: a parse error (a str) or a call past
    `max_calls` (False)."""
    if isinstance(parsed, str):
        out.errors.append(parsed)
        return False
    if max_calls is not None and len(out.calls) >= max_calls:
        out.errors.append(f"at most {max_calls} tool call(s) per turn: the call to "
                          f"{parsed.name!r} was not run")
        return False
    out.calls.append(parsed)
    return True


def parse_tool_calls(text: str, max_calls: int | None = None) -> ParsedTurn:
    """Splits one assistant turn into calls, errors and plain text (see the module docstring)."""
    out = ParsedTurn()
    rest: list[str] = []
    pos = 0
    while True:
        i = text.find(CALL_OPEN, pos)
        stray = text.find(CALL_CLOSE, pos)
        if stray != -1 and (i == -1 or stray < i):
            out.errors.append(f"{CALL_CLOSE} without a matching {CALL_OPEN}")
            rest.append(text[pos:stray])
            pos = stray + len(CALL_CLOSE)
            continue
        if i == -1:
            rest.append(text[pos:])
            break
        rest.append(text[pos:i])
        j = text.find(CALL_CLOSE, i + len(CALL_OPEN))
        if j == -1:
            out.errors.append(f"unterminated {CALL_OPEN} (no {CALL_CLOSE} after it)")
            break
        _add_call(out, _parse_body(text[i + len(CALL_OPEN):j].strip()), max_calls)
        pos = j + len(CALL_CLOSE)
    out.text = "".join(rest).strip()
    if "tool_call" in out.text:
        out.errors.append(f"\"tool_call\" outside a well-formed {CALL_OPEN}...{CALL_CLOSE}")
    return out


# ---- other syntaxes -------------------------------------------------------------------------

_KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_end|>", "<|tool_call_argument_begin|>")
_DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
             "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
_KIMI_ID = re.compile(r"functions\.([A-Za-z0-9_\-.]+):(\d+)")
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


def _split_kimi(head: str, body: str) -> tuple[str, str, str] | str:
    m = _KIMI_ID.fullmatch(head.strip())
    if not m:
        return f"tool call id {head.strip()[:40]!r} is not of the form functions.NAME:INDEX"
    return m.group(1), body, head.strip()


def _split_deepseek(head: str, body: str) -> tuple[str, str, str] | str:
    name = head.strip()
    if name == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
        name, _, body = body.partition("\n")
        m = _FENCE.search(body)
        if not m:
            return "tool call arguments are not in a ```json fence"
        body = m.group(1)
    if not name.strip():
        return "tool call needs a name before its separator"
    return name.strip(), body, ""


def _parse_named(name: str, body: str) -> ToolCall | str:
    """A call whose name and arguments come apart (Kimi, DeepSeek): the arguments' checks of
    _parse_body."""
    try:
        args = json.loads(body) if body.strip() else {}
    except ValueError as e:
        return f"tool call {name!r}: arguments are not valid JSON ({getattr(e, 'msg', e)})"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return f"tool call {name!r}: arguments are a string that is not a JSON object"
    if not isinstance(args, dict):
        return f"tool call {name!r}: arguments must be an object, got {type(args).__name__}"
    return ToolCall(name, args)


def _parse_sections(text: str, markers, split, max_calls: int | None) -> ParsedTurn:
    sec_open, sec_close, call_open, call_close, sep = markers
    out = ParsedTurn()
    rest: list[str] = []
    pos = 0
    while True:
        i = text.find(sec_open, pos)
        if i == -1:
            rest.append(text[pos:])
            break
        rest.append(text[pos:i])
        j = text.find(sec_close, i)
        if j == -1:
            out.errors.append(f"unterminated {sec_open} (no {sec_close} after it)")
            break
        section, pos = text[i + len(sec_open):j], j + len(sec_close)
        k = 0
        while True:
            a = section.find(call_open, k)
            if a == -1:
                if section[k:].strip():
                    out.errors.append(f"text inside {sec_open} outside a call")
                break
            if section[k:a].strip():
                out.errors.append(f"text inside {sec_open} outside a call")
            b = section.find(call_close, a)
            if b == -1:
                out.errors.append(f"unterminated {call_open} (no {call_close} after it)")
                break
            call, k = section[a + len(call_open):b], b + len(call_close)
            if sep not in call:
                out.errors.append(f"tool call without {sep}")
                continue
            head, _, body = call.partition(sep)
            got = split(head, body)
            if isinstance(got, str):
                out.errors.append(got)
                continue
            name, body, cid = got
            if _add_call(out, _parse_named(name, body), max_calls):
                out.ids.append(cid)
    out.text = "".join(rest).strip()
    stray = [m for m in markers if m in out.text]
    if stray:
        out.errors.append(f"{stray[0]} outside a well-formed {sec_open}...{sec_close}")
    return out


def parse_tool_calls_as(text: str, syntax: str | None, max_calls: int | None = None) -> ParsedTurn:
    """parse_tool_calls for a chat template's tool-call syntax ("hermes" or None: the Hermes
    tags; "kimi"; "deepseek"; see the module docstring)."""
    if syntax in (None, "hermes"):
        return parse_tool_calls(text, max_calls)
    if syntax == "kimi":
        return _parse_sections(text, _KIMI, _split_kimi, max_calls)
    if syntax == "deepseek":
        return _parse_sections(text, _DEEPSEEK, _split_deepseek, max_calls)
    raise ValueError(f"unknown tool-call syntax {syntax!r}: expected hermes, kimi or deepseek")


def split_responses(observation: str) -> list[str]:
    """The bodies of an observation's `<tool_response>` blocks, in order (wrap_response's
    inverse; the tags inside bodies are escaped, so the split is unambiguous)."""
    out, pos = [], 0
    head, tail = RESPONSE_OPEN + "\n", "\n" + RESPONSE_CLOSE
    while True:
        i = observation.find(head, pos)
        if i == -1:
            break
        j = observation.find(tail, i + len(head))
        if j == -1:
            raise ValueError(f"observation has an unterminated {RESPONSE_OPEN}")
        out.append(observation[i + len(head):j])
        pos = j + len(tail)
    if not out:
        raise ValueError(f"observation has no {RESPONSE_OPEN} block: {observation[:80]!r}")
    return out


# ---- observations ---------------------------------------------------------------------------


def _escape_tags(text: str) -> str:
    return _TAG_RE.sub(lambda m: f"&lt;{m.group(1)}{m.group(2)}>", text)


def sanitize_output(text: str) -> str:
    """Program output as observation text: binary -> a note; control characters -> \\xNN;
    protocol tags escaped."""
    if not text:
        return ""
    odd = len(_CTRL_RE.findall(text)) + text.count("\ufffd")
    if odd > 4 and odd > 0.1 * len(text):
        return f"[binary output, {len(text)} characters not shown]"
    text = _CTRL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return _escape_tags(text)


def truncate_tokens(text: str, budget: int, count_tokens: Callable[[str], int] = byte_count) -> str:
    """`text` if it fits `budget` tokens, else its longest prefix that fits together with the
    marker `[... N more bytes]` (N counts the bytes cut)."""
    if count_tokens(text) <= budget:
        return text
    lo, hi = 0, len(text)
    while lo < hi:  # the longest prefix whose text + marker fits
        mid = (lo + hi + 1) // 2
        cut = len(text[mid:].encode("utf-8", "surrogatepass"))
        if count_tokens(text[:mid] + _marker(cut)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + _marker(len(text[lo:].encode("utf-8", "surrogatepass")))


def _marker(n_bytes: int) -> str:
    return f"[... {n_bytes} more bytes]"


def wrap_response(body: str) -> str:
    return f"{RESPONSE_OPEN}\n{body}\n{RESPONSE_CLOSE}"


def format_error(message: str) -> str:
    """An observation for a call that could not run (malformed, unknown tool, bad arguments)."""
    return wrap_response("error: " + _escape_tags(message))


def _header(r: ExecutionResult) -> str:
    code = f" (exit {r.exit_code})" if r.exit_code is not None else ""
    if r.status in ("ok", "error"):
        return f"exit {r.exit_code}" if r.exit_code is not None else f"error: {r.message}"
    if r.status == "timeout":
        return f"timeout: {r.message or 'killed at the time limit'}{code}"
    if r.status == "memory":
        return f"{r.message or 'memory limit exceeded'}{code}"
    if r.status == "output_limit":
        return f"output limit: {r.message or 'too much output'}, program killed{code}"
    return f"sandbox error: {r.message or 'the sandbox failed'}"


def format_result(r: ExecutionResult, budget_tokens: int = 256,
                  count_tokens: Callable[[str], int] = byte_count) -> str:
    """The observation of one executed command (see the module docstring). stdout and stderr
    share `budget_tokens`: each gets half, and what one does not use goes to the other."""
    out, err = sanitize_output(r.stdout), sanitize_output(r.stderr)
    if r.stdout_truncated and out:
        out += "[... output cut at the sandbox's limit]"
    if r.stderr_truncated and err:
        err += "[... output cut at the sandbox's limit]"
    n_out, n_err = count_tokens(out), count_tokens(err)
    if n_out + n_err > budget_tokens:
        half = budget_tokens // 2
        if n_err <= half:
            out = truncate_tokens(out, budget_tokens - n_err, count_tokens)
        elif n_out <= half:
            err = truncate_tokens(err, budget_tokens - n_out, count_tokens)
        else:
            out = truncate_tokens(out, half, count_tokens)
            err = truncate_tokens(err, budget_tokens - half, count_tokens)
    parts = [_escape_tags(_header(r))]
    if out:
        parts.append(out.rstrip("\n"))
    if err:
        parts += ["stderr:", err.rstrip("\n")]
    return wrap_response("\n".join(parts))
