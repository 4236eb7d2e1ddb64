"""The method and engine seam of ``speccache precompute`` (issue 22): a method registered in
:mod:`speccache.methods.registry` and an engine registered in :mod:`speccache.engines.registry` run through
``run_precompute`` as the built-in ones do, with nothing in ``precompute/run.py`` naming them."""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.engines import registry as engines
from speccache.errors import UsageError
from speccache.format import LENGTHS_KEY, SOURCE_ROW_KEY, KeySpec, Manifest, source_row_spec
from speccache.methods import registry as methods
from speccache.methods.base import CaptureRequest, LoadedTarget, MethodPlan, PrePass, text_config
from speccache.methods.decoder import Capture
from speccache.read import CacheDataset

pytestmark = pytest.mark.usefixtures("offline_single_thread")

ARGS = ["--limit", "6", "--max-length", "48", "--batch-size", "2", "--shard-size", "4", "--device", "cpu"]
ARGS += ["--dtype", "fp32", "--model-dtype", "fp32", "--quiet"]


class _FinalNormRows:
    def __init__(self, capture: Capture, dtype: torch.dtype) -> None:
        self.capture, self.dtype = capture, dtype

    def compute_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        real = batch["attention_mask"].bool()
        last, captured = self.capture(batch["input_ids"], batch["attention_mask"], {}, None)
        assert not captured  # it asked for no layer
        return {
            "input_ids": batch["input_ids"][real].to(torch.int32),
            "loss_mask": batch["loss_mask"][real].bool(),
            "final_norm": last[real].to(self.dtype),
            LENGTHS_KEY: real.sum(1).to(torch.int64),
            SOURCE_ROW_KEY: batch["source_row"],
        }


class FinalNormMethod:
    """A method of this test alone: it stores the final-norm output under ``final_norm``, and the LM head."""

    cache_name = "final_norm"
    side_file = "final_norm_side.safetensors"
    presets = {"final-norm": "the final-norm output only"}

    def check_flags(self, cfg: Any) -> None:
        if cfg.aux_layers is not None:
            raise UsageError("--aux-layers is not for --method final-norm")

    def plan(self, cfg: Any, model_config: Any, dtype: torch.dtype) -> MethodPlan:
        text = text_config(model_config)
        specs = [KeySpec("input_ids", torch.int32, (), ragged=True), KeySpec("loss_mask", torch.bool, (), ragged=True)]
        specs += [KeySpec("final_norm", dtype, (int(text.hidden_size),), ragged=True), source_row_spec()]
        schema = {s.name: s for s in specs}
        return MethodPlan(schema, {"stores": "final_norm"}, CaptureRequest(), int(text.vocab_size), None)

    def prepare(self, plan: MethodPlan, data: PrePass) -> int:
        return len(data.samples)

    def target(
        self,
        plan: MethodPlan,
        loaded: LoadedTarget,
        capture: Capture,
        prepared: int,
        dtype: torch.dtype,
        nonfinite: str,
    ) -> _FinalNormRows:
        assert prepared == 6  # the pre-pass saw every sample
        return _FinalNormRows(capture, dtype)

    def side_tensors(self, plan: MethodPlan, loaded: LoadedTarget, prepared: int) -> dict[str, torch.Tensor]:
        return {"lm_head": loaded.output_embeddings().contiguous()}


FINAL_NORM = FinalNormMethod()


def _precompute(model: str, out: Path, *extra: str) -> Manifest:
    argv = ["precompute", "--model", model, "--data", demo_data_path("sharegpt"), "--out", str(out), *ARGS, *extra]
    assert main(argv) == 0
    return Manifest.read(str(out))


def test_a_method_registered_elsewhere_runs_through_precompute(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setitem(methods.METHODS, "final-norm", FINAL_NORM)
    manifest = _precompute(tiny_models("llama"), tmp_path / "final", "--method", "final-norm")
    assert manifest.cache_name == "final_norm" and manifest.config["method"] == "final-norm"
    assert manifest.config["stores"] == "final_norm"
    assert set(manifest.side_files) == {"final_norm_side.safetensors"}
    # the same final-norm states as the built-in method that stores only them
    _precompute(tiny_models("llama"), tmp_path / "mtp", "--method", "mtp")
    mtp = CacheDataset(str(tmp_path / "mtp"))
    mine = CacheDataset(str(tmp_path / "final"))
    assert len(mine) == len(mtp) == 6
    for i in range(len(mine)):
        assert torch.equal(mine[i]["final_norm"], mtp[i]["last_hidden_state"])
        assert torch.equal(mine[i]["input_ids"], mtp[i]["input_ids"])
    # its flag check runs with the others, before anything is read
    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path("sharegpt")]
    assert main([*argv, "--out", str(tmp_path / "o"), "--method", "final-norm", "--aux-layers", "1,2,3"]) == 2
    assert not (tmp_path / "o").exists()


class HiddenStatesEngine:
    """An engine of this test alone: transformers' ``output_hidden_states`` forward, returning only the decoder
    layer outputs (``hidden_states[l + 1]``) and embeddings (``hidden_states[0]``) that the method requested."""

    name = "states"
    group_size = 1
    pads = True
    opened: list[CaptureRequest] = []

    @classmethod
    def check_flags(cls, cfg: Any) -> None:
        pass

    @classmethod
    def check_model(cls, cfg: Any, model_config: Any, world_size: int) -> None:
        pass

    def __init__(self, cfg: Any, comm: Any) -> None:
        self.cfg = cfg

    def open(self, request: CaptureRequest, groups: Any, max_tokens: int) -> LoadedTarget:
        self.request = request
        HiddenStatesEngine.opened.append(request)
        model = AutoModelForCausalLM.from_pretrained(self.cfg.model, dtype=torch.float32).eval()
        self.model = model
        return LoadedTarget(
            model,
            lambda: model.get_input_embeddings().weight.detach(),
            lambda: model.get_output_embeddings().weight.detach(),
        )

    @torch.no_grad()
    def capture(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        outputs: Mapping[Hashable, int],
        input_of_first: Hashable | None = None,
    ) -> tuple[torch.Tensor, dict[Hashable, torch.Tensor]]:
        assert set(outputs.values()) <= set(self.request.layers) and (input_of_first is None or self.request.embeddings)
        out = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, output_hidden_states=True
        )
        captured = {key: out.hidden_states[layer + 1] for key, layer in outputs.items()}
        if input_of_first is not None:
            captured[input_of_first] = out.hidden_states[0]
        return out.last_hidden_state, captured

    def close(self) -> None:
        pass

    def record(self) -> dict[str, Any]:
        return {"engine": {"name": self.name}}


def _files(cache: Path) -> dict[str, bytes]:
    return {n: (cache / n).read_bytes() for n in sorted(os.listdir(cache)) if n.endswith(".safetensors")}


@pytest.mark.parametrize(
    "method",
    [
        ["--draft-vocab-size", "300", "--supervision", "topk:4"],
        ["--method", "layers", "--layers=-1,2,5", "--last-hidden"],
    ],
    ids=["eagle3", "layers"],
)
def test_an_engine_registered_elsewhere_writes_the_hf_engines_cache(tiny_models, tmp_path, monkeypatch, method):
    monkeypatch.setitem(engines.ENGINES, "states", HiddenStatesEngine)
    monkeypatch.setattr(HiddenStatesEngine, "opened", [])
    model = tiny_models("llama")
    hf = _precompute(model, tmp_path / "hf", *method)
    mine = _precompute(model, tmp_path / "states", *method, "--engine", "states")
    # the method's request reached the engine: EAGLE-3's default aux layers, or the layers asked for
    expected = CaptureRequest((1, 3, 4)) if "layers" not in method else CaptureRequest((2, 5), embeddings=True)
    assert HiddenStatesEngine.opened == [expected]
    assert mine.config["engine"] == "states" and mine.stats["engine"] == {"name": "states"}
    assert "engine" not in hf.stats
    assert {k: v for k, v in mine.config.items() if k != "engine"} == {
        k: v for k, v in hf.config.items() if k != "engine"
    }
    assert _files(tmp_path / "states") == _files(tmp_path / "hf")  # every shard and the side file, byte for byte
