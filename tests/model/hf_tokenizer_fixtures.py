"""Checkpoint tokenizer directories for the tests, written with the real libraries at test time.

    kimi_dir(path)      # tiktoken.model (BPE trained by tiktoken on CORPUS) + tokenizer_config.json
                        # with Kimi's special tokens and a Kimi-format chat template
    deepseek_dir(path)  # tokenizer.json (byte-level BPE trained by `tokenizers`) +
                        # tokenizer_config.json with a DeepSeek-V3.1-format chat template
    qwen_dir(path)      # the same BPE with ChatML specials and a Hermes (<tool_call>) template

The templates are written here in the two families' formats (Kimi: <|im_user|>user<|im_middle|>
... <|im_end|>, tool calls in <|tool_calls_section_begin|>, results as `## Return of ID`;
DeepSeek: <｜begin▁of▁sentence｜>, <｜User｜>, <｜Assistant｜></think>, tool calls in
<｜tool▁calls▁begin｜>, results in <｜tool▁output▁begin｜>, the assistant continuing after them
without a new <｜Assistant｜>). Each raises (raise_exception) on a role it does not know.
"""

from __future__ import annotations

import base64
import json
import pathlib

CORPUS = ("""The quick brown fox jumps over the lazy dog. Read the file pointer.txt to learn which
file to copy, then copy it to answer.txt and check the result with cat. ls -l shows the files;
exit 0 means the command worked. What is 12 plus 30? The answer is 42. Solve the equation,
write the program, run the tests, and report the number. {"command": "cat notes.txt"}
{"name": "bash", "arguments": {"command": "ls"}} stdout stderr done. 你好世界。
""" * 6)

KIMI_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                 "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>",
                 "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                 "[PAD]"]

KIMI_TEMPLATE = """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for m in messages -%}
{%- if loop.first and m.role != 'system' -%}
<|im_system|>system<|im_middle|>You are a careful assistant.<|im_end|>
{%- endif -%}
{%- if m.role == 'system' -%}
<|im_system|>system<|im_middle|>{{ m.content }}
{%- elif m.role == 'user' -%}
<|im_user|>user<|im_middle|>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|im_assistant|>assistant<|im_middle|>{{ m.content }}
{%- if m.tool_calls -%}
<|tool_calls_section_begin|>
{%- for c in m.tool_calls -%}
<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>
{%- if c.function.arguments is string %}{{ c.function.arguments }}
{%- else %}{{ c.function.arguments | tojson }}{% endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
{%- elif m.role == 'tool' -%}
<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}{{ '\\n' }}{{ m.content }}
{%- else -%}
{{ raise_exception('unknown role: ' + m.role) }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

DEEPSEEK_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                     "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                     "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]

DEEPSEEK_TEMPLATE = """\
{%- set ns = namespace(system='', tool=false) -%}
{%- for m in messages if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endfor -%}
{{ bos_token }}{{ ns.system }}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
<｜User｜>{{ m.content }}{%- set ns.tool = false -%}
{%- elif m.role == 'assistant' -%}
{%- if not ns.tool -%}<｜Assistant｜></think>{%- endif -%}
{{ m.content }}
{%- if m.tool_calls -%}
<｜tool▁calls▁begin｜>
{%- for c in m.tool_calls -%}
<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>
{%- endfor -%}
<｜tool▁calls▁end｜>
{%- endif -%}
<｜end▁of▁sentence｜>{%- set ns.tool = false -%}
{%- elif m.role == 'tool' -%}
<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{%- set ns.tool = true -%}
{%- elif m.role != 'system' -%}
{{ raise_exception('unknown role: ' + m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.tool -%}<｜Assistant｜></think>{%- endif -%}
"""


def kimi_dir(path, vocab: int = 300) -> pathlib.Path:
    """A Kimi-style checkpoint tokenizer: tiktoken.model trained here + tokenizer_config.json."""
    from tiktoken._educational import bpe_train

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    ranks = bpe_train(CORPUS, vocab, pat, visualise=None)
    with open(path / "tiktoken.model", "wb") as f:
        for tok, r in sorted(ranks.items(), key=lambda x: x[1]):
            f.write(base64.b64encode(tok) + b" " + str(r).encode() + b"\n")
    n = len(ranks)
    added = {str(n + i): {"content": s, "special": True} for i, s in enumerate(KIMI_SPECIALS)}
    cfg = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
           "added_tokens_decoder": added, "chat_template": KIMI_TEMPLATE,
           "tokenizer_class": "TikTokenTokenizer"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    return path


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML with Hermes tool calls (Qwen-style): calls as <tool_call> JSON lines in the assistant
# turn, consecutive tool results grouped in one user turn as <tool_response> blocks, a newline
# after every <|im_end|>
QWEN_TEMPLATE = """\
{%- for m in messages -%}
{%- if m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|im_start|>user{%- endif -%}
{{ '\\n<tool_response>\\n' }}{{ m.content }}{{ '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}<|im_end|>{{ '\\n' }}{%- endif -%}
{%- elif m.role in ('system', 'user', 'assistant') -%}
<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}
{%- for c in m.tool_calls or [] -%}
{{ '\\n<tool_call>\\n' }}{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{{ '\\n</tool_call>' }}
{%- endfor -%}
<|im_end|>{{ '\\n' }}
{%- else -%}
{{ raise_exception('unknown role: ' + m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}
"""


def qwen_dir(path) -> pathlib.Path:
    """A Qwen-style checkpoint tokenizer: ChatML specials, a Hermes tool-call template."""
    path = deepseek_dir(path, specials=QWEN_SPECIALS)
    cfg = {"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "chat_template": QWEN_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    return path


def deepseek_dir(path, vocab: int = 400, specials=DEEPSEEK_SPECIALS) -> pathlib.Path:
    """A DeepSeek-style checkpoint tokenizer: tokenizer.json (byte-level BPE trained here) +
    tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    tok.save(str(path / "tokenizer.json"))
    def added(s):  # how DeepSeek's tokenizer_config.json writes its special tokens
        return {"__type": "AddedToken", "content": s, "lstrip": False, "normalized": True,
                "rstrip": False, "single_word": False}
    cfg = {"add_bos_token": True, "add_eos_token": False,
           "bos_token": added("<｜begin▁of▁sentence｜>"),
           "eos_token": added("<｜end▁of▁sentence｜>"),
           "pad_token": added("<｜end▁of▁sentence｜>"),
           "chat_template": DEEPSEEK_TEMPLATE, "tokenizer_class": "LlamaTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    return path


KIMI_LINEAR_WEIGHTS = pathlib.Path(__file__).parent / "hf_fixtures" / "kimi_linear"


def kimi_chat_checkpoint(path, seed: int = 0) -> pathlib.Path:
    """A whole Kimi-Linear checkpoint to post-train in the tests and the `hf` config's docstring
    commands: the Kimi-format tokenizer of `kimi_dir` (316 ids) beside random weights in
    transformers' kimi_linear layout, written by model.hf.export_hf (whose parity with
    transformers' classes tests/model/test_hf_kimi_linear.py checks) for the tiny fixture
    model's config with a vocabulary of 320 (the tokenizer's ids and the token-id fields).

        python tests/model/hf_tokenizer_fixtures.py tests/model/hf_fixtures/kimi_chat
    """
    import jax

    from model.hf import export_hf, hf_config, load_tokenizer
    from model.transformer import Model

    path = kimi_dir(path)
    tok = load_tokenizer(str(path))
    cfg = hf_config(str(KIMI_LINEAR_WEIGHTS)).replace(vocab_size=320)
    assert tok.vocab_size <= cfg.vocab_size, (tok.vocab_size, cfg.vocab_size)
    model = Model(cfg)
    ids = {"bos_token_id": 300, "eos_token_id": 301, "pad_token_id": 315}  # [BOS] [EOS] [PAD]
    export_hf(cfg, model.init(jax.random.key(seed)), str(path), dtype="bfloat16", extra=ids)
    return path


if __name__ == "__main__":
    import sys

    print(kimi_chat_checkpoint(sys.argv[1]))
