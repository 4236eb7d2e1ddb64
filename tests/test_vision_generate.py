"""``speccache evaluate`` and ``speccache regenerate`` on vision-language targets (docs/vision.md, "Evaluate and
regenerate"): on tiny Qwen2.5-VL, Qwen3-VL and Gemma 3 targets, the target's greedy decoding of an image prompt
through the evaluator's runner equals transformers' own ``generate`` with the processor's pixels, and speculative
decoding (n-gram, prompt lookup, an EAGLE-3 draft trained on the image cache) equals it token for token;
regenerate answers an image row as ``generate`` does, keeps its images, and its output re-precomputes; what is
not built is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speccache.cli import main
from speccache.data import load_processor
from speccache.demo.real_target import ensure_real_target
from speccache.errors import UsageError
from speccache.regenerate import RegenerateConfig, regenerate
from speccache.testing.vlm import ensure_vlm_target
from speccache.train.draft import load_draft
from speccache.train.evaluate import (
    DraftProposer,
    NgramTable,
    PromptLookup,
    TargetRunner,
    eos_ids,
    image_prompts,
    speculative_generate,
)
from support.cachecmp import all_samples
from support.vision import chat_row, write_image_data

# the M-RoPE families (their positions are what decoding can get wrong) and Gemma 3 (its image tokens attend both ways)
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3")
AUX = ["--aux-layers", "0,1,2", "--dtype", "fp32", "--model-dtype", "fp32", "--device", "cpu", "--quiet"]
NEW = 12  # tokens decoded per prompt


ROWS = [
    (["a.png"], "What is red?", "A square."),
    ([], "Tell me a story.", "Once upon a time."),
    (["a.png", "b.png"], "Compare them.", "Two pictures."),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_data(tmp_path_factory.mktemp("vision-generate"), ROWS)


@pytest.fixture(scope="module")
def targets(offline_single_thread, data, tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per family: the target, its cache of :data:`ROWS` and a draft trained on it (all through the CLI)."""
    out = {}
    for family in FAMILIES:
        model = ensure_vlm_target(family, ensure_real_target())
        root = tmp_path_factory.mktemp(family)
        cache, draft = str(root / "cache"), str(root / "draft")
        argv = ["precompute", "--model", model, "--data", str(data / "data.jsonl"), "--out", cache, *AUX]
        assert main([*argv, "--batch-size", "2"]) == 0
        assert main(["train", cache, "--out", draft, "--epochs", "2", "--batch-size", "2", "--device", "cpu"]) == 0
        out[family] = {"model": model, "cache": cache, "draft": draft}
    return out


def _model(model_dir: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_of_image_prompts_equals_the_targets_generate(family, targets):
    t = targets[family]
    model, draft = _model(t["model"]), load_draft(t["draft"])
    prompts, images = image_prompts(t["cache"], None, t["model"])
    assert [bool(i.get("pixel_values") is not None) for i in images] == [True, False, True]
    runner, eos = TargetRunner(model, draft.config.aux_layers), eos_ids(model)
    proposers = {"draft": DraftProposer(draft), "ngram": NgramTable.from_cache(t["cache"]), "lookup": PromptLookup()}
    for prompt, inputs in zip(prompts, images):
        ids = torch.tensor([prompt])
        # transformers' own generate, its rope_deltas reset as a new prompt's generate does
        model.model.rope_deltas = None
        want = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **inputs, max_new_tokens=NEW, do_sample=False
        )[0, len(prompt) :].tolist()
        plain, forwards = speculative_generate(runner, prompt, None, 3, NEW, eos, inputs)
        assert plain == want and forwards == len(want)
        for name, proposer in proposers.items():
            got, _ = speculative_generate(runner, prompt, proposer, 3, NEW, eos, inputs)
            assert got == want, name
    if family == "gemma3":
        return
    # a proposer is handed the target's positions of the tokens it is given: the cached ones for the prompt (the
    # model's get_rope_index), then one more on all three rows per generated token
    seen: list[tuple[int, torch.Tensor]] = []

    class Recording(PromptLookup):
        def propose(self, tokens, aux, k, positions=None):
            seen.append((len(tokens), positions))
            return super().propose(tokens, aux, k)

    cached = all_samples(t["cache"])[2]["positions"].long()
    speculative_generate(runner, prompts[2], Recording(), 3, NEW, eos, images[2])
    n, positions = seen[-1]
    assert positions.shape == (n, 3) and n > len(prompts[2])
    assert torch.equal(positions[: len(prompts[2])], cached[: len(prompts[2])])
    after = positions[len(prompts[2]) :]
    assert torch.equal(after[:, 0], int(cached[: len(prompts[2])].max()) + 1 + torch.arange(len(after)))
    assert torch.equal(after, after[:, :1].expand(-1, 3))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_draft_proposer_places_an_mrope_drafts_slots_as_training_and_serving_do(family, targets):
    """The trained (``served``) draft of an M-RoPE target rotates by the target's positions: proposing after an
    image prompt gives the logits the training forward gives at that slot with the cached positions, and other
    logits than with text positions."""
    t = targets[family]
    draft = load_draft(t["draft"])
    assert draft.uses_mrope
    sample = all_samples(t["cache"])[2]  # two images
    ids, aux, positions = sample["input_ids"].long(), sample["aux_hidden_states"], sample["positions"].long()
    m = len(ids) - 2  # the proposer runs slots 0..m-1 and drafts from the last
    seen: list[torch.Tensor] = []
    logits = draft.logits

    def recorded(states: torch.Tensor) -> torch.Tensor:
        seen.append(logits(states))
        return seen[-1]

    draft.logits = recorded  # type: ignore[method-assign]
    DraftProposer(draft).propose(ids[: m + 1].tolist(), aux[:m], 1, positions[: m + 1])
    draft.logits = logits  # type: ignore[method-assign]
    with torch.no_grad():
        want = draft(aux[None, :m], ids[None, 1 : m + 1], positions=positions[None, :m])[0][0, m - 1]
        text = draft(aux[None, :m], ids[None, 1 : m + 1])[0][0, m - 1]
    torch.testing.assert_close(seen[0][0], want, atol=1e-5, rtol=0)
    assert (text - want).abs().max() > 1e-4  # the image positions move the draft


def test_evaluate_cli_decodes_an_image_cache(targets, tmp_path):
    t = targets["qwen3_vl"]
    report = tmp_path / "report.json"
    argv = ["evaluate", t["draft"], "--cache", t["cache"], "--model", t["model"], "--device", "cpu"]
    assert main([*argv, "--max-new-tokens", str(NEW), "--json", str(report), "--quiet"]) == 0
    spec = json.loads(report.read_text())["speculative"]
    assert spec["prompts"] == 3
    assert all(spec[name]["identical_to_greedy"] for name in ("draft", "ngram", "prompt_lookup"))


def _parts(out: Path) -> list[dict]:
    record = json.loads((out / "regenerate.json").read_text())
    return [json.loads(line) for part in record["parts"] for line in (out / part["name"]).read_text().splitlines()]


@pytest.mark.parametrize("family", FAMILIES)
def test_regenerate_answers_image_rows_as_generate_does_and_the_rows_precompute(family, targets, data, tmp_path):
    from PIL import Image

    t = targets[family]
    out = tmp_path / "regen"
    argv = ["regenerate", "--model", t["model"], "--data", str(data / "data.jsonl"), "--out", str(out)]
    # rows of unlike lengths batched together: left-padded, M-RoPE positions per row
    assert main([*argv, "--max-new-tokens", str(NEW), "--batch-size", "3", "--device", "cpu", "--quiet"]) == 0
    rows = _parts(out)
    model, processor = _model(t["model"]), load_processor(t["model"])
    for given, row in zip([chat_row(*r) for r in ROWS], rows):
        assert row["messages"][0] == given["messages"][0]  # the user turn as given: its image parts and paths
        parts = given["messages"][0]["content"]
        user = [
            {"type": "image", "image": Image.open(data / p["image_url"]["url"])} if p["type"] == "image_url" else p
            for p in parts
        ]
        inputs = processor.apply_chat_template(
            [{"role": "user", "content": user}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        prompt = inputs["input_ids"][0].tolist()
        model.model.rope_deltas = None
        want = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)[0, len(prompt) :].tolist()
        assert row["input_ids"] == prompt + want[: len(row["input_ids"]) - len(prompt)]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * (len(row["input_ids"]) - len(prompt))
    # the written rows feed precompute as they are: their ids, with their images' pixels
    cache = str(tmp_path / "cache")
    argv = ["precompute", "--model", t["model"], "--data", str(out), "--out", cache, "--image-root", str(data)]
    assert main([*argv, *AUX]) == 0
    samples = all_samples(cache)
    assert [s["input_ids"].tolist() for s in samples] == [r["input_ids"] for r in rows]
    assert (samples[2]["input_ids"] == model.config.image_token_id).sum() > 0
    if family != "gemma3":  # the images' tokens spread over height and width
        assert not torch.equal(samples[2]["positions"][:, 1], samples[2]["positions"][:, 0])


def test_vision_refusals_name_the_fix(targets, data, tmp_path, capsys):
    t = targets["qwen2_5_vl"]
    argv = ["regenerate", "--model", t["model"], "--data", str(data / "data.jsonl"), "--out", str(tmp_path / "v")]
    assert main([*argv, "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "is a vision-language target" in err and "use --engine hf" in err
    assert not (tmp_path / "v").exists()
    # the cache's pixels need the target's processor: a text-only --model is refused before any decoding
    argv = ["evaluate", t["draft"], "--cache", t["cache"], "--model", ensure_real_target(), "--device", "cpu"]
    assert main([*argv, "--quiet"]) != 0
    assert "has no image processor" in capsys.readouterr().err
    # a pre-tokenized row whose ids hold an image must give the image beside them
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image", "image": Image.open(data / "a.png")}]}]
    ids = load_processor(t["model"]).apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0]
    (tmp_path / "ids.jsonl").write_text(json.dumps({"input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n")
    argv = ["precompute", "--model", t["model"], "--data", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "c")]
    assert main([*argv, *AUX]) != 0
    assert "its input_ids hold 1 image(s) but the row gives 0" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--min-pixels/--max-pixels: .* text-only target"):
        regenerate(RegenerateConfig(ensure_real_target(), str(data / "data.jsonl"), str(tmp_path / "t"), min_pixels=9))


def test_regenerate_resumes_image_rows_with_their_pixel_settings(targets, data, tmp_path, monkeypatch, capsys):
    import speccache.precompute.regenerate as module

    t, out = targets["qwen2_5_vl"], tmp_path / "regen"
    argv = ["regenerate", "--model", t["model"], "--data", str(data / "data.jsonl"), "--out", str(out)]
    argv += ["--max-new-tokens", "4", "--part-size", "1", "--device", "cpu", "--quiet", "--max-pixels", "40000"]
    whole = tmp_path / "whole"
    assert main([*argv[:6], str(whole), *argv[7:]]) == 0
    written = module._write_record

    def stop_after_two_parts(path: str, record: dict) -> None:
        written(path, record)
        if len(record["parts"]) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(module, "_write_record", stop_after_two_parts)
    assert main(argv) != 0
    monkeypatch.undo()
    assert len(list(out.glob("part-*"))) == 2  # of three
    capsys.readouterr()
    # the pixel budget is the run's: another one is refused, naming the flag
    assert main([*argv[:-1], "50000", "--resume"]) != 0
    assert "--max-pixels is 50000" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    assert [(out / p.name).read_bytes() for p in sorted(whole.glob("part-*"))] == [
        p.read_bytes() for p in sorted(out.glob("part-*"))
    ]


def test_regenerate_a_later_turns_image_joins_the_prompt(targets, data, tmp_path, monkeypatch):
    """A second user turn's image is expanded into the second prompt, and the prefill gets both images' pixels."""
    from PIL import Image

    import speccache.engines.hf_generate as module

    t = targets["qwen2_5_vl"]
    processor = load_processor(t["model"])
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = processor.tokenizer("A square.", add_special_tokens=False)["input_ids"] + [end]
    seen: list[tuple[list[int], dict]] = []

    def answering(model, prompts, generators, sampling, max_new_tokens, stop_ids, pad_id, on_tokens=None, images=None):
        seen.extend(zip(prompts, images))
        return [(answer, True) for _ in prompts]

    monkeypatch.setattr(module, "generate_batch", answering)
    row = chat_row(["a.png"], "What is red?", "A square.")
    row["messages"] += chat_row(["b.png"], "And this?", "A line.")["messages"]
    (tmp_path / "two.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["regenerate", "--model", t["model"], "--data", str(tmp_path / "two.jsonl"), "--out", str(tmp_path / "r")]
    assert main([*argv, "--image-root", str(data), "--device", "cpu", "--quiet"]) == 0
    (written,) = _parts(tmp_path / "r")
    answered = {"role": "assistant", "content": "A square."}
    assert written["messages"] == [row["messages"][0], answered, row["messages"][2], answered]
    images = [Image.open(data / "a.png"), Image.open(data / "b.png")]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "text", "text": "What is red?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
        {"role": "user", "content": [{"type": "image", "image": images[1]}, {"type": "text", "text": "And this?"}]},
    ]
    want = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    (first, _), (second, pixels) = seen
    assert list(second) == want["input_ids"][0].tolist() and list(second[: len(first)]) == list(first)
    torch.testing.assert_close(pixels["pixel_values"], want["pixel_values"], atol=0, rtol=0)
    assert torch.equal(pixels["image_grid_thw"], want["image_grid_thw"])
    assert written["input_ids"] == [*second, *answer]
