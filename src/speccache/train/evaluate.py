"""``speccache evaluate``: how much a draft would speed up its target, measured two ways, against two baselines.

1. **Teacher-forced, on a held-out cache.** For each chain start ``s`` whose ``position_mask`` counts (the
   target's distribution at row ``s + 1``), the draft's training-time-test steps ``a = 0..k-1`` predict rows
   ``s + 1 + a``; a step is accepted when its token (a target id) is the target's argmax and every earlier step
   was. Reported: per-step acceptance (step ``a`` accepted given steps ``< a`` were) and the mean accepted
   length (0..k).
2. **Greedy speculative decoding with the target** (Hugging Face, batch 1, KV cache): the proposer drafts a
   chain of up to ``k`` tokens, the target verifies them in one forward and keeps the longest prefix that
   equals its own greedy choice plus its next token. Reported: tau (new tokens per target forward, prefill
   included, so plain greedy decoding has tau 1) and the wall-clock speed-up over plain greedy decoding
   through the same loop. The output equals the target's own greedy output token for token.

Baselines: prompt lookup (the continuation of the latest earlier occurrence of the last 3, 2 or 1 tokens in
the sequence so far) and an n-gram table of the training cache (the most frequent generated token after the
last two tokens, else after the last one).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from speccache.data import MODALITY_KEYS, image_count, image_token_id, processor_inputs, recorded_processor, row_images
from speccache.format import Manifest
from speccache.methods.decoder import cache_argument, capture_next_inputs, vision_inputs
from speccache.methods.eagle3 import Eagle3CacheDataset, TargetHead, build_eagle3_dataloader, draft_view

if TYPE_CHECKING:
    from transformers import PreTrainedModel
from speccache.train.draft import Eagle3Draft

__all__ = [
    "DraftProposer",
    "NgramTable",
    "PromptLookup",
    "Proposer",
    "TargetRunner",
    "acceptance",
    "eos_ids",
    "eval_prompts",
    "following_positions",
    "image_prompts",
    "speculative_generate",
    "teacher_forced",
]


class Proposer(Protocol):
    """Drafts up to ``k`` next tokens of ``tokens``; ``aux`` holds the target's aux rows of ``tokens[:-1]``.

    ``positions``, given for an M-RoPE target only, are the target's ``[len(tokens), 3]`` positions of ``tokens``
    (temporal, height, width: the model's own ``get_rope_index`` for the prompt, then one more on all three rows
    per generated token), for a draft that rotates as its target does."""

    def propose(
        self, tokens: Sequence[int], aux: torch.Tensor, k: int, positions: torch.Tensor | None = None
    ) -> list[int]: ...


class PromptLookup:
    """Prompt-lookup decoding: the tokens that followed the latest earlier occurrence of the last ``n`` tokens."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def propose(
        self, tokens: Sequence[int], aux: torch.Tensor | None, k: int, positions: torch.Tensor | None = None
    ) -> list[int]:
        """Up to ``k`` tokens (none when no suffix of up to ``max_ngram`` tokens occurred before)."""
        seq = list(tokens)
        for n in range(min(self.max_ngram, len(seq) - 1), 0, -1):
            pattern = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == pattern:
                    return seq[start + n : start + n + k]
        return []


class NgramTable:
    """The most frequent generated token after two tokens (else after one) in a training cache."""

    def __init__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> None:
        tri: defaultdict[tuple[int, int], Counter[int]] = defaultdict(Counter)
        bi: defaultdict[int, Counter[int]] = defaultdict(Counter)
        for sample in samples:
            ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
            for t in range(1, len(ids)):
                if mask[t]:
                    bi[ids[t - 1]][ids[t]] += 1
                    if t >= 2:
                        tri[(ids[t - 2], ids[t - 1])][ids[t]] += 1
        # most_common breaks ties by first occurrence, which is deterministic for a given cache
        self.tri = {key: c.most_common(1)[0][0] for key, c in tri.items()}
        self.bi = {key: c.most_common(1)[0][0] for key, c in bi.items()}

    @classmethod
    def from_cache(cls, cache_dir: str) -> NgramTable:
        """The table of every sample of an EAGLE-3 cache."""
        ds = Eagle3CacheDataset(cache_dir, keys=["input_ids", "loss_mask"])
        return cls([ds[i] for i in range(len(ds))])

    def next(self, a: int | None, b: int) -> int | None:
        """The predicted token after ``a, b`` (``a`` may be None)."""
        found = self.tri.get((a, b)) if a is not None else None
        return found if found is not None else self.bi.get(b)

    def propose(
        self, tokens: Sequence[int], aux: torch.Tensor | None, k: int, positions: torch.Tensor | None = None
    ) -> list[int]:
        """Up to ``k`` tokens, each predicted from the two before it."""
        seq = list(tokens)
        out: list[int] = []
        while len(out) < k:
            token = self.next(seq[-2] if len(seq) >= 2 else None, seq[-1])
            if token is None:
                break
            out.append(token)
            seq.append(token)
        return out


class DraftProposer:
    """The EAGLE-3 draft as a proposer, with a KV cache of its one layer.

    Slot ``j`` reads ``fc(aux[j])`` and the embedding of ``tokens[j + 1]`` for the verified tokens, and each
    drafted token's slot reads the draft's own output state at the slot before, as in training-time test. Between
    calls the cache keeps the verified slots only: a drafted token the target accepts is read again with the
    target's state. A call reuses the longest cached prefix whose tokens and aux rows are unchanged (so a rejected
    chain or a new prompt is undone by a crop), runs the new verified slots in one step and each drafted token in
    a single-slot step.
    """

    def __init__(self, draft: Eagle3Draft) -> None:
        from transformers import DynamicCache

        self.draft = draft.eval()
        self.cache = DynamicCache()
        self._ids = torch.zeros(0, dtype=torch.long)  # the input ids of the cached slots
        self._aux: torch.Tensor | None = None  # and their aux rows

    def _cached_prefix(self, ids: torch.Tensor, aux: torch.Tensor) -> int:
        """How many leading slots of ``ids``/``aux`` the cache holds as they are now."""
        n = min(len(self._ids), len(ids))
        if self._aux is None or n == 0:
            return 0
        same = (self._ids[:n] == ids[:n]) & (self._aux[:n] == aux[:n]).all(-1)
        return int(same.long().cumprod(0).sum())

    @torch.no_grad()
    def propose(
        self, tokens: Sequence[int], aux: torch.Tensor, k: int, positions: torch.Tensor | None = None
    ) -> list[int]:
        """Up to ``k`` tokens (target ids). Slot ``j`` sits at the position of the state it reads, as vLLM's proposer
        places it: ``j`` for a 1-D draft; for an M-RoPE draft (trained on ``positions``) the target's
        ``positions[j]``, each drafted token one past the last verified slot's on all three rows."""
        draft = self.draft
        device = draft.fc.weight.device
        ids = torch.tensor(list(tokens[1:]), dtype=torch.long, device=device)
        aux = aux.to(device, draft.fc.weight.dtype)
        # at least the last verified slot is run again: its output state is the first drafted token's
        keep = min(self._cached_prefix(ids, aux), len(ids) - 1)
        self.cache.crop(keep - self.cache.get_seq_length())
        slots = torch.arange(keep, len(ids), device=device)
        # the positions of the slots' states: the target's own for an M-RoPE draft, else the slot indices
        where = positions.to(device).long()[: len(ids)] if positions is not None and draft.uses_mrope else None
        mask = slots[:, None] >= torch.arange(len(ids), device=device)[None, :]
        at = slots if where is None else where[keep:]
        state = draft.layer(draft.embed_tokens(ids[keep:])[None], draft.fc(aux[keep:])[None], at, mask, self.cache)
        state = state[:, -1:]
        out: list[int] = []
        for position in range(len(ids), len(ids) + k):
            token = int(draft.draft_to_target(draft.logits(state[:, -1]).argmax(-1))[0])
            out.append(token)
            if len(out) == k:
                break
            every = torch.ones(1, position + 1, dtype=torch.bool, device=device)
            embeds = draft.embed_tokens(torch.tensor([[token]], device=device))
            step = position - len(ids) + 1  # the drafted token's distance from the last verified slot
            at = torch.tensor([position], device=device) if where is None else (where[-1] + step)[None]
            state = draft.layer(embeds, state, at, every, self.cache)
        self.cache.crop(len(ids) - self.cache.get_seq_length())
        self._ids, self._aux = ids, aux
        return out


class TargetRunner:
    """The HF target with a KV cache, returning its logits and the concatenated aux-layer outputs of new tokens.

    Aux layer ``k`` is read as the next module reads it (:func:`capture_next_inputs`), as precompute caches it:
    for a text target that is layer ``k``'s output; a vision-language target's prompt (:meth:`prefill` with its
    image inputs) sees Qwen3-VL's deepstack image features added.
    """

    def __init__(self, model: PreTrainedModel, aux_layers: Sequence[int]) -> None:
        self.model = model.eval()
        self.aux_layers = list(aux_layers)

    @torch.no_grad()
    def __call__(
        self, ids: Sequence[int], cache: Any, positions: torch.Tensor | None = None, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [n, V] fp32, aux [n, 3H])`` of ``ids`` appended to ``cache``; ``positions`` ``[n, 3]``: an
        M-RoPE target's (else the model counts on from the cache); ``inputs``: the prompt's image inputs."""
        captured: dict[Hashable, torch.Tensor] = {}
        handles = capture_next_inputs(self.model, {i: i for i in self.aux_layers}, captured)
        try:
            input_ids = torch.tensor([list(ids)], device=self.model.device)
            if positions is not None:
                inputs["position_ids"] = positions.T[:, None].to(self.model.device)
            out = self.model(input_ids=input_ids, **inputs, **cache_argument(self.model, cache), use_cache=True)
        finally:
            for handle in handles:
                handle.remove()
        aux = torch.cat([captured[i][0] for i in self.aux_layers], dim=-1)
        return out.logits[0].float(), aux.float()

    def prefill(
        self, prompt: Sequence[int], cache: Any, image_inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A vision-language target's prompt with its image inputs (:data:`IMAGE_INPUTS`): ``(logits, aux,
        positions)``, ``positions`` the prompt's ``[n, 3]`` M-RoPE positions (None for another target)."""
        ids = torch.tensor([list(prompt)], device=self.model.device)
        inputs = vision_inputs(self.model, ids, torch.ones_like(ids), image_inputs)
        # passed as positions below, so that the forward never reads the rope_deltas an earlier prompt left cached
        mrope = inputs.pop("position_ids", None)
        positions = None if mrope is None else mrope[:, 0].T
        logits, aux = self(prompt, cache, positions, **inputs)
        return logits, aux, positions


def following_positions(positions: torch.Tensor, n: int) -> torch.Tensor:
    """The M-RoPE positions ``[n, 3]`` of ``n`` tokens generated after tokens at ``positions`` ``[m, 3]``: as
    the model's own ``generate`` counts them, one past the largest position so far on all three rows, then one
    more per token."""
    return (int(positions.max()) + 1 + torch.arange(n, dtype=positions.dtype))[:, None].expand(n, 3)


def speculative_generate(
    runner: TargetRunner,
    prompt: Sequence[int],
    proposer: Proposer | None,
    k: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    image_inputs: Mapping[str, torch.Tensor] | None = None,
) -> tuple[list[int], int]:
    """Greedy decoding of ``prompt`` verified chain by chain; ``(new tokens, target forwards)``.

    With ``proposer`` None it is plain greedy decoding (one token per forward). Stops after an eos token or
    ``max_new_tokens`` tokens; every forward counted emitted at least one of the new tokens (tau = tokens /
    forwards >= 1). ``image_inputs``: a vision-language target's prompt's (:meth:`TargetRunner.prefill`).
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    positions = None
    if image_inputs is None:
        logits, aux = runner(prompt, cache)
    else:
        logits, aux, positions = runner.prefill(prompt, cache, image_inputs)
    tokens = [*prompt, int(logits[-1].argmax())]
    forwards = 1
    eos = set(eos_ids)
    while len(tokens) - len(prompt) < max_new_tokens and tokens[-1] not in eos:
        left = max_new_tokens - (len(tokens) - len(prompt))
        # positions are passed for an M-RoPE target only, so a proposer or runner of a text target keeps its
        # three-argument call
        known = {} if positions is None else {"positions": _extended(positions, len(tokens))}
        drafted = proposer.propose(tokens, aux, min(k, left - 1), **known) if proposer is not None and left > 1 else []
        chain: dict[str, torch.Tensor] = {}  # the positions of [tokens[-1], *drafted]
        if positions is not None:
            chain["positions"] = _extended(positions, len(tokens) + len(drafted))[len(tokens) - 1 :]
        logits, new_aux = runner([tokens[-1], *drafted], cache, **chain)
        forwards += 1
        choice = logits.argmax(-1).tolist()  # choice[i]: the target's token after tokens[-1], drafted[:i]
        m = 0
        while m < len(drafted) and drafted[m] == choice[m]:
            m += 1
        if len(drafted) > m:
            cache.crop(-(len(drafted) - m))
        aux = torch.cat([aux, new_aux[: m + 1]])
        emitted = [*drafted[:m], choice[m]]
        # an accepted eos ends the output there; the loop stops, so no forward is counted for tokens dropped after it
        ends = [i for i, token in enumerate(emitted) if token in eos]
        tokens += emitted[: ends[0] + 1] if ends else emitted
    return tokens[len(prompt) :], forwards


def _extended(positions: torch.Tensor, n: int) -> torch.Tensor:
    """The positions of the first ``n`` tokens: the prompt's ``positions``, then the generated tokens'."""
    return torch.cat([positions, following_positions(positions, n - len(positions))])[:n]


def acceptance(correct: Sequence[torch.Tensor], mask: torch.Tensor) -> dict[str, Any]:
    """Chain acceptance from per-step correctness.

    Args:
        correct: per step ``a``, ``[B, S]`` bool: the prediction made at slot ``j`` for row ``j + 1`` at step ``a``
            (a chain started at slot ``j - a``) is the target's argmax.
        mask: ``[B, S]`` bool, the slots whose row counts.

    Returns:
        ``chains`` (starts counted), ``per_step`` (step ``a`` accepted given the steps before were) and
        ``mean_accepted`` (mean accepted length of a chain of ``len(correct)`` steps).
    """
    steps = len(correct)
    alive = mask.clone()
    reached = [int(alive.sum())]
    total = torch.zeros_like(mask, dtype=torch.long)
    for a in range(steps):
        ok = torch.zeros_like(mask)
        ok[:, : mask.shape[1] - a] = (correct[a] & mask)[:, a:]
        alive &= ok
        total += alive
        reached.append(int(alive.sum()))
    chains = reached[0]
    return {
        "chains": chains,
        "per_step": [reached[a + 1] / reached[a] if reached[a] else 0.0 for a in range(steps)],
        "mean_accepted": float(total.sum()) / chains if chains else 0.0,
    }


def _lookup_correct(tokens: torch.Tensor, target_ids: torch.Tensor, mask: torch.Tensor, predict: Any) -> torch.Tensor:
    """``[B, S]``: whether ``predict(tokens up to j + 1)`` is row ``j + 1``'s argmax, at the counted slots."""
    out = torch.zeros_like(mask)
    for b, j in torch.nonzero(mask).tolist():
        guess = predict(tokens[b, : j + 2].tolist())
        out[b, j] = guess is not None and guess == int(target_ids[b, j])
    return out


@torch.no_grad()
def teacher_forced(
    draft: Eagle3Draft, cache_dir: str, steps: int, ngram: NgramTable | None = None, batch_size: int = 8
) -> dict[str, dict[str, Any]]:
    """Teacher-forced chain acceptance of the draft (and the baselines) on an EAGLE-3 cache, on the draft's device.

    Predictions and the target's argmax are compared as target ids, so the cache's draft vocabulary may differ
    from the draft's.
    """
    draft.eval()
    device = draft.fc.weight.device
    head = TargetHead.from_cache(cache_dir).to(device)
    lookup = PromptLookup()
    correct: dict[str, list[list[torch.Tensor]]] = {"draft": [[] for _ in range(steps)]}
    if ngram is not None:
        correct["ngram"] = [[]]
    correct["prompt_lookup"] = [[]]
    masks = []
    for batch in build_eagle3_dataloader(cache_dir, batch_size=batch_size, shuffle=False):
        tokens = batch["input_ids"].long()  # the baselines look tokens up on the CPU
        view = draft_view({k: v.to(device, non_blocking=True) for k, v in batch.items()}, head)
        target_ids = head.selected_token_ids[view["target"].argmax(-1)]
        for a, logits in enumerate(draft(view["hidden"].float(), view["input_ids"], steps)):
            correct["draft"][a].append((draft.draft_to_target(logits.argmax(-1)) == target_ids).cpu())
        target_ids, view["mask"] = target_ids.cpu(), view["mask"].cpu()
        if ngram is not None:
            correct["ngram"][0].append(
                _lookup_correct(tokens, target_ids, view["mask"], lambda s: ngram.next(s[-2], s[-1]))
            )
        correct["prompt_lookup"][0].append(
            _lookup_correct(tokens, target_ids, view["mask"], lambda s: next(iter(lookup.propose(s, None, 1)), None))
        )
        masks.append(view["mask"])
    width = max(m.shape[1] for m in masks)

    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    mask = joined(masks)
    results = {}
    for name, per_step in correct.items():
        tensors = [joined(p) for p in per_step]
        # a baseline predicts each row from the true tokens before it, the same way at every step
        results[name] = acceptance(tensors if len(tensors) == steps else tensors * steps, mask)
    return results


def eval_prompts(cache_dir: str, limit: int | None) -> list[list[int]]:
    """Prompts from a cache: each sample's tokens before its first generated token (samples without one skipped)."""
    return [prompt for prompt, _ in _prompt_samples(cache_dir, limit)]


def _prompt_samples(cache_dir: str, limit: int | None, source_rows: bool = False) -> list[tuple[list[int], int]]:
    """:func:`eval_prompts` with each prompt's ``source_row`` where asked (else -1)."""
    ds = Eagle3CacheDataset(cache_dir, keys=["input_ids", "loss_mask", *(["source_row"] if source_rows else [])])
    prompts = []
    for i in range(len(ds)):
        sample = ds[i]
        first = torch.nonzero(sample["loss_mask"]).flatten()
        if len(first) and int(first[0]) > 0:
            prompts.append(
                (sample["input_ids"][: int(first[0])].tolist(), int(sample["source_row"]) if source_rows else -1)
            )
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def image_prompts(
    cache_dir: str, limit: int | None, model_dir: str
) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
    """A vision-language target's prompts from its cache (as :func:`eval_prompts`) and each one's image inputs:
    the images of its source row (reread from the cache's data, as precompute read them), as many as the
    prompt holds, made into pixels by the target's processor set as the cache records (``config.vision``), as
    the processor gives them for a batch of one.

    Raises:
        DataError: the processor differs from the cache's, or an image is gone or changed.
    """
    config = Manifest.read(cache_dir).config
    vision = config["vision"]
    processor = recorded_processor(model_dir, vision, cache_dir)
    token = image_token_id(processor)
    prompts, inputs = [], []
    for prompt, source_row in _prompt_samples(cache_dir, limit, source_rows=True):
        where = f"{config['data']}:{source_row + 1}"
        images = row_images(config["data"], config.get("data_split"), source_row, vision["image_root"])
        prompts.append(prompt)
        made = processor_inputs(processor, prompt, images[: image_count(prompt, token)], where)
        # a batch of one, as the processor gives a prompt's: its per-token modality ids as [1, T]
        inputs.append({k: v[None] if k in MODALITY_KEYS else v for k, v in made.items()})
    return prompts, inputs


def speculative(
    runner: TargetRunner,
    prompts: Sequence[Sequence[int]],
    proposers: Mapping[str, Proposer],
    k: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    progress: bool = False,
    images: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, dict[str, Any]]:
    """tau, seconds and speed-up of each proposer against plain greedy decoding, and whether outputs agree.

    ``progress``: a bar on stderr over every method's prompts, with the method and its tokens/s. ``images``: a
    vision-language target's image inputs of each prompt (:func:`image_prompts`).
    """
    given = list(images) if images is not None else [None] * len(prompts)
    from tqdm import tqdm

    runs: dict[str, dict[str, Any]] = {}
    greedy: list[list[int]] = []
    # A method's first run pays one-time costs (allocations, kernel choice; on CUDA, loading each kernel at its first
    # use: greedy's first pass took 2.3s where the same forwards took 0.4s later) that no method should be timed on.
    # Each method warms up on its own: a proposer adds forwards of its own (the draft's, verifying chains).
    methods: dict[str, Proposer | None] = {"greedy": None, **proposers}
    for proposer in methods.values() if prompts else ():
        speculative_generate(runner, prompts[0], proposer, k, max_new_tokens, eos_ids, given[0])
    bar = tqdm(
        total=len(methods) * len(prompts), unit="prompt", desc="evaluate", disable=not progress, dynamic_ncols=True
    )
    for name, proposer in methods.items():
        tokens = forwards = 0
        identical = True
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            new, n = speculative_generate(runner, prompt, proposer, k, max_new_tokens, eos_ids, given[i])
            if proposer is None:
                greedy.append(new)
            identical &= new == greedy[i]
            tokens += len(new)
            forwards += n
            # every method pays the same for its bar (a few microseconds a prompt), so the speed-ups stay fair
            bar.set_postfix_str(f"{name}, {tokens / (time.perf_counter() - started):.0f} tok/s", refresh=False)
            bar.update()
        seconds = time.perf_counter() - started
        runs[name] = {"tokens": tokens, "forwards": forwards, "tau": tokens / max(forwards, 1), "seconds": seconds}
        runs[name]["identical_to_greedy"] = identical
    bar.close()
    for run in runs.values():
        run["speedup"] = runs["greedy"]["seconds"] / run["seconds"] if run["seconds"] else 0.0
    return runs


def eos_ids(model: PreTrainedModel) -> list[int]:
    """The token ids that end a generation: the generation config's eos ids, else the config's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
