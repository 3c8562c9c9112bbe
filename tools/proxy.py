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

What it forwards (`kvpack.tools.proxy_input`): the path and query of an origin-form request
target, to the upstream's own scheme, host and port (any other target: 400); a body only with
one ``Content-Length`` of at most ``--max-body-bytes`` (8 MiB by default; missing: 411, over:
413, checked before a byte is read); ``kv_transfer_params`` without the client's ``kvpack`` /
``kvpack_*`` fields unless ``--trust-kvpack-params``. A client connection idle for
`CLIENT_IDLE_S` is closed.
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
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .proxy_input import (
    BODY_BYTES_CAP,
    MAX_BODY_BYTES,
    Refusal,
    Upstream,
    body_length,
    client_params,
    origin_path,
    upstream_url,
)

log = logging.getLogger("kvpack.proxy")

PROXIED = ("/v1/completions", "/v1/chat/completions")
CLIENT_IDLE_S = 60.0
"""Seconds a client connection may send or take nothing before the proxy closes it."""


@dataclass(frozen=True)
class Upstreams:
    """A prefill/decode pair's base URLs (``http://HOST[:PORT][/PATH]``), each upstream call
    bounded by `timeout_s` seconds."""

    prefill: str
    decode: str
    timeout_s: float
    prefill_at: Upstream = field(init=False)
    """`prefill`, split (`Upstream.parse`: ValueError, one line, for a URL that is not one)."""
    decode_at: Upstream = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_at", Upstream.parse(self.prefill))
        object.__setattr__(self, "decode_at", Upstream.parse(self.decode))


@dataclass(frozen=True)
class ClientBounds:
    """What the proxy takes from a client: bodies of at most `max_body_bytes`; its
    ``kv_transfer_params``' kvpack fields only when `trust_kvpack_params`."""

    max_body_bytes: int = MAX_BODY_BYTES
    trust_kvpack_params: bool = False


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
    """The decode instance's request: the client's, with the prefill side's handoff params over
    the client's own (as forwarded: `proxy_input.client_params`)."""
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        return dict(body)
    return dict(body, kv_transfer_params={**(body.get("kv_transfer_params") or {}), **params})


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
        self._cycle = itertools.cycle([Upstream.parse(u) for u in urls])
        self._lock = threading.Lock()

    def next(self) -> Upstream:
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


def make_handler(up: Upstreams | RoundRobin, bounds: ClientBounds | None = None) -> type[BaseHTTPRequestHandler]:
    """The request handler: prefill/decode over `up` (`Upstreams`), or each request to the next
    instance (`RoundRobin`); what a client may send is bounded by `bounds` (module docstring)."""
    limits = bounds or ClientBounds()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = CLIENT_IDLE_S

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("proxy: " + fmt, *args)

        def _reply(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(payload)

        def _refuse(self, refusal: Refusal) -> None:
            """Answer `refusal` and close: a body left unread must not be taken for a request."""
            self.close_connection = True
            self._reply(refusal.status, json.dumps({"error": str(refusal)}).encode())

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            base = up.next() if isinstance(up, RoundRobin) else up.decode_at
            try:
                url = upstream_url(base, self.path)
                body_length(self.headers, limits.max_body_bytes, required=False)
            except Refusal as refusal:
                self._refuse(refusal)
                return
            try:
                with urllib.request.urlopen(url, timeout=up.timeout_s) as resp:
                    self._reply(resp.status, resp.read(), resp.headers.get("Content-Type", "application/json"))
            except urllib.error.HTTPError as exc:
                self._reply(exc.code, exc.read())
            except OSError as exc:
                self._reply(502, json.dumps({"error": f"decode instance: {exc}"}).encode())

        def do_POST(self) -> None:  # noqa: N802
            try:
                origin_path(self.path)
                n = body_length(self.headers, limits.max_body_bytes, required=True)
                if self.path not in PROXIED:
                    raise Refusal(404, f"kvpack proxy serves {list(PROXIED)}")
                body = self._json(n)
                params = client_params(body, limits.trust_kvpack_params)
            except Refusal as refusal:
                self._refuse(refusal)
                return
            if params is not None:
                body["kv_transfer_params"] = params
            stream = bool(body.get("stream"))
            if isinstance(up, RoundRobin):
                base = up.next()
                self._forward(upstream_url(base, self.path), body, up.timeout_s, f"instance {base}", stream)
                return
            try:
                with _post(upstream_url(up.prefill_at, self.path), prefill_body(body), up.timeout_s) as resp:
                    handoff = json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                self._reply(exc.code, exc.read())
                return
            except (OSError, ValueError) as exc:
                self._reply(502, json.dumps({"error": f"prefill instance: {exc}"}).encode())
                return
            handoff = handoff if isinstance(handoff, dict) else {}
            to_decode = decode_body(body, handoff)
            self._forward(upstream_url(up.decode_at, self.path), to_decode, up.timeout_s, "decode instance", stream)

        def _json(self, n: int) -> dict[str, Any]:
            """The request's body of `n` bytes (already bounded) as a JSON object; `Refusal` otherwise."""
            try:
                body = json.loads(self.rfile.read(n) or b"{}")
            except ValueError as exc:
                raise Refusal(400, f"not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise Refusal(400, f"the body must be a JSON object, got {type(body).__name__}")
            return body

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


def serve(up: Upstreams | RoundRobin, host: str, port: int, bounds: ClientBounds | None = None) -> ThreadingHTTPServer:
    """A started-but-not-serving server (call ``serve_forever``); port 0 picks a free one.
    ValueError (one line) for an upstream URL that is not ``http(s)://HOST[:PORT][/PATH]``."""
    return ProxyServer((host, port), make_handler(up, bounds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpack proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", help="base URL of the prefill instance (kv_producer)")
    parser.add_argument("--decode", help="base URL of the decode instance (kv_consumer)")
    parser.add_argument("--round-robin", nargs="+", metavar="URL", help="instances to send requests to in turn")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound of each upstream call")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help="largest request body taken from a client (larger: 413 before it is read; default %(default)s)",
    )
    parser.add_argument(
        "--trust-kvpack-params",
        action="store_true",
        help="forward the kvpack / kvpack_* fields clients send in kv_transfer_params (a tenant, its "
        "signature): only behind a front end that sets them itself; otherwise they are dropped",
    )
    args = parser.parse_args(argv)
    if bool(args.round_robin) == bool(args.prefill or args.decode) or bool(args.prefill) != bool(args.decode):
        parser.error("give --prefill and --decode, or --round-robin URL...")
    if not 1 <= args.max_body_bytes <= BODY_BYTES_CAP:
        parser.error(f"--max-body-bytes must be 1..{BODY_BYTES_CAP}, got {args.max_body_bytes}")
    if not 0 < args.timeout_s < float("inf"):
        parser.error(f"--timeout-s must be a number of seconds > 0, got {args.timeout_s}")
    logging.basicConfig(level=logging.INFO)
    bounds = ClientBounds(args.max_body_bytes, args.trust_kvpack_params)
    try:
        if args.round_robin:
            urls = [u.rstrip("/") for u in args.round_robin]
            server = serve(RoundRobin(urls, args.timeout_s), args.host, args.port, bounds)
            where = "round robin over " + ", ".join(urls)
        else:
            up = Upstreams(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout_s)
            server = serve(up, args.host, args.port, bounds)
            where = f"prefill {args.prefill}, decode {args.decode}"
    except ValueError as exc:
        parser.error(str(exc))
    except OSError as exc:
        print(f"kvpack proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
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
