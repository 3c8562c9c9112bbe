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
    ChunkChain,
    GroupKey,
    StoreKey,
    chain_hash,
    chunk_hashes,
    member_name,
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


def test_a_chain_extended_piecewise_is_the_whole_sequence_s_chain() -> None:
    tokens = list(range(1000, 1100))  # 6 full chunks of 16 and a partial one
    seed = seed_hash("salt")
    chain = ChunkChain(seed, 16)
    assert chain.extend(tokens, 2) == chunk_hashes(tokens[:32], 16, parent=seed)
    assert chain.extend(tokens, 2) == [] and chain.extend(tokens, 1) == []  # each chunk hashed once
    assert chain.extend(tokens[:70], 9) == chunk_hashes(tokens[:64], 16, parent=seed)[2:]  # only full chunks
    assert chain.hashes == chunk_hashes(tokens, 16, parent=seed)[:4]
    assert chain.parent(0) == seed and chain.parent(3) == chain.hashes[2]
    assert ChunkChain(None, 16).extend(tokens, 6) == chunk_hashes(tokens, 16)


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        (("kv",), {}, "kv"),
        (("kv", 1, 2), {}, "kv@1of2"),
        (("kv", 0, 1), {"group": 3}, "kv_g3"),
        (("kv", 3, 4), {"group": 1}, "kv_g1@3of4"),  # vLLM: a KV cache group per rank
        (("draft", 0, 2), {}, "draft@0of2"),
        (("mamba", 1, 2), {"stage": 1, "stages": 2}, "mamba_pp1@1of2"),  # SGLang: a pool per stage and shard
        (("mamba",), {"stage": 0, "stages": 1}, "mamba"),
        (("kv",), {"heads": (0, 2)}, "kv_h0_2"),  # a canonical object's head range
        (("kv",), {"group": 1, "heads": (2, 4)}, "kv_g1_h2_4"),
    ],
)
def test_member_names_follow_one_rule(args: tuple, kwargs: dict, name: str) -> None:  # type: ignore[type-arg]
    assert member_name(*args, **kwargs) == name


def test_a_pool_named_outside_the_member_alphabet_gets_a_valid_distinct_name() -> None:
    a, b = member_name("Draft-Pool.X", 1, 2), member_name("Draft-Pool.Y", 1, 2)
    digest = hashlib.sha256(b"Draft-Pool.X").hexdigest()[:8]
    assert a == f"draftpoolx_{digest}@1of2" and a != b
    assert member_name("x" * 40).startswith("x" * 20 + "_") and member_name("-").startswith("p_")


def test_key_strings_have_one_form() -> None:
    key = StoreKey("acme", FP, "c" * 8, "kv@0of2")
    assert key.as_str() == f"{key.group.as_str()}/kv@0of2" == f"kvpack/acme/{FP}/{'c' * 8}/kv@0of2"
    assert StoreKey.parse(key.as_str()) == key and GroupKey.parse(key.group.as_str()) == key.group
    with pytest.raises(ValueError, match="not a kvpack store key"):
        StoreKey.parse(key.group.as_str())
    with pytest.raises(ValueError, match="not a kvpack group key"):
        GroupKey.parse(key.as_str())
