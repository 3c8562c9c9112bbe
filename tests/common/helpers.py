"""The core tests' builders: re-exported from `fixtures.builders`, the one set every suite shares."""

from __future__ import annotations

from fixtures.builders import GROUP_FP, MEMBER_FP, SPEC, TOKENS, chunk_id, expect, header, make_item

__all__ = ["GROUP_FP", "MEMBER_FP", "SPEC", "TOKENS", "chunk_id", "expect", "header", "make_item"]
