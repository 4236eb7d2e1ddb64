"""tau counts exactly the tokens each target forward emitted: a forward after an accepted end-of-sequence token
(whose tokens the output drops) is not counted, so tau >= 1 and equals tokens / forwards of the kept output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from speccache.train.evaluate import speculative, speculative_generate

VOCAB, EOS = 10, 7


def runner(ids: Sequence[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A target whose greedy next token is always the last one plus 1 (mod 10); it needs no KV cache."""
    logits = torch.nn.functional.one_hot((torch.tensor(list(ids)) + 1) % VOCAB, VOCAB).float()
    return logits, torch.zeros(len(ids), 1)


class Oracle:
    """Proposes exactly the target's next ``k`` tokens, an end-of-sequence token among them included."""

    def propose(self, tokens: Sequence[int], aux: torch.Tensor, k: int) -> list[int]:
        return [(tokens[-1] + i) % VOCAB for i in range(1, k + 1)]


def test_no_forward_is_counted_after_an_accepted_eos():
    # prompt [4]: the prefill emits 5, one forward verifies [5, 6, 7(eos), 8] and keeps 6 and 7
    assert speculative_generate(runner, [4], Oracle(), 3, 64, [EOS]) == ([5, 6, 7], 2)
    assert speculative_generate(runner, [4], None, 3, 64, [EOS]) == ([5, 6, 7], 3)


def test_tau_is_the_tokens_emitted_per_forward():
    runs = speculative(runner, [[4], [8], [1]], {"oracle": Oracle()}, 3, 64, [EOS])
    # per forward: [4]: 5 | 6 7; [8]: 9 | 0 1 2 3 | 4 5 6 7; [1]: 2 | 3 4 5 6 | 7 (8 9 0 dropped)
    assert (runs["oracle"]["tokens"], runs["oracle"]["forwards"]) == (3 + 9 + 6, 2 + 3 + 3)
    assert runs["greedy"]["tau"] == 1.0 and runs["oracle"]["identical_to_greedy"]


def test_every_method_runs_once_before_its_timing_starts(monkeypatch):
    # on CUDA a method's first run loads its kernels (greedy's first pass took 2.3 s where the same forwards took
    # 0.4 s later), so each method, greedy included, runs once on the first prompt before any clock is read
    import speccache.train.evaluate as evaluate

    events: list[str] = []
    clock = evaluate.time.perf_counter

    class Logged(Oracle):
        def propose(self, tokens: Sequence[int], aux: torch.Tensor, k: int) -> list[int]:
            events.append("propose")
            return super().propose(tokens, aux, k)

    def logged_runner(ids: Sequence[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        events.append("forward")
        return runner(ids, cache)

    def logged_clock() -> float:
        events.append("clock")
        return clock()

    monkeypatch.setattr(evaluate.time, "perf_counter", logged_clock)
    runs = speculative(logged_runner, [[4], [8]], {"oracle": Logged()}, 3, 64, [EOS])
    first_clock = events.index("clock")
    assert "forward" in events[:first_clock] and "propose" in events[:first_clock]
    # the warm-up is not counted: the timed runs alone give the figures of test_tau_is_the_tokens_emitted_per_forward
    assert (runs["oracle"]["tokens"], runs["oracle"]["forwards"]) == (3 + 9, 2 + 3)
