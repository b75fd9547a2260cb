"""The OpenAI proxy's cost: latency per request and requests/s through real HTTP (uvicorn on
127.0.0.1, the ``openai`` client), against calling the generator directly with the same
prompts, sampling and seeds.

Two generators: ``scripted`` (a fixed answer, no model: what remains is the proxy's own work —
HTTP, JSON, request checks, tokenizing the new messages, the session's bookkeeping) and
``torch`` (the tiny Qwen3 on the CPU, ``--max-tokens`` new tokens a request: the share of a
real turn the proxy adds). Sequential: one client, one turn after another in one session
(each request extends it). Concurrent: ``--clients`` threads, one session each, whose requests
the proxy batches; direct: the same turns as batched ``generate`` calls. ``proxy-stream``: the
same requests streamed (``stream=True``), with the time to the first event (sent once the first
token is sampled) and to the first content.

    python bench/bench_proxy.py --out bench/results/proxy.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch

import common  # bench/ is the script's folder: first on sys.path

from agentrl_fast.harness import ChatFormat
from agentrl_fast.config import SamplingParams
from agentrl_fast.generators import ScriptedGenerator, TorchGenerator
from agentrl_fast.envs import VaultEnvironment, build_tokenizer
from agentrl_fast.proxy import Proxy, ProxyServer
from agentrl_fast.models.tiny import tiny_qwen3

TOOLS = [{"type": "function", "function": {
    "name": "open_vault", "description": "Open a vault and read its code.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}]


def conversation(task: str) -> list[dict]:
    return [{"role": "system", "content": "You open vaults to collect their codes."},
            {"role": "user", "content": task}]


def streamed_reply(client: openai.OpenAI, request: dict, start: float
                   ) -> tuple[dict, float, float]:
    """``(message, seconds to the first event, to the first content)`` of a streamed request
    (the first content's time is the whole request's when no content came early)."""
    content, calls, first_event, first_content = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, **request):
        first_event = first_event or time.perf_counter() - start
        for choice in chunk.choices:
            if choice.delta.content:
                first_content = first_content or time.perf_counter() - start
                content += choice.delta.content
            for call in choice.delta.tool_calls or []:
                calls[call.index] = call.model_dump(exclude_none=True, exclude={"index"})
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message, first_event, first_content or time.perf_counter() - start


def session_turns(client: openai.OpenAI, task: str, turns: int, max_tokens: int,
                  stream: bool = False) -> list[tuple[float, ...]]:
    """``(seconds, and when streamed: to the first event, to the first content)`` of each
    request of one session (each extends the last)."""
    messages, times = conversation(task), []
    for turn in range(turns):
        request = dict(model="p", messages=messages, tools=TOOLS, max_tokens=max_tokens,
                       seed=turn)
        start = time.perf_counter()
        if stream:
            message, *firsts = streamed_reply(client, request, start)
        else:
            reply = client.chat.completions.create(**request)
            message, firsts = reply.choices[0].message.model_dump(exclude_none=True), []
        times.append((time.perf_counter() - start, *firsts))
        messages.append(message)
        messages.append({"role": "user", "content": f"Go on ({turn})."})
    return times


def through_proxy(server: ProxyServer, tasks: list[str], turns: int, max_tokens: int,
                  stream: bool = False) -> list[tuple[float, ...]]:
    """Each session on a thread of its own; every request's seconds (:func:`session_turns`)."""
    def run(task: str) -> list[tuple[float, ...]]:
        session = server.proxy.create_session()
        client = openai.OpenAI(base_url=server.base_url(session), api_key="-", max_retries=0)
        try:
            return session_turns(client, task, turns, max_tokens, stream)
        finally:
            server.proxy.finish(session)
    with ThreadPoolExecutor(len(tasks)) as pool:
        return [t for times in pool.map(run, tasks) for t in times]


def direct(generator, chat: ChatFormat, tasks: list[str], turns: int, max_tokens: int
           ) -> list[tuple[float]]:
    """The same turns as batched generate calls (all sessions' turn k in one call), the
    prompts grown by the same messages; each call's seconds, once per request in it."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_tokens,
                              stop_ids=chat.stop_ids)
    prompts = [chat.render_ids(conversation(t), TOOLS, add_generation_prompt=True) for t in tasks]
    times = []
    for turn in range(turns):
        start = time.perf_counter()
        out = generator.generate(prompts, sampling, [turn] * len(prompts))
        times += [(time.perf_counter() - start,)] * len(prompts)
        prompts = [p + g.ids + chat.turn_end_ids(g.ids) + chat.user_ids(f"Go on ({turn}).")
                   + chat.generation_prompt_ids() for p, g in zip(prompts, out)]
    return times


def summary(times: list[tuple[float, ...]], wall: float) -> dict:
    ordered = sorted(t[0] for t in times)
    row = {"requests": len(times), "p50_ms": 1000 * statistics.median(ordered),
           "p95_ms": 1000 * ordered[int(0.95 * (len(ordered) - 1))],
           "requests_per_s": len(times) / wall}
    if len(times[0]) == 3:
        row["first_event_p50_ms"] = 1000 * statistics.median(t[1] for t in times)
        row["first_content_p50_ms"] = 1000 * statistics.median(t[2] for t in times)
    return row


def measure(name: str, generator, chat: ChatFormat, args) -> list[dict]:
    rows = []
    tasks = [f"Collect the codes of vaults amber, birch ({k})." for k in range(args.clients)]
    proxy = Proxy(generator, chat, SamplingParams(temperature=1.0, max_new_tokens=args.max_tokens),
                  context_budget=4096, batch_window=args.batch_window)
    with ProxyServer(proxy) as server:
        through_proxy(server, tasks[:1], 2, args.max_tokens)  # warm-up
        for clients in (1, args.clients):
            for how in ("direct", "proxy", "proxy-stream"):
                start = time.perf_counter()
                if how != "direct":
                    times = through_proxy(server, tasks[:clients], args.turns, args.max_tokens,
                                          stream=how == "proxy-stream")
                else:
                    times = direct(generator, chat, tasks[:clients], args.turns, args.max_tokens)
                rows.append({"generator": name, "clients": clients, "path": how,
                             **summary(times, time.perf_counter() - start)})
                print(json.dumps(rows[-1]), flush=True)
    proxy.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| generator | clients | path | requests | p50 ms | p95 ms | requests/s | "
             "first event p50 ms | first content p50 ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        firsts = " | ".join(f"{r[k]:.2f}" if k in r else "" for k in
                            ("first_event_p50_ms", "first_content_p50_ms"))
        lines.append(f"| {r['generator']} | {r['clients']} | {r['path']} | {r['requests']} | "
                     f"{r['p50_ms']:.2f} | {r['p95_ms']:.2f} | {r['requests_per_s']:.1f} | "
                     f"{firsts} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=8, help="requests per session")
    parser.add_argument("--clients", type=int, default=8, help="concurrent sessions")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch-window", type=float, default=0.005)
    parser.add_argument("--out", default=None, help="write the table (markdown) here")
    args = parser.parse_args()
    torch.manual_seed(0)
    env = VaultEnvironment()
    chat = ChatFormat(build_tokenizer(env.corpus(), words=env.words()))
    model = tiny_qwen3(len(chat.tokenizer), seed=0).eval()
    rows = measure("scripted", ScriptedGenerator(lambda context: "Done.", chat), chat, args)
    rows += measure("torch", TorchGenerator(model, pad_id=0), chat, args)
    text = table(rows)
    print(text)
    if args.out:
        common.write_record(
            args.out, f"# OpenAI proxy overhead\n\nCommand: `python bench/bench_proxy.py --out "
            f"{args.out}` (turns {args.turns}, max_tokens {args.max_tokens}, batch window "
            f"{args.batch_window * 1000:g} ms, torch threads {torch.get_num_threads()})"
            f"\n\n{text}\n")


if __name__ == "__main__":
    main()
