"""The draft inputs speccache hands a trainer at image positions are the ones vLLM 0.32's EAGLE proposer feeds the
draft at serving time (docs/vision.md, "What a draft trainer reads, and how it matches serving").

vLLM's own proposer is not run here: its vision-language model modules (Qwen2.5-VL's, Qwen3-VL's) import
torchvision, which vLLM 0.32's CPU build lacks, so no vision-language target loads under ``make test-engine``
(docs/engines.md). Instead the test assembles the first draft pass's inputs exactly as
``EagleProposer.propose`` (``vllm/v1/spec_decode/eagle.py``) does, from the transformers model whose computation
vLLM's Qwen-VL modules mirror:

- ``target_token_ids`` shifted by one (``self.input_ids[: num_tokens - 1] = target_token_ids[1:]``; the last slot
  takes the sampled token, which a cache has no row for);
- ``target_positions``, ``[3, num_tokens]`` when the target uses M-RoPE (``_set_positions``), as the target's
  ``MRotaryEmbedding`` computed them: transformers' ``get_rope_index``;
- ``target_hidden_states``: the aux layers' outputs as vLLM's EAGLE-3 capture returns them, the residual stream
  the next layer reads (after Qwen3-VL's deepstack addition);
- ``inputs_embeds = self.model.embed_input_ids(input_ids, multimodal_embeddings=..., is_multimodal=...)``:
  ``Eagle3LlamaForCausalLM.embed_input_ids`` (``vllm/model_executor/models/llama_eagle3.py``) returns
  ``self.model.embed_input_ids(input_ids)``, the token embedding, whatever the multimodal embeddings; a draft
  that merges them (``_merge_multimodal_embeddings``) gets the target's image features at the image tokens of
  the shifted ids.

``speccache train --draft-inputs served`` must read the first, ``merged`` the second, at every slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.data import load_processor
from speccache.demo.real_target import ensure_real_target
from speccache.methods.eagle3 import TargetHead, build_eagle3_dataloader, draft_view
from speccache.testing.vlm import ensure_vlm_target
from speccache.train.inputs import slot_inputs
from speccache.train.trainer import draft_for_cache
from support.vision import rendered, write_image_data

pytestmark = pytest.mark.usefixtures("offline_single_thread")

AUX = (0, 1, 2)
FLAGS = ["--aux-layers", "0,1,2", "--dtype", "fp32", "--model-dtype", "fp32", "--batch-size", "2", "--device", "cpu"]
ROWS = [(["a.png", "b.png"], "Compare them.", "Two pictures."), ([], "Say hello.", "Hello.")]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_data(tmp_path_factory.mktemp("vision-serving"), ROWS)


def _vllm_first_pass(model, processor, messages: list[dict], embed: torch.nn.Embedding) -> dict[str, torch.Tensor]:
    """The inputs of vLLM's first draft pass over a prompt (see the module docstring), slot by slot."""
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    layers = model.model.language_model.layers
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(_module, args, kwargs):
            seen[name] = (args[0] if args else kwargs.get("hidden_states", kwargs.get("inputs_embeds")))[0]

        return hook

    hooks = [layers[k + 1].register_forward_pre_hook(keep(f"aux{k}"), with_kwargs=True) for k in AUX]
    hooks.append(model.model.language_model.register_forward_pre_hook(keep("inputs_embeds"), with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    ids = inputs["input_ids"][0]
    target_positions = model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        attention_mask=inputs["attention_mask"],
    )[0][:, 0]  # [3, num_tokens]
    input_ids = ids[1:]  # the proposer's shift; the last slot (the sampled token) has no cache row
    is_multimodal = input_ids == model.config.image_token_id
    with torch.no_grad():
        token_embeds = embed(input_ids)
    return {
        "input_ids": input_ids,
        "positions": target_positions[:, :-1].T,
        "hidden": torch.cat([seen[f"aux{k}"] for k in AUX], dim=-1)[:-1],
        "served": token_embeds,  # Eagle3LlamaForCausalLM.embed_input_ids: the token embedding only
        "merged": torch.where(is_multimodal[:, None], seen["inputs_embeds"][1:], token_embeds),
        "is_multimodal": is_multimodal,
    }


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_trainers_slot_inputs_are_what_vllms_proposer_feeds_the_draft(family, data, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir = ensure_vlm_target(family, ensure_real_target())
    cache = str(tmp_path / "cache")
    assert main(["precompute", "--model", model_dir, "--data", str(data / "data.jsonl"), "--out", cache, *FLAGS]) == 0
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = load_processor(model_dir)
    batch = next(iter(build_eagle3_dataloader(cache, batch_size=len(ROWS), shuffle=False)))
    view = draft_view(batch, TargetHead.from_cache(cache))
    for mode in ("served", "merged"):
        draft, _ = draft_for_cache(cache, draft_inputs=mode)
        assert draft.uses_mrope  # the saved config carries the mrope_section: vLLM builds it an MRotaryEmbedding
        embeds, positions = slot_inputs(draft, view, mode)
        with torch.no_grad():
            embeds = draft.embed_tokens(view["input_ids"].long()) if embeds is None else embeds
        for b, row in enumerate(ROWS):
            want = _vllm_first_pass(model, processor, rendered(data, row), draft.embed_tokens)
            n = len(want["input_ids"])
            assert torch.equal(view["input_ids"][b, :n].long(), want["input_ids"])
            assert positions is not None and torch.equal(positions[b, :n].long(), want["positions"])
            torch.testing.assert_close(view["hidden"][b, :n], want["hidden"], atol=1e-5, rtol=0)
            torch.testing.assert_close(embeds[b, :n], want[mode], atol=1e-5, rtol=0)
            if row[0]:  # at the image tokens the two modes feed different embeddings
                at = want["is_multimodal"]
                assert at.any() and (want["merged"][at] - want["served"][at]).abs().max() > 1e-3
