"""Chat templates of released checkpoints: jinja rendering, tool-call syntaxes, token-level masks.

    tpl = ChatTemplate(source, specials={"bos_token": "<s>", "eos_token": "</s>"})
    text = tpl.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    segs = tpl.segments(messages, tools=tools)   # [(text, is_assistant)], concatenating to the
                                                 # rendered conversation

Rendering follows the conventions HF templates are written for: a sandboxed jinja environment
(`ImmutableSandboxedEnvironment`, trim_blocks and lstrip_blocks, loop controls), the globals
`raise_exception(msg)` and `strftime_now(fmt)`, the `tojson` filter (ensure_ascii off, optional
indent / separators / sort_keys), the variables `messages`, `tools`, `add_generation_prompt` and
the tokenizer's special strings (`bos_token`, `eos_token`, ...). A `{% generation %}` block is
accepted and renders its body (masks are computed here, see `segments`). A template that raises
(or fails to compile) gives a ChatTemplateError naming the template's origin and its message.

Assistant masks (`segments`): the conversation is rendered prefix by prefix. For each assistant
message k, render(messages[:k], add_generation_prompt=True) must be a prefix of the whole
conversation's rendering (the template is prefix-stable), and the assistant's span runs from there
to the end of its end-of-turn string (`end_of_turn`, e.g. `<|im_end|>`) in
render(messages[:k+1]); whitespace the template puts after the end-of-turn belongs to the next
(context) segment. The assistant segments are exactly the text a policy generates in a rollout
(content, tool calls, end-of-turn); everything else is context. A template that rewrites earlier
turns when later ones are added (e.g. one that drops earlier reasoning) is not prefix-stable and
gives a ChatTemplateError naming the message.

Tool-call syntaxes (`detect_tool_syntax` reads them off the template source):
  - "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results in
    `<tool_response>` (Qwen-style templates);
  - "kimi": `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>`, results as a
    `tool` message with `tool_call_id` (Kimi-K2 / Kimi-Linear templates);
  - "deepseek": `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>`, results in `<｜tool▁output▁begin｜>` (DeepSeek-V3.1
    templates; V3's `function<｜tool▁sep｜>NAME` + fenced-json form is parsed too).
rl/tools.py parses all three (`parse_tool_calls_as`). Not covered: DeepSeek-V3.2's DSML
encoding, which its checkpoints ship as Python code, not as a jinja template (pass a jinja
template of your own to `load_tokenizer(..., chat_template=...)`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

TOOL_SYNTAXES = ("hermes", "kimi", "deepseek")

# markers that identify a template's tool-call syntax (looked for in its source)
_SYNTAX_MARKERS = (
    ("kimi", "<|tool_calls_section_begin|>"),
    ("deepseek", "<｜tool▁calls▁begin｜>"),
    ("hermes", "<tool_call>"),
)


class ChatTemplateError(ValueError):
    """A chat template that cannot render a conversation (or does not render it the way masks
    need); the message names the template's origin."""


def detect_tool_syntax(source: str) -> str | None:
    """The tool-call syntax a template's source writes (TOOL_SYNTAXES), None if it has none."""
    for name, marker in _SYNTAX_MARKERS:
        if marker in source:
            return name
    return None


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _environment():
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need jinja2: pip install '.[hf]'") from e

    class _Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """A compiled chat template. origin: where it came from (for error messages); specials: the
    tokenizer's special strings passed to the template (bos_token, eos_token, ...);
    end_of_turn: the string that ends an assistant turn (set by the tokenizer, see
    model/hf/tokenizer.py)."""

    def __init__(self, source: str, *, origin: str = "chat template",
                 specials: dict[str, str] | None = None, end_of_turn: str | None = None):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{origin}: the chat template is empty")
        import jinja2

        self.source, self.origin = source, origin
        self.specials = dict(specials or {})
        self.end_of_turn = end_of_turn
        self.tool_syntax = detect_tool_syntax(source)
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{origin}: the chat template does not compile: {e}") from e

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
               tools: Sequence[dict] | None = None, **extra: Any) -> str:
        """The template's text for `messages` (HF's apply_chat_template(tokenize=False))."""
        import jinja2

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"message {i} must be a dict with a string 'role', "
                                        f"got {m!r}")
        try:
            return self._template.render(messages=list(messages), tools=list(tools) if tools
                                         else None, add_generation_prompt=add_generation_prompt,
                                         **self.specials, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.origin} refused the conversation: {e}") from e

    # ---- masks ------------------------------------------------------------------------------
    def assistant_end(self, before: Sequence[dict], assistant: dict,
                      tools: Sequence[dict] | None = None) -> tuple[str, int, int]:
        """(rendering of before + [assistant], start, end): the assistant's generated span is
        text[start:end], from after the generation prompt to the end of its end-of-turn."""
        if self.end_of_turn is None:
            raise ChatTemplateError(f"{self.origin}: no end-of-turn string is known, so "
                                    "assistant turns cannot be delimited")
        prompt = self.render(before, add_generation_prompt=True, tools=tools)
        full = self.render(list(before) + [assistant], tools=tools)
        k = len(before)
        if not full.startswith(prompt):
            raise ChatTemplateError(
                f"{self.origin} is not prefix-stable at message {k} (assistant): the rendering "
                f"with it does not start with the generation prompt of the messages before it "
                f"({prompt[-60:]!r} vs {full[len(prompt) - 60:len(prompt)]!r})")
        span = full[len(prompt):]
        cut = span.rfind(self.end_of_turn)
        if cut == -1 or span[cut + len(self.end_of_turn):].strip():
            raise ChatTemplateError(
                f"{self.origin}: assistant message {k} is not closed by the end-of-turn "
                f"{self.end_of_turn!r} (its rendering ends {span[-60:]!r})")
        return full, len(prompt), len(prompt) + cut + len(self.end_of_turn)

    def segments(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                 add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is_assistant) segments, in order (module
        docstring); their concatenation is render(messages, add_generation_prompt=...)."""
        whole = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        self._check_contents(messages, whole)
        out: list[tuple[str, bool]] = []
        pos = 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            full, start, end = self.assistant_end(messages[:k], m, tools)
            if not whole.startswith(full[:end]):
                raise ChatTemplateError(
                    f"{self.origin} is not prefix-stable at message {k} (assistant): later "
                    "messages change how it is rendered")
            if start < pos:
                raise ChatTemplateError(f"{self.origin}: assistant message {k} starts inside "
                                        "the previous assistant turn")
            if start > pos:
                out.append((whole[pos:start], False))
            out.append((whole[start:end], True))
            pos = end
        if pos < len(whole):
            out.append((whole[pos:], False))
        return out

    def _check_contents(self, messages: Sequence[dict], text: str) -> None:
        """Every non-assistant message's content is in the rendering (a template that skips a
        role, e.g. `tool`, would hide observations from the model)."""
        for k, m in enumerate(messages):
            c = m.get("content")
            if m["role"] != "assistant" and isinstance(c, str) and c.strip() not in text:
                raise ChatTemplateError(f"{self.origin} does not render the content of message "
                                        f"{k} (role {m['role']!r}): {c[:60]!r}")

    def continuation(self, messages: Sequence[dict], new: Sequence[dict], *,
                     tools: Sequence[dict] | None = None) -> str:
        """The text the template puts after the last assistant turn of `messages` (from the end
        of its end-of-turn) once `new` messages follow, up to the next generation prompt: a
        rollout's observation segment."""
        if not messages or messages[-1]["role"] != "assistant":
            raise ChatTemplateError("continuation: the messages must end with an assistant turn")
        full, _, end = self.assistant_end(messages[:-1], messages[-1], tools)
        after = self.render(list(messages) + list(new), add_generation_prompt=True, tools=tools)
        self._check_contents(new, after[end:])
        if not after.startswith(full[:end]):
            raise ChatTemplateError(
                f"{self.origin} is not prefix-stable at message {len(messages)}: adding "
                f"{[m['role'] for m in new]} changes how the earlier turns are rendered")
        return after[end:]


# ---- demonstrations as messages ------------------------------------------------------------


def call_id(syntax: str | None, name: str, index: int) -> str:
    """The id of the index-th tool call of a conversation, as the syntax's models write them."""
    return f"functions.{name}:{index}" if syntax == "kimi" else f"call_{index}"


def assistant_message(content: str, calls: Sequence[tuple[str, dict]], first_index: int,
                      syntax: str | None) -> dict:
    """An assistant message in the HF convention (OpenAI-style `tool_calls`)."""
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = [{"id": call_id(syntax, n, first_index + i), "type": "function",
                            "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(calls)]
    return m


def tool_messages(bodies: Sequence[str], ids: Sequence[str], names: Sequence[str],
                  escape=None) -> list[dict]:
    """One `tool` message per result body; ids / names of the calls they answer (missing ones,
    e.g. for a malformed call's error, get "error"). escape: applied to each body (a
    tokenizer's `escape_specials`, so program output cannot write special tokens)."""
    escape = escape or (lambda b: b)
    return [{"role": "tool", "content": escape(b), "tool_call_id": ids[i] if i < len(ids) else "error",
             "name": names[i] if i < len(names) else "error"} for i, b in enumerate(bodies)]
