"""`kvpack proxy` forwards paths to the upstreams it was given, bounds bodies before reading them,
and drops the kvpack fields a client puts in ``kv_transfer_params``.

The real CLI (``python -m kvpack.cli proxy``) runs as a process on 127.0.0.1 in front of stand-in
instances (stdlib HTTP servers in this process that record every request they get); the tests
speak raw HTTP over a socket, as a hostile client would:

- ``GET :PORT/path`` in front of an upstream URL without a port (a Kubernetes service URL)
  reached any port of that host; an absolute-form target (``GET http://HOST:PORT/``) was glued
  to the upstream's URL. Both are 400 now, and no instance sees a request.
- A negative ``Content-Length`` made the proxy read until the client hung up; an 8 GiB one was
  read rather than refused; a POST without one was forwarded. Now 400, 413 and 411 at once.
- A client's ``kvpack_tenant`` reached the instances; now only with ``--trust-kvpack-params``,
  while the prefill/decode handoff the proxy carries still reaches the decode instance.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import pytest

HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "kvpack": {"tenant": "default", "tokens": 3}}


@dataclass
class Instance:
    """A stand-in vLLM instance: records each request (method, path, JSON body); a prefill request
    (``do_remote_decode``) is answered with `HANDOFF`, anything else with ``{"by": port}``."""

    server: ThreadingHTTPServer
    seen: list[tuple[str, str, Any]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])


def instance() -> Instance:
    seen: list[tuple[str, str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def _answer(self, body: Any) -> None:
            seen.append((self.command, self.path, body))
            params = body.get("kv_transfer_params") if isinstance(body, dict) else None
            out = {"kv_transfer_params": HANDOFF} if params and params.get("do_remote_decode") else {"by": port}
            payload = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(None)

        def do_POST(self) -> None:  # noqa: N802
            self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    Thread(target=server.serve_forever, daemon=True).start()
    return Instance(server, seen)


@pytest.fixture
def instances() -> Iterator[tuple[Instance, Instance]]:
    """The proxy's upstream, and another server on the same host the proxy was not given."""
    pair = (instance(), instance())
    yield pair
    for inst in pair:
        inst.server.shutdown()
        inst.server.server_close()


class Proxy:
    """``kvpack proxy ARGS --port 0`` as a process; `port` from the line it prints when listening."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "kvpack.cli", "proxy", *args, "--port", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # EOF if it exits
        assert line.startswith("kvpack proxy on http://127.0.0.1:"), (line, self.proc.stderr.read())  # type: ignore[union-attr]
        self.port = int(line.split("127.0.0.1:")[1].split()[0])

    def stop(self) -> str:
        """SIGINT (Ctrl-C); its stderr."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.communicate(timeout=30)[1]

    def raw(self, request: bytes) -> tuple[int, bytes]:
        """Send `request` as it is; (status, whole reply) once the proxy closes or answers whole.
        A proxy that waits for bytes that never come fails the test at the socket's timeout."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            s.sendall(request)
            reply = b""
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        assert reply.startswith(b"HTTP/1."), reply[:200]
        return int(reply.split(b" ", 2)[1]), reply


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 62


def _post(body: bytes, *headers: str) -> bytes:
    head = "".join(h + "\r\n" for h in headers)
    return f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode() + body


def test_request_targets_other_than_a_path_are_refused_and_reach_no_one(
    instances: tuple[Instance, Instance],
) -> None:
    given, other = instances
    # an upstream URL without a port, as a Kubernetes service URL is: ":PORT/..." picked the port
    portless = Proxy("--prefill", "http://127.0.0.1", "--decode", "http://127.0.0.1")
    with_port = Proxy("--round-robin", f"http://127.0.0.1:{given.port}")
    try:
        status, reply = portless.raw(f"GET :{other.port}/secret HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert status == 400 and b"not a path" in reply, reply
        for target in (f"http://127.0.0.1:{other.port}/secret", f"127.0.0.1:{other.port}", "*"):
            status, reply = with_port.raw(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 400, (target, reply)
        status, _ = with_port.raw(
            _post(b"{}", "Content-Length: 2").replace(b"/v1/", f"http://127.0.0.1:{other.port}/v1/".encode())
        )
        assert status == 400
        assert other.seen == [] and given.seen == []
        # a path and its query reach the upstream it was given, and only it
        status, reply = with_port.raw(b"GET /v1/models?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 200 and json.loads(reply.split(b"\r\n\r\n", 1)[1]) == {"by": given.port}
        assert given.seen == [("GET", "/v1/models?x=1", None)] and other.seen == []
    finally:
        errors = portless.stop() + with_port.stop()
    assert "Traceback" not in errors, errors[-3000:]


def test_bodies_are_bounded_before_they_are_read(instances: tuple[Instance, Instance]) -> None:
    given, _ = instances
    url = f"http://127.0.0.1:{given.port}"
    proxy = Proxy("--prefill", url, "--decode", url)
    try:
        # the body is never sent: a proxy that reads it waits until the client hangs up
        for length, want in (("-1", 400), ("8589934592", 413), ("0x10", 400), ("1e3", 400)):
            status, reply = proxy.raw(_post(b"", f"Content-Length: {length}"))
            assert status == want, (length, reply)
            assert b"Connection: close" in reply
        assert proxy.raw(_post(b'{"prompt": "a"}'))[0] == 411  # no Content-Length on a POST
        assert proxy.raw(_post(b"{}", "Content-Length: 2", "Content-Length: 2"))[0] == 400
        assert proxy.raw(_post(b"2\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked"))[0] == 411
        assert proxy.raw(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")[0] == 400
        assert given.seen == []
    finally:
        errors = proxy.stop()
    assert "Traceback" not in errors, errors[-3000:]


def test_the_body_bound_is_an_option(instances: tuple[Instance, Instance]) -> None:
    given, _ = instances
    url = f"http://127.0.0.1:{given.port}"
    proxy = Proxy("--prefill", url, "--decode", url, "--max-body-bytes", "1000")
    try:
        assert proxy.raw(_post(b"", "Content-Length: 1001"))[0] == 413
        assert given.seen == []
        body = json.dumps({"prompt": "a" * 900}).encode()
        status, _ = proxy.raw(_post(body, f"Content-Length: {len(body)}", "Connection: close"))
        assert status == 200 and len(given.seen) == 2  # prefill, then decode: a body within the bound
    finally:
        proxy.stop()


def _client_body() -> bytes:
    params = {"kvpack_tenant": "victim", "kvpack_tenant_sig": "00", "kvpack": {"tenant": "victim"}, "keep": 1}
    return json.dumps({"prompt": "hi", "max_tokens": 4, "kv_transfer_params": params}).encode()


@pytest.mark.parametrize("trusted", [False, True])
def test_a_clients_kvpack_fields_reach_no_instance_unless_trusted(
    instances: tuple[Instance, Instance], trusted: bool
) -> None:
    prefill, decode = instances
    flags = ["--trust-kvpack-params"] if trusted else []
    proxy = Proxy(
        "--prefill", f"http://127.0.0.1:{prefill.port}", "--decode", f"http://127.0.0.1:{decode.port}", *flags
    )
    try:
        body = _client_body()
        status, reply = proxy.raw(_post(body, f"Content-Length: {len(body)}", "Connection: close"))
        assert status == 200, reply
    finally:
        proxy.stop()
    ((_, _, to_prefill),) = prefill.seen
    ((_, _, to_decode),) = decode.seen
    sent = to_prefill["kv_transfer_params"]
    assert sent["do_remote_decode"] is True and sent["keep"] == 1
    if trusted:  # a front end's tenant reaches both sides; the decode side gets the prefill side's handoff
        assert (sent["kvpack_tenant"], sent["kvpack"]) == ("victim", {"tenant": "victim"})
        assert to_decode["kv_transfer_params"] == {**json.loads(body)["kv_transfer_params"], **HANDOFF}
    else:
        assert not any(k.startswith("kvpack") for k in sent), sent
        assert to_decode["kv_transfer_params"] == {"keep": 1, **HANDOFF}


@pytest.mark.parametrize(
    "args,says",
    [
        (["--decode", "ftp://h", "--prefill", "http://h"], "must be http://HOST"),
        (["--round-robin", "http://127.0.0.1:notaport"], "not a URL"),
        (["--round-robin", "http://h", "--max-body-bytes", "0"], "--max-body-bytes must be"),
        (["--round-robin", "http://h", "--timeout-s", "nan"], "--timeout-s must be"),
    ],
)
def test_bad_options_get_one_line(args: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpack.cli", "proxy", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
