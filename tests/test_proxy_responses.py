"""The proxy's Responses API (``/s/{session}/v1/responses``) over real HTTP: the ``openai``
client's ``responses.create`` (plain and streamed) extends a session token for token when the
harness sends its input back with the output items and the tool outputs, what the proxy cannot
serve is refused naming the parameter, and the OpenAI Agents SDK runs an agent with a function
tool unchanged, on its default Responses model and on its chat-completions model. A scripted
text policy runs through the real ChatFormat and tokenizer."""

import asyncio
import copy

import agents  # the OpenAI Agents SDK (the test extra)
import httpx
import openai
import pytest

from agentrl_fast.harness import ChatFormat
from agentrl_fast.config import SamplingParams
from agentrl_fast.generators import ScriptedGenerator
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.proxy import Proxy, ProxyServer

CALL = '<tool_call>\n{"name": "open_vault", "arguments": {"name": "amber"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "open_vault", "description": "Open a vault.",
          "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                         "required": ["name"]}}]
INSTRUCTIONS = "You open vaults."
TASK = "Collect the code of vault amber."


@pytest.fixture(scope="module")
def chat():
    env = VaultEnvironment()
    return ChatFormat(build_tokenizer(env.corpus(), words=env.words()))


@pytest.fixture
def serve(chat):
    """``serve(*outputs) -> (proxy, server)``: a proxy over a scripted policy answering with
    ``outputs`` in turn; stopped after the test."""
    running = []

    def start(*outputs):
        queue = list(outputs)
        proxy = Proxy(ScriptedGenerator(lambda context: queue.pop(0), chat), chat,
                      SamplingParams(temperature=1.0, max_new_tokens=64), batch_window=0.0)
        running.append((proxy, ProxyServer(proxy).start()))
        return running[-1]
    yield start
    for proxy, server in running:
        server.stop()
        proxy.close()


def session(server, name) -> str:
    httpx.post(f"{server.url}/sessions", json={"session_id": name}).raise_for_status()
    return server.base_url(name)


def finish(server, name) -> dict:
    return httpx.post(f"{server.url}/sessions/{name}/finish", json={"reward": 1}).json()


def streamed_response(client, **request):
    """``(event types, text deltas, the final response)`` of a streamed request."""
    types, deltas, final = [], [], None
    for event in client.responses.create(stream=True, **request):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return types, deltas, final


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_on_the_responses_api_extends_its_session(serve, stream):
    proxy, server = serve("Opening it. " + CALL, "The code is 4711.")
    client = openai.OpenAI(base_url=session(server, "loop"), api_key="-", max_retries=0)
    items = [{"role": "user", "content": TASK}]
    request = dict(model="m", instructions=INSTRUCTIONS, tools=TOOLS, store=False)
    for turn in range(2):
        if stream:
            types, deltas, response = streamed_response(client, input=items, **request)
            assert types[0] == "response.created" and types[-1] == "response.completed"
            assert "".join(deltas) == response.output_text
        else:
            response = client.responses.create(input=items, **request)
        assert response.status == "completed"
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if turn == 0:
            assert response.output_text == "Opening it."
            assert [(c.name, c.arguments) for c in calls] == [("open_vault", '{"name": "amber"}')]
            items.append({"type": "function_call_output", "call_id": calls[0].call_id,
                          "output": "4711"})
        else:
            assert response.output_text == "The code is 4711." and calls == []
    assert response.usage.output_tokens > 0
    done = finish(server, "loop")
    assert done["turns"] == 2 and done["sub_traces"] == 1  # the second turn extended the first
    assert proxy.finished.get(timeout=1).reward == 1


def test_a_reply_cut_by_max_output_tokens_is_incomplete(serve):
    _, server = serve("A long answer that will not fit in four tokens.")
    client = openai.OpenAI(base_url=session(server, "cut"), api_key="-", max_retries=0)
    response = client.responses.create(model="m", input=TASK, max_output_tokens=4)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_a_response_of_the_session(serve, stream):
    """Only the new items each turn: the response it continues comes before them (its reply
    included) and the session is extended as if the whole input had been sent. An unknown id,
    or one of another session, is a 404 naming the parameter."""
    proxy, server = serve("Opening it. " + CALL, "The code is 4711.", "Other.")
    client = openai.OpenAI(base_url=session(server, "chain"), api_key="-", max_retries=0)
    create = ((lambda **r: streamed_response(client, **r)[2]) if stream
              else client.responses.create)
    first = create(model="m", instructions=INSTRUCTIONS, tools=TOOLS, input=TASK)
    [call] = [item for item in first.output if item.type == "function_call"]
    second = create(model="m", instructions=INSTRUCTIONS, tools=TOOLS, previous_response_id=first.id,
                    input=[{"type": "function_call_output", "call_id": call.call_id,
                            "output": "4711"}])
    assert second.output_text == "The code is 4711." and second.previous_response_id == first.id
    other = openai.OpenAI(base_url=session(server, "other"), api_key="-", max_retries=0)
    unstored = client.responses.create(model="m", input="Again.", store=False)
    for client_, previous in ((client, "resp_unknown"), (other, first.id), (client, unstored.id)):
        with pytest.raises(openai.NotFoundError) as missing:
            client_.responses.create(model="m", input="Go on.", previous_response_id=previous)
        assert missing.value.body["param"] == "previous_response_id"
    done = finish(server, "chain")
    assert done["turns"] == 3 and done["sub_traces"] == 2  # the third restarted: "Again."
    assert "chain" not in proxy.responses._sessions  # forgotten with the session


def test_an_empty_reply_is_an_empty_message_the_harness_sends_back(serve):
    _, server = serve("", "Done.")
    client = openai.OpenAI(base_url=session(server, "empty"), api_key="-", max_retries=0)
    items = [{"role": "user", "content": TASK}]
    first = client.responses.create(model="m", input=items)
    assert [item.type for item in first.output] == ["message"] and first.output_text == ""
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"role": "user", "content": "Well?"})
    assert client.responses.create(model="m", input=items).output_text == "Done."
    done = finish(server, "empty")
    assert done["turns"] == 2 and done["sub_traces"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_include_output_text_logprobs_returns_every_sampled_token(serve, stream):
    """Each sampled token of the turn (the tool call's and the stop token's too) with its
    log-prob (the scripted policy's are 0) and bytes that join to the turn's text."""
    _, server = serve("Opening. " + CALL)
    client = openai.OpenAI(base_url=session(server, "logprobs"), api_key="-", max_retries=0)
    request = dict(model="m", input=TASK, tools=TOOLS, include=["message.output_text.logprobs"])
    response = (streamed_response(client, **request)[2] if stream
                else client.responses.create(**request))
    [message] = [item for item in response.output if item.type == "message"]
    tokens = message.content[0].logprobs
    assert len(tokens) == response.usage.output_tokens
    assert all(t.logprob == 0.0 for t in tokens)
    text = b"".join(bytes(t.bytes) for t in tokens).decode()
    assert text.startswith("Opening. <tool_call>") and text.endswith("</tool_call>")


@pytest.mark.parametrize("field, value, param", [
    ("conversation", "conv_1", "conversation"),
    ("tools", [{"type": "web_search"}], "tools[0]"),
    ("input", [{"type": "reasoning", "summary": []}], "input[0]"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content[0]"),
    ("reasoning", {"effort": "high"}, "reasoning"),
    ("text", {"format": {"type": "json_object"}}, "text.format"),
    ("temperature", 0.2, "temperature"),
    ("tool_choice", {"type": "function", "name": "fly"}, "tool_choice"),
    ("tool_choice", {"type": "allowed_tools", "tools": []}, "tool_choice"),
    ("input", [], "input"),
    ("frobnicate", 1, "frobnicate"),
    ("max_output_tokens", 0, "max_output_tokens"),
    ("input", [{"role": "tool", "content": "x"}], "input[0].role"),
    ("input", [{"type": "function_call", "call_id": 7, "name": "f", "arguments": "{}"}],
     "input[0].call_id"),
    ("input", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
     "input[1]"),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f",
                "arguments": "[" * 5000 + "]" * 5000},
               {"type": "function_call_output", "call_id": "c", "output": "x"}],
     "messages[0].tool_calls[0].function.arguments"),
    ("top_logprobs", 3, "top_logprobs"),
])
def test_what_the_proxy_cannot_serve_is_refused_naming_the_parameter(serve, field, value, param):
    _, server = serve("Fine.")
    client = openai.OpenAI(base_url=session(server, "refused"), api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input=TASK, extra_body={field: value})
    assert refused.value.body["param"] == param, refused.value.body
    assert client.responses.create(model="m", input=TASK).output_text == "Fine."  # still up


# -- the OpenAI Agents SDK, unchanged ---------------------------------------------------------------

@pytest.mark.parametrize("api", ["responses", "chat_completions", "responses_streamed",
                                 "responses_chained"])
def test_an_openai_agents_sdk_agent_runs_and_is_recorded(serve, api):
    agents.set_tracing_disabled(True)  # nothing leaves this machine
    proxy, server = serve("Let me open it. " + CALL, "The code of amber is 4711.")
    opened = []

    @agents.function_tool
    def open_vault(name: str) -> str:
        """Open a vault and read its code.

        Args:
            name: The vault.
        """
        opened.append(name)
        return "4711"

    client = openai.AsyncOpenAI(base_url=session(server, api), api_key="-", max_retries=0)
    model = (agents.OpenAIChatCompletionsModel if api == "chat_completions"
             else agents.OpenAIResponsesModel)(model="policy", openai_client=client)
    agent = agents.Agent(name="vaults", instructions=INSTRUCTIONS, tools=[open_vault],
                         model=model)

    async def run():
        if api == "responses_streamed":
            result = agents.Runner.run_streamed(agent, TASK)
            async for _ in result.stream_events():
                pass
            return result
        return await agents.Runner.run(agent, TASK,
                                       auto_previous_response_id=api == "responses_chained")
    result = asyncio.run(run())
    assert result.final_output == "The code of amber is 4711."
    assert opened == ["amber"]
    done = finish(server, api)
    assert done["turns"] == 2 and done["sub_traces"] == 1, done


def test_hostile_responses_requests_get_well_formed_errors(serve):
    """150 mutations of a valid body (each field, and each input item's fields, set to values
    of every JSON type): each is answered (a 4xx with an OpenAI error body naming a parameter,
    or a 200 from the script), never a 5xx, and the server stays up."""
    import random

    _, server = serve(*["Fine."] * 200)
    url = session(server, "hostile") + "/responses"
    values = [None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"type": "x"}, [{"type": None}],
              [{"role": "user"}], [{"type": "function_call"}], [{"type": "message", "role": 7}]]
    valid = {"model": "m", "input": [{"role": "user", "content": TASK}], "tools": TOOLS,
             "instructions": INSTRUCTIONS, "max_output_tokens": 8}
    rng = random.Random()
    for _ in range(150):
        body = {**valid, "input": [dict(valid["input"][0])]}
        for _ in range(rng.randint(1, 3)):
            value = copy.deepcopy(rng.choice(values))  # never shared: no cycles, no leaks
            if rng.random() < 0.5:
                body[rng.choice([*valid, "stream", "tool_choice", "text", "include"])] = value
            elif (isinstance(body.get("input"), list) and body["input"]
                  and isinstance(body["input"][0], dict)):
                body["input"][0][rng.choice(["role", "content", "type", "call_id", "output",
                                             "name", "arguments"])] = value
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code in (200, 400), (body, reply.text)
        if reply.status_code != 200:
            error = reply.json()["error"]
            assert error["message"] and error["type"], (body, reply.text)
    assert httpx.post(url, json=valid).status_code == 200
