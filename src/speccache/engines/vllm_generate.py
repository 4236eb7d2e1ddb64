"""The ``vllm`` generator of ``speccache regenerate``: vLLM writes the answers (plain generation, no connector).

Every prompt is speccache's own ids (``TokensPrompt``), each with its own ``SamplingParams``: the settings'
temperature, top-k and top-p (``temperature`` 0: greedy), ``max_tokens`` the answer's limit, ``stop_token_ids``
regenerate's stop ids and ``ignore_eos`` (so vLLM stops at those ids exactly, not at its own reading of the
eos), and a seed per request when sampling: the row's seed for its first answer, then one derived from it and
the turn. One ``generate`` call answers a whole round (every open row of a part); vLLM batches it itself, at
most ``batch_size`` sequences at a time. An answer ends where vLLM's ``finish_reason`` is ``stop`` and was cut
where it is ``length``.

Reproducibility is vLLM's (docs.vllm.ai, "Reproducibility"): offline, with its engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as here) its scheduling is deterministic, so the same round gives the
same answers on the same hardware and vLLM version; each call starts from an empty prefix cache so that a
round does not depend on what the rounds before it left cached (a resumed part is generated as the
uninterrupted run generated it). Across engines, or batch compositions, greedy answers agree with the ``hf``
generator's up to near-ties that rounding flips.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import xxhash

from speccache.data import vision_processor_class
from speccache.engines.generation import Answer, GenerationSettings
from speccache.engines.vllm import (
    _DTYPES,
    _memory_share,
    check_cpu_head_size,
    run_engine_core_here,
    shutdown_llm,
    vllm_version,
)
from speccache.errors import UsageError

__all__ = ["VllmGenerator"]


class _TurnSeeds:
    """A row's request seeds: its own seed for the first answer, then a hash of it and the turn."""

    def __init__(self, seed: int) -> None:
        self.seed, self.turn = seed, 0

    def next(self) -> int:
        seed = (
            self.seed
            if self.turn == 0
            else xxhash.xxh64_intdigest(f"{self.seed}:{self.turn}".encode()) & ((1 << 63) - 1)
        )
        self.turn += 1
        return seed


class VllmGenerator:
    """The ``vllm`` generator (:class:`speccache.engines.generation.Generator`); vLLM starts at the first call."""

    name = "vllm"

    @classmethod
    def check_flags(cls, config: Any) -> None:
        """Refuse ``--device`` (vLLM runs on its own platform), a vision-language target and an environment
        without vLLM."""
        vision = vision_processor_class(config.model) if os.path.isdir(config.model) else None
        if vision is not None:
            raise UsageError(
                f"--model {config.model} is a vision-language target ({vision}): --engine vllm does not answer its "
                "image rows here (vLLM's vision-language modules need torchvision); use --engine hf"
            )
        if config.device is not None:
            raise UsageError(
                f"--device {config.device} is the hf engine's: vLLM runs the target on its own platform (the GPU "
                "where it has one); drop --device"
            )
        vllm_version()

    @classmethod
    def version(cls) -> str:
        """vLLM's version."""
        return vllm_version()

    def __init__(self, settings: GenerationSettings) -> None:
        self.settings = settings
        self.llm: Any = None

    def stream(self, seed: int) -> _TurnSeeds:
        """The row's request seeds."""
        return _TurnSeeds(seed)

    def _start(self) -> None:
        from transformers import AutoConfig

        s = self.settings
        check_cpu_head_size(AutoConfig.from_pretrained(s.model), vllm_version())
        run_engine_core_here()
        from vllm import LLM

        self.llm = LLM(
            model=s.model,
            dtype=_DTYPES[s.dtype],
            seed=s.seed,
            max_num_seqs=s.batch_size,
            **_memory_share(s.gpu_memory_utilization),
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        streams: Sequence[Any],
        on_tokens: Callable[[int], None] | None = None,
        images: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Answer]:
        """The answers of one ``vllm.LLM.generate`` call (vLLM starts at the first); ``on_tokens`` is told of each
        answer's tokens as the call returns it (vLLM's own bar is off: the run's bar shows rows and tokens).
        ``images`` never comes: :meth:`check_flags` refuses a vision-language target."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            self._start()
        self.llm.reset_prefix_cache()
        s = self.settings
        params = [
            SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                # greedy needs no seed, and an unseeded request keeps vLLM's batched sampler
                seed=stream.next() if s.temperature > 0 else None,
                max_tokens=s.max_new_tokens,
                stop_token_ids=sorted(s.stop_ids),
                ignore_eos=True,
                detokenize=False,
            )
            for stream in streams
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        answers: list[Answer] = []
        for output in outputs:
            completion = output.outputs[0]
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"vLLM finished a request with finish_reason {completion.finish_reason!r} (not stop or length); "
                    "report it with the vLLM version, and use --engine hf meanwhile"
                )
            answers.append((list(completion.token_ids), completion.finish_reason == "stop"))
            if on_tokens is not None:
                on_tokens(len(completion.token_ids))
        return answers

    def close(self) -> None:
        """Shut vLLM down, if it started."""
        if self.llm is not None:
            shutdown_llm(self.llm)
            self.llm = None
