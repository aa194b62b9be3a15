"""A released checkpoint's tokenizer and chat template, behind this repo's tokenizer interface.

    from model.hf.tokenizer import load_tokenizer
    tok = load_tokenizer("/path/to/checkpoint")      # or model.tokenizer.load_tokenizer(dir)
    ids = tok.encode(tok.chat_prompt("What is 2+2?"), bos=True)   # the rendered chat prompt
    ids, mask = tok.encode_chat(messages, tools=tools)   # mask: True on assistant tokens

Files read from the directory:
  - `tokenizer.json` (HF `tokenizers`), or `tiktoken.model` (a tiktoken BPE file: one
    "base64(token bytes) rank" line per token, as Kimi's checkpoints ship it; its special tokens
    come from tokenizer_config.json's `added_tokens_decoder`, unnamed ids from the last base id up
    to the last named one are `<|reserved_token_{id}|>`; the split pattern is Kimi's
    (`KIMI_PATTERN`) unless tokenizer_config.json sets `pat_str`);
  - `tokenizer_config.json`: `bos_token`, `eos_token`, `pad_token` (strings or {"content": ...}),
    `add_bos_token`, `added_tokens_decoder`, `chat_template` (a string, or a list of
    {"name", "template"} from which "default" is taken);
  - `chat_template.jinja` (or `chat_template.json`), where newer checkpoints keep the template.
A missing or unreadable file gives an error naming the file. `chat_template=` overrides the
checkpoint's template (a jinja string or a path to a .jinja file).

The interface is model/tokenizer.py's (encode / decode / chat_prompt, pad_id / bos_id / eos_id,
vocab_size), so the sampler, SFT and RL code take it unchanged:
  - `encode(text)` reads special-token strings in `text` as their ids (rendered templates);
    `bos=True` starts the sequence with one BOS where the checkpoint starts sequences with it
    (`add_bos_token`, or a template that renders `bos_token`; never twice), else adds nothing;
    `eos=True` appends `eos_id`.
  - `eos_id` is the token that ends an assistant turn in the chat template (`end_of_turn`, e.g.
    Kimi's `<|im_end|>`, DeepSeek's `<｜end▁of▁sentence｜>`): the sampler stops there and SFT
    targets end with it. Without a template it is `eos_token`.
  - `decode` keeps special tokens as text (tool-call markers stay parseable) and stops at eos_id
    unless `stop_at_eos=False`.
  - `chat_prompt(p)` renders [{"role": "user", "content": p}] with the generation prompt. The
    loader checks that the template renders a one-turn conversation as exactly
    chat_prompt(p) + answer + end-of-turn (+ whitespace), so prompt ids + answer ids + EOS (how SFT
    rows and rollouts are built) is the template's token stream.
  - `encode_chat(messages)` / `chat_segments(messages)`: token ids and the assistant mask of a
    whole conversation (model/hf/chat_template.py), each segment tokenized on its own, exactly
    as a rollout produces them (prompt, sampled turn, observation, ...).
  - `escape_specials(text)`: special-token strings written as plain text (`&lt;|im_end|>`), for
    text from outside the model (tool results).
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Sequence

from .chat_template import ChatTemplate, ChatTemplateError

# Kimi's tiktoken split pattern (its tokenization code): Han runs, cased words with English
# contractions, up to 3 digits, punctuation runs, newlines, spaces
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

_PROBE_USER, _PROBE_ANSWER = "Probe question 7?", "Probe answer 7."



# the files of a checkpoint directory that make up its tokenizer and chat template (what an
# export copies beside the weights)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "tiktoken.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")

class TokenizerFileError(ValueError):
    """A checkpoint's tokenizer file that is missing or cannot be read (the message names it)."""


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerFileError(f"{path}: cannot read it as JSON ({e})") from e
    if not isinstance(out, dict):
        raise TokenizerFileError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


def _token_str(value, field: str, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerFileError(f"{path}: {field} must be a string or {{\"content\": ...}}, "
                             f"got {value!r}")


# ---- backends: text <-> ids ----------------------------------------------------------------


class _TokenizersBackend:
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("reading tokenizer.json needs `pip install '.[hf]'` "
                              "(the tokenizers package)") from e
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises its own exception type
            raise TokenizerFileError(f"{path}: not a valid tokenizer.json ({e})") from e
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_id(self, s: str) -> int | None:
        return self.tok.token_to_id(s)

    def special_strings(self) -> list[str]:
        return [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special]


class _TiktokenBackend:
    def __init__(self, path: str, added: dict[int, str], pattern: str):
        try:
            import tiktoken
        except ImportError as e:
            raise ImportError("reading tiktoken.model needs `pip install '.[hf]'` "
                              "(the tiktoken package)") from e
        ranks: dict[bytes, int] = {}
        try:
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    parts = line.split()
                    if len(parts) != 2:
                        raise ValueError(f"line {n}: expected 'base64-token rank'")
                    ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except OSError as e:
            raise TokenizerFileError(f"{path}: cannot read it ({e})") from e
        except ValueError as e:  # binascii.Error is a ValueError
            raise TokenizerFileError(f"{path}: not a tiktoken BPE file ({e})") from e
        if not ranks:
            raise TokenizerFileError(f"{path}: no tokens in the file")
        n_base = len(ranks)
        if sorted(ranks.values()) != list(range(n_base)):
            raise TokenizerFileError(f"{path}: ranks must be 0..{n_base - 1} without gaps")
        bad = [i for i in added if i < n_base]
        if bad:
            raise TokenizerFileError(f"tokenizer_config.json: added token id {bad[0]} "
                                     f"({added[bad[0]]!r}) collides with {path}'s {n_base} "
                                     "base tokens")
        top = max(added, default=n_base - 1)
        specials = {added.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, top + 1)}
        self.enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=pattern,
                                     mergeable_ranks=ranks, special_tokens=specials)
        self.specials = specials
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids, errors="replace")

    def special_strings(self) -> list[str]:
        return list(self.specials)

    def token_id(self, s: str) -> int | None:
        if s in self.specials:
            return self.specials[s]
        ids = self.enc.encode(s, disallowed_special=())
        return ids[0] if len(ids) == 1 else None


# ---- the tokenizer --------------------------------------------------------------------------


class HFTokenizer:
    """A checkpoint's tokenizer with model/tokenizer.py's interface (see the module docstring).
    `template` is its ChatTemplate (None if it ships none), `tool_syntax` the template's
    tool-call syntax (model/hf/chat_template.py), `specials` the named special strings."""

    def __init__(self, backend, *, name: str, bos: str | None, eos: str | None, pad: str | None,
                 add_bos: bool, template_source: str | None, template_origin: str):
        self._b, self.name = backend, name
        self.vocab_size = backend.vocab_size
        names = sorted((s for s in backend.special_strings() if s), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None

        def tid(s, field):
            if s is None:
                return None
            i = backend.token_id(s)
            if i is None:
                raise TokenizerFileError(f"{name}: {field} {s!r} is not a single token of the "
                                         "vocabulary")
            return i
        self.bos_token, self.eos_token = bos, eos
        self.bos_id = tid(bos, "bos_token")
        eos_token_id = tid(eos, "eos_token")
        self.specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos),
                                           ("pad_token", pad)) if v is not None}
        self.template = None
        self.tool_syntax = None
        self.end_of_turn = eos
        if template_source is not None:
            self.template = ChatTemplate(template_source, origin=template_origin,
                                         specials=self.specials)
            self.tool_syntax = self.template.tool_syntax
            self.end_of_turn = self._probe_end_of_turn()
            self.template.end_of_turn = self.end_of_turn
        self.eos_id = tid(self.end_of_turn, "end of turn")
        if self.eos_id is None:
            raise TokenizerFileError(f"{name}: no eos_token and no chat template to find the "
                                     "end of an assistant turn")
        self.pad_id = tid(pad, "pad_token") if pad is not None else (
            eos_token_id if eos_token_id is not None else self.eos_id)
        if self.bos_id is None:
            self.bos_id = self.pad_id  # a context filler only: add_bos is off without a BOS
            add_bos = False
        self.add_bos = add_bos or bool(
            template_source is not None and bos is not None
            and self.chat_prompt(_PROBE_USER).startswith(bos))
        if self.template is not None:
            self._check_one_turn()

    # ---- interface of model/tokenizer.py -------------------------------------------------
    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._b.encode(text)
        if bos and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._b.decode([i for i in ids if 0 <= i < self.vocab_size])

    def escape_specials(self, text: str) -> str:
        """`text` with every special-token string's first character written as an HTML entity
        ("<" as "&lt;", as rl/tools.py escapes its tags; "[" as "&#91;"), so that text from
        outside the model (program output) tokenizes as plain text and cannot close a turn or
        forge one."""
        def esc(m):
            c = m.group()[0]
            return ("&lt;" if c == "<" else f"&#{ord(c)};") + m.group()[1:]
        return self._special_re.sub(esc, text) if self._special_re is not None else text

    def chat_prompt(self, prompt: str) -> str:
        return self._tpl().render([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True)

    # ---- chat -----------------------------------------------------------------------------
    def chat_segments(self, messages: Sequence[dict], *, tools=None,
                      add_generation_prompt: bool = False) -> list[tuple[list[int], bool]]:
        """(ids, is_assistant) per segment of the rendered conversation (the first one starts
        the sequence: `bos=True`)."""
        segs = self._tpl().segments(messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt)
        return [(self.encode(t, bos=i == 0), a) for i, (t, a) in enumerate(segs)]

    def encode_chat(self, messages: Sequence[dict], *, tools=None,
                    add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
        """A conversation's ids and mask (True on the assistant's tokens)."""
        ids: list[int] = []
        mask: list[bool] = []
        for seg, a in self.chat_segments(messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt):
            ids += seg
            mask += [a] * len(seg)
        return ids, mask

    def _tpl(self) -> ChatTemplate:
        if self.template is None:
            raise ChatTemplateError(f"{self.name}: the checkpoint has no chat template "
                                    "(tokenizer_config.json chat_template or chat_template.jinja);"
                                    " pass one: load_tokenizer(dir, chat_template=...)")
        return self.template

    def _probe_end_of_turn(self) -> str:
        """The special token that closes an assistant turn: the first one the template writes
        after an assistant message's content."""
        t = self.template
        text = t.render([{"role": "user", "content": _PROBE_USER},
                         {"role": "assistant", "content": _PROBE_ANSWER}])
        at = text.rfind(_PROBE_ANSWER)
        if at == -1:
            raise ChatTemplateError(f"{t.origin} does not render an assistant message's content")
        specials = set(self._b.special_strings())
        for i in self._b.encode(text[at + len(_PROBE_ANSWER):]):
            s = self._b.decode([i])
            if s in specials:
                return s
        raise ChatTemplateError(f"{t.origin}: no special token closes an assistant turn (after "
                                f"the content it renders {text[at + len(_PROBE_ANSWER):]!r})")

    def _check_one_turn(self) -> None:
        """One user turn renders as chat_prompt + answer + end-of-turn (+ whitespace)."""
        t = self.template
        prompt = self.chat_prompt(_PROBE_USER)
        whole = t.render([{"role": "user", "content": _PROBE_USER},
                          {"role": "assistant", "content": _PROBE_ANSWER}])
        want = prompt + _PROBE_ANSWER + self.end_of_turn
        if not whole.startswith(want) or whole[len(want):].strip():
            raise ChatTemplateError(
                f"{t.origin}: a one-turn conversation renders as {whole!r}, not as the "
                f"generation prompt + answer + {self.end_of_turn!r}; SFT rows and rollouts "
                "build it that way, so this template is not supported as is")


def _template_source(d: str, cfg: dict, cfg_path: str, override: str | None):
    if override is not None:
        if os.path.isfile(override):
            with open(override, encoding="utf-8") as f:
                return f.read(), override
        if "{%" in override or "{{" in override:
            return override, "chat_template argument"
        raise TokenizerFileError(f"chat_template {override!r} is neither a file nor a jinja "
                                 "template")
    jinja = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja):
        try:
            with open(jinja, encoding="utf-8") as f:
                return f.read(), jinja
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerFileError(f"{jinja}: cannot read it ({e})") from e
    js = os.path.join(d, "chat_template.json")
    if os.path.isfile(js):
        src = _read_json(js).get("chat_template")
        if not isinstance(src, str):
            raise TokenizerFileError(f"{js}: expected a string chat_template")
        return src, js
    src = cfg.get("chat_template")
    if src is None:
        return None, ""
    if isinstance(src, list):
        named = {t.get("name"): t.get("template") for t in src if isinstance(t, dict)}
        src = named.get("default")
        if src is None:
            raise TokenizerFileError(f"{cfg_path}: chat_template is a list without a "
                                     f"'default' entry (names: {sorted(map(str, named))})")
    if not isinstance(src, str):
        raise TokenizerFileError(f"{cfg_path}: chat_template must be a string, got "
                                 f"{type(src).__name__}")
    return src, f"{cfg_path} chat_template"


def load_tokenizer(ckpt_dir: str, *, chat_template: str | None = None) -> HFTokenizer:
    """The tokenizer of a checkpoint directory (module docstring)."""
    if not os.path.isdir(ckpt_dir):
        raise TokenizerFileError(f"checkpoint directory {ckpt_dir!r} does not exist")
    cfg_path = os.path.join(ckpt_dir, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.exists(cfg_path) else {}
    added: dict[int, str] = {}
    for k, v in (cfg.get("added_tokens_decoder") or {}).items():
        try:
            added[int(k)] = _token_str(v, f"added_tokens_decoder[{k}]", cfg_path)
        except ValueError as e:
            raise TokenizerFileError(f"{cfg_path}: added_tokens_decoder key {k!r} is not an "
                                     "integer id") from e
    tj, tk = os.path.join(ckpt_dir, "tokenizer.json"), os.path.join(ckpt_dir, "tiktoken.model")
    if os.path.exists(tj):
        backend = _TokenizersBackend(tj)
    elif os.path.exists(tk):
        if not cfg:
            raise TokenizerFileError(f"{cfg_path}: missing; a tiktoken.model needs it for its "
                                     "special tokens")
        backend = _TiktokenBackend(tk, added, cfg.get("pat_str", KIMI_PATTERN))
    else:
        raise TokenizerFileError(f"{ckpt_dir}: no tokenizer file (tokenizer.json or "
                                 "tiktoken.model)")
    src, origin = _template_source(ckpt_dir, cfg, cfg_path, chat_template)
    return HFTokenizer(
        backend, name=ckpt_dir,
        bos=_token_str(cfg.get("bos_token"), "bos_token", cfg_path),
        eos=_token_str(cfg.get("eos_token"), "eos_token", cfg_path),
        pad=_token_str(cfg.get("pad_token"), "pad_token", cfg_path),
        add_bos=bool(cfg.get("add_bos_token", False)), template_source=src,
        template_origin=origin)
