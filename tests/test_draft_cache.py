"""The draft proposer's KV cache: it proposes what rerunning the draft over the whole sequence proposes.

* over many calls whose verified sequence grows by every accepted length from 0 to ``k`` and then switches to
  another sample, the cached proposer's tokens equal the uncached reference's and its logits agree within fp32
  tolerance;
* greedy speculative decoding with the cached proposer, reused across prompts, is the target's own greedy
  output, with some drafted tokens accepted and some rejected.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM

from speccache.cli import main
from speccache.demo import demo_data_path
from speccache.methods.eagle3 import Eagle3CacheDataset
from speccache.train.draft import Eagle3Draft, load_draft
from speccache.train.evaluate import DraftProposer, TargetRunner, eos_ids, eval_prompts, speculative_generate
from speccache.train.trainer import train

pytestmark = pytest.mark.usefixtures("offline_single_thread")

K = 3


@pytest.fixture(scope="module")
def cache_and_draft(tiny_models, tmp_path_factory):
    """An fp32 EAGLE-3 cache of 24 demo rows from the tiny llama target and a draft trained on it briefly."""
    base = tmp_path_factory.mktemp("draft-cache")
    model = tiny_models("llama")
    cache = str(base / "cache")
    argv = ["precompute", "--model", model, "--data", demo_data_path("sharegpt"), "--out", cache, "--limit", "24",
            "--batch-size", "4", "--max-length", "128", "--model-dtype", "fp32", "--dtype", "fp32",
            "--draft-vocab-size", "300", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    out = str(base / "draft")
    train(cache, out, epochs=4, lr=3e-3, ttt_steps=2, batch_size=4, seed=0)
    return model, cache, load_draft(out)


@torch.no_grad()
def uncached_propose(draft: Eagle3Draft, tokens: Sequence[int], aux: torch.Tensor, k: int) -> list[int]:
    """The reference: the draft's layer rerun over the whole sequence for each drafted token."""
    ids = torch.tensor(list(tokens[1:]), dtype=torch.long)[None]
    states = draft.fc(aux.float())[None]
    out: list[int] = []
    for _ in range(k):
        length = ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        result = draft.layer(draft.embed_tokens(ids), states, torch.arange(length), causal)
        token = int(draft.draft_to_target(draft.logits(result[:, -1]).argmax(-1))[0])
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        states = torch.cat([states, result[:, -1:]], dim=1)
    return out


@contextmanager
def recorded(draft: Eagle3Draft, method: str) -> Iterator[list[tuple[tuple, torch.Tensor]]]:
    """The arguments and result of every call to ``draft.<method>`` inside the block."""
    calls: list[tuple[tuple, torch.Tensor]] = []
    plain = getattr(draft, method)

    def wrapped(*args: object) -> torch.Tensor:
        calls.append((args, plain(*args)))
        return calls[-1][1]

    setattr(draft, method, wrapped)
    try:
        yield calls
    finally:
        delattr(draft, method)


def test_cached_proposals_equal_the_uncached_ones(cache_and_draft):
    _, cache, draft = cache_and_draft
    ds = Eagle3CacheDataset(cache, keys=["input_ids", "aux_hidden_states"])
    proposer = DraftProposer(draft)
    calls = 0
    for i in (0, 1, 0):  # back to a sample after another: the cache is rebuilt, not reused wrongly
        sample = ds[i]
        ids, aux = sample["input_ids"].tolist(), sample["aux_hidden_states"].float()
        n, accepted, grown = 2, 0, 0
        while n <= len(ids):
            # tokens[:n] verified, the aux rows of tokens[:n - 1], as speculative decoding hands them over
            with recorded(draft, "logits") as cached_logits, recorded(draft, "layer") as layer_calls:
                got = proposer.propose(ids[:n], aux[: n - 1], K)
            with recorded(draft, "logits") as reference_logits:
                want = uncached_propose(draft, ids[:n], aux[: n - 1], K)
            assert got == want, (i, n)
            assert len(cached_logits) == len(reference_logits) == K
            for (_, a), (_, b) in zip(cached_logits, reference_logits):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            # the cost: the slots of the newly verified tokens in one step, then one slot per drafted token
            widths = [args[1].shape[1] for args, _ in layer_calls]
            if grown:  # (a sample's first call may reuse only a prefix of the previous sample's slots)
                assert widths == [grown] + [1] * (K - 1), (i, n, widths)
            calls += 1
            grown = accepted + 1  # every accepted length 0..K in turn, then the target's next token
            n += grown
            accepted = (accepted + 1) % (K + 1)
    assert calls > 60


def test_speculative_output_with_the_cached_draft_equals_greedy(cache_and_draft):
    model_dir, cache, draft = cache_and_draft
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = TargetRunner(model, draft.config.aux_layers)
    eos = eos_ids(model)
    proposer = DraftProposer(draft)  # one proposer for every prompt, as speccache evaluate uses it
    drafted = accepted = 0
    original = proposer.propose

    def counting(tokens: Sequence[int], aux: torch.Tensor, k: int) -> list[int]:
        nonlocal drafted
        out = original(tokens, aux, k)
        drafted += len(out)
        return out

    proposer.propose = counting  # type: ignore[method-assign]
    for prompt in eval_prompts(cache, 6):
        want = model.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
        )[0, len(prompt) :].tolist()
        got, forwards = speculative_generate(runner, prompt, proposer, K, 32, eos)
        assert got == want
        accepted += len(got) - forwards
    assert 0 < accepted < drafted, (accepted, drafted)
