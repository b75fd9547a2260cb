"""Token-by-token streaming through the proxy: ContentStream's deltas add up to the final
content for random outputs (tool calls valid and malformed, stop strings, whitespace, multi-byte
characters cut mid-character), and over real HTTP with the ``openai`` client: content reaches
the client while the reply is still being sampled, the streamed message equals the plain one, a
client that hangs up mid-stream loses nothing of the session, and failures before and after the
first token end as a 5xx and as an error event. A scripted text policy runs through the real
ChatFormat and tokenizer (its ids come one at a time, like sampled ones)."""

import random
import threading
import time

import httpx
import openai
import pytest

from agentrl_fast.harness import ChatFormat
from agentrl_fast.config import SamplingParams
from agentrl_fast.generators import ScriptedGenerator
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.proxy import Proxy, ProxyServer
from agentrl_fast.proxy.session import make_reply, parse_request
from agentrl_fast.proxy.stream import ContentStream

CALL = '<tool_call>\n{"name": "open_vault", "arguments": {"name": "amber"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "open_vault", "description": "Open a vault.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}]
MESSAGES = [{"role": "system", "content": "You open vaults."},
            {"role": "user", "content": "Collect the codes of vaults amber, birch."}]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=96)
PIECES = ["The code", " is", " 4711", ".", " ", "  ", "\n", "\n\n", "é", "世界", "🙂", "END", "EN",
          "<tool", "_call>", CALL, "<tool_call>{not json}</tool_call>", "<tool_call>\n{\"nam",
          "</tool_call>", "x", "amber"]


@pytest.fixture(scope="module")
def chat():
    env = VaultEnvironment()
    return ChatFormat(build_tokenizer(env.corpus(), words=env.words()))


def random_output(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))


def random_ids(chat, rng: random.Random) -> list[int]:
    """A random output's ids, some multi-byte characters split into one id per byte (as a
    sampler may emit them), maybe ending with <|im_end|>."""
    from agentrl_fast.harness.chat_format import _BYTE_OF_CHAR
    vocab = chat.tokenizer.get_vocab()
    byte_id = {byte: vocab[char] for char, byte in _BYTE_OF_CHAR.items()}
    ids = []
    for char in random_output(rng):
        split = ord(char) > 127 and rng.random() < 0.5
        ids += [byte_id[b] for b in char.encode()] if split else chat.encode(char)
    return ids + ([chat.im_end_id] if rng.random() < 0.7 else [])


def streamed(chat, ids, body, chunk=lambda: 1) -> tuple[list[str], str, str]:
    """``(deltas before the end, the rest, the final content)`` of ``ids`` streamed ``chunk()``
    ids at a time under request ``body``."""
    request = parse_request({"model": "m", "messages": MESSAGES, "tools": TOOLS, **body},
                            SAMPLING)
    stream = ContentStream(chat, request.stop, request.parse_calls)
    deltas, k = [], 0
    while k < len(ids):
        step = chunk()
        deltas.append(stream.feed(ids[k:k + step]))
        k += step
    deltas = [d for d in deltas if d]
    reply = make_reply(chat, ids, [0.0] * len(ids), "stop", request, lambda k: f"call_{k}")
    return deltas, stream.finish(reply.content), reply.content or ""


@pytest.mark.parametrize("body", [{}, {"stop": ["END"]}, {"stop": ["\n\n", "code", "b€"]},
                                  {"tool_choice": "none"}, "stop strings from the output"])
def test_deltas_add_up_to_the_final_content(chat, body):
    rng = random.Random()
    for _ in range(300):
        ids = random_ids(chat, rng)
        if body == "stop strings from the output":
            text = chat.decode(ids)
            starts = [rng.randrange(len(text)) for _ in range(2)] if text else []
            request = {"stop": [text[i:i + rng.randint(1, 4)] for i in starts] or None}
        else:
            request = body
        deltas, rest, content = streamed(chat, ids, request, lambda: rng.randint(1, 3))
        assert "".join(deltas) + rest == content, (ids, request, deltas, rest)
        assert "\ufffd" not in "".join(deltas)  # never half a character


def test_a_stop_string_ending_inside_an_unfinished_character_is_held(chat):
    # "€" sampled as its three bytes, one id each: "b" must wait, since "b€" is a stop string.
    from agentrl_fast.harness.chat_format import _BYTE_OF_CHAR
    vocab = chat.tokenizer.get_vocab()
    euro = [vocab[char] for byte in "€".encode() for char, b in _BYTE_OF_CHAR.items() if b == byte]
    ids = chat.encode("ab") + euro + [chat.im_end_id]
    deltas, rest, content = streamed(chat, ids, {"stop": ["b€"]})
    assert content == "a" and "".join(deltas) + rest == "a"


def test_plain_text_streams_all_but_its_last_token_and_holds_what_may_change(chat):
    text = "The code is 4711 and the vault is amber."
    deltas, rest, content = streamed(chat, chat.encode(text) + [chat.im_end_id], {})
    assert content == text and len(deltas) > 5 and len(rest) <= 2
    # From a tool call, a possible stop string and leading whitespace on, nothing goes early.
    deltas, rest, _ = streamed(chat, chat.encode("Let me look. " + CALL), {})
    assert "".join(deltas) == "Let me look." and rest == ""
    deltas, rest, _ = streamed(chat, chat.encode("The code is ENDS"), {"stop": ["ENDS"]})
    assert "".join(deltas) == "The code is" and rest == " "  # "END" was held: it began "ENDS"
    deltas, rest, content = streamed(chat, chat.encode("  indented text here"), {})
    assert deltas == [] and rest == content == "  indented text here"


# -- over HTTP --------------------------------------------------------------------------------------

class Gated(ScriptedGenerator):
    """A scripted generator whose ids come one at a time; after ``hold_after`` ids of a reply it
    waits (at most 10 s) until ``released`` is set, e.g. by a client that has seen content, and
    ``fail_after`` ids in it raises."""

    def __init__(self, chat, outputs, hold_after=None, fail_after=None):
        super().__init__(lambda context: outputs.pop(0), chat)
        self.hold_after, self.fail_after = hold_after, fail_after
        self.released, self.waited_out = threading.Event(), False

    def generate(self, prompts, sampling, seeds=None, on_tokens=None):
        sent = []

        def each(index, ids):  # holds even when nobody listens: a proxy that does not stream
            sent.append(ids)   # waits out the 10 s
            if len(sent) == self.fail_after:
                raise RuntimeError("the engine failed mid-reply")
            if len(sent) == self.hold_after and not self.released.wait(10):
                self.waited_out = True
            if on_tokens is not None:
                on_tokens(index, ids)
        return super().generate(prompts, sampling, seeds, on_tokens=each)


class Whole(ScriptedGenerator):
    """A generator that does not stream (no ``on_tokens``)."""

    def __init__(self, chat, outputs):
        super().__init__(lambda context: outputs.pop(0), chat)

    def generate(self, prompts, sampling, seeds=None):
        return super().generate(prompts, sampling, seeds)


def serve(chat, generator):
    proxy = Proxy(generator, chat, SAMPLING, batch_window=0.0)
    return proxy, ProxyServer(proxy).start()


def client_of(server, name) -> openai.OpenAI:
    httpx.post(f"{server.url}/sessions", json={"session_id": name}).raise_for_status()
    return openai.OpenAI(base_url=server.base_url(name), api_key="-", max_retries=0)


def chunks(client, **body) -> list:
    return list(client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                               stream=True, **body))


def test_content_reaches_the_client_while_the_reply_is_sampled(chat):
    text = "The code of amber is 4711, and birch is next. " + CALL
    generator = Gated(chat, [text], hold_after=12)
    proxy, server = serve(chat, generator)
    try:
        client = client_of(server, "early")
        seen = []
        for chunk in client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                    stream=True):
            seen.append(chunk)
            if any(c.delta.content for c in chunk.choices):
                generator.released.set()  # content came before the 12th id was released
        assert not generator.waited_out, "no content reached the client before the reply ended"
        content = "".join(c.delta.content or "" for ch in seen for c in ch.choices)
        calls = [t for ch in seen for c in ch.choices for t in c.delta.tool_calls or []]
        assert content == "The code of amber is 4711, and birch is next."
        assert [t.function.name for t in calls] == ["open_vault"]
        assert seen[-1].choices[0].finish_reason == "tool_calls"
    finally:
        server.stop()
        proxy.close()


@pytest.mark.parametrize("generator", [Gated, Whole])
def test_a_streamed_message_equals_the_plain_one(chat, generator):
    outputs = ["Opening. " + CALL, "The codes are 1 and 2.END more", "  <tool_call>{bad</tool_call>",
               "One " + CALL + " and two " + CALL + "\n"]
    proxy, server = serve(chat, generator(chat, [o for o in outputs for _ in range(2)]))
    try:
        plain, streaming = client_of(server, "plain"), client_of(server, "streaming")
        for _ in outputs:  # the same messages each time: each request starts a sub-trace
            want = plain.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                 stop=["END"]).choices[0]
            got = chunks(streaming, stop=["END"], stream_options={"include_usage": True})
            content = "".join(c.delta.content or "" for ch in got for c in ch.choices)
            calls = [t.function.arguments for ch in got for c in ch.choices
                     for t in c.delta.tool_calls or []]
            assert content == (want.message.content or "")
            assert calls == [t.function.arguments for t in want.message.tool_calls or []]
            assert got[-2].choices[0].finish_reason == want.finish_reason
            assert got[-1].usage.completion_tokens > 0
    finally:
        server.stop()
        proxy.close()


def test_a_client_that_hangs_up_mid_stream_loses_nothing(chat):
    text = "A long answer about the vaults and their codes, unread."
    generator = Gated(chat, [text, "Done."], hold_after=8)
    proxy, server = serve(chat, generator)
    try:
        client = client_of(server, "gone")
        with client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                            stream=True) as stream:
            for chunk in stream:
                if any(c.delta.content for c in chunk.choices):
                    break  # hang up after the first content
        generator.released.set()
        # The turn is still committed: the next request (once it is in) extends the session.
        history = MESSAGES + [{"role": "assistant", "content": text},
                              {"role": "user", "content": "And?"}]
        deadline = time.monotonic() + 10
        while True:
            try:
                reply = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
                break
            except openai.ConflictError:  # 409: the hung-up turn is still being sampled
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert reply.choices[0].message.content == "Done."
        finished = httpx.post(f"{server.url}/sessions/gone/finish", json={"reward": 1}).json()
        assert finished["turns"] == 2 and finished["sub_traces"] == 1
    finally:
        server.stop()
        proxy.close()


def test_failures_before_and_after_the_first_token(chat):
    proxy, server = serve(chat, Gated(chat, ["Some text that fails later on."], fail_after=6))
    try:
        client = client_of(server, "fails")
        content = ""
        with pytest.raises(openai.APIError, match="the engine failed mid-reply") as raised:
            for chunk in client.chat.completions.create(model="m", messages=MESSAGES,
                                                        tools=TOOLS, stream=True):
                content += "".join(c.delta.content or "" for c in chunk.choices)
        assert type(raised.value) is openai.APIError  # an event in a 200 stream, not a 5xx
        assert content.startswith("Some")  # sent before the failure
        # Before any id: a plain 5xx with an OpenAI error body, not a stream.
        failing = Proxy(Gated(chat, ["x"], fail_after=1), chat, SAMPLING, batch_window=0.0)
        with ProxyServer(failing) as early:
            with pytest.raises(openai.InternalServerError, match="the engine failed"):
                chunks(client_of(early, "early"))
        failing.close()
        # The server is up and the session free: a well-formed request is answered.
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            chunks(client, max_tokens=-1)
    finally:
        server.stop()
        proxy.close()


@pytest.mark.parametrize("prefix_cache_bytes", [0, 1 << 24])
def test_torch_generator_tells_each_prompts_ids_as_sampled(prefix_cache_bytes):
    """Over sub-batches (max_batch_size 2 of 5 prompts) and prefix-cache hits, ``on_tokens``
    hears each prompt's ids in order, one step at a time; sampling is the same without it."""
    from agentrl_fast.generators import TorchGenerator
    from agentrl_fast.models.tiny import tiny_qwen3

    generator = TorchGenerator(tiny_qwen3(64, seed=1), max_batch_size=2,
                               prefix_cache_bytes=prefix_cache_bytes)
    rng = random.Random()
    prompts = [[rng.randrange(1, 64) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=rng.randint(1, 12),
                              stop_ids=(rng.randrange(64),))
    plain = generator.generate(prompts, sampling, seeds=range(5))
    for _ in range(2):  # the second time from the prefix cache, when it is on
        heard: dict[int, list[list[int]]] = {i: [] for i in range(5)}
        told = generator.generate(prompts, sampling, seeds=range(5),
                                  on_tokens=lambda i, ids: heard[i].append(ids))
        assert [sum(heard[i], []) for i in range(5)] == [g.ids for g in told]
        assert all(len(ids) == 1 for i in range(5) for ids in heard[i])
    assert prefix_cache_bytes or [g.ids for g in told] == [g.ids for g in plain]
