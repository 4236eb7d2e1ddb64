"""What every method needs of a Hugging Face target: its decoder layers, and one forward that captures them.

A method computes its features from a :data:`Capture`: by default :func:`forward_capturing` over the
transformers model (the ``hf`` engine); an engine in :mod:`speccache.engines` supplies another with the same
contract (the ``vllm`` engine runs the decoder in vLLM and applies the model's own final norm).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

__all__ = [
    "IMAGE_EMBEDS",
    "IMAGE_INPUTS",
    "POSITIONS",
    "Capture",
    "batch_image_inputs",
    "cache_argument",
    "capture_batch",
    "capture_next_inputs",
    "decoder_calls",
    "decoder_layers",
    "final_norm",
    "forward_capturing",
    "is_mrope",
    "is_vision_language",
    "model_image_token_id",
    "vision_inputs",
]


def cache_argument(module: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword that passes a KV ``cache`` to ``module``'s forward (a transformers model or attention layer):
    ``cache`` from transformers 5.2x, ``past_key_values`` before (vLLM's environment pins 5.19). Both forwards
    swallow unknown keywords, so the wrong name would run every step without the tokens before it, silently."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


_LAST = object()
"""The key of the final norm's output among a chunked forward's captured tensors."""


class Capture(Protocol):
    """``(input_ids, attention_mask, outputs, input_of_first[, image_inputs]) -> (last_hidden_state, captured)``, as
    :func:`forward_capturing` with its model bound: padded ``[B, T, H]`` tensors; padding rows are never read.

    ``image_inputs``, the batch's :data:`IMAGE_INPUTS` (empty for text rows), is passed for a vision-language
    target only, so an engine that runs text-only targets takes the first four arguments alone."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        outputs: Mapping[Hashable, int],
        input_of_first: Hashable | None = None,
        image_inputs: Mapping[str, torch.Tensor] | None = None,
        /,
    ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]: ...


IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids")
"""The processor outputs a vision-language target's forward takes besides the ids: the images' pixels and
grids (concatenated over a batch's images), and the per-token modality ids (right-padded with 0, text)."""

POSITIONS = "positions"
"""The capture key of an M-RoPE target's positions, ``[B, T, 3]`` (temporal, height, width), as the forward used
them."""


def batch_image_inputs(
    model_config: Any, batch: Mapping[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor] | None:
    """A padded batch's :data:`IMAGE_INPUTS` on ``device`` for a vision-language target, ``None`` for a text-only
    one (whose :class:`Capture` takes no image inputs)."""
    if not is_vision_language(model_config):
        return None
    return {k: batch[k].to(device) for k in IMAGE_INPUTS if k in batch}


def capture_batch(
    capture: Capture,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    outputs: Mapping[Hashable, int],
    input_of_first: Hashable | None,
    image_inputs: Mapping[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
    """Call ``capture``, passing ``image_inputs`` only when there are some (see :class:`Capture`)."""
    if image_inputs is None:
        return capture(input_ids, attention_mask, outputs, input_of_first)
    return capture(input_ids, attention_mask, outputs, input_of_first, image_inputs)


IMAGE_EMBEDS = "image_embeds"
"""The capture key of a vision-language target's merged input embeddings at its image tokens, ``[B, T, H]``: what
its language model receives as ``inputs_embeds`` (the image features scattered in), zero at every other token."""


def model_image_token_id(model_config: Any) -> int:
    """The id of the token the target's model replaces by image features (its config's ``image_token_id``; LLaVA and
    Gemma 3 name it ``image_token_index``).

    Raises:
        ValueError: the config names none.
    """
    for name in ("image_token_id", "image_token_index"):
        token = getattr(model_config, name, None)
        if token is not None:
            return int(token)
    raise ValueError(f"{type(model_config).__name__} names no image token (image_token_id or image_token_index)")


def is_vision_language(model_config: Any) -> bool:
    """Whether ``model_config`` is a vision-language target's (it has a vision tower)."""
    return getattr(model_config, "vision_config", None) is not None


def is_mrope(model_config: Any) -> bool:
    """Whether the target's text model rotates by 3-D positions (M-RoPE: Qwen2.5-VL, Qwen3-VL)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return isinstance(rope, Mapping) and "mrope_section" in rope


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a Hugging Face causal LM.

    Raises:
        ValueError: the architecture does not expose one.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: cannot find its decoder layers (expected model.get_decoder().layers)"
        )
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    """The decoder's final norm module (transformers' own: e.g. Gemma's adds one to its weight).

    Raises:
        ValueError: the architecture does not expose one as ``model.get_decoder().norm``.
    """
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(
            f"{type(model).__name__}: cannot find its final norm (expected model.get_decoder().norm); use --engine hf"
        )
    return norm


def decoder_calls(length: int, chunk: int | None) -> int:
    """How many decoder forwards :func:`forward_capturing` makes for ``length`` tokens in ``chunk``-token chunks."""
    return 1 if chunk is None or length <= chunk else -(-length // chunk)


@torch.no_grad()
def forward_capturing(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    outputs: Mapping[Hashable, int],
    input_of_first: Hashable | None = None,
    image_inputs: Mapping[str, torch.Tensor] | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
    """Run the target's decoder once, capturing decoder layers' outputs (and the first layer's input).

    A vision-language target (``image_inputs`` given) runs with its images merged into the input embeddings, as
    :func:`_vision_forward` describes; only an M-RoPE target is chunked (:func:`_vision_chunks`).

    With ``chunk``, a sequence longer than ``chunk`` tokens is computed ``chunk`` tokens at a time, each chunk
    attending to the ones before through a KV cache (chunked prefill): the activations of one forward are those
    of a chunk (its attention: ``chunk`` queries over the tokens so far), not of the whole sequence; the features
    are the unchunked forward's up to rounding (fp32: within 1e-5).

    Args:
        model: the causal LM.
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]``; padding on either side (chunked, positions count from the first column as they
            do unchunked, and each chunk's mask is the columns so far).
        outputs: capture key -> decoder layer index whose output (before the final norm) it receives.
        input_of_first: capture key for the first decoder layer's input (the embedding output), if wanted.
        image_inputs: a vision-language target's :data:`IMAGE_INPUTS` of the batch (``None``: a text-only target).
        chunk: the most tokens per forward (``None``: the whole sequence at once).

    Returns:
        ``(last_hidden_state, captured)``: the decoder's output after its final norm, and the captured tensors
        (with a vision-language target's :data:`IMAGE_EMBEDS` and an M-RoPE target's :data:`POSITIONS`).
    """
    if image_inputs is not None:
        return _vision_forward(model, input_ids, attention_mask, outputs, input_of_first, image_inputs, chunk)
    layers = decoder_layers(model)
    captured: dict[Hashable, torch.Tensor] = {}

    def after(key: Hashable) -> Any:
        def capture(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[key] = output[0] if isinstance(output, tuple) else output

        return capture

    def before(key: Hashable) -> Any:
        def capture(_module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            captured[key] = args[0] if args else kwargs["hidden_states"]

        return capture

    handles = [layers[index].register_forward_hook(after(key)) for key, index in outputs.items()]
    if input_of_first is not None:
        handles.append(layers[0].register_forward_pre_hook(before(input_of_first), with_kwargs=True))
    decoder = model.get_decoder()
    try:
        length = input_ids.shape[1]
        if chunk is None or length <= chunk:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return out.last_hidden_state, captured
        return _in_chunks(decoder, {"input_ids": input_ids}, attention_mask, chunk, captured)
    finally:
        for h in handles:
            h.remove()


def _in_chunks(
    decoder: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    attention_mask: torch.Tensor,
    chunk: int,
    captured: dict[Hashable, torch.Tensor],
    sliced: Callable[[int, int], Mapping[str, Any]] | None = None,
) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
    """Run ``decoder`` over ``inputs`` (``[B, T, ...]`` tensors: ids or embeddings) ``chunk`` tokens at a time
    through a KV cache, gathering what its hooks put in ``captured`` chunk by chunk into whole-length tensors.

    ``sliced(start, end)``, if given, returns more keywords for a chunk (sliced positions, deepstack features).
    """
    from transformers import DynamicCache

    length = attention_mask.shape[1]
    config: Any = decoder.config  # the decoder's own (a text config)
    cache = DynamicCache(config=config)
    whole: dict[Hashable, torch.Tensor] = {}  # the outputs, filled chunk by chunk (no concatenated copy)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        out = decoder(
            **{name: value[:, start:end] for name, value in inputs.items()},
            **(sliced(start, end) if sliced is not None else {}),
            attention_mask=attention_mask[:, :end],  # the tokens so far: the cache's and this chunk's
            use_cache=True,
            **cache_argument(decoder, cache),
        )
        captured[_LAST] = out.last_hidden_state
        for key, part in captured.items():
            if key not in whole:
                whole[key] = part.new_empty((part.shape[0], length, *part.shape[2:]))
            whole[key][:, start:end] = part
        captured.clear()
    last = whole.pop(_LAST)
    return last, whole


def _vision_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    outputs: Mapping[Hashable, int],
    input_of_first: Hashable | None,
    image_inputs: Mapping[str, torch.Tensor],
    chunk: int | None = None,
) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
    """The forward of a vision-language target (its ``ForConditionalGeneration``'s ``model``) with the pixels.

    Layer ``i``'s output is captured as the next module reads it (layer ``i + 1``'s input, or the final norm's):
    Qwen3-VL adds its deepstack image features to the residual stream after a layer's forward, and vLLM's EAGLE-3
    capture, like the next layer, sees the sum. An M-RoPE target's positions come from the model's own
    ``get_rope_index`` and are passed explicitly (never its cached ``rope_deltas``). :data:`IMAGE_EMBEDS` are
    the ``inputs_embeds`` the base's ``language_model`` is called with, kept at the model's image tokens. With
    ``chunk``, an M-RoPE target's sequence longer than ``chunk`` runs in chunks (:func:`_vision_chunks`; the engine
    refuses the others).
    """
    captured: dict[Hashable, torch.Tensor] = {}
    handles = capture_next_inputs(model, outputs, captured)
    if input_of_first is not None:
        handles += capture_next_inputs(model, {input_of_first: -1}, captured)
    base: Any = model.model  # the ForConditionalGeneration's vision-language model
    at_image = (input_ids == model_image_token_id(model.config)).unsqueeze(-1)

    def image_rows(embeds: torch.Tensor) -> torch.Tensor:
        # What every family's language model receives, whatever it did to get there (Gemma 3 scales the text
        # embeddings, not the image features): kept at the image tokens only, text rows being embed_tokens(ids).
        return torch.where(at_image, embeds, 0.0)

    def merged(_module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        captured[IMAGE_EMBEDS] = image_rows(kwargs["inputs_embeds"])

    merged_hook = base.language_model.register_forward_pre_hook(merged, with_kwargs=True)
    handles.append(merged_hook)
    try:
        inputs = vision_inputs(model, input_ids, attention_mask, image_inputs)
        if chunk is not None and input_ids.shape[1] > chunk:
            merged_hook.remove()  # the chunks call the language model once each, a chunk of the embeddings at a time
            last, got, embeds = _vision_chunks(model, input_ids, attention_mask, inputs, chunk, captured)
            got[IMAGE_EMBEDS] = image_rows(embeds)
        else:
            out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **inputs)
            last, got = out.last_hidden_state, captured
        if "position_ids" in inputs:
            got[POSITIONS] = inputs["position_ids"].permute(1, 2, 0)
        return last, got
    finally:
        for h in handles:
            h.remove()


def vision_inputs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_inputs: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The keywords of a vision-language target's forward over ``input_ids`` besides the ids and the mask: the
    :data:`IMAGE_INPUTS` on the model's device (pixels in its dtype), and for an M-RoPE target ``position_ids``
    ``[3, B, T]`` from the model's own ``get_rope_index``, so that no forward reads the ``rope_deltas`` the model
    caches from an earlier call."""
    parameter = next(model.parameters())
    inputs = {
        k: v.to(parameter.device, parameter.dtype if v.is_floating_point() else v.dtype)
        for k, v in image_inputs.items()
    }
    if is_mrope(model.config):
        modality = inputs.pop("mm_token_type_ids", None)
        base: Any = model.model  # the ForConditionalGeneration's vision-language model
        inputs["position_ids"] = base.get_rope_index(
            input_ids,
            mm_token_type_ids=torch.zeros_like(input_ids) if modality is None else modality,
            image_grid_thw=inputs.get("image_grid_thw"),
            attention_mask=attention_mask,
        )[0]
    return inputs


def capture_next_inputs(
    model: nn.Module, outputs: Mapping[Hashable, int], captured: dict[Hashable, torch.Tensor]
) -> list[Any]:
    """Hooks that put decoder layer ``index``'s output into ``captured[key]`` as the next module reads it (layer
    ``index + 1``'s input, or the final norm's; ``index`` -1: the first layer's input): Qwen3-VL adds its
    deepstack image features after a layer's forward, and vLLM's EAGLE-3 capture, like the next layer, sees the
    sum. Returns the handles to remove."""
    layers = decoder_layers(model)
    consumers = [*layers, final_norm(model)] if max(outputs.values(), default=0) + 1 >= len(layers) else layers

    def before(key: Hashable) -> Any:
        def capture(_module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            captured[key] = args[0] if args else kwargs["hidden_states"]

        return capture

    return [consumers[i + 1].register_forward_pre_hook(before(k), with_kwargs=True) for k, i in outputs.items()]


class _LanguageModelCall(Exception):
    """Stops a vision-language model's forward where it calls its language model, with the keywords it passes."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("the vision-language model's inputs are merged")
        self.kwargs = kwargs


def _vision_chunks(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    chunk: int,
    captured: dict[Hashable, torch.Tensor],
) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor], torch.Tensor]:
    """An M-RoPE target's forward in ``chunk``-token chunks (chunked prefill), exact as text chunks are; returns
    :func:`_in_chunks`'s result and the merged input embeddings the chunks ran over.

    The vision-language model runs up to its language model call (images encoded and merged into the input
    embeddings by its own code), and the language model then runs over the merged embeddings chunk by chunk with
    each chunk's slice of the explicit positions; Qwen3-VL's deepstack features are split with them (the rows of
    the image tokens in the chunk), as its layers add them at those tokens. Exact because the language model's
    attention is causal at image tokens too and every position is explicit.
    """
    decoder: nn.Module = model.get_decoder()  # type: ignore[operator]  # nn.Module's __getattr__ stub
    base: Any = model.model  # the ForConditionalGeneration's vision-language model

    def stop(_module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        raise _LanguageModelCall(kwargs)

    handle = decoder.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **inputs)
        raise AssertionError(f"{type(model).__name__}: its forward never called its language model")
    except _LanguageModelCall as call:
        merged = call.kwargs
    finally:
        handle.remove()
    positions = merged["position_ids"]
    visual, deepstack = merged.get("visual_pos_masks"), merged.get("deepstack_visual_embeds")
    if visual is not None and deepstack is not None:
        # row i of each deepstack tensor belongs to the i-th image token in (batch, position) order
        order = torch.zeros(visual.shape, dtype=torch.long, device=visual.device)
        order[visual] = torch.arange(int(visual.sum()), device=visual.device)

    def sliced(start: int, end: int) -> dict[str, Any]:
        part: dict[str, Any] = {"position_ids": positions[..., start:end]}
        if visual is not None and deepstack is not None:
            rows = order[:, start:end][visual[:, start:end]]
            part |= {"visual_pos_masks": visual[:, start:end], "deepstack_visual_embeds": [d[rows] for d in deepstack]}
        return part

    embeds = merged["inputs_embeds"]
    last, got = _in_chunks(decoder, {"inputs_embeds": embeds}, attention_mask, chunk, captured, sliced)
    return last, got, embeds
