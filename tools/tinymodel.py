"""Tiny Llama models built on disk, offline (no hub), for the engine tests and benches.

A model is a `LlamaConfig` with random weights plus a word-level tokenizer
trained offline with the `tokenizers` library and saved as
`PreTrainedTokenizerFast`. Building is deterministic (fixed seeds) and cached:
a directory that already holds a complete model is reused.

Used by `kvpack demo`, the benchmarks and the tests (tests/fixtures/tiny_model.py
wraps these as pytest fixtures). Needs `transformers` and `tokenizers`, which
every engine install has; imported lazily::

    from kvpack.tools.tinymodel import build_tiny_llama, build_bench_llama
    path = build_tiny_llama("/tmp/tiny-llama")
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

VOCAB_WORDS = 2000
"""Words in the tokenizer's vocabulary (plus a few special tokens)."""

_DONE = "kvpack_model.json"


def _train_tokenizer(path: Path, vocab_words: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_words)]
    corpus = [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"], vocab_size=vocab_words + 3)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    dtype: str = "float32",
    max_positions: int = 4096,
    initializer_range: float = 0.15,
    seed: int = 0,
    sliding_window: int | None = None,
    layer_types: tuple[str, ...] | None = None,
) -> Path:
    """Write a random-weight Llama + tokenizer to `path` (reused if already built).

    `initializer_range` 0.15 gives varied, non-repeating greedy output, so
    damaged KV shows in the tokens. `layer_types` ("full_attention" or
    "sliding_attention" per layer) with `sliding_window` (tokens) makes a
    sliding-window hybrid: vLLM's hybrid allocator gives it one KV cache group
    per attention type. Returns the model directory.
    """
    if (sliding_window is None) != (layer_types is None):
        raise ValueError("sliding_window and layer_types go together")
    if layer_types is not None and len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    spec = dict(
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate or hidden * 2,
        dtype=dtype,
        max_positions=max_positions,
        initializer_range=initializer_range,
        seed=seed,
    )
    if layer_types is not None:
        spec.update(sliding_window=sliding_window, layer_types=list(layer_types))
    done = out / _DONE
    if done.exists():
        try:
            if json.loads(done.read_text()) == spec:
                return out
        except (OSError, ValueError):
            pass
        shutil.rmtree(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = _train_tokenizer(tmp, VOCAB_WORDS)
    # The SGLang venv's transformers knows only `torch_dtype`; newer ones take it as the old name of `dtype` (and
    # their typed signature lists only `dtype`), so it goes in untyped.
    by_old_name: dict[str, Any] = {"torch_dtype": dtype}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,  # spec["intermediate"]
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **by_old_name,
    )
    if layer_types is not None:
        config.sliding_window = sliding_window
        config.layer_types = list(layer_types)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / _DONE).write_text(json.dumps(spec))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


BENCH_SIZES: dict[str, int | str | float] = dict(
    num_layers=6,
    hidden=1024,
    heads=16,
    kv_heads=4,
    intermediate=2816,
    dtype="bfloat16",
    max_positions=8192,
    initializer_range=0.02,
)
"""The benchmark model's sizes (prefill of 3000 tokens costs real time on a CPU)."""


def build_bench_llama(path: str | os.PathLike[str]) -> Path:
    """The benchmark model: 6 layers, hidden 1024, 16 heads, 4 kv heads, bf16."""
    return build_tiny_llama(path, **BENCH_SIZES)  # type: ignore[arg-type]


def build_bench_swa_llama(path: str | os.PathLike[str]) -> Path:
    """The benchmark model as a sliding-window hybrid: the same sizes, layers 0 and 3
    full attention, the others a 1024-token window (vLLM gives it several KV cache groups)."""
    return build_tiny_llama(
        path,
        **BENCH_SIZES,  # type: ignore[arg-type]
        sliding_window=1024,
        layer_types=("full_attention", "sliding_attention", "sliding_attention") * 2,
    )


def copy_model(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """A copy of a built model under another path (e.g. a draft model)."""
    out = Path(dst)
    if not (out / _DONE).exists():
        shutil.copytree(src, out, dirs_exist_ok=True)
    return out
