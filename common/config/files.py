"""Reading config files: any bytes in, plain JSON/TOML values or one `ConfigError` out.

Used for kvpack's own config file (`KVPackConfig.from_file`) and a Mooncake
config file (``mooncake.config_file``, ``MOONCAKE_CONFIG_PATH``). Whatever a
file holds, the reader returns parsed values or raises a `ConfigError` naming
the file and the problem on one line; never a `UnicodeDecodeError`, a
`RecursionError` (nesting deeper than the parser's stack), Python's
int-string `ValueError` (an integer of more than 4300 digits), or a hang on
something that is not a regular file (a FIFO, a device).

Bounds: a file is read only if it is a regular file of at most
`MAX_CONFIG_BYTES`; the text must be UTF-8 (a UTF-8 byte order mark is
allowed at the start).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tomllib
from typing import Any

from ..errors import ConfigError

MAX_CONFIG_BYTES = 16 << 20
"""Largest config file read (bytes): far above any real config, far below memory trouble."""


def read_text(path: str | os.PathLike[str], limit: int = MAX_CONFIG_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (at most `limit` bytes).

    Raises ConfigError (no field, `source` the file) when it cannot be read, is
    not a regular file, is larger than `limit`, or is not UTF-8."""
    source = os.fspath(path)
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise ConfigError("", f"cannot be read: {_reason(exc)}", source) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError("", "is not a regular file", source)
        if st.st_size > limit:
            raise ConfigError("", f"is {st.st_size} bytes; a config file holds at most {limit}", source)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError("", f"cannot be read: {_reason(exc)}", source) from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > limit:
        raise ConfigError("", f"grew past {limit} bytes while read; a config file holds at most {limit}", source)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            "", f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}, line {line})", source
        ) from None


def parse_json(text: str, source: str) -> Any:
    """`text` as JSON values; ConfigError naming `source` when it is not valid JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("", f"is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", source) from None
    except RecursionError:
        raise ConfigError("", "is not a config: JSON nested too deeply to read", source) from None
    except ValueError as exc:
        raise ConfigError("", f"is not a config: {_number_problem(exc)}", source) from None


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """`text` as a TOML document; ConfigError naming `source` when it is not valid TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"is not valid TOML: {exc}", source) from None
    except RecursionError:
        raise ConfigError("", "is not a config: TOML nested too deeply to read", source) from None
    except ValueError as exc:
        raise ConfigError("", f"is not a config: {_number_problem(exc)}", source) from None


def _number_problem(exc: ValueError) -> str:
    """The problem a parser's plain ValueError stands for (in practice, an integer too long to convert)."""
    if "integer string conversion" in str(exc):
        return f"holds an integer of more than {sys.get_int_max_str_digits()} digits"
    return str(exc)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)
