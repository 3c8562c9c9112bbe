"""A vLLM LoRA request's key seed names its adapter by content (`request_scopes.lora_identity`): a
real ``LoRARequest`` on real adapter files, without an engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.lora_adapter import write_adapter
from kvpack.config.schema import KVPackConfig

pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm_helpers import fake_request  # noqa: E402

from kvpack.vllm_plugin.request_scopes import request_scope  # noqa: E402


def scope_seed(lora: LoRARequest | None) -> object:
    request = fake_request([1, 2, 3])
    request.lora_request = lora
    return request_scope(request, KVPackConfig()).seed


def test_an_adapter_reloaded_under_the_same_name_and_id_with_other_weights_never_shares(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "sql-lora", seed=0)
    first = scope_seed(LoRARequest("sql-lora", 1, str(path)))
    write_adapter(path, seed=1)  # other weights, the same name, id and path (a hot reload)
    second = scope_seed(LoRARequest("sql-lora", 1, str(path)))
    assert first is not None and second is not None and first != second
    assert scope_seed(None) not in (first, second)


def test_the_same_adapter_under_another_name_shares(tmp_path: Path) -> None:
    a = scope_seed(LoRARequest("a", 1, str(write_adapter(tmp_path / "a", seed=5))))
    b = scope_seed(LoRARequest("b", 2, str(write_adapter(tmp_path / "b", seed=5))))
    assert a == b
