"""The reference EAGLE-3 draft, its trainer and evaluator, and the alignment they rest on.

* the trainer's loss falls and its draft's teacher-forced acceptance beats the n-gram and prompt-lookup
  baselines on a tiny cache (random tiny target, so only the draft, which reads the target's states, can
  predict it);
* greedy speculative decoding with every proposer gives the target's own greedy output token for token;
* offline equals online: a few training steps from an fp32 cache and from the target's features computed live
  give identical losses and parameters;
* ``--compute-dtype bf16`` trains under autocast, near the fp32 run, and saves fp32 weights;
* on the real target (SmolLM2-135M-Instruct), ``in_draft[t]`` is row ``t``'s argmax and ``position_mask`` counts
  the row that predicts each turn's first generated token and not the row after its end-of-turn.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.methods.eagle3 import (
    Supervision,
    TargetHead,
    build_eagle3_dataloader,
    draft_view,
)
from speccache.methods.eagle3_producer import Eagle3Target
from speccache.train.draft import load_draft
from speccache.train.evaluate import (
    DraftProposer,
    NgramTable,
    PromptLookup,
    TargetRunner,
    eos_ids,
    eval_prompts,
    speculative_generate,
    teacher_forced,
)
from speccache.train.trainer import draft_for_cache, make_optimizer, train, train_steps

pytestmark = pytest.mark.usefixtures("offline_single_thread")

DATA = demo_data_path("sharegpt")
# --device cpu: the exact comparisons with a live forward run it on the CPU, also on a machine with a GPU
COMMON = ["--model-dtype", "fp32", "--dtype", "fp32", "--max-length", "128", "--quiet", "--draft-vocab-size", "300"]
COMMON += ["--device", "cpu"]


@pytest.fixture(scope="module")
def caches(tiny_models, tmp_path_factory):
    """A training cache of the first 48 demo rows (batch size 1, so its features are a lone forward's exactly)
    and a held-out cache of the last 16, both fp32, from the tiny llama target."""
    base = tmp_path_factory.mktemp("train")
    with open(DATA, encoding="utf-8") as f:
        rows = f.readlines()
    held_out = base / "held_out.jsonl"
    held_out.write_text("".join(rows[-16:]), encoding="utf-8")
    model = tiny_models("llama")
    train_dir, eval_dir = str(base / "train"), str(base / "eval")
    args = ["--model", model, "--out", train_dir, "--data", DATA, "--limit", "48", "--batch-size", "1"]
    assert main(["precompute", *args, *COMMON]) == 0
    args = ["--model", model, "--out", eval_dir, "--data", str(held_out), "--batch-size", "4"]
    assert main(["precompute", *args, *COMMON]) == 0
    return {"model": model, "train": train_dir, "eval": eval_dir, "base": base}


@pytest.fixture(scope="module")
def trained(caches):
    """A draft trained by ``speccache train`` (3 training-time-test steps) and the loss of every step."""
    out = str(caches["base"] / "draft")
    result = train(caches["train"], out, epochs=6, lr=3e-3, ttt_steps=3, batch_size=8, seed=0)
    return out, result.losses


def test_train_cli_writes_the_published_eagle3_layout(caches, capsys):
    out = str(caches["base"] / "cli-draft")
    argv = ["train", caches["train"], "--out", out, "--max-steps", "2", "--batch-size", "4"]
    assert main(argv) == 0
    assert "EAGLE-3 draft trained 2 steps" in capsys.readouterr().out
    tensors = load_file(os.path.join(out, "model.safetensors"))
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
    assert expected <= set(tensors)
    assert {k for k in tensors if k.startswith("midlayer.")} >= {
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.mlp.down_proj.weight",
    }
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64  # [embedding; state]
    assert tensors["lm_head.weight"].shape == (300, 64) and tensors["fc.weight"].shape == (64, 3 * 64)
    config = json.loads(open(os.path.join(out, "config.json"), encoding="utf-8").read())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 300
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    side = load_file(os.path.join(caches["train"], "eagle3_side.safetensors"))
    assert torch.equal(tensors["d2t"], side["d2t"]) and torch.equal(tensors["t2d"], side["t2d"])
    # nothing that exists is overwritten
    assert main(argv) == 1
    assert "already holds a draft" in capsys.readouterr().err


def test_loss_falls_and_acceptance_beats_the_baselines(caches, trained):
    out, losses = trained
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses
    draft = load_draft(out)
    results = teacher_forced(draft, caches["eval"], 3, NgramTable.from_cache(caches["train"]))
    assert results["draft"]["chains"] > 200
    for baseline in ("ngram", "prompt_lookup"):
        assert results["draft"]["per_step"][0] > results[baseline]["per_step"][0] + 0.05, results
        assert results["draft"]["mean_accepted"] > results[baseline]["mean_accepted"], results
    # an untrained draft (its head the target's LM-head rows over an untrained fusion) accepts far less
    torch.manual_seed(0)
    fresh, _ = draft_for_cache(caches["train"])
    assert teacher_forced(fresh, caches["eval"], 1)["draft"]["per_step"][0] < results["draft"]["per_step"][0]


def test_speculative_output_equals_greedy(caches, trained):
    model = AutoModelForCausalLM.from_pretrained(caches["model"], dtype=torch.float32).eval()
    draft = load_draft(trained[0])
    runner = TargetRunner(model, draft.config.aux_layers)
    eos = eos_ids(model)
    proposers = {
        "draft": DraftProposer(draft),
        "prompt_lookup": PromptLookup(),
        "ngram": NgramTable.from_cache(caches["train"]),
    }
    prompts = eval_prompts(caches["eval"], 4)
    assert len(prompts) == 4
    accepted = {name: 0 for name in proposers}
    for prompt in prompts:
        want = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
        )[0, len(prompt) :].tolist()
        plain, forwards = speculative_generate(runner, prompt, None, 3, 24, eos)
        assert plain == want and forwards == len(want)
        for name, proposer in proposers.items():
            got, forwards = speculative_generate(runner, prompt, proposer, 3, 24, eos)
            assert got == want, name
            accepted[name] += len(got) - forwards
    assert accepted["draft"] > 0, "the trained draft should get some drafted tokens accepted"


def _live_batch(batch: dict[str, torch.Tensor], target: Eagle3Target) -> dict[str, torch.Tensor]:
    """The batch's tokens and masks with aux and last hidden states computed by the target now, sample by sample."""
    aux = torch.zeros_like(batch["aux_hidden_states"])
    last = torch.zeros_like(batch["last_hidden_state"])
    for b, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        ids = batch["input_ids"][b : b + 1, :n].long()
        feats = target.forward_features(ids, torch.ones_like(ids))
        aux[b, :n], last[b, :n] = feats["aux_hidden_states"][0], feats["last_hidden_state"][0]
    keep = ("input_ids", "loss_mask", "attention_mask", "in_draft")
    return {**{k: batch[k] for k in keep if k in batch}, "aux_hidden_states": aux, "last_hidden_state": last}


def test_offline_equals_online(caches):
    cache = caches["train"]
    model = AutoModelForCausalLM.from_pretrained(caches["model"], dtype=torch.float32)
    selected = TargetHead.from_cache(cache).selected_token_ids
    target = Eagle3Target(model, [1, 3, 4], Supervision("hidden"), selected, torch.float32)
    live_head = TargetHead(model.get_output_embeddings().weight.detach()[selected], selected)
    batches = [b for _, b in zip(range(4), build_eagle3_dataloader(cache, batch_size=4, shuffle=True, seed=3))]
    runs = []
    for online in (False, True):
        torch.manual_seed(7)
        draft, head = draft_for_cache(cache)
        if online:
            head, feed = live_head, (_live_batch(b, target) for b in batches)
        else:
            feed = iter(batches)
        losses = train_steps(draft, feed, head, make_optimizer(draft, 1e-3), steps=2)
        runs.append((losses, draft.state_dict()))
    (offline_losses, offline_params), (online_losses, online_params) = runs
    assert offline_losses == online_losses and len(offline_losses) == 4
    for name, value in offline_params.items():
        assert torch.equal(value, online_params[name]), name
    assert not torch.equal(offline_params["fc.weight"], draft_for_cache(cache)[0].fc.weight), "it trained"


def test_bf16_compute_runs_under_autocast_and_keeps_fp32_weights(caches, tmp_path, capsys):
    losses = {}
    for dtype in ("fp32", "bf16"):
        out = str(tmp_path / dtype)
        result = train(caches["train"], out, max_steps=12, lr=3e-3, ttt_steps=2, batch_size=8, compute_dtype=dtype)
        losses[dtype] = result.losses
    fp32, bf16 = losses["fp32"], losses["bf16"]
    # the same weights and first batch: bf16 products round differently, but not far
    assert bf16[0] != fp32[0] and abs(bf16[0] - fp32[0]) < 0.02 * fp32[0], (fp32[0], bf16[0])
    assert sum(bf16[-3:]) < sum(bf16[:3]), bf16
    config = json.loads((tmp_path / "bf16" / "config.json").read_text(encoding="utf-8"))
    assert config["speccache"]["training"]["compute_dtype"] == "bf16"
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {v.dtype for v in tensors.values() if v.is_floating_point()} == {torch.float32}
    assert main(["train", caches["train"], "--out", str(tmp_path / "fp16"), "--compute-dtype", "fp16"]) == 2
    assert "--compute-dtype 'fp16' is unknown; choose one of fp32, bf16" in capsys.readouterr().err


def test_alignment_on_the_real_target(real_model, tmp_path):
    """Rows are target states: in_draft[t] is row t's argmax; position_mask[t] = loss_mask[t + 1] & in_draft[t]."""
    out = str(tmp_path / "real")
    argv = ["precompute", "--model", real_model, "--data", DATA, "--out", out, "--limit", "3", "--max-length", "192",
            "--model-dtype", "fp32", "--dtype", "fp32", "--draft-vocab-size", "4096", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    head = TargetHead.from_cache(out)
    lm_head = AutoModelForCausalLM.from_pretrained(real_model).get_output_embeddings().weight.detach()
    t2d = torch.zeros(lm_head.shape[0], dtype=torch.bool)
    t2d[head.selected_token_ids] = True
    end_of_turn = 2  # <|im_end|>
    turns = 0
    for batch in build_eagle3_dataloader(out, batch_size=1, shuffle=False):
        n = int(batch["attention_mask"].sum())
        ids, loss_mask, in_draft = batch["input_ids"][0, :n], batch["loss_mask"][0, :n], batch["in_draft"][0, :n]
        last = batch["last_hidden_state"][0, :n]
        assert torch.equal(in_draft, t2d[(last @ lm_head.T).argmax(-1)])
        _, position_mask = head(last, loss_mask, in_draft)
        view = draft_view(batch, head)
        starts = [t for t in range(1, n) if loss_mask[t] and not loss_mask[t - 1]]
        ends = [t for t in range(n) if loss_mask[t] and (t + 1 == n or not loss_mask[t + 1])]
        for s in starts:  # the row after "<|im_start|>assistant\n" predicts the turn's first generated token
            assert bool(position_mask[s - 1]) == bool(in_draft[s - 1])
            assert (
                bool(view["mask"][0, s - 2]) == bool(in_draft[s - 1]) and int(view["input_ids"][0, s - 2]) == ids[s - 1]
            )
            turns += bool(in_draft[s - 1])
        for e in ends:  # the end-of-turn token is generated; the row after reading it predicts nothing generated
            assert not position_mask[e]
            if e + 1 < n:
                assert int(ids[e]) == end_of_turn
        assert not position_mask[n - 1]
    assert turns >= 3


def test_evaluate_cli_reports_both_measures(caches, trained, tmp_path, capsys):
    report = tmp_path / "report.json"
    argv = ["evaluate", trained[0], "--cache", caches["eval"], "--model", caches["model"], "--prompts", "2",
            "--max-new-tokens", "8", "--json", str(report)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "teacher-forced on" in out and "mean accepted length" in out and "identical to greedy: yes" in out
    body = json.loads(report.read_text())
    assert set(body["teacher_forced"]) == {"draft", "ngram", "prompt_lookup"}
    assert body["train_cache"] == os.path.abspath(caches["train"])
    spec = body["speculative"]
    assert spec["prompts"] == 2 and spec["greedy"]["tau"] == 1.0
    assert all(spec[name]["identical_to_greedy"] for name in ("greedy", "draft", "prompt_lookup", "ngram"))


def test_evaluate_refuses_a_chain_of_no_tokens_by_name(caches, trained, capsys):
    assert main(["evaluate", trained[0], "--cache", caches["eval"], "--k", "0"]) == 2
    assert "speccache evaluate: error: --k 0 must be at least 1" in capsys.readouterr().err
    assert main(["evaluate", trained[0], "--cache", caches["eval"], "--model-dtype", "half"]) == 2
    assert "speccache evaluate: error: --model-dtype 'half' is unknown" in capsys.readouterr().err
    assert main(["evaluate", trained[0], "--cache", caches["eval"], "--device", "tpu"]) == 2
    assert "speccache evaluate: error: --device 'tpu' is unknown; choose cpu or cuda" in capsys.readouterr().err


def test_evaluate_on_a_named_device_reports_what_the_default_does(caches, trained, tmp_path, capsys):
    reports = []
    for extra in ([], ["--device", "cpu"]):
        report = tmp_path / f"report{len(reports)}.json"
        argv = ["evaluate", trained[0], "--cache", caches["eval"], "--model", caches["model"], "--prompts", "2",
                "--max-new-tokens", "8", "--json", str(report), *extra]  # fmt: skip
        assert main(argv) == 0
        body = json.loads(report.read_text())
        for run in body["speculative"].values():
            if isinstance(run, dict):
                run.pop("seconds"), run.pop("speedup")
        reports.append(body)
    assert reports[0] == reports[1]
    capsys.readouterr()
