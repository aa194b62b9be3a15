"""Hermes-syntax chat templates (Qwen-style ChatML, model/hf/chat_template.py) and templates
without a tool-call syntax: masks with the newline a template writes after each end-of-turn,
tool results grouped in one turn, the rollout's observation segment (`continuation`) equal to
the SFT rendering's, a template that does not render a role refused, and (where
transformers is installed) rendering and ids equal to its apply_chat_template. About 1 s.
"""

import pytest
from hf_tokenizer_fixtures import deepseek_dir, qwen_dir  # noqa: E402

from model.hf.chat_template import ChatTemplateError  # noqa: E402
from model.hf.tokenizer import load_tokenizer  # noqa: E402
from rl.agent import turns_to_messages  # noqa: E402
from rl.tools import ToolCall, format_tool_call, parse_tool_calls, wrap_response  # noqa: E402

TURNS = [(format_tool_call("bash", {"command": "ls"}) + format_tool_call("bash", {"command": "pwd"}),
          wrap_response("exit 0\na.txt") + "\n" + wrap_response("exit 0\n/work")),
         ("done", None)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_tokenizer(str(qwen_dir(tmp_path_factory.mktemp("qwen"))))


def test_hermes_template_masks_and_grouped_tool_results(qwen):
    assert qwen.tool_syntax == "hermes" and qwen.end_of_turn == "<|im_end|>"
    assert not qwen.add_bos
    msgs = turns_to_messages("List it.", TURNS, qwen.tool_syntax)
    e = qwen.encode
    prompt = "<|im_start|>user\nList it.<|im_end|>\n<|im_start|>assistant\n"
    turn1 = ('\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
             '\n<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>'
             "<|im_end|>")
    obs = ("\n<|im_start|>user\n<tool_response>\nexit 0\na.txt\n</tool_response>\n"
           "<tool_response>\nexit 0\n/work\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    turn2, tail = "done<|im_end|>", "\n"
    want = [(e(prompt), False), (e(turn1), True), (e(obs), False), (e(turn2), True),
            (e(tail), False)]
    ids, mask = qwen.encode_chat(msgs)
    assert ids == [i for s, _ in want for i in s]
    assert mask == [m for s, m in want for _ in s]
    # what the model is trained to write parses back to the demonstration's calls
    first = qwen.decode([i for i, m in zip(ids, mask) if m])
    assert parse_tool_calls(first).calls == [ToolCall("bash", {"command": "ls"}),
                                             ToolCall("bash", {"command": "pwd"})]
    # a rollout's observation segment (continuation) is the SFT rendering's
    cont = qwen.template.continuation(msgs[:2], msgs[2:4])
    assert cont == obs


def test_template_without_tool_syntax_keeps_the_hermes_text(tmp_path):
    d = deepseek_dir(tmp_path)
    src = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<｜Assistant｜>"
           "{{ m.content }}<｜end▁of▁sentence｜>{% else %}<｜User｜>{{ m.content }}{% endif %}"
           "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
    tok = load_tokenizer(str(d), chat_template=src)
    assert tok.tool_syntax is None
    msgs = turns_to_messages("List it.", TURNS, None)
    assert msgs[1] == {"role": "assistant", "content": TURNS[0][0]}
    ids, mask = tok.encode_chat(msgs)
    assert tok.decode([i for i, m in zip(ids, mask) if m], stop_at_eos=False) == (
        TURNS[0][0] + "<｜end▁of▁sentence｜>done<｜end▁of▁sentence｜>")
    # a template that drops tool messages would hide the observations: refused
    tok = load_tokenizer(str(d), chat_template=src.replace("{% else %}", "{% elif m.role == "
                                                            "'user' %}"))
    with pytest.raises(ChatTemplateError, match=r"does not render the content of message 2 "
                                                r"\(role 'tool'\)"):
        tok.encode_chat(msgs)


@pytest.mark.parametrize("make", ["deepseek_dir", "qwen_dir"])
@pytest.mark.hf_reference
def test_rendering_and_ids_equal_transformers(make, tmp_path):
    """Runs where `transformers` is installed: the same directory through its
    PreTrainedTokenizerFast gives the same rendered text and token ids (apply_chat_template)."""
    import hf_tokenizer_fixtures as fx
    import transformers

    d = getattr(fx, make)(tmp_path)
    ours = load_tokenizer(str(d))
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    conv = [{"role": "system", "content": "S."}] + turns_to_messages("List it.", TURNS,
                                                                     ours.tool_syntax)
    for msgs, gen in [(conv, False), (conv[:2], True), (conv[:5], True)]:
        text = ours.template.render(msgs, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert ours.encode(text, bos=True) == list(ids)
