"""Rollouts on vLLM: :class:`VLLMGenerator`, the :class:`~agentrl_fast.generators.base.
Generator` protocol against running vLLM OpenAI-compatible servers.

Token in, token out: prompts go to ``/v1/completions`` as token ids and the sampled ids come
back as ids (``return_token_ids``), never re-tokenized; only our stop ids end a sequence
(``ignore_eos``), and the stop id is kept with its log-prob. Log-probs follow the project's
convention, ``log_softmax(logits / T)`` of the sampled token: the server must run with
``--logprobs-mode processed_logprobs`` (checked at connect), which is that exactly when top-k and
top-p are off, so a sampling with them on is refused. ``banned_ids`` go as a ``logit_bias`` of
-100 (applied before those log-probs).

Many requests are in flight at once (async HTTP on one event loop thread, at most
``max_concurrency``), each sent to the server with the fewest outstanding requests. A request
that times out is retried ``retries`` times, then its sequence fails (``finish_reason "error"``:
the rollout engine ends that episode and the trainer leaves it out). A server that stops
answering (connection refused, or its :class:`~agentrl_fast.generators.vllm_server.VLLMServer`
exited) raises :class:`~agentrl_fast.generators.vllm_server.ServerError`. With ``on_tokens`` (the
proxy streaming a reply) requests stream as server-sent events, each event's ids told as it
comes; such a request is retried only if it timed out before its first ids.

Weights (:meth:`VLLMGenerator.update_weights`): the model's state dict is written as safetensors
into a new folder of ``weights_dir`` (default shared memory, ``/dev/shm``; a folder on shared
storage for servers on other machines) and every server reloads it in place through the dev-mode
``/collective_rpc`` (the worker's ``reload_weights``), then drops its prefix cache. A folder is
named only once whole (:func:`_write_update`), so no server reads a partial update.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from agentrl_fast.config.sampling import SamplingParams
from agentrl_fast.generators.base import Generation
from agentrl_fast.models.wrappers import unwrap
from agentrl_fast.generators.vllm_server import ServerError, VLLMServer, log_tail


_CONNECTION_TRIES = 3  # of a request whose connection failed (not timed out)


class _Endpoint:
    def __init__(self, base_url: str, server: VLLMServer | None):
        self.base_url = base_url.rstrip("/")
        self.server = server
        self.outstanding = 0  # requests in flight
        self.requests = 0  # sent, over the generator's life

    def exited(self) -> bool:
        return (self.server is not None and self.server.process is not None
                and self.server.process.poll() is not None)

    def dead_error(self, detail: str) -> ServerError:
        if self.server is not None and self.server.process is not None:
            try:  # a dying process closes its sockets before it can be reaped: wait a moment
                code = self.server.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                return ServerError(f"{self.server.name} exited with code {code} ({detail}); "
                                   f"log tail:\n{log_tail(self.server.log_path)}")
        return ServerError(f"vLLM server {self.base_url} stopped answering: {detail}")


async def _reconnecting(endpoint: _Endpoint, call: Callable[[], Awaitable[Any]],
                        again: Callable[[], bool] = lambda: True) -> Any:
    """``await call()``, tried again when its connection failed (a kept-alive connection the
    server closed as it was reused fails once) while ``again()``; a server that keeps failing,
    or exited, is gone (:class:`ServerError`). Timeouts are the caller's to retry or not."""
    import httpx

    for attempt in range(_CONNECTION_TRIES):
        try:
            return await call()
        except httpx.TimeoutException:  # a TransportError too
            raise
        except httpx.TransportError as error:
            if not again() or endpoint.exited() or attempt == _CONNECTION_TRIES - 1:
                raise endpoint.dead_error(f"{type(error).__name__}: {error}") from None
            await asyncio.sleep(0.25 * (attempt + 1))
    raise AssertionError("unreachable")


def _refusal(endpoint: _Endpoint, request: str, response) -> Exception:
    """The error for an HTTP error ``response``: a 4xx is the request's fault (ValueError), a
    5xx the server's (:class:`ServerError`)."""
    detail = response.text[:500]
    if response.status_code < 500:
        return ValueError(f"vLLM server {endpoint.base_url} refused {request} "
                          f"({response.status_code}): {detail}")
    return endpoint.dead_error(f"{request} answered {response.status_code}: {detail}")


WEIGHTS_PREFIX = "agentrl_fast-weights-"  # + pid: a weight update's folder in weights_dir


def default_weights_dir() -> Path:
    """Where weight updates go without ``weights_dir``: ``/dev/shm`` when writable, else the
    temporary folder (servers on this machine only)."""
    shm = "/dev/shm"
    return Path(shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir())


def checked_weights_dir(folder: str | os.PathLike | None) -> Path:
    """``folder`` (``generator.weights_dir``) as an absolute path, checked to be an existing
    folder this process can write in (by making one there); ``None``: :func:`default_weights_dir`.
    The path is kept as given, not resolved: the servers must see it at the same path."""
    if folder is None:
        return default_weights_dir()
    path = Path(os.path.abspath(os.path.expanduser(os.fspath(folder))))
    if not path.is_dir():
        raise ValueError(f"generator.weights_dir: {os.fspath(folder)!r} is not an existing "
                         f"folder; create it on storage the trainer and every server see at the "
                         f"same path (or leave it unset for /dev/shm, servers on this machine)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{WEIGHTS_PREFIX}probe-", dir=path))
    except OSError as error:
        raise ValueError(f"generator.weights_dir: cannot write in {str(path)!r} ({error})"
                         ) from None
    return path


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries) to its storage."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    except OSError as error:  # some file systems cannot fsync a folder
        if not (path.is_dir() and error.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(handle)


def _write_update(state: dict, root: Path) -> Path:
    """``state`` as ``model.safetensors`` in a new folder of ``root``, named only once whole:
    written into a hidden ``.partial`` folder, the file and that folder fsynced, renamed (atomic
    within a file system, NFS's included) and ``root`` fsynced. A server given the returned path,
    on any host, reads the whole update; a crash mid-write leaves a ``.partial`` folder that no
    server was told of."""
    from safetensors.torch import save_file

    name = f"{WEIGHTS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    partial, final = root / f".{name}.partial", root / name
    os.mkdir(partial)  # the umask's mode (not mkdtemp's 0o700): servers may run as other users
    try:
        save_file(state, str(partial / "model.safetensors"))
        _fsync(partial / "model.safetensors")
        _fsync(partial)
        os.rename(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _fsync(root)
    return final


class VLLMGenerator:
    """Generation on vLLM servers at ``base_url`` (one URL, a list of them, or
    :class:`~agentrl_fast.generators.vllm_server.VLLMServer` objects, whose deaths are then
    reported with their logs). ``model``: the served model name (default the server's first);
    ``max_concurrency``: requests in flight over all servers; ``timeout``: seconds per request;
    ``retries``: more tries of a request that timed out; ``connect_timeout``: seconds to wait
    for the servers at construction; ``weights_dir``: the folder weight updates are written
    into and the servers read from (``generator.weights_dir``: shared storage seen at the same
    path by all servers; default ``/dev/shm``, servers on this machine), checked here."""

    def __init__(self, base_url: str | VLLMServer | Sequence[str | VLLMServer],
                 model: str | None = None, *, max_concurrency: int = 64, timeout: float = 120.0,
                 retries: int = 2, connect_timeout: float = 30.0,
                 weights_dir: str | os.PathLike | None = None):
        import httpx  # the optional "serve" extra

        targets = [base_url] if isinstance(base_url, str | VLLMServer) else list(base_url)
        if not targets:
            raise ValueError("base_url must name at least one server")
        self.endpoints = []
        for target in targets:
            if isinstance(target, VLLMServer):
                self.endpoints.append(_Endpoint(target.base_url, target))
            elif isinstance(target, str) and target.startswith(("http://", "https://")):
                self.endpoints.append(_Endpoint(target, None))
            else:
                raise ValueError(f"base_url: expected http(s) URLs or VLLMServer objects, got "
                                 f"{target!r}")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        self.max_concurrency, self.timeout, self.retries = max_concurrency, timeout, retries
        self.weights_dir = checked_weights_dir(weights_dir)
        self.stats = {"requests": 0, "retries": 0, "failed": 0, "weight_syncs": 0,
                      "weight_sync_seconds": 0.0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="agentrl_fast-vllm")
        self._thread.start()
        self._client = self._call(self._make_client(httpx))
        self._update_dir: Path | None = None  # the servers' current weights (kept until the next)
        try:
            self.model = model or self._call(self._connect(connect_timeout))
        except BaseException:
            self.close()
            raise

    # -- plumbing ---------------------------------------------------------------------------

    async def _make_client(self, httpx):
        limits = httpx.Limits(max_connections=self.max_concurrency,
                              max_keepalive_connections=self.max_concurrency)
        return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.timeout))

    def _call(self, coroutine):
        """Run ``coroutine`` on the generator's event loop thread; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if getattr(self, "_client", None) is not None:
            self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        if self._update_dir is not None:
            shutil.rmtree(self._update_dir, ignore_errors=True)

    def __enter__(self) -> "VLLMGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def _request(self, endpoint: _Endpoint, method: str, path: str,
                       body: Any = None, timeout: float | None = None):
        response = await _reconnecting(endpoint, lambda: self._client.request(
            method, endpoint.base_url + path, json=body, timeout=timeout or self.timeout))
        if response.status_code >= 400:
            raise _refusal(endpoint, f"{method} {path}", response)
        return response.json() if response.content else None

    async def _connect(self, deadline_seconds: float) -> str:
        """Wait for every server's ``/health``; check its log-probs mode; the model name."""
        names = []
        for endpoint in self.endpoints:
            deadline = time.monotonic() + deadline_seconds
            while True:
                try:
                    await self._request(endpoint, "GET", "/health", timeout=5)
                    break
                except ServerError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            info = await self._request(endpoint, "GET", "/server_info?config_format=json")
            mode = info["vllm_config"]["model_config"]["logprobs_mode"]
            if mode != "processed_logprobs":
                raise ValueError(f"vLLM server {endpoint.base_url} runs with --logprobs-mode "
                                 f"{mode}; rollouts need processed_logprobs (log_softmax(logits "
                                 f"/ T) of the sampled token)")
            models = await self._request(endpoint, "GET", "/v1/models")
            names.append(models["data"][0]["id"])
        if len(set(names)) > 1:
            raise ValueError(f"base_url: the servers serve different models: {names}")
        return names[0]

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 seeds: Sequence[int] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Generation]:
        """As the protocol says; with ``on_tokens`` the requests stream (server-sent events),
        and a request that timed out after some ids were told is not retried: it fails."""
        if sampling.top_k or sampling.top_p < 1.0:
            raise ValueError(f"sampling: top_k={sampling.top_k}, top_p={sampling.top_p} with the "
                             "vLLM backend: its log-probs would be renormalized over the kept "
                             "tokens, not log_softmax(logits / T); turn top-k/top-p off (top_k=0, "
                             "top_p=1.0)")
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be callable as on_tokens(prompt index, ids), got "
                            f"{type(on_tokens).__name__}")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds must have one seed per prompt ({len(prompts)}), got "
                             f"{len(seeds)}")
        if not prompts:
            return []
        return self._call(self._generate_all([list(map(int, p)) for p in prompts], sampling,
                                             seeds, on_tokens))

    async def _generate_all(self, prompts: list[list[int]], sampling: SamplingParams,
                            seeds, on_tokens) -> list[Generation]:
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(i: int) -> Generation:
            async with gate:
                return await self._generate_one(
                    prompts[i], sampling, None if seeds is None else int(seeds[i]),
                    None if on_tokens is None else functools.partial(on_tokens, i))
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _body(self, prompt: list[int], sampling: SamplingParams, seed: int | None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": 1.0, "top_k": -1, "n": 1,
                "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "stop_token_ids": list(sampling.stop_ids), "ignore_eos": True,
                "skip_special_tokens": False, "include_stop_str_in_output": True}
        if seed is not None:
            body["seed"] = seed % (1 << 63)
        if sampling.banned_ids:
            # vLLM's strongest bias (it clamps to +-100), added to the logits before the
            # processed log-probs: a banned id keeps under e^-100 of its odds, and the
            # recorded log-probs are the renormalized ones the ids were drawn from.
            body["logit_bias"] = {str(i): -100.0 for i in sampling.banned_ids}
        return body

    async def _generate_one(self, prompt: list[int], sampling: SamplingParams,
                            seed: int | None, on_ids: Callable[[list[int]], None] | None
                            ) -> Generation:
        import httpx

        body = self._body(prompt, sampling, seed)
        told: list[int] = []
        for attempt in range(self.retries + 1):
            endpoint = min(self.endpoints, key=lambda e: e.outstanding)
            endpoint.outstanding += 1
            endpoint.requests += 1
            self.stats["requests"] += 1
            try:
                if on_ids is None:
                    reply = await self._request(endpoint, "POST", "/v1/completions", body)
                else:
                    reply = await self._stream(endpoint, body, on_ids, told)
                return _generation(reply, stop_ids=set(sampling.stop_ids))
            except _StreamFailed as error:  # this sequence fails, the others go on
                self.stats["failed"] += 1
                return Generation([], [], "error", error=f"vLLM server {endpoint.base_url}: "
                                                         f"{error}")
            except httpx.TimeoutException as error:
                if attempt < self.retries and not told:
                    self.stats["retries"] += 1
                    continue
                self.stats["failed"] += 1
                return Generation([], [], "error", error=(
                    f"vLLM server {endpoint.base_url}: {type(error).__name__} after "
                    f"{self.retries + 1} tries of {self.timeout} s"))
            finally:
                endpoint.outstanding -= 1
        raise AssertionError("unreachable")

    async def _stream(self, endpoint: _Endpoint, body: dict,
                      on_ids: Callable[[list[int]], None], told: list[int]) -> dict:
        """``/v1/completions`` as server-sent events: each event's ids go to ``on_ids`` (and
        onto ``told``) as it arrives; returns the reply a plain request would have. A failed
        connection is tried again (as :meth:`_request` does) while nothing was told."""
        return await _reconnecting(endpoint,
                                   lambda: self._stream_once(endpoint, body, on_ids, told),
                                   again=lambda: not told)

    async def _stream_once(self, endpoint: _Endpoint, body: dict,
                           on_ids: Callable[[list[int]], None], told: list[int]) -> dict:
        ids, logprobs, finish = [], [], None
        async with self._client.stream("POST", endpoint.base_url + "/v1/completions",
                                       json={**body, "stream": True}) as response:
            if response.status_code >= 400:
                await response.aread()
                raise _refusal(endpoint, "POST /v1/completions", response)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    event = json.loads(line[len("data: "):])
                except ValueError:
                    raise _StreamFailed(f"an event that is not JSON: {line[:200]!r}") from None
                if "error" in event:
                    raise _StreamFailed(f"an error event mid-stream: {event['error']}")
                choice = event["choices"][0]
                new = _ids_of(choice)
                ids += new
                logprobs += choice["logprobs"]["token_logprobs"]
                finish = choice["finish_reason"] or finish
                if new:
                    told += new
                    on_ids(new)
        if finish is None:
            raise _StreamFailed("the stream ended without a finish reason")
        return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": logprobs},
                             "finish_reason": finish}]}

    # -- weights ----------------------------------------------------------------------------

    async def _each(self, method: str, path: str, body: Any = None, timeout: float | None = None):
        """The same control request to every server; one that times out stopped answering."""
        import httpx

        async def one(endpoint: _Endpoint):
            try:
                return await self._request(endpoint, method, path, body, timeout)
            except httpx.TimeoutException as error:
                raise endpoint.dead_error(f"{method} {path}: {type(error).__name__} after "
                                          f"{timeout or self.timeout} s") from None
        return await asyncio.gather(*(one(e) for e in self.endpoints))

    def update_weights(self, model) -> None:
        """The servers sample from ``model``'s current parameters from their next request on:
        its state dict (HF names, float tensors) as safetensors in a new folder of
        ``weights_dir`` (:func:`_write_update`: whole before the servers are told its path),
        reloaded in place by every server, whose prefix caches are then dropped; then the
        previous update's folder is removed."""
        start = time.perf_counter()
        state = {name: tensor.detach().to("cpu").contiguous()
                 for name, tensor in unwrap(model).state_dict().items()}
        folder = _write_update(state, self.weights_dir)
        try:
            try:
                self._call(self._each("POST", "/collective_rpc", {
                    "method": "reload_weights", "kwargs": {"weights_path": str(folder)}},
                    timeout=max(self.timeout, 600)))
            except (ServerError, ValueError) as error:
                raise type(error)(f"{error}\n(reloading the weights from {folder}: every server "
                                  f"must see generator.weights_dir, {self.weights_dir}, at that "
                                  f"path)") from None
            self._call(self._each("POST", "/reset_prefix_cache"))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        # Every server confirmed the reload and now points at the new folder: keep only it.
        if self._update_dir is not None:
            shutil.rmtree(self._update_dir, ignore_errors=True)
        self._update_dir = folder
        self.stats["weight_syncs"] += 1
        self.stats["weight_sync_seconds"] += time.perf_counter() - start


class _StreamFailed(Exception):
    """A streamed request the server ended badly: its sequence fails, the call goes on."""


def _ids_of(choice: dict) -> list[int]:
    """A completion choice's (or stream event's) sampled ids: ``token_ids``, else the
    ``token_id:N`` log-prob tokens."""
    ids = choice.get("token_ids")
    if ids is None:
        ids = [t.removeprefix("token_id:") for t in choice["logprobs"]["tokens"]]
    return [int(i) for i in ids]


def _generation(reply: dict, stop_ids: set[int]) -> Generation:
    """A :class:`Generation` from a ``/v1/completions`` reply of one choice."""
    choice = reply["choices"][0]
    ids = _ids_of(choice)
    logprobs = choice["logprobs"]["token_logprobs"]
    if len(ids) != len(logprobs):
        raise RuntimeError(f"vLLM returned {len(ids)} ids and {len(logprobs)} log-probs")
    finish = choice["finish_reason"]
    if finish == "stop" and (not ids or ids[-1] not in stop_ids):
        raise RuntimeError(f"vLLM stopped on {ids[-1:]} which is not a stop id {sorted(stop_ids)}")
    if finish not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sequence with {finish!r}")
    return Generation(ids, [float(x) for x in logprobs], finish)
