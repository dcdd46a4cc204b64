"""A standard-library HTTP server on 127.0.0.1, served from a daemon thread: the base of the tests'
stand-in OpenAI-compatible servers (scripted answers, a vLLM-shaped one, the fake replicas)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalServer:
    """Serves ``handler`` on 127.0.0.1 until :meth:`close`.

    Args:
        handler: the request handler class.
        port: the port (0: any free one).
        daemon_threads: whether request threads are daemons (:meth:`close` then does not wait for them).

    Attributes:
        port: the port it listens on.
        url: its OpenAI-style base URL, ``http://127.0.0.1:<port>/v1``.
    """

    def __init__(
        self, handler: type[BaseHTTPRequestHandler], port: int = 0, daemon_threads: bool = False
    ) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.daemon_threads = daemon_threads
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port."""
        self.httpd.shutdown()
        self.httpd.server_close()
