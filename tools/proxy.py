"""`kvpack proxy`: a minimal prefill/decode proxy in front of two vLLM OpenAI servers.

    kvpack proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

It speaks vLLM's disaggregation protocol (the one vLLM's own proxies use), so
the two instances only need kvpack with one shared tier (disk or Mooncake):

1. the request goes to the prefill instance with ``max_tokens: 1`` (no
   streaming) and ``kv_transfer_params: {"do_remote_decode": true}``;
2. the prefill response's ``kv_transfer_params`` (kvpack's `Handoff`: layout,
   tenant, token count, tail) go with the original request to the decode
   instance, which loads the prompt from the store (waiting at most
   ``handoff_wait_ms`` for objects still landing) and generates;
3. the decode instance's answer (streamed or not) goes back to the client.

``/v1/completions`` and ``/v1/chat/completions`` are proxied this way; other
GET paths (``/health``, ``/v1/models``) go to the decode instance. Listens on
127.0.0.1 unless told otherwise. Standard library only; one thread per
connection; every upstream call has a timeout (``--timeout-s``).

    kvpack proxy --round-robin http://127.0.0.1:8100 http://127.0.0.1:8200 --port 8000

sends each request whole to the next instance in turn (`RoundRobin`), as a
load balancer that knows nothing of prefixes does: what one instance computed
reaches another only through a tier they share (``kvpack bench pair``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("kvpack.proxy")

PROXIED = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Upstreams:
    prefill: str
    decode: str
    timeout_s: float


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: one token, no streaming, asking for a remote decode."""
    out = dict(body, max_tokens=1, stream=False)
    out.pop("max_completion_tokens", None)
    out.pop("stream_options", None)
    params = dict(body.get("kv_transfer_params") or {})
    params.update(do_remote_decode=True, do_remote_prefill=False)
    out["kv_transfer_params"] = params
    return out


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode instance's request: the client's, with the prefill side's handoff params."""
    params = prefill_response.get("kv_transfer_params")
    return dict(body, kv_transfer_params=params) if params else dict(body)


def _post(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout_s)


class RoundRobin:
    """The next upstream base URL, in turn (thread-safe: one thread per connection); each
    upstream call bounded by `timeout_s` seconds."""

    def __init__(self, urls: list[str], timeout_s: float = 600.0) -> None:
        if not urls:
            raise ValueError("round robin over no instance")
        self.timeout_s = timeout_s
        self._cycle = itertools.cycle(urls)
        self._lock = threading.Lock()

    def next(self) -> str:
        with self._lock:
            return next(self._cycle)


def _relay(handler: BaseHTTPRequestHandler, resp: Any, stream: bool) -> None:
    """Send upstream response `resp` back to the client: whole, or chunk by chunk as it arrives."""
    if not stream:
        payload = resp.read()
        handler.send_response(resp.status)
        handler.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)
        return
    handler.send_response(resp.status)
    handler.send_header("Content-Type", resp.headers.get("Content-Type", "text/event-stream"))
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    while chunk := resp.read1(65536):
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        handler.wfile.flush()
    handler.wfile.write(b"0\r\n\r\n")


def make_handler(up: Upstreams | RoundRobin) -> type[BaseHTTPRequestHandler]:
    """The request handler: prefill/decode over `up` (`Upstreams`), or each request to the next
    instance (`RoundRobin`)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("proxy: " + fmt, *args)

        def _reply(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            base = up.next() if isinstance(up, RoundRobin) else up.decode
            try:
                with urllib.request.urlopen(base + self.path, timeout=up.timeout_s) as resp:
                    self._reply(resp.status, resp.read(), resp.headers.get("Content-Type", "application/json"))
            except urllib.error.HTTPError as exc:
                self._reply(exc.code, exc.read())
            except OSError as exc:
                self._reply(502, json.dumps({"error": f"decode instance: {exc}"}).encode())

        def do_POST(self) -> None:  # noqa: N802
            if self.path not in PROXIED:
                self._reply(404, json.dumps({"error": f"kvpack proxy serves {list(PROXIED)}"}).encode())
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            except ValueError as exc:
                self._reply(400, json.dumps({"error": f"not JSON: {exc}"}).encode())
                return
            stream = bool(body.get("stream"))
            if isinstance(up, RoundRobin):
                base = up.next()
                self._forward(base + self.path, body, up.timeout_s, f"instance {base}", stream)
                return
            try:
                with _post(up.prefill + self.path, prefill_body(body), up.timeout_s) as resp:
                    handoff = json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                self._reply(exc.code, exc.read())
                return
            except OSError as exc:
                self._reply(502, json.dumps({"error": f"prefill instance: {exc}"}).encode())
                return
            self._forward(up.decode + self.path, decode_body(body, handoff), up.timeout_s, "decode instance", stream)

        def _forward(self, url: str, body: dict[str, Any], timeout_s: float, who: str, stream: bool) -> None:
            """POST `body` to `url` and relay the answer (`_relay`); an upstream error is
            answered with its status, an unreachable `who` with 502."""
            try:
                resp = _post(url, body, timeout_s)
            except urllib.error.HTTPError as exc:
                self._reply(exc.code, exc.read())
                return
            except OSError as exc:
                self._reply(502, json.dumps({"error": f"{who}: {exc}"}).encode())
                return
            with resp:
                _relay(self, resp, stream)

    return Handler


class ProxyServer(ThreadingHTTPServer):
    """One thread per connection; a client that hangs up mid-request (a readiness probe, a
    benchmark client stopping) is logged at debug level, not printed as a traceback."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            log.debug("kvpack proxy: %s hung up: %s", client_address, exc)
            return
        super().handle_error(request, client_address)


def serve(up: Upstreams | RoundRobin, host: str, port: int) -> ThreadingHTTPServer:
    """A started-but-not-serving server (call ``serve_forever``); port 0 picks a free one."""
    return ProxyServer((host, port), make_handler(up))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpack proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", help="base URL of the prefill instance (kv_producer)")
    parser.add_argument("--decode", help="base URL of the decode instance (kv_consumer)")
    parser.add_argument("--round-robin", nargs="+", metavar="URL", help="instances to send requests to in turn")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound of each upstream call")
    args = parser.parse_args(argv)
    if bool(args.round_robin) == bool(args.prefill or args.decode) or bool(args.prefill) != bool(args.decode):
        parser.error("give --prefill and --decode, or --round-robin URL...")
    logging.basicConfig(level=logging.INFO)
    if args.round_robin:
        urls = [u.rstrip("/") for u in args.round_robin]
        server = serve(RoundRobin(urls, args.timeout_s), args.host, args.port)
        where = "round robin over " + ", ".join(urls)
    else:
        up = Upstreams(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout_s)
        server = serve(up, args.host, args.port)
        where = f"prefill {args.prefill}, decode {args.decode}"
    print(f"kvpack proxy on http://{args.host}:{server.server_address[1]} -> {where}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
