"""The OpenAI-compatible proxy: an agent harness written against the OpenAI API (chat
completions or Responses, streamed or not) or Anthropic's Messages API (:mod:`.messages`)
trains unchanged. :class:`Proxy` (the service, :mod:`.service`) keeps one token-exact session
per rollout (:mod:`.session`) in front of any generator and batches their generations;
:class:`ProxyServer` (:mod:`.server`) serves the HTTP app (:mod:`.app`, which imports the
service, never the reverse) on uvicorn. Importing this package does not import FastAPI or
uvicorn (the ``serve`` extra); the server does when it starts.
The training driver (agents -> sessions -> trainer) is :mod:`agentrl_fast.train.proxy_driver`."""

from agentrl_fast.proxy.server import ProxyServer
from agentrl_fast.proxy.service import Proxy
from agentrl_fast.proxy.session import ProxyError

__all__ = ["Proxy", "ProxyError", "ProxyServer"]
