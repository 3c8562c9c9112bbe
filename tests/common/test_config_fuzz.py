"""The config reader answers any input with a valid config or one `ConfigError`, nothing else.

Random bytes as a JSON or TOML file, deep nesting, numbers past Python's
int-string limit, and a value of every JSON shape in every field of every
config dataclass: each must come back as a `KVPackConfig` or as a
`ConfigError` whose message is one bounded line (never a UnicodeDecodeError,
RecursionError, the int-string ValueError, or a message that quotes a huge
value whole).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpack import ConfigError, KVPackConfig

MAX_MESSAGE = 1000
"""Longest message a ConfigError may carry (characters): it names, it never quotes a value whole."""

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def field_paths(cls: type = KVPackConfig, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every leaf field of the config dataclasses (nested ones included)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from field_paths(tp, (*prefix, f.name))  # type: ignore[arg-type]
        else:
            yield (*prefix, f.name)


PATHS = list(field_paths())


def nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: Any = value
    for name in reversed(path):
        out = {name: out}
    return typing.cast(dict[str, Any], out)


def check_outcome(read: typing.Callable[[], KVPackConfig]) -> None:
    """`read()` returns a config or raises a one-line, bounded ConfigError; any other outcome fails."""
    try:
        cfg = read()
    except ConfigError as exc:
        text = str(exc)
        assert "\n" not in text and "\r" not in text, text[:300]
        assert len(text) <= MAX_MESSAGE, text[:300]
        return
    assert isinstance(cfg, KVPackConfig)


class Huge(typing.NamedTuple):
    """Stands for an integer of `digits` digits: hypothesis reprs its examples, and Python refuses
    to turn such an int into a string, so the int is made only inside the test (`materialize`)."""

    digits: int


def materialize(value: Any) -> Any:
    if isinstance(value, Huge):
        return 10**value.digits - 1
    if isinstance(value, list):
        return [materialize(v) for v in value]
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.builds(Huge, st.integers(min_value=4301, max_value=6000))
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.text(min_size=2000, max_size=2100, alphabet="ab\n\x00\u2028"),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(autouse=True)
def _no_mooncake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)


def test_every_field_is_fuzzed() -> None:
    assert ("disk", "path") in PATHS and ("mooncake", "config_file") in PATHS and ("eviction", "tenant_quotas") in PATHS
    assert len(PATHS) > 30


@pytest.mark.parametrize("path", PATHS, ids=".".join)
@FUZZ
@given(value=json_values)
def test_any_value_in_any_field_is_a_config_or_a_config_error(path: tuple[str, ...], value: Any) -> None:
    check_outcome(lambda: KVPackConfig.from_dict(nest(path, materialize(value))))


@pytest.mark.parametrize("path", PATHS, ids=".".join)
def test_an_integer_past_the_int_string_limit_in_any_field(path: tuple[str, ...], tmp_path: Path) -> None:
    huge = 10**5000 - 1
    check_outcome(lambda: KVPackConfig.from_dict(nest(path, huge)))
    check_outcome(lambda: KVPackConfig.from_dict(nest(path, [huge])))
    check_outcome(lambda: KVPackConfig.from_dict(nest(path, {"a": huge})))
    text = json.dumps(nest(path, 0)).replace("0", "9" * 5000)
    (tmp_path / "c.json").write_text(text)
    check_outcome(lambda: KVPackConfig.from_file(tmp_path / "c.json"))
    (tmp_path / "c.toml").write_text(f"{'.'.join(path)} = {'9' * 5000}\n")
    check_outcome(lambda: KVPackConfig.from_file(tmp_path / "c.toml"))


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".json", ".toml", ".conf"]))
def test_random_bytes_as_a_file(tmp_path: Path, data: bytes, suffix: str) -> None:
    file = tmp_path / f"c{suffix}"
    file.write_bytes(data)
    check_outcome(lambda: KVPackConfig.from_file(file))


@FUZZ
@given(
    prefix=st.sampled_from([b'{"tenant": "', b'tenant = "', b'{"disk": {"path": ', b"", b"\xef\xbb\xbf"]),
    tail=st.binary(),
)
def test_bytes_that_are_not_utf8(tmp_path: Path, prefix: bytes, tail: bytes) -> None:
    for suffix in (".json", ".toml"):
        file = tmp_path / f"c{suffix}"
        file.write_bytes(prefix + b"\xff\xfe" + tail)
        check_outcome(lambda: KVPackConfig.from_file(file))


DEEP = 100_000


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.json", "[" * DEEP + "]" * DEEP),
        ("c.json", '{"a":' * DEEP + "1" + "}" * DEEP),
        ("c.json", '{"tenant": ' + "[" * DEEP + "]" * DEEP + "}"),
        ("c.toml", "a = " + "[" * DEEP + "]" * DEEP + "\n"),
        ("c.toml", "a = " + "{b = " * DEEP + "1" + "}" * DEEP + "\n"),
        ("c.toml", "tenant = " + "[" * 1000 + "]" * 1000 + "\n"),
    ],
    ids=["json-list", "json-object", "json-field", "toml-array", "toml-table", "toml-field"],
)
def test_deep_nesting(tmp_path: Path, name: str, text: str) -> None:
    file = tmp_path / name
    file.write_text(text)
    check_outcome(lambda: KVPackConfig.from_file(file))
    if name.endswith(".json"):
        check_outcome(lambda: KVPackConfig.from_json(text))


def deep_list(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("path", PATHS, ids=".".join)
def test_a_deeply_nested_value_from_an_engine_dict(path: tuple[str, ...]) -> None:
    check_outcome(lambda: KVPackConfig.from_dict(nest(path, deep_list(100_000))))


@pytest.mark.parametrize(
    "content",
    [
        b'{"master_server_address": "\xff"}',
        b'{"protocol": ' + b"9" * 5000 + b"}",
        b'{"global_segment_size": ' + b"9" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"local_hostname": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"tenant_id": "' + b"x" * 100_000 + b'\n"}',
        b"\xff\xfe",
    ],
    ids=["not-utf8", "huge-protocol", "huge-size", "deep", "deep-value", "long-value", "bom-junk"],
)
def test_a_bad_mooncake_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes) -> None:
    file = tmp_path / "mooncake.json"
    file.write_bytes(content)
    check_outcome(lambda: KVPackConfig.from_dict({"mooncake": {"enabled": True, "config_file": str(file)}}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(file))
    check_outcome(lambda: KVPackConfig.from_dict({"mooncake": {"enabled": True}}))
