"""The generator protocol: what writes the target's answers for ``speccache regenerate`` (``--engine``).

``speccache regenerate`` (:mod:`speccache.precompute.regenerate`) owns the rows: the chat template, the prompt
ids of each turn, the stop ids, the seeds, the parts and the resume. A generator owns only the target: given
every open row's prompt ids of one round (all rows' turn ``k`` of a part, shortest first) it returns per
prompt the ids it generated and whether the answer ended at a stop id (else it was cut at
``max_new_tokens``). A generator is a class: its class methods check the flags before anything is read, an
instance is one run's generator and starts the target only when first asked to generate.
:mod:`.registry` maps ``--engine`` to it (``GENERATORS``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Answer", "GenerationSettings", "Generator"]

Answer = tuple[list[int], bool]
"""One prompt's generated ids (its stop id last if it ended) and whether it ended at a stop id."""


@dataclass(frozen=True)
class GenerationSettings:
    """What a generator is given: the target, how to sample, where answers end.

    Attributes:
        model: the Hugging Face model directory.
        dtype: the target's compute dtype, a key of :data:`speccache.devices.DTYPES`.
        device: ``--device`` (the ``hf`` generator's; ``None``: CUDA when available).
        batch_size: the most rows generated together.
        max_new_tokens: the most tokens per answer.
        temperature: 0 for greedy, else the sampling temperature (then ``top_k``, then ``top_p``).
        top_p: nucleus mass (1: off).
        top_k: the likeliest tokens sampled among (0: off).
        seed: ``--seed`` (the run's; each row's own seed comes with its stream).
        stop_ids: the ids that end an answer, decided by regenerate from the target's directory.
        pad_id: the id padding a batch, where the generator pads.
        gpu_memory_utilization: ``--gpu-memory-utilization`` (the ``vllm`` generator's; ``None``: vLLM's default).
    """

    model: str
    dtype: str
    device: str | None
    batch_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_ids: frozenset[int]
    pad_id: int
    gpu_memory_utilization: float | None = None


class Generator(Protocol):
    """One run's generator (``--engine`` of ``speccache regenerate``).

    Attributes:
        name: what ``--engine`` calls it (recorded in ``regenerate.json``'s settings).
    """

    name: str

    @classmethod
    def check_flags(cls, config: Any) -> None:
        """Refuse the flags of a :class:`speccache.precompute.regenerate.RegenerateConfig` this generator does not
        take, or an environment it cannot run in, before anything is read (``UsageError``: the CLI exits 2)."""

    @classmethod
    def version(cls) -> str:
        """The version of what generates (transformers, vLLM), recorded beside the settings."""

    def __init__(self, settings: GenerationSettings) -> None:
        """Keep the settings; start nothing."""

    def stream(self, seed: int) -> Any:
        """A row's sampling state from its seed, handed back with each of its prompts: the row's draws depend on
        it alone, not on the rows generated with it."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        streams: Sequence[Any],
        on_tokens: Callable[[int], None] | None = None,
        images: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Answer]:
        """The answer to each prompt (``streams[i]`` is prompt ``i``'s row's); starts the target when first called.

        ``on_tokens(n)``, where given, is told of every ``n`` tokens generated as they come (for progress).
        ``images``: a vision-language target's image inputs of each prompt (a batch of one each: the processor's
        pixels, grids and per-token modality ids), given to a generator that runs such targets only."""

    def close(self) -> None:
        """Release what :meth:`generate` started (called whether the run succeeded or not)."""
