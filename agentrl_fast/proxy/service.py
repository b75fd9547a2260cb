"""The proxy's service: :class:`Proxy` keeps token-exact sessions in front of any
:class:`~agentrl_fast.generators.base.Generator` and batches their generations.

    proxy = proxy_for(trainer)                      # agentrl_fast.train.proxy_driver
    with ProxyServer(proxy) as server:              # uvicorn on 127.0.0.1, a free port
        session = proxy.create_session(task_id="t1")
        client = openai.OpenAI(base_url=server.base_url(session), api_key="-")
        ...                                          # the harness, as it is
        trajectory = proxy.finish(session, reward=1.0)
        trainer.train_on([trajectory, ...])

Endpoints (:mod:`agentrl_fast.proxy.app`): ``POST /s/{session}/v1/chat/completions``, ``POST
/s/{session}/v1/responses`` (:mod:`agentrl_fast.proxy.responses`) and ``POST
/s/{session}/v1/messages`` (Anthropic's, :mod:`agentrl_fast.proxy.messages`), whole or streamed
token by token (:mod:`agentrl_fast.proxy.stream`), ``GET /s/{session}/v1/models``, ``POST
/sessions``, ``POST /sessions/{id}/finish``. A session is one rollout: how requests extend it
or start a new sub-trace is :mod:`agentrl_fast.proxy.session`'s doc. Sampling stays the run's:
a request may restate ``temperature``/``top_p``, not change them; ``max_tokens`` is capped by
the run's ``max_new_tokens``; ``stop`` strings end a turn where they end on a token boundary;
a forced ``tool_choice`` puts the call's head in the prompt, ``"none"`` bans ``<tool_call>``
(``SamplingParams.banned_ids``, a sampling group of its own in a batch).

Batching: requests of different sessions go to one worker thread, which waits
``batch_window`` seconds after the first for more (up to ``max_batch``) and generates each
group of equal sampling parameters in one ``generate`` call; :meth:`Proxy.paused` holds it off
(the trainer's update runs between generations). Each generation records :attr:`Proxy.version`,
the policy version it sampled with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import queue
import re
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.harness.chat_format import ChatFormat
from agentrl_fast.harness.tool_calls import TOOL_CALL_OPEN
from agentrl_fast.generators.base import Generation, Generator
from agentrl_fast.proxy.responses import ResponseStore
from agentrl_fast.proxy.session import (ChatRequest, Plan, ProxyError, Reply, Session, make_reply,
                                        parse_request)
from agentrl_fast.harness.trajectory import Trajectory
from agentrl_fast.seeds import derive_seed

_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

__all__ = ["Proxy", "ProxyError"]


@dataclass
class _Pending:
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    future: concurrent.futures.Future
    on_tokens: Callable[[list[int]], None] | None = None


def _streams(generator: Generator) -> bool:
    """Whether ``generator.generate`` takes ``on_tokens`` (ids as they are sampled)."""
    try:
        return "on_tokens" in inspect.signature(generator.generate).parameters
    except (TypeError, ValueError):
        return False


def _tell(listeners: list, index: int, ids: Sequence[int]) -> None:
    """A generator's ``on_tokens(index, ids)``, routed to the listener of prompt ``index``."""
    if listeners[index] is not None:
        listeners[index](list(ids))


class _Batcher:
    """One worker thread: collects requests for ``window`` seconds after the first (at most
    ``max_batch``, and no longer once every open session has one waiting: a session has one
    request in flight at most), then one ``generate`` per group of equal sampling parameters,
    under ``gate``. Results are ``(Generation, version)``. A request's ``on_tokens`` hears its
    ids as they are sampled when the generator streams (:func:`_streams`), else not at all."""

    def __init__(self, generator: Generator, window: float, max_batch: int,
                 version: Callable[[], int], open_sessions: Callable[[], int]):
        self.generator, self.window, self.max_batch, self.version = (generator, window,
                                                                      max_batch, version)
        self.open_sessions = open_sessions
        self.streams = _streams(generator)
        self.gate = threading.Lock()
        self.batch_sizes: Counter = Counter()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="proxy-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], sampling: SamplingParams, seed: int,
               on_tokens: Callable[[list[int]], None] | None = None
               ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Pending(prompt, sampling, seed, future, on_tokens))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, deadline, closing = [first], time.monotonic() + self.window, False
            while len(batch) < min(self.max_batch, self.open_sessions()):
                try:
                    item = self._queue.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            self._run([p for p in batch if p.future.set_running_or_notify_cancel()])
            if closing:
                return

    def _run(self, batch: list[_Pending]) -> None:
        groups: dict[SamplingParams, list[_Pending]] = {}
        for pending in batch:
            groups.setdefault(pending.sampling, []).append(pending)
        for sampling, group in groups.items():
            listeners = [p.on_tokens for p in group]
            streaming = {}
            if self.streams and any(listeners):
                streaming["on_tokens"] = functools.partial(_tell, listeners)
            try:
                with self.gate:
                    version = self.version()
                    out = self.generator.generate([p.prompt for p in group], sampling,
                                                  [p.seed for p in group], **streaming)
                if len(out) != len(group):
                    raise RuntimeError(f"the generator returned {len(out)} generations for "
                                       f"{len(group)} prompts")
            except BaseException as error:  # noqa: BLE001 - every waiter hears of it
                for pending in group:
                    pending.future.set_exception(error)
                continue
            self.batch_sizes[len(group)] += 1
            for pending, generation in zip(group, out):
                pending.future.set_result((generation, version))


class Proxy:
    """Sessions in front of ``generator`` (see the module doc).

    ``sampling``: the run's sampling (its ``stop_ids`` are replaced by ``chat_format``'s);
    ``context_budget``: the most tokens a sub-trace may reach (its prompt, ``max_tokens`` and
    the turn's end); ``max_total_tokens``: the most a session may hold over all its
    sub-traces; ``batch_window`` (seconds) and ``max_batch`` (default the generator's
    ``max_batch_size``, else 64): the batching; ``version``: the policy version now.
    """

    def __init__(self, generator: Generator, chat_format: ChatFormat, sampling: SamplingParams,
                 *, context_budget: int = 2048, max_total_tokens: int | None = None,
                 batch_window: float = 0.005, max_batch: int | None = None,
                 model_name: str = "agentrl-policy", seed: int = 0, version: int = 0):
        if not callable(getattr(generator, "generate", None)):
            raise TypeError(f"Proxy: generator must have generate(prompts, sampling, seeds), got "
                            f"{type(generator).__name__}")
        if not isinstance(chat_format, ChatFormat):
            raise TypeError(f"Proxy: chat_format must be a ChatFormat, got "
                            f"{type(chat_format).__name__}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"Proxy: sampling must be a SamplingParams, got "
                            f"{type(sampling).__name__}")
        if not isinstance(context_budget, int) or context_budget <= sampling.max_new_tokens:
            raise ValueError(f"Proxy: context_budget must be an int above sampling.max_new_tokens "
                             f"({sampling.max_new_tokens}), got {context_budget!r}")
        if not (isinstance(batch_window, (int, float)) and 0 <= batch_window <= 1):
            raise ValueError(f"Proxy: batch_window must be in [0, 1] seconds, got {batch_window!r}")
        max_batch = max_batch or getattr(generator, "max_batch_size", None) or 64
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"Proxy: max_batch must be an int >= 1, got {max_batch!r}")
        self.generator, self.chat_format, self.model_name = generator, chat_format, model_name
        self.sampling = dataclasses.replace(sampling, stop_ids=chat_format.stop_ids)
        self.context_budget, self.max_total_tokens = context_budget, max_total_tokens
        self.seed, self.version = seed, version
        self._turn_end_room = max(len(chat_format.turn_end_ids([chat_format.im_end_id])),
                                  len(chat_format.turn_end_ids([])))
        self._sessions: dict[str, Session] = {}
        self.responses = ResponseStore()  # previous_response_id's conversations (/responses)
        self._closed: set[str] = set()
        self._lock = threading.Lock()
        self.finished: queue.Queue[Trajectory] = queue.Queue()  # sessions finished over HTTP
        self._batcher = _Batcher(generator, batch_window, max_batch, lambda: self.version,
                                 lambda: len(self._sessions))

    # -- sessions ---------------------------------------------------------------------------------

    def create_session(self, task_id: str | None = None, sample_index: int = 0,
                       session_id: str | None = None) -> str:
        """A new session (one rollout, ``rollout_id`` ``"proxy/<id>"``); returns its id."""
        if session_id is not None and not (isinstance(session_id, str)
                                           and _SESSION_ID.fullmatch(session_id)):
            raise ProxyError(400, "session_id must be 1 to 64 letters, digits, '_' or '-'",
                             "session_id")
        if task_id is not None and not isinstance(task_id, str):
            raise ProxyError(400, f"task_id must be a string, got {type(task_id).__name__}",
                             "task_id")
        if isinstance(sample_index, bool) or not isinstance(sample_index, int):
            raise ProxyError(400, "sample_index must be an integer", "sample_index")
        session_id = session_id or secrets.token_hex(8)
        with self._lock:
            if session_id in self._sessions or session_id in self._closed:
                raise ProxyError(409, f"session {session_id} exists", "session_id",
                                 "session_exists")
            trajectory = Trajectory(f"proxy/{session_id}", task_id=task_id,
                                    sample_index=sample_index)
            self._sessions[session_id] = Session(session_id, trajectory,
                                                 derive_seed(self.seed, "proxy", session_id))
        return session_id

    def session(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                if session_id in self._closed:
                    raise ProxyError(409, f"session {session_id} is finished", None,
                                     "session_finished")
                raise ProxyError(404, f"no session {session_id!r}; create one with POST /sessions",
                                 None, "session_not_found")
            return session

    def finish(self, session_id: str, reward: float = 0.0,
               turn_rewards: Sequence[float] | None = None, truncated: bool = False) -> Trajectory:
        """End a session with its ``reward`` (``turn_rewards``: one per completion, optional);
        returns its :class:`Trajectory` (``error`` set when it made no completion: not trained
        on). See :meth:`Session.finish`."""
        session = self.session(session_id)
        with session.lock:
            if session.busy:
                raise ProxyError(409, f"session {session_id} has a request in flight; finish it "
                                 "after the reply", None, "session_busy")
            trajectory = session.finish(reward, turn_rewards, truncated)
            session.finished = True
        with self._lock:
            del self._sessions[session_id]
            self._closed.add(session_id)
        self.responses.forget(session_id)
        return trajectory

    def take_finished(self, count: int, timeout: float | None = None) -> list[Trajectory]:
        """The next ``count`` trajectories of sessions finished over HTTP (waits up to
        ``timeout`` seconds for each; fewer come back when it runs out)."""
        out = []
        with contextlib.suppress(queue.Empty):
            while len(out) < count:
                out.append(self.finished.get(timeout=timeout))
        return out

    # -- completions ------------------------------------------------------------------------------

    def _acquire(self, session_id: str) -> Session:
        session = self.session(session_id)
        with session.lock:
            if session.finished:
                raise ProxyError(409, f"session {session_id} is finished", None,
                                 "session_finished")
            if session.busy:
                raise ProxyError(409, f"session {session_id} already has a request in flight; "
                                 "a session is one conversation: wait for its reply",
                                 None, "session_busy")
            session.busy = True
        return session

    def _check_budget(self, session: Session, plan: Plan, request: ChatRequest) -> None:
        need = len(plan.prompt) + request.max_tokens + self._turn_end_room
        if need > self.context_budget:
            raise ProxyError(400, f"the messages take {len(plan.prompt)} tokens; with max_tokens "
                             f"{request.max_tokens} the turn needs {need}, over the context "
                             f"budget of {self.context_budget}: shorten or compact the history",
                             "messages", "context_length_exceeded")
        if self.max_total_tokens is not None:
            total = (session.trajectory.num_tokens + len(plan.context) + request.max_tokens
                     + self._turn_end_room)
            if total > self.max_total_tokens:
                raise ProxyError(400, f"the session would hold {total} tokens, over its limit of "
                                 f"{self.max_total_tokens}: finish it", "messages",
                                 "session_token_limit")

    def _sampling(self, request: ChatRequest) -> SamplingParams:
        """The run's sampling with the request's ``max_tokens``; a one-token stop string also
        stops the generator (longer ones are cut afterwards, :func:`make_reply`);
        ``tool_choice: "none"`` bans ``<tool_call>`` (its own sampling group in a batch)."""
        extra = []
        for text in request.stop:
            ids = self.chat_format.encode(text)
            if len(ids) == 1 and ids[0] not in self.sampling.stop_ids + tuple(extra):
                extra.append(ids[0])
        banned = self.sampling.banned_ids
        if request.tool_choice == "none":
            banned += (self.chat_format.token_ids[TOOL_CALL_OPEN],)
        return dataclasses.replace(self.sampling, max_new_tokens=request.max_tokens,
                                   stop_ids=self.sampling.stop_ids + tuple(extra),
                                   banned_ids=banned)

    async def complete(self, session_id: str, body: Any,
                       on_tokens: Callable[[list[int]], None] | None = None
                       ) -> tuple[ChatRequest, Reply, dict]:
        """One ``/chat/completions`` request (its JSON ``body``, or the :class:`ChatRequest`
        parsed from it): ``(request, reply, usage)``; raises :class:`ProxyError` for what the
        client must fix. ``on_tokens`` (called from the generating thread) hears the sampled
        ids as they come when the generator streams."""
        request = body if isinstance(body, ChatRequest) else parse_request(body, self.sampling)
        session = self._acquire(session_id)
        try:
            try:
                plan = session.plan(request, self.chat_format)
            except (TypeError, ValueError) as error:  # the template's own checks
                raise ProxyError(400, str(error), "messages") from None
            self._check_budget(session, plan, request)
            seed = request.seed if request.seed is not None else session.turn_seed()
            future = self._batcher.submit(plan.prompt, self._sampling(request), seed, on_tokens)
            generation, version = await asyncio.wrap_future(future)
            if generation.finish_reason == "error":
                raise ProxyError(502, f"the inference backend failed: {generation.error}", None,
                                 "generator_error")
            reply = make_reply(self.chat_format, generation.ids, generation.logprobs,
                               generation.finish_reason, request, session.call_id, plan.forced)
            with session.lock:
                session.commit(plan, request, reply, self.chat_format, version)
        finally:
            with session.lock:
                session.busy = False
        usage = {"prompt_tokens": len(plan.prompt), "completion_tokens": len(reply.ids),
                 "total_tokens": len(plan.prompt) + len(reply.ids)}
        return request, reply, usage

    def generate_direct(self, prompts: list[list[int]], seeds: Sequence[int]) -> list[Generation]:
        """The generator called as the proxy calls it, without sessions or HTTP (benchmarks)."""
        with self._batcher.gate:
            return self.generator.generate(prompts, self.sampling, list(seeds))

    # -- weights ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def paused(self):
        """No generation runs inside (requests wait): for the trainer's update."""
        with self._batcher.gate:
            yield

    def update_weights(self, model, version: int | None = None) -> None:
        """Serve ``model``'s weights from the next generation on, as policy ``version``
        (default: one more)."""
        with self._batcher.gate:
            self.generator.update_weights(model)
            self.version = self.version + 1 if version is None else int(version)

    @property
    def batch_sizes(self) -> Counter:
        """How many ``generate`` calls had each batch size (requests per call)."""
        return self._batcher.batch_sizes

    def close(self) -> None:
        self._batcher.close()
