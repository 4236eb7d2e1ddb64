"""The ``hf`` generator of ``speccache regenerate``: the target loaded with transformers, answering with this
module's own generation loop.

The loop runs the model with a KV cache (transformers' ``DynamicCache``) over batches of at most
``batch_size`` prompts, left-padded, with the attention mask and position ids of the padded rows; a row leaves
its batch (and the cache) when its answer ends, so the forwards shrink as answers end. Every row samples with
its own ``torch.Generator`` (its stream), one uniform per generated token, so what a row gets does not depend
on the rows batched with it (up to the rounding of batched matrix products).

A vision-language target's prompts come with their image inputs, given to the prefill; an M-RoPE target's
positions are its own ``get_rope_index`` of the padded batch, and each generated token's one more on all three
rows, as transformers' ``generate`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speccache.data import MODALITY_KEYS
from speccache.devices import target_device
from speccache.engines.generation import Answer, GenerationSettings
from speccache.engines.hf import load_target
from speccache.methods.decoder import cache_argument, vision_inputs

__all__ = ["HfGenerator", "Sampling", "generate_batch"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (``temperature`` 0) or sampled with top-k and top-p."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def choose(self, logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """One token per row of ``logits [B, V]``; a sampled row draws one uniform from its own generator."""
        if self.temperature == 0:
            return logits.argmax(-1)
        scores = logits.float().cpu() / self.temperature
        if self.top_k > 0:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            ordered, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (its first token always)
            drop = ordered.cumsum(-1) - ordered >= self.top_p
            probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
        cdf = probs.double().cumsum(-1)
        draws = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
        chosen = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
        return chosen.clamp(max=probs.shape[-1] - 1).to(logits.device)


@torch.inference_mode()
def generate_batch(
    model: Any,
    prompts: list[list[int]],
    generators: list[torch.Generator],
    sampling: Sampling,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    pad_id: int,
    on_tokens: Callable[[int], None] | None = None,
    images: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> list[tuple[list[int], bool]]:
    """Generate for left-padded ``prompts`` with a KV cache; per prompt ``(new ids, ended)``.

    ``ended``: the model emitted a stop token (the last id); otherwise the answer was cut at ``max_new_tokens``.
    ``on_tokens(n)`` is told of each step's ``n`` new tokens (one per open row). ``images``: a vision-language
    target's image inputs of each prompt (:meth:`HfGenerator.generate`), given to the prefill.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention[i, width - len(prompt) :] = 1
    ids, attention = ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    inputs = {} if images is None else vision_inputs(model, ids, attention, _left_padded(images, width))
    # an M-RoPE target's [3, B, T] positions: passed on every step, never left to the rope_deltas the model caches
    positions = inputs.pop("position_ids", positions)
    cache = DynamicCache()
    kv = cache_argument(model, cache)
    logits = model(
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions,
        **inputs,
        **kv,
        use_cache=True,
        logits_to_keep=1,
    ).logits
    out: list[list[int]] = [[] for _ in prompts]
    open_rows = list(range(len(prompts)))  # the prompts still answering, in the order of the batch's rows
    stops = torch.tensor(sorted(stop_ids), device=device)
    # a prompt ends in text, whose M-RoPE position is the prompt's largest on all three rows: generate's next one
    position = positions[..., -1:]
    for step in range(max_new_tokens):
        # only open rows draw: a row's generator carries over to its next turn, whoever it was batched with
        chosen = sampling.choose(logits[:, -1], [generators[i] for i in open_rows])
        ended = torch.isin(chosen, stops).tolist()
        for i, token in zip(open_rows, chosen.tolist()):
            out[i].append(token)
        if on_tokens is not None:
            on_tokens(len(open_rows))
        if all(ended) or step == max_new_tokens - 1:
            break
        if any(ended):
            # rows that ended leave the batch (their cache rows too), so the forwards shrink as answers end
            keep = torch.tensor([k for k, stop in enumerate(ended) if not stop], device=device)
            cache.batch_select_indices(keep)
            attention, position, chosen = attention[keep], position[..., keep, :], chosen[keep]
            open_rows = [i for i, stop in zip(open_rows, ended) if not stop]
        position = position + 1
        attention = torch.cat([attention, attention.new_ones((len(open_rows), 1))], dim=-1)
        logits = model(
            input_ids=chosen.unsqueeze(-1), attention_mask=attention, position_ids=position, **kv, use_cache=True
        ).logits
    return [(o, bool(o) and o[-1] in stop_ids) for o in out]


def _left_padded(images: Sequence[Mapping[str, torch.Tensor]], width: int) -> dict[str, torch.Tensor]:
    """The prompts' image inputs as one batch: per-token modality ids ``[1, T]`` left-padded with 0 (text) to
    ``width`` as the ids are, the pixels and grids concatenated in prompt order."""
    out: dict[str, torch.Tensor] = {}
    for key in {k for one in images for k in one}:
        parts = [one[key] for one in images if key in one]
        if key in MODALITY_KEYS:
            out[key] = torch.cat([torch.nn.functional.pad(p, (width - p.shape[-1], 0)) for p in parts])
        else:
            out[key] = torch.cat(parts)
    return out


class HfGenerator:
    """The ``hf`` generator (:class:`speccache.engines.generation.Generator`): :func:`generate_batch` over
    batches of ``batch_size`` of the prompts, in their order."""

    name = "hf"

    @classmethod
    def check_flags(cls, config: Any) -> None:
        """Every regenerate flag is the ``hf`` generator's."""

    @classmethod
    def version(cls) -> str:
        """transformers' version."""
        import transformers

        return transformers.__version__

    def __init__(self, settings: GenerationSettings) -> None:
        self.settings = settings
        self.sampling = Sampling(settings.temperature, settings.top_p, settings.top_k)
        self.model: Any = None

    def stream(self, seed: int) -> torch.Generator:
        """The row's ``torch.Generator``: it carries over from turn to turn."""
        return torch.Generator().manual_seed(seed)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        streams: Sequence[Any],
        on_tokens: Callable[[int], None] | None = None,
        images: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> list[Answer]:
        """The answers, batch after batch (the model is loaded at the first call)."""
        s = self.settings
        if self.model is None:
            self.model = load_target(s.model, s.dtype, target_device(s.device)).model
        answers: list[Answer] = []
        for start in range(0, len(prompts), s.batch_size):
            batch = slice(start, start + s.batch_size)
            answers += generate_batch(
                self.model,
                [list(p) for p in prompts[batch]],
                list(streams[batch]),
                self.sampling,
                s.max_new_tokens,
                s.stop_ids,
                s.pad_id,
                on_tokens,
                None if images is None else images[batch],
            )
        return answers

    def close(self) -> None:
        """Drop the model."""
        self.model = None
