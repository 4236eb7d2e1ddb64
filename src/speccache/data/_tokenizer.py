"""What a run's chat format is built from: the model source, its tokenizer, ``--chat-template`` and ``--tools``
files; and the tokenizer's fingerprint."""

from __future__ import annotations

import json
import os
from typing import Any

import xxhash

from speccache.data._failure import RowFailure
from speccache.data._messages import tool_list
from speccache.data._mistral import mistral_common_path
from speccache.errors import DataError

__all__ = [
    "chat_template_of",
    "check_model_source",
    "load_chat_tokenizer",
    "load_template_file",
    "load_tools_file",
    "tokenizer_hash",
    "tokenizer_template",
]


def load_template_file(path: str) -> str:
    """Read a ``--chat-template`` Jinja file.

    Raises:
        DataError: the file cannot be read as UTF-8 text.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--chat-template {path}: cannot read the template ({e}); pass a UTF-8 Jinja file") from e


def load_tools_file(path: str) -> list[dict]:
    """Read a ``--tools`` file: a JSON list of tool schemas, rendered for every row that has none.

    Raises:
        DataError: the file cannot be read or is not such a list.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--tools {path}: cannot read the file ({e}); pass a UTF-8 JSON file") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"--tools {path}:{e.lineno}: invalid JSON ({e.msg}); the file holds one JSON list of tool schemas"
        ) from e
    try:
        return tool_list(value, f"--tools {path}")
    except RowFailure as e:
        raise DataError(str(e)) from None


def tokenizer_template(tokenizer: Any) -> str | None:
    try:
        return tokenizer.get_chat_template()
    except (ValueError, NotImplementedError, AttributeError):
        return None


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template, or None when it has none or cannot give one (``MistralCommonBackend``)."""
    return tokenizer_template(tokenizer)


def check_model_source(model: str, flag: str = "--model") -> None:
    """Refuse, within seconds, a model that is neither a local directory nor a hub id this machine can load.

    A name that is no directory is read as a hub id (``name`` or ``org/name``): it passes when the local
    Hugging Face cache holds it, or when the hub answers for it; offline (``HF_HUB_OFFLINE``) or unreachable,
    transformers would otherwise spend half a minute in retries before saying so.

    Raises:
        FileNotFoundError: neither reading gives a model; the message names both and the fix.
    """
    if os.path.isdir(model):
        return
    if os.path.exists(model):
        raise FileNotFoundError(f"{flag} {model} is a file; give the model's directory")
    missing = f"{flag} {model}: no such model directory"
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or not model.strip("/"):
        raise FileNotFoundError(f"{missing}; fix the path")
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        cached = huggingface_hub.try_to_load_from_cache(model, "config.json")
    except HFValidationError:  # not a valid hub id either
        raise FileNotFoundError(f"{missing}; fix the path") from None
    if isinstance(cached, str):
        return
    hub = f"and as a hub id it is not in the local Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE})"
    fix = f"give the model's local directory, or download it first (hf download {model})"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"{missing}, {hub} and HF_HUB_OFFLINE is set; {fix}")
    try:
        huggingface_hub.model_info(model, timeout=10)
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{missing}, {hub} nor on the hub (or it is private: log in); {fix}") from None
    except Exception as exc:  # noqa: BLE001 - the hub client's network errors come from its own HTTP library
        raise FileNotFoundError(f"{missing}, {hub}, and the hub cannot be reached ({exc}); {fix}") from None


def load_chat_tokenizer(model: str, template_file: str | None = None) -> Any:
    """Load ``model``'s tokenizer as a fast tokenizer, the kind whose offsets the masks need.

    ``AutoTokenizer`` may give a backend without ``get_chat_template`` or offsets (``MistralCommonBackend``
    when ``mistral-common`` is installed and the folder has ``tekken.json``); then the folder's tokenizer is
    loaded as a ``PreTrainedTokenizerFast`` instead, where it has a chat template (or ``template_file``, the
    ``--chat-template``, gives one). Otherwise a ``MistralCommonBackend`` is kept: its rows are encoded by
    mistral-common itself (:class:`MistralCommonFormat`).

    Raises:
        DataError: neither a fast tokenizer nor a ``MistralCommonBackend`` can be loaded from the folder.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(model)
    if getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer"):
        return tokenizer
    try:
        fast = PreTrainedTokenizerFast.from_pretrained(model)
    except (OSError, ValueError) as e:
        fast, error = None, e
    if fast is not None and (template_file or tokenizer_template(fast) is not None):
        return fast
    if mistral_common_path(tokenizer) is not None:
        return tokenizer
    if fast is not None:
        return fast
    raise DataError(
        f"--model {model}: the tokenizer loads as {type(tokenizer).__name__}, which gives neither a chat "
        "template nor token offsets, and the folder has no loadable tokenizer.json; add the model's "
        f"tokenizer.json (a Hugging Face fast tokenizer) to the folder ({error})"
    ) from error


def tokenizer_hash(tokenizer: Any) -> str:
    """Fingerprint a tokenizer, stable across processes and save/load round trips.

    Covers the vocabulary (sorted by token), the special tokens, the chat
    template and, for a fast tokenizer, the backend's normalizer, pre-tokenizer
    and model settings (BPE merges...), which decide how text splits into that
    vocabulary. Padding and truncation settings, which transformers changes at
    run time, are left out.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        An xxh3_128 hex digest.
    """
    template = chat_template_of(tokenizer)
    payload: dict[str, Any] = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items()),
        "all_special_tokens": sorted(str(t) for t in tokenizer.all_special_tokens),
        "chat_template": template,
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pipeline = json.loads(backend.to_str())
        model = {k: v for k, v in (pipeline.get("model") or {}).items() if k != "vocab"}
        payload["backend"] = {
            "normalizer": pipeline.get("normalizer"),
            "pre_tokenizer": pipeline.get("pre_tokenizer"),
            "model": model,
        }
    encoded = json.dumps(payload, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(encoded.encode("utf-8"))
