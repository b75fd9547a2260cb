"""Third-party OpenAI clients against a real ProxyServer, unchanged: litellm (which moves a
reply's leading ``<think>`` block into ``reasoning_content`` when not streaming) and LangChain
keep one sub-trace per appending conversation with a thinking model; smolagents'
``ToolCallingAgent`` runs on its defaults (``tool_choice: "required"``, the call's
``<tool_call>`` forced as context) to its final answer; a named ``tool_choice`` pins the function
on Qwen3's tokenizer, over chat completions (plain and streamed) and the Responses API. A
scripted text policy runs through the real ChatFormat and tokenizer; nothing leaves 127.0.0.1
(litellm reads its bundled cost map and sends no telemetry)."""

import os

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before litellm is imported: no download
os.environ["LITELLM_TELEMETRY"] = "False"

import httpx  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from smolagents import OpenAIServerModel, ToolCallingAgent, tool  # noqa: E402

from agentrl_fast.config import SamplingParams  # noqa: E402
from agentrl_fast.envs import VaultEnvironment, build_tokenizer  # noqa: E402
from agentrl_fast.generators import ScriptedGenerator  # noqa: E402
from agentrl_fast.harness import ChatFormat  # noqa: E402
from agentrl_fast.proxy import Proxy, ProxyServer  # noqa: E402
from test_proxy_stream import MESSAGES, TOOLS  # noqa: E402

litellm.telemetry = False
litellm.suppress_debug_info = True



def call(name: str) -> str:
    return f'<tool_call>\n{{"name": "open_vault", "arguments": {{"name": "{name}"}}}}\n</tool_call>'


# A thinking model's turns: a think block, then a call or the answer.
THINKING = ["<think>\nAmber first.\n</think>\n\n" + call("amber"),
            "<think>\nNow birch.\n</think>\n\nOpening birch. " + call("birch"),
            "<think>\nBoth are open.\n</think>\n\nThe codes are 4711 and 42."]


@pytest.fixture(scope="module")
def chat():
    env = VaultEnvironment()
    return ChatFormat(build_tokenizer(env.corpus(), words=env.words()))


@pytest.fixture
def serve():
    """``serve(chat, policy, **proxy options) -> (proxy, server)``, stopped after the test."""
    running = []

    def start(chat_format, policy, **options):
        proxy = Proxy(ScriptedGenerator(policy, chat_format), chat_format,
                      SamplingParams(temperature=1.0, max_new_tokens=64), batch_window=0.0,
                      **options)
        running.append((proxy, ProxyServer(proxy).start()))
        return running[-1]
    yield start
    for proxy, server in running:
        server.stop()
        proxy.close()


def session(server, name: str) -> str:
    httpx.post(f"{server.url}/sessions", json={"session_id": name}).raise_for_status()
    return server.base_url(name)


def script(*outputs):
    queue = list(outputs)
    return lambda context: queue.pop(0)


def assert_one_appending_sub_trace(proxy, name: str, turns: int):
    trajectory = proxy.finish(name, 1.0)
    assert len(trajectory.sub_traces) == 1 and trajectory.metrics["compactions"] == 0
    assert trajectory.metrics["turns"] == turns
    return trajectory


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_with_a_thinking_model_extends_its_session(chat, serve, stream):
    proxy, server = serve(chat, script(*THINKING))
    base_url = session(server, "litellm")
    messages = list(MESSAGES)
    for turn in range(3):
        request = dict(model="openai/policy", api_base=base_url, api_key="x",
                       messages=messages, tools=TOOLS)
        if stream:
            chunks = list(litellm.completion(stream=True, **request))
            message = litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message
            assert message.content.startswith("<think>")  # streamed, it stays in the content
        else:
            message = litellm.completion(**request).choices[0].message
            # litellm's split: the text between the tags, and all after them, unstripped.
            reasoning = THINKING[turn].split("</think>")[0].removeprefix("<think>")
            assert message.reasoning_content == reasoning and "<think>" not in message.content
        messages.append(message)  # as litellm's users do: its Message object, sent back
        for tool_call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "4711"})
    assert message.tool_calls is None and message.content.endswith("The codes are 4711 and 42.")
    trajectory = assert_one_appending_sub_trace(proxy, "litellm", 3)
    assert chat.decode(trajectory.current.ids).count("<think>") == 3


def test_langchain_with_tools_extends_its_session(chat, serve):
    proxy, server = serve(chat, script(*THINKING))
    model = ChatOpenAI(model="policy", base_url=session(server, "langchain"), api_key="x",
                       max_retries=0).bind_tools(TOOLS)
    messages = [SystemMessage(MESSAGES[0]["content"]), HumanMessage(MESSAGES[1]["content"])]
    for _ in range(3):
        reply = model.invoke(messages)
        messages.append(reply)
        messages += [ToolMessage("4711", tool_call_id=c["id"]) for c in reply.tool_calls]
    assert [c["args"] for m in messages[2:] for c in getattr(m, "tool_calls", [])] == [
        {"name": "amber"}, {"name": "birch"}]
    assert reply.content.endswith("The codes are 4711 and 42.")
    assert_one_appending_sub_trace(proxy, "langchain", 3)


@tool
def open_vault(name: str) -> str:
    """Open a vault and read its code.

    Args:
        name: the vault's name
    """
    return {"amber": "4711"}.get(name, "no such vault")


def test_smolagents_tool_calling_agent_runs_on_its_defaults(chat, serve):
    """Its default ``tool_choice: "required"`` forces ``<tool_call>`` (context, not an action):
    the scripted policy sees its prompt end with it and continues the call."""
    def policy(context: str) -> str:
        assert context.endswith("<|im_start|>assistant\n<tool_call>")
        if "4711" in context:
            return '\n{"name": "final_answer", "arguments": {"answer": "4711"}}\n</tool_call>'
        return '\n{"name": "open_vault", "arguments": {"name": "amber"}}\n</tool_call>'

    # smolagents' system prompt is long, and this word-level tokenizer spells it out.
    proxy, server = serve(chat, policy, context_budget=16384)
    model = OpenAIServerModel(model_id="policy", api_base=session(server, "smol"), api_key="x")
    agent = ToolCallingAgent(tools=[open_vault], model=model, max_steps=4, verbosity_level=0)
    assert agent.run("Collect the code of vault amber.") == "4711"
    trajectory = proxy.finish("smol", 1.0)
    assert trajectory.metrics["turns"] == 2 and trajectory.metrics["calls"] == 2
    opener = chat.token_ids["<tool_call>"]
    for sub_trace in trajectory.sub_traces:  # smolagents rewrites its history: a new one a turn
        start = sub_trace.action_mask.index(1)
        assert sub_trace.ids[start - 1] == opener and sub_trace.action_mask[start - 1] == 0
        assert opener not in [i for i, m in zip(sub_trace.ids, sub_trace.action_mask) if m]


# -- a named tool_choice on Qwen3's tokenizer -----------------------------------------------------

WEATHER = [{"type": "function", "function": {
    "name": name, "description": "The weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("get_weather", "get_weather_hourly")]


@pytest.mark.parametrize("api", ["chat", "chat-stream", "responses"])
def test_a_named_tool_choice_forces_the_call_head_through_the_name(qwen3_tokenizer, serve, api):
    """Qwen3's BPE splits a call's head off alike whatever its arguments, so the forced ids
    run through ``"arguments":`` (the name's closing quote included: ``get_weather`` cannot
    become ``get_weather_hourly``); they are context, the model continues after them, and the
    reply is the named call, with no head leaking as content."""
    chat_format = ChatFormat(qwen3_tokenizer)
    head = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments":'

    def policy(context: str) -> str:
        assert context.endswith(head), context[-80:]
        return ' {"city": "Paris"}}\n</tool_call>'

    proxy, server = serve(chat_format, policy)
    client = openai.OpenAI(base_url=session(server, "named"), api_key="x", max_retries=0)
    if api == "responses":
        response = client.responses.create(
            model="m", input=MESSAGES[1]["content"],
            tools=[{"type": "function", **t["function"]} for t in WEATHER],
            tool_choice={"type": "function", "name": "get_weather"})
        calls = [(i.name, i.arguments) for i in response.output if i.type == "function_call"]
        content = response.output_text
    else:
        request = dict(model="m", messages=MESSAGES, tools=WEATHER,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if api == "chat-stream":
            chunks = list(client.chat.completions.create(stream=True, **request))
            content = "".join(c.delta.content or "" for k in chunks for c in k.choices)
            calls = [(d.function.name, d.function.arguments) for k in chunks for c in k.choices
                     for d in c.delta.tool_calls or []]
        else:
            message = client.chat.completions.create(**request).choices[0].message
            content = message.content
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert calls == [("get_weather", '{"city": "Paris"}')] and not content
    [sub_trace] = proxy.finish("named", 1.0).sub_traces
    start = sub_trace.action_mask.index(1)
    assert chat_format.decode(sub_trace.ids[:start]).endswith(head)
    sampled = chat_format.decode(sub_trace.ids[start:])
    assert sampled == ' {"city": "Paris"}}\n</tool_call><|im_end|>\n'
