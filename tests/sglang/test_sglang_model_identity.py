"""SGLang pages are keyed by what the checkpoint is, not by ``model_name`` (its path).

Real host pools and SGLang's real storage factory; the disk tier shared by
several backends, as by several SGLang servers. The checkpoints are the tiny
Llama of `kvpack.tools.tinymodel`: the session's model, a copy of it at another
path, and the same model rebuilt with another seed (other weights, same config
and tensor shapes). Every get is checked bit-exact after the pool is poisoned.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_parts import alloc_pages, fill_random, kvpack_extra, make_backend, make_pool, page_bytes, page_keys, poison

from fixtures.tiny_model import build_tiny_llama, copy_model
from kvpack.sglang_plugin.pools import sglang_model_identity

pytestmark = pytest.mark.sglang


def test_two_paths_of_one_checkpoint_share_pages_and_other_weights_do_not(
    tiny_llama: Path, tmp_path: Path, store_dir
) -> None:
    copy = copy_model(tiny_llama, tmp_path / "copied" / "same-weights")
    reseeded = build_tiny_llama(tmp_path / "reseeded", seed=1)
    extra = kvpack_extra(store_dir, memory=False)
    pool = make_pool("mha", "page_first")
    writer = make_backend(pool, extra, model=str(tiny_llama))
    keys = page_keys(4, seed=16)
    try:
        fill_random(pool, seed=16)
        src = alloc_pages(pool, 4)
        want = page_bytes(pool, src)
        assert writer.batch_set_v1(keys, src) == [True] * 4
        assert writer.flush(10)
    finally:
        writer.close()

    reader_pool = make_pool("mha", "page_first")
    reader = make_backend(reader_pool, extra, model=str(copy))
    try:
        assert reader.batch_exists(keys) == 4
        poison(reader_pool)
        dst = alloc_pages(reader_pool, 4)
        assert reader.batch_get_v1(keys, dst) == [True] * 4
        assert page_bytes(reader_pool, dst) == want
    finally:
        reader.close()

    other = make_backend(make_pool("mha", "page_first"), extra, model=str(reseeded))
    try:
        assert other.batch_exists(keys) == 0  # same config and shapes, other weights: another scope
    finally:
        other.close()

    named = make_backend(
        make_pool("mha", "page_first"), kvpack_extra(store_dir, memory=False, model_id="tiny@v1"), model=str(reseeded)
    )
    try:
        assert named.batch_exists(keys) == 0  # model_id is a scope of its own, never the digest's
    finally:
        named.close()


def test_tagged_model_name_is_the_checkpoint_digest_plus_the_format(tiny_llama: Path, tmp_path: Path) -> None:
    """SGLang tags ``model_name`` with the host pool's page format (``<name>-<tag>``)."""
    copy = copy_model(tiny_llama, tmp_path / "copy-of-tiny")
    plain = sglang_model_identity(str(tiny_llama))
    assert plain.startswith("ckpt:v1:") and plain == sglang_model_identity(str(copy))
    tagged = sglang_model_identity(f"{tiny_llama}-unified-token-major")
    assert tagged == f"{plain}|format=unified-token-major" == sglang_model_identity(f"{copy}-unified-token-major")
    assert sglang_model_identity("served-name") == "name:served-name"
    assert sglang_model_identity(str(tiny_llama), model_id="tiny@v1") == "id:tiny@v1"
