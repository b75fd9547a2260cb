"""render_messages against strings written by hand from the original Qwen3 chat template's rules,
and ChatFormat's token-level rendering (decodes back to the same text, with any HF tokenizer
that has the Qwen3 tokens)."""

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl_fast.harness import SPECIAL_TOKENS, ChatFormat, render_messages
from agentrl_fast.envs import build_tokenizer
from agentrl_fast.harness.chat_format import render_pieces

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
NOTE_TOOL = {"type": "function", "function": {
    "name": "note", "description": "Write a note — ünïcödé 笔记.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}

TOOLS_HEADER_START = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_HEADER_END = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
ADD_JSON = ('{"type": "function", "function": {"name": "add", "description": "Add two integers.", '
            '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}, '
            '"b": {"type": "integer"}}, "required": ["a", "b"]}}}')
NOTE_JSON = ('{"type": "function", "function": {"name": "note", "description": '
             '"Write a note — ünïcödé 笔记.", "parameters": {"type": "object", "properties": '
             '{"text": {"type": "string"}}}}}')


def test_plain_chat_without_system_or_tools():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Bye"}]
    assert render_messages(messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n")
    assert render_messages(messages, add_generation_prompt=True).endswith(
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")
    assert render_messages(messages, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_messages(messages, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")


def test_system_without_tools_and_final_answer_gets_empty_think_block():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    # The last assistant turn after the last query opens with an (empty) think block.
    assert render_messages(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")


def test_tools_header_with_and_without_system_message():
    user = {"role": "user", "content": "What is 1+2?"}
    assert render_messages([user], tools=[ADD_TOOL]) == (
        "<|im_start|>system\n" + TOOLS_HEADER_START + "\n" + ADD_JSON + TOOLS_HEADER_END
        + "<|im_start|>user\nWhat is 1+2?<|im_end|>\n")
    system = {"role": "system", "content": "You add."}
    assert render_messages([system, user], tools=[ADD_TOOL, NOTE_TOOL]) == (
        "<|im_start|>system\nYou add.\n\n" + TOOLS_HEADER_START + "\n" + ADD_JSON + "\n"
        + NOTE_JSON + TOOLS_HEADER_END + "<|im_start|>user\nWhat is 1+2?<|im_end|>\n")
    # Empty tools are no tools.
    assert render_messages([system, user], tools=[]) == (
        "<|im_start|>system\nYou add.<|im_end|>\n<|im_start|>user\nWhat is 1+2?<|im_end|>\n")


def test_multi_turn_multi_tool_conversation_groups_tool_results():
    messages = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Add 1+2 and 3+4, then note it."},
        {"role": "assistant", "content": "Two sums.", "tool_calls": [
            {"name": "add", "arguments": {"a": 1, "b": 2}},
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "note", "arguments": {"text": "3 和 7 ✓"}}}]},
        {"role": "tool", "content": "{\"ok\": true}"},
        {"role": "assistant", "content": "Done: 3 and 7."},
    ]
    expected = (
        "<|im_start|>system\nYou are an agent.\n\n" + TOOLS_HEADER_START + "\n" + ADD_JSON + "\n"
        + NOTE_JSON + TOOLS_HEADER_END
        + "<|im_start|>user\nAdd 1+2 and 3+4, then note it.<|im_end|>\n"
        # content, then a newline before the first call because content precedes it
        + "<|im_start|>assistant\nTwo sums.\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
          "{\"a\": 1, \"b\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
          "{\"a\": 3, \"b\": 4}}\n</tool_call><|im_end|>\n"
        # consecutive tool results share one user turn
        + "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n"
          "</tool_response><|im_end|>\n"
        # empty content: no newline before the call; unicode kept (ensure_ascii=False)
        + "<|im_start|>assistant\n<tool_call>\n{\"name\": \"note\", \"arguments\": "
          "{\"text\": \"3 和 7 ✓\"}}\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n{\"ok\": true}\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n<think>\n\n</think>\n\nDone: 3 and 7.<|im_end|>\n")
    assert render_messages(messages, tools=[ADD_TOOL, NOTE_TOOL]) == expected
    assert render_messages(messages, tools=[ADD_TOOL, NOTE_TOOL], add_generation_prompt=True) == (
        expected + "<|im_start|>assistant\n")


def test_arguments_given_as_string_are_inserted_verbatim():
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"name": "add", "arguments": '{"a":1,  "b" : 2}'},
                    {"name": "note", "arguments": '{"text": "\\u00e9"}'}]},
                {"role": "user", "content": "y"}]
    assert render_messages(messages) == (
        "<|im_start|>user\nx<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\":1,  \"b\" : 2}}"
        "\n</tool_call>\n<tool_call>\n{\"name\": \"note\", \"arguments\": {\"text\": \"\\u00e9\"}}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\ny<|im_end|>\n")


def test_tool_result_first_and_tool_result_last():
    messages = [{"role": "tool", "content": "a"}, {"role": "user", "content": "q"},
                {"role": "tool", "content": "b"}]
    assert render_messages(messages) == (
        "<|im_start|>user\n<tool_response>\na\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nb\n</tool_response><|im_end|>\n")


def test_think_block_rules_follow_the_last_real_user_query():
    # A user turn that is a <tool_response> wrapper is not a query: the last query is index 1,
    # so the assistant turns after it are "in the current query"; only the last (or one with
    # reasoning) gets a think block.
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "first"},
                {"role": "user", "content": "<tool_response>\nr\n</tool_response>"},
                {"role": "assistant", "content": "mid", "reasoning_content": "\nthought\n"},
                {"role": "assistant", "content": "\n\nlast"}]
    assert render_messages(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\nfirst<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nthought\n</think>\n\nmid<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nlast<|im_end|>\n")
    # Before the last query, assistant turns are rendered without think blocks, and a
    # </think> in the content is split off (its reasoning dropped).
    history = [{"role": "user", "content": "Q1"},
               {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
               {"role": "user", "content": "Q2"}]
    assert render_messages(history) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n")


def test_system_message_not_first_is_a_turn_of_its_own():
    messages = [{"role": "user", "content": "u"}, {"role": "system", "content": "late"}]
    assert render_messages(messages, tools=[ADD_TOOL]) == (
        "<|im_start|>system\n" + TOOLS_HEADER_START + "\n" + ADD_JSON + TOOLS_HEADER_END
        + "<|im_start|>user\nu<|im_end|>\n<|im_start|>system\nlate<|im_end|>\n")


def test_no_user_query_means_no_think_block():
    # Without a real user query the last query index is the last message: no think blocks.
    messages = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "hello"}]
    assert render_messages(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n")
    assert render_messages([]) == ""
    assert render_messages([], add_generation_prompt=True) == "<|im_start|>assistant\n"


@pytest.mark.parametrize("messages, error, fragment", [
    ("hello", TypeError, "messages must be a list"),
    ([{"role": "developer", "content": "x"}], ValueError, "messages[0]['role'] must be one of"),
    ([["user", "x"]], TypeError, "messages[0] must be a dict"),
    ([{"role": "user", "content": ["part"]}], TypeError, "messages[0]['content'] must be a str"),
    ([{"role": "user", "content": "x", "tool_calls": [{"name": "f", "arguments": {}}]}],
     ValueError, "only assistant messages carry tool_calls"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": 3, "arguments": {}}]}],
     TypeError, "messages[0]['tool_calls'][0]: 'name' must be a str"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}],
     ValueError, "messages[0]['tool_calls'][0] has no 'arguments'"),
])
def test_bad_messages_raise_naming_the_field(messages, error, fragment):
    with pytest.raises(error) as info:
        render_messages(messages)
    assert fragment in str(info.value)


# ---------------------------------------------------------------------------------------------
# Token level.

CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Add 1+2 ✓ 你好"},
      {"role": "assistant", "content": "ok", "tool_calls": [
          {"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": "{}"}]},
      {"role": "tool", "content": "3"}, {"role": "tool", "content": "Error: bad"},
      {"role": "assistant", "content": "<think>\nr\n</think>\n\n3"}], [ADD_TOOL, NOTE_TOOL]),
    ([{"role": "user", "content": "  spaces  \n\n"}, {"role": "assistant", "content": ""}], None),
]


@pytest.fixture(scope="module")
def builtin_tokenizer():
    return build_tokenizer(["Add 1+2 and note it.", "memory_write key value"] * 3)


def plain_byte_tokenizer():
    """Another HF tokenizer: byte-level BPE without merges, the Qwen3 tokens added the way a
    user adds them to an existing tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return hf


@pytest.mark.parametrize("which", ["builtin", "plain"])
@pytest.mark.parametrize("stop_mode", ["tool_call", "im_end"])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_token_rendering_decodes_to_render_messages(builtin_tokenizer, which, stop_mode, case):
    tokenizer = builtin_tokenizer if which == "builtin" else plain_byte_tokenizer()
    chat = ChatFormat(tokenizer, stop_mode=stop_mode)
    messages, tools = CONVERSATIONS[case]
    for add_generation_prompt in (False, True):
        ids, mask = chat.encode_messages(messages, tools, add_generation_prompt)
        rendered = chat.render_ids(messages, tools, add_generation_prompt)
        assert chat.decode(rendered) == render_messages(messages, tools, add_generation_prompt)
        # Demonstrations are the conversation as a rollout builds it: every assistant turn
        # opens with the generation prompt, no think block the template would add.
        assert chat.decode(ids) == "".join(text for _, text in render_pieces(
            messages, tools, add_generation_prompt, as_generated=True))
        assert len(mask) == len(ids)
    # The action mask covers exactly the assistant outputs and the stop token the model samples.
    sampled = chat.decode([t for t, m in zip(ids, mask) if m])
    expected = ""
    for m in messages:
        if m["role"] != "assistant":
            continue
        text = render_messages([m])[len("<|im_start|>assistant\n"):-len("<|im_end|>\n")]
        if "</think>" in m["content"]:  # a reasoning the model wrote: sampled with the answer
            reasoning, _, answer = m["content"].partition("</think>")
            text = (f"<think>\n{reasoning.split('<think>')[-1].strip(chr(10))}\n</think>\n\n"
                    + answer.lstrip("\n"))
        ends_with_call = text.endswith("</tool_call>")
        expected += text + ("" if ends_with_call and stop_mode == "tool_call" else "<|im_end|>")
    assert sampled == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]),
                          st.text(max_size=20)), max_size=6),
       st.booleans())
def test_token_rendering_round_trips_random_conversations(builtin_tokenizer, turns, generation):
    chat = ChatFormat(builtin_tokenizer)
    messages = [{"role": role, "content": content} for role, content in turns]
    ids = chat.render_ids(messages, [ADD_TOOL], generation)
    assert chat.decode(ids) == render_messages(messages, [ADD_TOOL], generation)


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=40), st.sampled_from(["builtin", "plain"]))
def test_encode_is_the_tokenizers_encode(builtin_tokenizer, text, which):
    """ChatFormat encodes through the fast tokenizer's backend (no wrapper overhead per call):
    the same ids as the tokenizer's own ``encode``."""
    tokenizer = builtin_tokenizer if which == "builtin" else plain_byte_tokenizer()
    chat = ChatFormat(tokenizer)
    assert chat._backend is not None
    for piece in (text, "<|im_start|>" + text + "</tool_call>", text + "\n<tool_response>\n"):
        assert chat.encode(piece) == list(tokenizer.encode(piece, add_special_tokens=False))


def test_encode_keeps_a_tokenizer_whose_wrapper_differs_from_its_backend(builtin_tokenizer):
    class Trimming(type(builtin_tokenizer)):  # drops trailing spaces before encoding
        def encode(self, text, **kwargs):
            return super().encode(text.rstrip(" \t"), **kwargs)

    trimming = copy.deepcopy(builtin_tokenizer)
    trimming.__class__ = Trimming
    chat = ChatFormat(trimming)
    assert chat._backend is None
    text = "add note  "
    assert chat.encode(text) == trimming.encode(text, add_special_tokens=False)
    assert chat.encode(text) != builtin_tokenizer.encode(text, add_special_tokens=False)


def test_turns_are_tokenized_as_whole_runs(builtin_tokenizer):
    """A tool-result turn is the tokenizer's ids of its whole text (runs between special tokens
    merge across the template/content seams), not its pieces' ids joined."""
    chat = ChatFormat(builtin_tokenizer)
    contents = ["3", "x y\n", ""]
    text = render_messages([{"role": "tool", "content": c} for c in contents])
    tool_turn = chat.tool_results_ids(contents)
    assert tool_turn == list(builtin_tokenizer.encode(text, add_special_tokens=False))
    pieces = (chat.encode("<|im_start|>user") + chat.encode("\n<tool_response>\n")
              + chat.encode("3") + chat.encode("\n</tool_response>"))
    assert tool_turn[:len(pieces)] != pieces  # the built-in tokenizer merges "\n" + "3"
    assert chat.user_ids("hi\n") == list(builtin_tokenizer.encode(
        "<|im_start|>user\nhi\n<|im_end|>\n", add_special_tokens=False))


def test_chat_format_checks_the_tokenizer(builtin_tokenizer):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE(vocab={s: i for i, s in
                                           enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                     merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    with pytest.raises(ValueError, match=r"lacks Qwen3's chat tokens \['<\|im_start\|>', "
                                         r"'<\|im_end\|>', '<tool_call>'.*resize_token_embeddings"):
        ChatFormat(bare)
    bare.add_tokens(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"])
    with pytest.raises(ValueError, match=r"chat tokens \[.<tool_response>., .</tool_response>.\].*add_tokens"):
        ChatFormat(bare)
    # What the message says to do makes it a chat tokenizer.
    bare.add_tokens(["<tool_response>", "</tool_response>"])
    assert ChatFormat(bare).token_ids["</tool_response>"] == len(bare) - 1
    with pytest.raises(ValueError, match="stop_mode must be one of"):
        ChatFormat(builtin_tokenizer, stop_mode="eos")
    with pytest.raises(TypeError, match="tokenizer must be a Hugging Face tokenizer"):
        ChatFormat("not a tokenizer")


def test_builtin_tokenizer(tmp_path):
    corpus = ["memory_write the key", "search the notes"] * 4
    tokenizer = build_tokenizer(corpus, vocab_size=400)
    again = build_tokenizer(corpus, vocab_size=400)
    assert tokenizer.get_vocab() == again.get_vocab()  # training is deterministic
    assert len(tokenizer) <= 400
    for token in SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # Byte-level: anything round-trips, including text it never saw.
    text = "<|im_start|>user\nNull\x00 bytes, 表情 🙂, tabs\t and \r\n <tool_call>{\"a\": 1}</tool_call>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # Frequent corpus words become single tokens: the corpus shortens its own text.
    assert len(tokenizer.encode(" memory_write", add_special_tokens=False)) < len(" memory_write")
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode(text, add_special_tokens=False) == ids
    with pytest.raises(ValueError, match="vocab_size must be an int >= 265"):
        build_tokenizer(vocab_size=100)
    with pytest.raises(TypeError, match="corpus must be an iterable of strings"):
        build_tokenizer("one string")


def test_tools_header_uses_tojson_without_ascii_escapes():
    text = render_messages([], tools=[NOTE_TOOL])
    assert json.dumps(NOTE_TOOL, ensure_ascii=False) in text
    assert "\\u" not in text


@pytest.mark.parametrize("which", ["builtin", "plain"])
@given(text=st.text(max_size=40))
@settings(max_examples=150, deadline=None)
def test_token_bytes_join_to_the_texts_utf8(builtin_tokenizer, which, text):
    """Each id's bytes (part of a character, maybe) are what the ids of any text join to; the
    byte-level alphabet is transformers' own."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from agentrl_fast.harness.chat_format import render_pieces, _BYTE_OF_CHAR
    assert _BYTE_OF_CHAR == {char: byte for byte, char in bytes_to_unicode().items()}
    chat = ChatFormat(builtin_tokenizer if which == "builtin" else plain_byte_tokenizer())
    text += "<tool_call><|im_end|>"
    assert b"".join(chat.token_bytes(i) for i in chat.encode(text)) == text.encode("utf-8")


def test_a_tokenizer_that_is_not_byte_level_has_no_token_bytes():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["[UNK]", "hello", "world", *SPECIAL_TOKENS]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    hf.add_tokens(list(SPECIAL_TOKENS))
    chat = ChatFormat(hf)
    assert chat.token_bytes(chat.encode("hello")[0]) is None
