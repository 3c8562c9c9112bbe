"""`kvpack.with_weights`: the layout's model, and so every fingerprint, names the weights held."""

from __future__ import annotations

from kvpack import KVLayoutSpec, WeightsOrigin, WeightsState, with_weights


def scoped_fingerprint(base: str, state: WeightsState) -> str:
    return with_weights(base, state.identity)


def group(model: str) -> str:
    return KVLayoutSpec(engine="sglang:page_first", model=model, dtype="float16", chunk_tokens=16).group_fingerprint


def test_the_start_up_weights_keep_every_fingerprint() -> None:
    base = "ckpt:v1:" + "a" * 32
    assert scoped_fingerprint(base, WeightsState()) == base
    assert scoped_fingerprint(base, WeightsState(3, "", WeightsOrigin.CHECKPOINT)) == base  # reloaded itself


def test_other_weights_get_other_groups_and_the_same_weights_the_same() -> None:
    base = "ckpt:v1:" + "a" * 32
    b = WeightsState(1, "ckpt:v1:" + "b" * 32, WeightsOrigin.RELOADED)
    b_later = WeightsState(4, b.identity, WeightsOrigin.RELOADED)
    private = WeightsState(2, "private:" + "c" * 32, WeightsOrigin.PRIVATE)
    scoped = {scoped_fingerprint(base, s) for s in (WeightsState(), b, private)}
    assert len(scoped) == 3
    assert scoped_fingerprint(base, b) == scoped_fingerprint(base, b_later)  # engines on B share
    assert len({group(m) for m in scoped}) == 3
    assert scoped_fingerprint(base, b) != b.identity  # not taken for an engine that started on B
