"""The proxy over HTTP: :class:`ProxyServer` runs the app (:mod:`agentrl_fast.proxy.app`) on
uvicorn in a thread of this process. FastAPI and uvicorn (the ``serve`` extra) are imported
when it starts, not when this module is."""

from __future__ import annotations

import socket
import threading
import time

from agentrl_fast.proxy.service import Proxy


class ProxyServer:
    """``proxy`` over HTTP: uvicorn in a thread of this process on ``host:port`` (0: a free
    port); a context manager. ``max_body_bytes``: larger requests get a 413."""

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = 8 << 20):
        self.proxy, self.host, self.max_body_bytes = proxy, host, max_body_bytes
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it a response's second write waits for the
        # client's delayed ACK (40 ms a request).
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """What an OpenAI client takes as ``base_url`` for ``session_id``."""
        return f"{self.url}/s/{session_id}/v1"

    def start(self, timeout: float = 30.0) -> "ProxyServer":
        import uvicorn

        from agentrl_fast.proxy.app import create_app
        app = create_app(self.proxy, max_body_bytes=self.max_body_bytes)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="proxy-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the proxy's HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
        self._socket.close()

    def __enter__(self) -> "ProxyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
