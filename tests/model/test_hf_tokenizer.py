"""Checkpoint tokenizers and chat templates (model/hf/tokenizer.py, model/hf/chat_template.py).

The tokenizers are trained here with the real libraries (tiktoken's BPE trainer for a Kimi-style
tiktoken.model, `tokenizers` for a DeepSeek-style tokenizer.json; hf_tokenizer_fixtures.py) and
the templates are written in the two families' formats. Covered: encode/decode round trips,
rendering of every role incl. tool turns and the generation prompt, assistant masks against
hand-worked token lists, tool calls parsed back from what the templates render (and malformed
ones refused), clear errors for a raising template, a non-prefix-stable one, and missing or
corrupt files. About 2 s in all.
"""

import json

import pytest
from hf_tokenizer_fixtures import deepseek_dir, kimi_dir  # noqa: E402

from model import tokenizer as base_tokenizer  # noqa: E402
from model.hf.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402
from model.hf.tokenizer import TokenizerFileError, load_tokenizer  # noqa: E402
from rl.agent import turns_to_messages  # noqa: E402
from rl.tools import ToolCall, format_tool_call, parse_tool_calls_as, wrap_response  # noqa: E402

TOOL_CONV = [
    {"role": "user", "content": "Copy the file."},
    {"role": "assistant", "content": "Looking first.", "tool_calls": [
        {"id": "functions.bash:0", "type": "function",
         "function": {"name": "bash", "arguments": {"command": "cat pointer.txt"}}}]},
    {"role": "tool", "tool_call_id": "functions.bash:0", "content": "exit 0\nb.txt"},
    {"role": "assistant", "content": "done"},
]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return load_tokenizer(str(kimi_dir(tmp_path_factory.mktemp("kimi"))))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return load_tokenizer(str(deepseek_dir(tmp_path_factory.mktemp("deepseek"))))


@pytest.mark.parametrize("name", ["kimi", "deepseek"])
def test_round_trip_and_special_ids(name, request):
    tok = request.getfixturevalue(name)
    for text in ["The answer is 42.", "Read pointer.txt, then cp a b\n\tdone", "你好世界 ünïcode ✓",
                 "{\"command\": \"ls -l\"}  trailing  "]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    # special strings in text are their single ids, and decode keeps them as text
    eot = tok.end_of_turn
    ids = tok.encode("ok" + eot)
    assert ids[-1] == tok.eos_id and tok.decode(ids, stop_at_eos=False) == "ok" + eot
    assert tok.decode(ids) == "ok"  # stops at EOS
    assert tok.encode("x", eos=True)[-1] == tok.eos_id


def test_kimi_specials_and_tiktoken_vocab(kimi):
    assert kimi.end_of_turn == "<|im_end|>" and kimi.tool_syntax == "kimi"
    assert kimi.decode([kimi.eos_id], stop_at_eos=False) == "<|im_end|>"
    assert kimi.decode([kimi.pad_id], stop_at_eos=False) == "[PAD]"
    assert kimi.decode([kimi.bos_id], stop_at_eos=False) == "[BOS]"
    assert not kimi.add_bos  # the template renders no BOS and the config does not ask for one
    assert kimi.encode("hi", bos=True) == kimi.encode("hi")
    assert kimi.vocab_size == 300 + 16
    # Kimi's split pattern keeps Han runs apart from Latin words
    assert kimi.decode(kimi.encode("abc你好")) == "abc你好"


def test_deepseek_specials_and_bos(deepseek):
    assert deepseek.end_of_turn == "<｜end▁of▁sentence｜>" and deepseek.tool_syntax == "deepseek"
    assert deepseek.add_bos
    p = deepseek.chat_prompt("hi")
    ids = deepseek.encode(p, bos=True)
    assert ids[0] == deepseek.bos_id and ids[1] != deepseek.bos_id  # one BOS, never two
    assert deepseek.encode("hi", bos=True)[0] == deepseek.bos_id


def test_kimi_renders_every_role(kimi):
    conv = [{"role": "system", "content": "Be brief."}] + TOOL_CONV
    text = kimi.template.render(conv, tools=[{"name": "bash"}])
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"name":"bash"}]<|im_end|>'
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Copy the file.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Looking first.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>{"command": '
        '"cat pointer.txt"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.bash:0\nexit 0\nb.txt<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>done<|im_end|>")
    assert kimi.chat_prompt("Hi") == ("<|im_system|>system<|im_middle|>You are a careful "
                                      "assistant.<|im_end|><|im_user|>user<|im_middle|>Hi"
                                      "<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_deepseek_renders_every_role_and_generation_prompts(deepseek):
    text = deepseek.template.render([{"role": "system", "content": "S."}] + TOOL_CONV)
    assert text == (
        "<｜begin▁of▁sentence｜>S.<｜User｜>Copy the file.<｜Assistant｜></think>Looking first."
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>{"command": "cat pointer.txt"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁output▁begin｜>exit 0\nb.txt<｜tool▁output▁end｜>done<｜end▁of▁sentence｜>")
    # after a tool output the assistant continues without a new <｜Assistant｜>
    assert deepseek.template.render(TOOL_CONV[:3], add_generation_prompt=True).endswith(
        "<｜tool▁output▁end｜>")
    assert deepseek.chat_prompt("Hi") == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"


def test_kimi_mask_is_the_hand_worked_assistant_tokens(kimi):
    e = kimi.encode
    prompt = ("<|im_system|>system<|im_middle|>You are a careful assistant.<|im_end|>"
              "<|im_user|>user<|im_middle|>Copy the file.<|im_end|>"
              "<|im_assistant|>assistant<|im_middle|>")
    turn1 = ('Looking first.<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0'
             '<|tool_call_argument_begin|>{"command": "cat pointer.txt"}<|tool_call_end|>'
             "<|tool_calls_section_end|><|im_end|>")
    obs = ("<|im_system|>tool<|im_middle|>## Return of functions.bash:0\nexit 0\nb.txt"
           "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    turn2 = "done<|im_end|>"
    want = [(e(prompt), False), (e(turn1), True), (e(obs), False), (e(turn2), True)]
    ids, mask = kimi.encode_chat(TOOL_CONV)
    assert ids == [i for s, _ in want for i in s]
    assert mask == [m for s, m in want for _ in s]
    assert sum(mask) == len(e(turn1)) + len(e(turn2))
    # the assistant tokens end with the end-of-turn id, which is the tokenizer's EOS
    assert [ids[i] for i in range(len(ids)) if mask[i]][-1] == kimi.eos_id


def test_deepseek_mask_after_tool_output_has_no_role_header(deepseek):
    e = deepseek.encode
    ids, mask = deepseek.encode_chat(TOOL_CONV)
    head = e("<｜begin▁of▁sentence｜><｜User｜>Copy the file.<｜Assistant｜></think>")
    turn1 = e('Looking first.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>'
              '{"command": "cat pointer.txt"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
              "<｜end▁of▁sentence｜>")
    obs = e("<｜tool▁output▁begin｜>exit 0\nb.txt<｜tool▁output▁end｜>")
    turn2 = e("done<｜end▁of▁sentence｜>")
    assert ids == head + turn1 + obs + turn2
    assert mask == [False] * len(head) + [True] * len(turn1) + [False] * len(obs) + [True] * len(turn2)


@pytest.mark.parametrize("name", ["kimi", "deepseek"])
def test_tool_calls_rendered_by_the_template_parse_back(name, request):
    tok = request.getfixturevalue(name)
    args = {"command": "cp \"$(cat pointer.txt)\" answer.txt", "n": [1, 2]}
    turns = [("first <tool_call>" + json.dumps({"name": "bash", "arguments": args}) + "</tool_call>"
              + format_tool_call("bash", {"command": "ls"}),
              wrap_response("exit 0\na") + "\n" + wrap_response("exit 1")),
             ("done", None)]
    msgs = turns_to_messages("Do it.", turns, tok.tool_syntax)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [m["content"] for m in msgs[2:4]] == ["exit 0\na", "exit 1"]
    segs = tok.chat_segments(msgs)
    model_turns = [tok.decode(ids) for ids, a in segs if a]
    parsed = parse_tool_calls_as(model_turns[0], tok.tool_syntax)
    assert parsed.errors == [] and parsed.text == "first"
    assert parsed.calls == [ToolCall("bash", args), ToolCall("bash", {"command": "ls"})]
    if name == "kimi":
        assert parsed.ids == ["functions.bash:0", "functions.bash:1"]
    assert parse_tool_calls_as(model_turns[1], tok.tool_syntax).is_final


@pytest.mark.parametrize("syntax,text,error", [
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>bash:0<|tool_call_argument_begin|>{}"
     "<|tool_call_end|><|tool_calls_section_end|>", "not of the form functions.NAME:INDEX"),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0"
     "<|tool_call_argument_begin|>{\"command\": }<|tool_call_end|><|tool_calls_section_end|>",
     "not valid JSON"),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0"
     "<|tool_call_argument_begin|>{}<|tool_call_end|>", "unterminated <|tool_calls_section_begin|>"),
    ("kimi", "text <|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>{}"
     "<|tool_call_end|>", "outside a well-formed"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "must be an object"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "without <｜tool▁sep｜>"),
    ("deepseek", "<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜>", "outside a call"),
])
def test_malformed_family_tool_calls_are_errors_not_calls(syntax, text, error):
    p = parse_tool_calls_as(text, syntax)
    assert not p.calls and not p.is_final
    assert any(error in e for e in p.errors), p.errors


def test_deepseek_v3_fenced_calls_and_max_calls():
    one = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>bash\n```json\n{\"command\": \"ls\"}\n```"
           "<｜tool▁call▁end｜>")
    p = parse_tool_calls_as(f"<｜tool▁calls▁begin｜>{one}{one}<｜tool▁calls▁end｜>", "deepseek",
                            max_calls=1)
    assert p.calls == [ToolCall("bash", {"command": "ls"})]
    assert p.errors == ["at most 1 tool call(s) per turn: the call to 'bash' was not run"]
    with pytest.raises(ValueError, match="unknown tool-call syntax"):
        parse_tool_calls_as("", "qwen")


def test_a_template_that_raises_gives_a_clear_error(kimi):
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json chat_template refused "
                                                r"the conversation: unknown role: critic"):
        kimi.template.render([{"role": "critic", "content": "no"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", origin="broken.jinja")
    # the sandbox refuses attribute escapes
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    # HF's globals and the generation block
    t = ChatTemplate("{% generation %}{{ strftime_now('%Y') | length }}{{ [1] | tojson }}"
                     "{% endgeneration %}")
    assert t.render([]) == "4[1]"


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    d = deepseek_dir(tmp_path)
    # drops every assistant turn's content but the last one (like templates that strip
    # earlier reasoning): a rollout's earlier tokens would not be what the template renders
    src = ("{% for m in messages %}<｜User｜>{% if m.role == 'user' %}{{ m.content }}{% elif "
           "loop.last %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% else %}<｜Assistant｜>"
           "<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<｜User｜><｜Assistant｜>{% endif %}")
    tok = load_tokenizer(str(d), chat_template=src)
    with pytest.raises(ChatTemplateError, match="not prefix-stable at message 1"):
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])


def test_a_template_whose_turn_is_not_prompt_answer_eos_is_refused(tmp_path):
    d = deepseek_dir(tmp_path)
    src = ("{% for m in messages %}{{ m.role }}: {{ m.content }} (signed)<｜end▁of▁sentence｜>"
           "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ChatTemplateError, match="not as the generation prompt"):
        load_tokenizer(str(d), chat_template=src)
    with pytest.raises(ChatTemplateError, match="does not render an assistant message's content"):
        load_tokenizer(str(d), chat_template=src.replace("m.content", "m.content | upper"))


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(TokenizerFileError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(TokenizerFileError, match="no tokenizer file"):
        load_tokenizer(str(tmp_path))
    d = deepseek_dir(tmp_path / "ds")
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    with pytest.raises(TokenizerFileError, match=r"ds/tokenizer.json: not a valid tokenizer.json"):
        load_tokenizer(str(d))
    d = deepseek_dir(tmp_path / "ds2")
    (d / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerFileError, match=r"ds2/tokenizer_config.json: cannot read it"):
        load_tokenizer(str(d))
    d = deepseek_dir(tmp_path / "ds3")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<never-added>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerFileError, match="bos_token '<never-added>' is not a single token"):
        load_tokenizer(str(d))
    k = kimi_dir(tmp_path / "k")
    with open(k / "tiktoken.model", "a") as f:
        f.write("%%%not-base64 12\n")
    with pytest.raises(TokenizerFileError, match=r"k/tiktoken.model: not a tiktoken BPE file"):
        load_tokenizer(str(k))
    k = kimi_dir(tmp_path / "k2")
    (k / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerFileError, match=r"k2/tokenizer_config.json: missing"):
        load_tokenizer(str(k))
    k = kimi_dir(tmp_path / "k3")
    (k / "chat_template.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(TokenizerFileError, match=r"k3/chat_template.jinja: cannot read it"):
        load_tokenizer(str(k))


def test_chat_template_file_overrides_and_no_template(tmp_path):
    k = kimi_dir(tmp_path / "k")
    (k / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
    tok = load_tokenizer(str(k))
    assert tok.chat_prompt("x") == "<|im_user|>x<|im_end|><|im_assistant|>"
    cfg = json.loads((k / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (k / "tokenizer_config.json").write_text(json.dumps(cfg))
    (k / "chat_template.jinja").unlink()
    tok = load_tokenizer(str(k))
    assert tok.template is None and tok.eos_id == tok.encode("[EOS]")[0]
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tok.chat_prompt("x")


def test_model_tokenizer_loads_a_checkpoint_directory(tmp_path):
    d = kimi_dir(tmp_path)
    tok = base_tokenizer.load_tokenizer(str(d))
    assert tok.chat_prompt("q").endswith("<|im_assistant|>assistant<|im_middle|>")
    assert base_tokenizer.load_tokenizer("byte").chat_prompt("q") == "Q: q\nA: "
