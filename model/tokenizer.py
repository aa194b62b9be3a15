"""Tokenizers: a byte-level default (no files needed) and optional `tokenizers`/sentencepiece files.

ByteTokenizer ids: 0 PAD, 1 BOS, 2 EOS, 3..258 the bytes 0..255 (vocab_size 259). Text is UTF-8;
decoding replaces invalid byte sequences (a sampled id stream need not be valid UTF-8).
`load_tokenizer("byte_tools")` is the same tokenizer with the four Hermes tool-call tags
(`TOOL_TAGS`: <tool_call>, </tool_call>, <tool_response>, </tool_response>) as single special ids
259..262 (vocab_size 263), as agent-stack tokenizers (Qwen's) have them: a multi-turn episode
is about 50 tokens per turn shorter, and a tag is one prediction instead of 11-16.

Chat template (plain text and short, so a byte model can learn it cheaply):
    "Q: {prompt}\nA: "   then the completion, then EOS.
`load_tokenizer(path)` wraps a HuggingFace `tokenizer.json` or a sentencepiece `.model` file in the
same interface (pip install .[tokenizers]). `load_tokenizer(checkpoint_dir)` reads a released
checkpoint's tokenizer files and chat template (model/hf/tokenizer.py, pip install .[hf]): its
`chat_prompt` is the template's, and SFT rows, RL prompts and agent episodes go through that
template (rl/agent.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

USER, ASSISTANT = "Q: ", "\nA: "


TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


class ByteTokenizer:
    """Bytes, plus `specials`: strings that each encode to one id after the bytes' (wherever they
    occur in the text; decoding gives the string back, so decode(encode(t)) == t)."""

    pad_id, bos_id, eos_id = 0, 1, 2
    offset = 3

    def __init__(self, specials: Sequence[str] = ()):
        if len(set(specials)) != len(specials) or not all(specials):
            raise ValueError(f"special strings must be distinct and non-empty, got {specials!r}")
        self.specials = tuple(specials)
        self.vocab_size = self.offset + 256 + len(self.specials)
        self._special_id = {s: self.offset + 256 + i for i, s in enumerate(self.specials)}
        # longest first, so a special that contains another one wins
        self._split = (re.compile("(" + "|".join(map(re.escape, sorted(
            self.specials, key=len, reverse=True))) + ")") if self.specials else None)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [self.bos_id] if bos else []
        parts = self._split.split(text) if self._split else [text]
        for i, part in enumerate(parts):  # odd parts are the specials the split matched
            if i % 2:
                ids.append(self._special_id[part])
            else:
                ids += [b + self.offset for b in part.encode("utf-8")]
        return ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        out = bytearray()
        first_special = self.offset + 256
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if self.offset <= i < first_special:
                out.append(i - self.offset)
            elif first_special <= i < self.vocab_size:
                out += self.specials[i - first_special].encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def chat_prompt(self, prompt: str) -> str:
        return f"{USER}{prompt}{ASSISTANT}"


class _Wrapped:
    """Same interface over a `tokenizers.Tokenizer` or a sentencepiece processor."""

    def __init__(self, enc, dec, vocab_size, pad_id, bos_id, eos_id):
        self._enc, self._dec = enc, dec
        self.vocab_size, self.pad_id, self.bos_id, self.eos_id = vocab_size, pad_id, bos_id, eos_id

    def encode(self, text, *, bos=False, eos=False):
        ids = list(self._enc(text))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids, *, stop_at_eos=True):
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._dec(ids)

    chat_prompt = ByteTokenizer.chat_prompt


def load_tokenizer(path: str | None = None):
    """None or "byte" -> ByteTokenizer; "byte_tools" -> ByteTokenizer with the tool-call tags as
    special ids (TOOL_TAGS); *.json -> HuggingFace tokenizers; *.model -> sentencepiece; a
    directory -> a checkpoint's tokenizer and chat template (model.hf.tokenizer.load_tokenizer)."""
    if path is None or path == "byte":
        return ByteTokenizer()
    if path == "byte_tools":
        return ByteTokenizer(TOOL_TAGS)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
    if os.path.isdir(path):
        from model.hf.tokenizer import load_tokenizer as load_checkpoint_tokenizer

        return load_checkpoint_tokenizer(path)
    if path.endswith(".json"):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("loading a tokenizer.json needs `pip install tokenizers`") from e
        tok = Tokenizer.from_file(path)

        def special(*names):
            for n in names:
                i = tok.token_to_id(n)
                if i is not None:
                    return i
            raise ValueError(f"{path}: none of the special tokens {names} is in the vocabulary")
        return _Wrapped(lambda t: tok.encode(t, add_special_tokens=False).ids,
                        lambda ids: tok.decode(ids), tok.get_vocab_size(),
                        special("<pad>", "[PAD]", "<|endoftext|>", "</s>"),
                        special("<s>", "<bos>", "[CLS]", "<|begin_of_text|>", "<|endoftext|>"),
                        special("</s>", "<eos>", "[SEP]", "<|end_of_text|>", "<|endoftext|>"))
    if path.endswith(".model"):
        try:
            import sentencepiece as spm
        except ImportError as e:
            raise ImportError("loading a .model file needs `pip install sentencepiece`") from e
        sp = spm.SentencePieceProcessor(model_file=path)
        pad = sp.pad_id() if sp.pad_id() >= 0 else sp.unk_id()
        return _Wrapped(sp.encode, sp.decode, sp.get_piece_size(), pad, sp.bos_id(), sp.eos_id())
    raise ValueError(f"unknown tokenizer file type {path!r}: expected a .json or .model file")
