"""Keys: SGLang-compatible chain, determinism, tenant and key validation."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpack.identity.keys import (
    StoreKey,
    chain_hash,
    chunk_hashes,
    seed_hash,
    validate_chunk_hash,
    validate_chunk_hashes,
    validate_tenant,
)

FP = "0" * 32


def _reference_page_hash(tokens: list[int], prior: str | None) -> str:
    """SGLang's page hash written out independently: sha256(prior digest + u32le tokens)."""
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    for t in tokens:
        h.update(struct.pack("<I", t))
    return h.hexdigest()


def test_known_vector() -> None:
    # Fixed vector: sha256 of the little-endian uint32 bytes of 1, 2, 3.
    expected = hashlib.sha256(bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])).hexdigest()
    assert chain_hash(None, [1, 2, 3]) == expected
    second = hashlib.sha256(bytes.fromhex(expected) + bytes([4, 0, 0, 0])).hexdigest()
    assert chain_hash(expected, [4]) == second


@given(st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8), min_size=1, max_size=5))
def test_chain_matches_independent_reference(pages: list[list[int]]) -> None:
    prior: str | None = None
    for page in pages:
        ours = chain_hash(prior, page)
        assert ours == _reference_page_hash(page, prior)
        prior = ours


def test_chain_is_deterministic_across_processes() -> None:
    code = "from kvpack.identity.keys import chunk_hashes; print(','.join(chunk_hashes(list(range(100)), 16)))"
    out = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(out) == 1
    assert out.pop().strip().split(",") == chunk_hashes(list(range(100)), 16)


def test_chunk_hashes_ignore_partial_tail_and_chain() -> None:
    tokens = np.arange(50)
    hashes = chunk_hashes(tokens, 16)
    assert len(hashes) == 3
    assert hashes[1] == chain_hash(hashes[0], tokens[16:32])
    assert chunk_hashes(tokens[:48], 16) == hashes
    # A different first chunk changes every later key (the chain).
    other = chunk_hashes(np.concatenate([[999], tokens[1:]]), 16)
    assert all(a != b for a, b in zip(hashes, other))


def test_salt_seeds_the_chain() -> None:
    assert chunk_hashes([1] * 16, 16, seed_hash("a")) != chunk_hashes([1] * 16, 16, seed_hash("b"))
    assert chunk_hashes([1] * 16, 16, seed_hash("a")) != chunk_hashes([1] * 16, 16)


@pytest.mark.parametrize("bad", ["", "..", "a/b", "../x", "a\x00", "x" * 65, ".hidden", "a..b", "é", " a"])
def test_bad_tenant_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant"):
        validate_tenant(bad)
    with pytest.raises(ValueError):
        StoreKey(bad, FP, "c" * 64, "kv")


@pytest.mark.parametrize("good", ["default", "acme", "team-1.prod", "A_b"])
def test_good_tenant_names(good: str) -> None:
    assert validate_tenant(good) == good


@pytest.mark.parametrize(
    ("chunk", "member"), [("../../x", "kv"), ("a/b", "kv"), ("c" * 64, "../kv"), ("c" * 64, "KV"), ("c" * 64, "")]
)
def test_store_key_rejects_path_tricks(chunk: str, member: str) -> None:
    with pytest.raises(ValueError):
        StoreKey("t", FP, chunk, member)


def test_store_key_string_round_trip() -> None:
    key = StoreKey("acme", FP, "ab" * 32, "kv@1of2")
    assert StoreKey.parse(key.as_str()) == key
    assert key.group.member("draft").group == key.group


def test_token_ids_must_fit_u32() -> None:
    with pytest.raises(ValueError):
        chain_hash(None, [2**32])


def test_group_key_parse_is_the_inverse_of_as_str_and_refuses_anything_else() -> None:
    from kvpack.identity.keys import GroupKey, StoreKey

    group = StoreKey("alice", "f" * 32, "c" * 64, "kv").group
    assert GroupKey.parse(group.as_str()) == group
    for bad in (
        "x/alice/" + "f" * 32 + "/c",
        "kvpack/alice/" + "f" * 32,
        "kvpack/../" + "f" * 32 + "/c",
        "kvpack/alice\n/f/c",
    ):
        with pytest.raises(ValueError):
            GroupKey.parse(bad)


@given(st.lists(st.text(max_size=140), max_size=12))
def test_chunk_hashes_validated_at_once_refuse_exactly_what_one_by_one_refuses(chunks: list[str]) -> None:
    """`validate_chunk_hashes` (one match over the joined batch) accepts a batch exactly when
    every chunk passes `validate_chunk_hash`, and raises the same error for the first bad one:
    a newline inside a chunk, an empty chunk, 129 characters, a '/' or a non-string."""
    cases = [chunks, ["ok", "a\nb"], ["a\n"], ["ok", ""], ["x" * 129], ["ok", "a/b"], ["ok", 5], ["x" * 128, "y"]]
    for batch in cases:
        want: str | None = None
        for chunk in batch:
            try:
                validate_chunk_hash(chunk)  # type: ignore[arg-type]
            except ValueError as exc:
                want = str(exc)
                break
        try:
            validate_chunk_hashes(batch)  # type: ignore[arg-type]
            got = None
        except ValueError as exc:
            got = str(exc)
        assert got == want, batch


def test_a_keys_hash_is_its_fields_and_survives_a_trip_to_another_process() -> None:
    """`StoreKey` keeps its hash from when it was built (a key is hashed ~15 times a page):
    it must be the hash of its fields whichever way the key was built (constructor, `batch`,
    `dataclasses.replace`), so equal keys find each other in a dict; and a key pickled into
    a process with another string-hash seed must hash as that process's own keys do."""
    import dataclasses
    import pickle

    chunks = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    one = StoreKey("t", FP, chunks[1], "kv")
    built = StoreKey.batch("t", FP, chunks, "kv")
    moved = dataclasses.replace(built[0], chunk=chunks[1])
    for key in (one, built[1], moved):
        assert hash(key) == hash(("t", FP, chunks[1], "kv")) and key == one
    assert {one: 1}[built[1]] == 1 and {built[1]: 1}[moved] == 1
    assert hash(built[0]) != hash(one) and built[0] != one
    code = (
        "import pickle, sys\n"
        "from kvpack.identity.keys import StoreKey\n"
        "key = pickle.loads(sys.stdin.buffer.read())\n"
        "print({StoreKey(key.tenant, key.fingerprint, key.chunk, key.member): 1}.get(key, 0))\n"
    )
    for seed in ("1", "2"):
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], input=pickle.dumps(one), capture_output=True, env=env, check=True
        )
        assert out.stdout.strip() == b"1", f"PYTHONHASHSEED={seed}: a pickled key is not found among equal keys"
