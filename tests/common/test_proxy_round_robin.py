"""`kvpack proxy --round-robin`: each request goes whole to the next instance, streamed answers relayed.

Two stand-in instances (stdlib HTTP servers answering with their own name, one
streamed answer in two chunks) behind the proxy in this process (`proxy.serve`).
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvpack.tools.proxy import RoundRobin, main, serve


def instance(name: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(2 * len(name) + 2))
                self.end_headers()
                for _ in range(2):
                    self.wfile.write(f"{name}\n".encode())
                    self.wfile.flush()
                return
            out = json.dumps({"by": name, "prompt": body["prompt"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def proxy_url() -> Iterator[str]:
    servers = [instance("a"), instance("b")]
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    proxy = serve(RoundRobin(urls, timeout_s=30), "127.0.0.1", 0)
    servers.append(proxy)
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{proxy.server_address[1]}"
    for s in servers:
        s.shutdown()
        s.server_close()


def post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return bytes(resp.read())


def test_requests_go_to_each_instance_in_turn_whole(proxy_url: str) -> None:
    answers = [json.loads(post(proxy_url, {"prompt": [i, i + 1]})) for i in range(4)]
    assert [a["by"] for a in answers] == ["a", "b", "a", "b"]
    assert [a["prompt"] for a in answers] == [[i, i + 1] for i in range(4)]  # the client's body, unchanged
    assert post(proxy_url, {"prompt": [0], "stream": True}) == b"a\na\n"  # relayed chunk by chunk


def test_round_robin_and_prefill_decode_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--round-robin", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2"])
    assert exc.value.code == 2 and "--round-robin" in capsys.readouterr().err
    with pytest.raises(ValueError):
        RoundRobin([])
