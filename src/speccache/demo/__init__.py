"""Bundled demo target model, tokenizer and chat data, built locally with no download.

The demo tokenizer is a byte-level BPE (1024 entries) trained at run time on the
bundled ShareGPT file, which makes it deterministic: same data, same trainer
settings, same vocabulary in every process. Ids 0-7 are the special tokens
``<unk> <s> </s> <pad> <|system|> <|user|> <|assistant|> <|end|>``.

Its chat template renders a conversation as::

    <s><|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{assistant}<|end|>...

with nothing between the pieces, and wraps each assistant ``{content}<|end|>``
in ``{% generation %}``, so ``return_assistant_tokens_mask`` marks exactly the
assistant content plus its closing ``<|end|>``. ``add_generation_prompt``
appends ``<|assistant|>``.

The demo target is a tiny random ``LlamaForCausalLM`` (hidden 64, 8 layers, 4
heads, 2 KV heads, intermediate 128, float32, init std 0.1 so hidden states at
different positions stay well apart). :func:`build_tiny_model_dir` builds the
same shape for other architectures, for tests.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from speccache.data import tokenizer_hash
from speccache.format.durable import apply_umask

__all__ = [
    "ARCHITECTURES",
    "CHAT_TEMPLATE",
    "DEMO_VERSION",
    "build_demo_tokenizer",
    "build_tiny_model_dir",
    "demo_data_path",
    "ensure_demo_target",
]

# Bump when the data, tokenizer or model recipe changes, so stale cached targets are not reused.
DEMO_VERSION = 1
_VOCAB_SIZE = 1024
_MARKER = "speccache_demo.json"
_DATA_DIR = Path(__file__).resolve().parent / "data"
_DATA_FORMS = ("sharegpt", "openai")

_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
_ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- elif message['role'] == 'user' or message['role'] == 'system' -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- else -%}"
    "{{- raise_exception('demo chat template: unsupported role ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

_TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}

# Class names, resolved on use so importing this module does not load every model family.
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    # a mixture of experts saved, like Qwen3-235B-A22B, with one tensor per expert (transformers fuses them on load)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"use_sliding_window": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
}


def demo_data_path(form: str = "sharegpt") -> str:
    """Path of the bundled demo chat dataset.

    Args:
        form: ``"sharegpt"`` or ``"openai"``; both files hold the same conversations.

    Returns:
        Absolute path of the ``.jsonl`` file.

    Raises:
        ValueError: ``form`` is not one of the two forms.
    """
    if form not in _DATA_FORMS:
        raise ValueError(f"unknown demo data form {form!r}; use one of {', '.join(_DATA_FORMS)}")
    return str(_DATA_DIR / f"chat_{form}.jsonl")


def _training_texts() -> list[str]:
    texts: list[str] = []
    with open(demo_data_path("sharegpt"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.extend(turn["value"] for turn in json.loads(line)["conversations"])
    return texts


@functools.lru_cache(maxsize=1)
def _trained_backend_json() -> str:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=_SPECIAL_TOKENS + _ROLE_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_texts(), trainer)
    return backend.to_str()


def build_demo_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Build the demo tokenizer (a new object each call; identical vocabulary every time).

    Returns:
        A fast tokenizer with ``<s>``/``</s>``/``<pad>``/``<unk>``, the role markers
        and :data:`CHAT_TEMPLATE`.
    """
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_backend_json()),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens=_ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=_TINY_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def _marker(architecture: str, seed: int, tokenizer: transformers.PreTrainedTokenizerFast, head_dim: int) -> dict:
    return {
        "demo_version": DEMO_VERSION,
        "architecture": architecture,
        "seed": seed,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        # only when not the default, so that a model built before the option still matches its marker
        **({"head_dim": head_dim} if head_dim != _TINY_SHAPE["head_dim"] else {}),
    }


def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _save_model(
    out: Path, architecture: str, seed: int, tokenizer: transformers.PreTrainedTokenizerFast, head_dim: int
) -> None:
    config_name, model_name, extra = ARCHITECTURES[architecture]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **{**_TINY_SHAPE, "head_dim": head_dim},
        **extra,
    )
    # fork_rng keeps the caller's global torch RNG untouched by the seeded init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[end_id, tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = _marker(architecture, seed, tokenizer, head_dim)
    (out / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def build_tiny_model_dir(path: str, architecture: str, seed: int = 0, head_dim: int = 16) -> str:
    """Build (or reuse) a tiny random causal LM with the demo tokenizer in ``path``.

    The model is written to a temporary sibling directory and renamed into place,
    so a reader never sees a half-written model and two racing builders are safe:
    the loser discards its copy and uses the winner's.

    Args:
        path: Target directory; must not exist, be empty, or hold this same build.
        architecture: One of :data:`ARCHITECTURES` (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen3_moe``).
        seed: Torch seed of the random weights.
        head_dim: Attention head size (vLLM's CPU attention needs at least 32; the default 16 keeps the demo small).

    Returns:
        ``path`` as an absolute string, loadable with ``AutoModelForCausalLM`` and
        ``AutoTokenizer`` ``from_pretrained`` offline. For ``qwen2`` transformers 5
        loads ``Qwen2Tokenizer``, which keeps the demo vocabulary, merges, special
        tokens and chat template but swaps in Qwen2's normalizer and pre-tokenizer,
        so text can split differently than with :func:`build_demo_tokenizer`.

    Raises:
        ValueError: Unknown ``architecture``.
        FileExistsError: ``path`` holds something else (delete it or pick another path).
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; use one of {', '.join(ARCHITECTURES)}")
    final = Path(path).expanduser().resolve()
    tokenizer = build_demo_tokenizer()
    wanted = _marker(architecture, seed, tokenizer, head_dim)
    if _read_marker(final) == wanted:
        return str(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(
            f"{final} exists but does not hold the speccache demo model "
            f"({architecture}, seed {seed}, demo version {DEMO_VERSION}); delete it or choose another path"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _save_model(tmp, architecture, seed, tokenizer, head_dim)
        apply_umask(str(tmp))  # mkdtemp and save_pretrained leave it readable by its owner alone
        try:
            os.rename(tmp, final)
        except OSError:
            if _read_marker(final) != wanted:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def ensure_demo_target(path: str | None = None) -> str:
    """Return the demo target model directory, building it on first use.

    Args:
        path: Directory to use; defaults to ``$SPECCACHE_DEMO_TARGET`` or
            ``~/.cache/speccache/demo-target-v1``.

    Returns:
        Absolute path of a directory holding the tiny ``LlamaForCausalLM`` and its tokenizer.

    Raises:
        FileExistsError: The directory holds something else.
    """
    if path is None:
        path = os.environ.get("SPECCACHE_DEMO_TARGET") or os.path.join(
            "~", ".cache", "speccache", f"demo-target-v{DEMO_VERSION}"
        )
    return build_tiny_model_dir(path, "llama", seed=0)
