"""The reference EAGLE-3 draft: fc fusion of the aux states, one decoder layer, a draft-vocabulary head.

Per slot ``j`` (see :func:`speccache.methods.eagle3.draft_view`) the draft reads the fused aux state
``fc(aux[j])`` and the embedding of ``input_ids[j + 1]`` (the target's frozen embedding), runs one Llama
decoder layer over ``[input_layernorm(embedding); hidden_norm(state)]`` (so ``q/k/v_proj`` take ``2H``
inputs, as in published EAGLE-3 drafts), and predicts row ``j + 1``'s distribution with
``lm_head(norm(out))``. Its output state ``out`` is what it feeds itself at the next step.

Training-time test (``steps > 1``): step ``a`` at slot ``j`` reads the draft's own state of step ``a - 1`` at
slot ``j - 1`` instead of ``fc(aux[j])``; its queries see the true states of slots ``<= j - a`` and its own
chain (step ``b`` at slot ``j - (a - b)``), exactly what a chain of drafted tokens sees at inference, where
the chain's slots simply follow the context.

Positions: ``[S]`` (1-D RoPE, as a text draft) or, for an M-RoPE draft (:attr:`DraftConfig.mrope_section` set,
trained on a Qwen2.5-VL or Qwen3-VL cache's ``positions``), ``[S, 3]`` temporal/height/width rows, rotated by the
target family's own transformers rotary (Qwen2.5-VL's sections, or Qwen3-VL's interleaved layout).

Saved as published EAGLE-3 llama drafts are (SpecForge, vLLM): ``config.json`` (``LlamaForCausalLMEagle3``,
``draft_vocab_size``, ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``) and
``model.safetensors`` with ``embed_tokens.weight``, ``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t`` (``target_id = draft_id + d2t[draft_id]``) and ``t2d``. An M-RoPE draft's
``config.json`` carries ``mrope_section`` (and ``mrope_interleaved``) in ``rope_parameters``, where vLLM looks to
build an ``MRotaryEmbedding`` for the draft and feed it the target's 3-D positions, and in ``rope_scaling``, the
key older transformers and vLLM releases read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Cache, DynamicCache, LlamaConfig, Qwen2_5_VLTextConfig, Qwen3VLTextConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from speccache.format.durable import atomic_write
from speccache.format.names import check_no_foreign_files
from speccache.methods.decoder import cache_argument

__all__ = ["DraftConfig", "Eagle3Draft", "check_new_draft_dir", "draft_record", "load_draft", "save_draft"]

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# written beside the draft by speccache train: one JSON line per optimizer step, and its picture
TRAIN_LOG = "train_log.jsonl"
LOSS_CURVE = "loss.png"
DRAFT_FILES = (CONFIG, WEIGHTS, TRAIN_LOG, LOSS_CURVE)
"""Every file ``speccache train`` writes into ``--out``: any other name there is the user's, and refused."""


@dataclass
class DraftConfig:
    """The draft's shape: the target's hidden size and vocabularies, a small layer.

    ``mrope_section`` (the target text config's, summing to ``head_dim // 2``) makes it an M-RoPE draft, whose
    positions are ``[..., 3]``; ``mrope_interleaved`` is Qwen3-VL's layout of the sections.
    """

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    aux_layers: list[int] = field(default_factory=list)
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = False

    def rope_parameters(self) -> dict[str, Any]:
        """The rope parameters as transformers 5 and vLLM read them (``mrope_*`` only for an M-RoPE draft)."""
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.mrope_section is not None:
            params["mrope_section"] = list(self.mrope_section)
            if self.mrope_interleaved:
                params["mrope_interleaved"] = True
        return params

    def rotary(self) -> nn.Module:
        """The rotary embedding: Llama's, or for an M-RoPE draft the target family's own (Qwen3-VL's when
        interleaved, else Qwen2.5-VL's), which take position ids ``[3, B, S]``."""
        if self.mrope_section is None:
            return LlamaRotaryEmbedding(self.llama())
        shape: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": self.rope_parameters(),
        }
        if self.mrope_interleaved:
            return Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(**shape))
        # it reads the text config's fields; its annotation names the model's whole config
        return Qwen2_5_VLRotaryEmbedding(cast(Any, Qwen2_5_VLTextConfig(**shape)))

    def llama(self) -> LlamaConfig:
        """The transformers config of the decoder layer (sdpa attention, so a boolean mask can be passed)."""
        config = LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            num_hidden_layers=1,
        )
        config._attn_implementation = "sdpa"
        return config


class DraftLayer(nn.Module):
    """One Llama decoder layer over ``[embedding; state]``: the attention reads ``2H``, the residual is the state."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # as wide as the attention made them, over 2H inputs
            width = getattr(self.self_attn, name).out_features
            setattr(self.self_attn, name, nn.Linear(2 * hidden, width, bias=False))
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        state: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """``[B, S, H]`` embeddings and states in, ``[B, S, H]`` states out; ``mask`` ``[S, K]`` bool (True: attend)
        over the ``K`` keys: the ``cache``'s, if given (it then gains these slots' keys and values), then these."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)
        attn, _ = self.self_attn(
            x, position_embeddings=rotary, attention_mask=mask[None, None], **cache_argument(self.self_attn, cache)
        )
        state = state + attn
        return state + self.mlp(self.post_attention_layernorm(state))


def chain_mask(length: int, steps: int, device: torch.device | None = None) -> torch.Tensor:
    """The attention mask of ``steps`` training-time-test blocks of ``length`` slots each, ``[S, S]`` bool.

    Query (step ``a``, slot ``j``) attends to key (step 0, slot ``i``) for ``i <= j - a`` and to key
    (step ``b``, slot ``j - (a - b)``) for ``1 <= b <= a``: the true context before its chain, then the chain.
    """
    j = torch.arange(length, device=device)
    blocks = []
    for a in range(steps):
        row = []
        for b in range(steps):
            if b == 0:
                row.append(j[None, :] <= j[:, None] - a)
            elif b <= a:
                row.append(j[None, :] == j[:, None] - (a - b))
            else:
                row.append(torch.zeros(length, length, dtype=torch.bool, device=device))
        blocks.append(torch.cat(row, dim=1))
    return torch.cat(blocks, dim=0)


def chain_positions(positions: torch.Tensor, step: int) -> torch.Tensor:
    """Training-time-test step ``step``'s positions: slot ``j`` gets ``positions[j - step] + step`` (the chain
    start's, advanced by one per drafted token on every row, as serving advances it); slots ``j < step``, which
    start no chain, keep their own. ``positions`` is ``[T]``, ``[B, T]`` or ``[B, T, 3]``."""
    if step == 0:
        return positions
    axis = 0 if positions.dim() == 1 else 1
    length = positions.shape[axis]
    return torch.cat([positions.narrow(axis, 0, step), positions.narrow(axis, 0, length - step) + step], dim=axis)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft (see the module docstring).

    Args:
        config: its shape.
        embed_tokens: ``[V, H]`` the target's input embedding (frozen).
        lm_head: ``[Vd, H]`` the target's LM-head rows of the draft vocabulary (the head's initial weights).
        d2t: ``[Vd]`` int64 offsets, ``target_id = draft_id + d2t[draft_id]``.
        t2d: ``[V]`` bool, whether a target id is in the draft vocabulary.
    """

    # buffers (register_buffer), which nn.Module's attribute lookup types as Tensor | Module
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(
        self,
        config: DraftConfig,
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
    ) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        llama = config.llama()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.float().clone(), freeze=True)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = DraftLayer(llama)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head.float())
        self.rotary = config.rotary()
        self.register_buffer("d2t", d2t.to(torch.int64).clone())
        self.register_buffer("t2d", t2d.to(torch.bool).clone())

    @property
    def uses_mrope(self) -> bool:
        """Whether the draft rotates by M-RoPE (positions ``[..., 3]``), as vLLM serves a draft whose config has an
        ``mrope_section``."""
        return self.config.mrope_section is not None

    def position_ids(self, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """What the rotary takes: ``[B, S]``, or ``[3, B, S]`` for an M-RoPE draft, from ``positions`` ``[S]``,
        ``[B, S]``, or for an M-RoPE draft ``[S]``, ``[S, 3]``, ``[B, S, 3]``; it reads a 1-D position ``p`` as
        ``(p, p, p)``, a text token's M-RoPE position.

        Raises:
            ValueError: 3-D positions for a draft without M-RoPE.
        """
        positions = positions.long()
        if not self.uses_mrope:
            if positions.dim() > 2:
                raise ValueError(f"positions {tuple(positions.shape)}: this draft has no M-RoPE; give [S] or [B, S]")
            return positions.expand(batch, -1)
        if positions.dim() == 1:
            positions = positions.unsqueeze(-1).expand(-1, 3)
        return positions.expand(batch, -1, -1).permute(2, 0, 1)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft-vocabulary ids."""
        return draft_ids + self.d2t[draft_ids]

    def layer(
        self,
        embeds: torch.Tensor,
        states: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        """The decoder layer over ``[B, S]`` slots at ``positions`` under ``mask`` ``[S, K]``, after the slots
        ``cache`` holds (see :meth:`DraftLayer.forward`).

        ``positions`` is ``[S]`` int64 (or ``[B, S]``), or when :attr:`uses_mrope` ``[S, 3]`` (or ``[B, S, 3]``):
        the target's temporal/height/width positions (see :meth:`position_ids`).
        """
        rotary = self.rotary(states, self.position_ids(positions, states.shape[0]))
        return self.midlayer(embeds, states, rotary, mask, cache)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of output states."""
        return self.lm_head(self.norm(states))

    def states(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int = 1,
        positions: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Output states ``[B, T, H]`` of each training-time-test step over aligned slots (``draft_view``'s
        ``hidden`` ``[B, T, 3H]`` and ``input_ids`` ``[B, T]``); step ``a``'s slots ``j < a`` have no chain and
        mean nothing.

        ``positions`` are the slots' (``[B, T]``, or ``[B, T, 3]`` for an M-RoPE draft; default ``arange(T)``);
        step ``a`` at slot ``j`` sits where serving puts the ``a``-th drafted token of a chain started at slot
        ``j - a``: that slot's position advanced by ``a`` on every row (with ``arange``: slot ``j``'s own).
        ``embeds`` (``[B, T, H]``) replaces the embedding of ``input_ids`` (e.g. the target's merged image
        embeddings at image tokens).

        Step ``a`` runs the layer over its own slots only: the keys and values of the steps before it are in a
        cache, and their queries' outputs would be theirs again (no query attends to a later step).
        """
        length = input_ids.shape[1]
        if embeds is None:
            embeds = self.embed_tokens(input_ids.long())
        if positions is None:
            positions = torch.arange(length, device=input_ids.device)
        state = self.fc(hidden.to(self.fc.weight.dtype))
        cache = DynamicCache()
        outs = []
        for a in range(steps):
            mask = chain_mask(length, a + 1, input_ids.device)[a * length :]
            outs.append(self.layer(embeds, state, chain_positions(positions, a), mask, cache))
            # the next step reads this step's state one slot later
            state = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
        return outs

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int = 1,
        positions: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Logits ``[B, T, Vd]`` of each training-time-test step (see :meth:`states`)."""
        return [self.logits(state) for state in self.states(hidden, input_ids, steps, positions, embeds)]


def check_new_draft_dir(out: str) -> None:
    """Refuse a directory that already holds a draft, or files :func:`save_draft` does not write (nothing that
    exists is overwritten or mixed with a draft).

    Raises:
        FileExistsError: ``out`` holds a ``config.json`` or ``model.safetensors``.
        CacheExistsError: ``out`` holds other files (a ``FileExistsError`` too).
    """
    if os.path.exists(os.path.join(out, WEIGHTS)) or os.path.exists(os.path.join(out, CONFIG)):
        raise FileExistsError(f"--out {out} already holds a draft; choose a new directory")
    check_no_foreign_files(out, DRAFT_FILES, None, "speccache train")


def save_draft(draft: Eagle3Draft, out: str, extra: Mapping[str, Any] | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (published EAGLE-3 key names) into the directory ``out``.

    Raises:
        FileExistsError: ``out`` already holds a draft (see :func:`check_new_draft_dir`).
    """
    check_new_draft_dir(out)
    os.makedirs(out, exist_ok=True)
    c = draft.config
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layers), "use_aux_hidden_state": True},
        **({"rope_parameters": c.rope_parameters(), "rope_scaling": c.rope_parameters()} if c.mrope_section else {}),
        "speccache": {"draft_config": asdict(c), **dict(extra or {})},
    }
    tensors = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
    atomic_write(os.path.join(out, WEIGHTS), lambda tmp: save_file(tensors, tmp))
    text = json.dumps(config, indent=2) + "\n"
    atomic_write(os.path.join(out, CONFIG), lambda tmp: open(tmp, "w", encoding="utf-8").write(text))


def draft_record(path: str) -> dict[str, Any]:
    """What :func:`save_draft` recorded of a draft in its ``config.json``: ``draft_config``, ``cache`` (the
    training cache), ``target``, ``training``.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        ValueError: the directory's ``config.json`` is not one :func:`save_draft` wrote.
    """
    if not os.path.isdir(path):  # a mistyped path: say so rather than name a config.json inside it
        raise FileNotFoundError(f"no such directory: {path} (no draft there); check the path")
    with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
        record = json.load(f).get("speccache")
    if not isinstance(record, dict) or "draft_config" not in record:
        raise ValueError(f"{path}/{CONFIG} has no speccache record: it is not a draft that speccache train wrote")
    return record


def load_draft(path: str) -> Eagle3Draft:
    """Load a draft :func:`save_draft` wrote."""
    config = DraftConfig(**draft_record(path)["draft_config"])
    tensors = load_file(os.path.join(path, WEIGHTS))
    draft = Eagle3Draft(
        config, tensors["embed_tokens.weight"], tensors["lm_head.weight"], tensors["d2t"], tensors["t2d"]
    )
    draft.load_state_dict(tensors)
    return draft
