"""Model identity (`kvpack.identity.model_identity`): a digest of what a checkpoint is, not where it lives.

Checkpoints are written by hand here (config.json + safetensors files: 8-byte
little-endian header length, JSON header, raw bytes), so the tests need no
torch and every byte is known.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path

import pytest

from kvpack.config.schema import KVPackConfig
from kvpack.errors import ConfigError
from kvpack.identity import model_identity as mi
from kvpack.identity.model_identity import IdentitySource, checkpoint_digest, checkpoint_kv_heads, model_identity

CONFIG = {
    "_name_or_path": "/somewhere/tiny",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "torch_dtype": "float32",
    "transformers_version": "4.57.0",
}

Tensors = dict[str, tuple[str, tuple[int, ...], bytes]]
"""name -> (dtype, shape, raw bytes)."""


def tensors(seed: int = 0, dtype: str = "F32") -> Tensors:
    """Three tensors whose bytes depend on `seed` (as a rebuild with another seed)."""
    size = 2 if dtype in ("F16", "BF16") else 4

    def data(n: int, salt: int) -> bytes:
        return bytes((seed * 31 + salt * 7 + i * 13) % 256 for i in range(n * size))

    return {
        "model.embed_tokens.weight": (dtype, (16, 8), data(128, 1)),
        "model.layers.0.self_attn.k_proj.weight": (dtype, (8, 8), data(64, 2)),
        "lm_head.weight": (dtype, (16, 8), data(128, 3)),
    }


def write_safetensors(path: Path, items: Tensors) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    payload = b""
    for name, (dtype, shape, raw) in items.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(payload), len(payload) + len(raw)]}
        payload += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + payload)


def checkpoint(
    path: Path, config: dict[str, object] | None = None, items: Tensors | None = None, shards: int = 1
) -> Path:
    """A checkpoint directory: config.json and `shards` safetensors files (an index when > 1)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config if config is not None else CONFIG, indent=2))
    items = items if items is not None else tensors()
    if shards == 1:
        write_safetensors(path / "model.safetensors", items)
        return path
    names = list(items)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        part = {n: items[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(path / fname, part)
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    mi.clear_cache()


def ident(path: Path, **kw: object) -> str:
    return model_identity(path, **kw).value  # type: ignore[arg-type]


def test_digest_is_stable_across_copies_and_paths(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a" / "tiny")
    b = tmp_path / "elsewhere" / "copy-of-tiny"
    shutil.copytree(a, b)
    (b / "README.md").write_text("not part of the identity")
    got = model_identity(a)
    assert got.source is IdentitySource.DIGEST and got.value.startswith("ckpt:v1:")
    assert ident(b) == got.value
    assert ident(Path(os.path.relpath(b))) == got.value  # a relative spelling of the same directory
    # the same tensors, resharded into two files with an index, are the same checkpoint
    assert ident(checkpoint(tmp_path / "sharded", shards=2)) == got.value


def test_config_fields_that_change_nothing_are_ignored(tmp_path: Path) -> None:
    base = ident(checkpoint(tmp_path / "a"))
    renamed = dict(CONFIG, _name_or_path="/other/place", transformers_version="5.0.0")
    del renamed["torch_dtype"]
    renamed["dtype"] = "float32"  # the newer name of torch_dtype
    assert ident(checkpoint(tmp_path / "b", config=renamed)) == base


@pytest.mark.parametrize(
    "change",
    [
        "config_field",
        "architectures_order",
        "tensor_name",
        "tensor_shape",
        "tensor_dtype",
        "weights_seed",
        "extra_tensor",
    ],
)
def test_digest_changes_with_what_the_model_computes(tmp_path: Path, change: str) -> None:
    base = ident(checkpoint(tmp_path / "base", config=dict(CONFIG, architectures=["A", "B"])))
    config: dict[str, object] = dict(CONFIG, architectures=["A", "B"])
    items = tensors()
    if change == "config_field":
        config["num_key_value_heads"] = 1
    elif change == "architectures_order":
        config["architectures"] = ["B", "A"]
    elif change == "tensor_name":
        items["model.layers.0.self_attn.v_proj.weight"] = items.pop("model.layers.0.self_attn.k_proj.weight")
    elif change == "tensor_shape":
        dtype, _, raw = items["lm_head.weight"]
        items["lm_head.weight"] = (dtype, (8, 16), raw)
    elif change == "tensor_dtype":
        items = {n: ("I32", shape, raw) for n, (_, shape, raw) in items.items()}
    elif change == "weights_seed":
        items = tensors(seed=1)  # same names, shapes, dtypes and config: other weights
    elif change == "extra_tensor":
        items["model.norm.weight"] = ("F32", (8,), bytes(32))
    assert ident(checkpoint(tmp_path / "changed", config=config, items=items)) != base


def test_a_rebuild_in_place_is_seen_despite_the_cache(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "m")
    first = ident(path)
    assert ident(path) == first  # cached
    shutil.rmtree(path)
    checkpoint(path, items=tensors(seed=5))
    assert ident(path) != first


def test_only_headers_and_samples_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded cost: a 4 MiB tensor costs 3 samples of SAMPLE_BYTES, never its data."""
    big = {"w": ("F32", (1024, 1024), os.urandom(4 << 20))}
    path = checkpoint(tmp_path / "big", items=big)
    read: list[int] = []
    real = os.pread
    monkeypatch.setattr(mi.os, "pread", lambda fd, n, at: read.append(n) or real(fd, n, at))
    checkpoint_digest(path)
    assert read == [mi.SAMPLE_BYTES] * 3


def test_model_id_overrides_the_digest(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a")
    b = checkpoint(tmp_path / "b", items=tensors(seed=9))
    assert ident(a) != ident(b)
    assert ident(a, model_id="tiny@v1") == ident(b, model_id="tiny@v1") == "id:tiny@v1"
    assert model_identity(a, model_id="tiny@v1").source is IdentitySource.MODEL_ID
    assert ident(a, model_id="tiny@v2") != ident(a, model_id="tiny@v1")


def test_model_id_config_field_is_validated() -> None:
    assert KVPackConfig.from_dict({"model_id": "org/llama-3.1-8b@rev2"}).model_id == "org/llama-3.1-8b@rev2"
    assert KVPackConfig().model_id == ""
    for bad in ("has space", "../x", "a\nb", "x" * 300, 5):
        with pytest.raises(ConfigError, match="model_id"):
            KVPackConfig.from_dict({"model_id": bad})


def test_hub_name_falls_back_to_the_name_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvpack.identity.model_identity")
    got = model_identity("meta-llama/Llama-3.1-8B", revision="abc123")
    assert got.source is IdentitySource.NAME and got.value == "name:meta-llama/Llama-3.1-8B@abc123"
    assert model_identity("meta-llama/Llama-3.1-8B", revision="abc123") == got
    assert ident(tmp_path / "missing") == f"name:{tmp_path / 'missing'}"
    notes = [r for r in caplog.records if "not a local checkpoint" in r.getMessage()]
    assert len(notes) == 2  # once per name
    assert model_identity("meta-llama/Llama-3.1-8B").value != got.value  # the revision is part of it


def test_damaged_header_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "bad")
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="model.safetensors"):
        checkpoint_digest(path)


def test_checkpoint_without_safetensors_samples_its_files(tmp_path: Path) -> None:
    a = tmp_path / "bin"
    a.mkdir()
    (a / "config.json").write_text(json.dumps(CONFIG))
    (a / "pytorch_model.bin").write_bytes(bytes(range(256)) * 64)
    first = ident(a)
    (a / "pytorch_model.bin").write_bytes(bytes(range(255, -1, -1)) * 64)
    assert ident(a) != first and ident(a).startswith("ckpt:v1:")


def test_an_engine_page_format_splits_the_identity_whatever_names_the_model(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "a")
    plain = model_identity(path)
    tagged = model_identity(path, page_format="unified")
    assert tagged.value == f"{plain.value}|format=unified" and tagged.source is IdentitySource.DIGEST
    assert model_identity(path, model_id="m@1", page_format="unified").value == "id:m@1|format=unified"
    assert model_identity("served", page_format="unified").value == "name:served|format=unified"


@pytest.mark.parametrize(
    ("config", "heads"),
    [
        ({"num_key_value_heads": 8, "num_attention_heads": 32}, 8),
        ({"num_attention_heads": 32}, 32),
        ({"text_config": {"num_key_value_heads": 4}, "num_key_value_heads": 8}, 4),  # multimodal: the text model's
        ({"num_key_value_heads": True}, 0),
        ({"num_key_value_heads": 0}, 0),
        ([1, 2], 0),
    ],
)
def test_kv_heads_from_the_checkpoint_config(tmp_path: Path, config: object, heads: int) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_kv_heads(tmp_path) == heads


def test_kv_heads_unknown_without_a_readable_config(tmp_path: Path) -> None:
    assert checkpoint_kv_heads(tmp_path) == 0 and checkpoint_kv_heads("") == 0
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_kv_heads(tmp_path) == 0
