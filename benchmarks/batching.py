"""Tokens/s and padding of the ``hf`` engine's batchings (padded in stored order, sorted, token budget), per target.

    python benchmarks/batching.py --out docs/benchmarks.md    # replaces the "hf batching" section there

Each run is a whole ``speccache precompute`` (``run_precompute``: plan, load, compute, write, seal) of EAGLE-3
features in fp32, on one thread (``OMP_NUM_THREADS=1``, set here), with ``--batching ordered --batch-size 8``
(the old padded loop), ``--batching sorted --batch-size 8`` and ``--max-batch-tokens B`` for each ``--budgets``:

* data: ``--samples`` synthetic pre-tokenized rows (random token ids, lognormal lengths of mean ~``--mean``, cut to
  ``--max-length``: a long tail), and the 240 demo ShareGPT rows;
* targets: the tiny demo Llama (hidden 64, 8 layers) and a wider random Llama (hidden 256, 3 layers, heads of 64),
  on which the projections weigh more.

Real tokens/s = the manifest's ``stats.tokens`` / (the run's wall time - start-up), the start-up being the wall
time of the same run on one demo row (planning, loading the target, sealing), best of two. Computed / real is the
manifest's ``stats.computed_tokens`` / ``stats.tokens``. Every sorted cache is compared with the ordered one: the
same files of the same sizes, the same token ids, masks and source rows, features within 1e-4 of each sample's
largest value (a batch's shape changes fp32 rounding, so the float features are not bitwise the same). A table of
computed / real by shard size on a larger draw of the same lengths (no model: ``computed_tokens``, the function
the manifest's figure comes from) shows where padding is left. Inside the vLLM environment (``make
bench-engine``), ``--engine vllm`` runs the long-tailed rows on the wide target too (the tiny target's heads of 16
are below what vLLM's CPU attention takes).

Usage: python benchmarks/batching.py [--samples N] [--mean T] [--sigma S] [--max-length L] [--budgets B ...]
    [--targets tiny wide] [--no-demo] [--work-dir DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import shutil
import sys
import time
from typing import TYPE_CHECKING

from harness import load_average, machine_summary, replace_section  # benchmarks/, beside this script
from shard_memory import build_model_dir

if TYPE_CHECKING:
    from speccache.format.manifest import Manifest

BEGIN, END = "<!-- batching-benchmark:begin -->", "<!-- batching-benchmark:end -->"
# Wider than the demo target, so that the projections, not the per-head attention work, carry more of a forward.
WIDE = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
WIDE_AUX_LAYERS = [0, 1, 2]  # the default [1, L // 2 - 1, L - 4] needs 7 layers or more to be distinct
TARGET = 1.05  # the most computed / real tokens sorted batches may cost on the long-tailed mix (issue 22)
FEATURE_TOLERANCE = 1e-4
DRAW_SEEDS = (1, 2, 3, 4)  # the by-shard-size table's draws of 4096 lengths, apart from the measured rows' seed
SHARD_SIZES = (64, 128, 256, 1024, 4096)


def long_tailed_lengths(n: int, mean: float, sigma: float, max_length: int, seed: int) -> list[int]:
    """``n`` lognormal lengths of mean ``mean`` (before the cut), cut to ``[16, max_length]``."""
    import numpy as np

    mu = math.log(mean) - sigma**2 / 2
    lengths = np.random.default_rng(seed).lognormal(mu, sigma, n).round().astype(int)
    return np.clip(lengths, 16, max_length).tolist()


def write_rows(path: str, lengths: list[int], vocab: int, seed: int) -> str:
    """Pre-tokenized rows of these lengths (random ids above the 8 special tokens; the last 3/4 supervised)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n in lengths:
            mask = [0] * (n // 4) + [1] * (n - n // 4)
            f.write(json.dumps({"input_ids": rng.integers(8, vocab, n).tolist(), "loss_mask": mask}) + "\n")
    return path


def build_wide_target(path: str) -> str:
    """The wide random Llama of :data:`WIDE` with the demo tokenizer, built once in ``path``."""
    from speccache.demo import build_demo_tokenizer

    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        build_model_dir(path, WIDE)
        build_demo_tokenizer().save_pretrained(path)
    return path


def precompute(
    model: str, data: str, out: str, max_length: int, setting: dict, limit: int | None = None
) -> tuple[float, Manifest]:
    """One ``run_precompute`` of ``setting`` (``PrecomputeConfig`` fields) into a fresh ``out``: its wall seconds
    and the sealed manifest."""
    from speccache.precompute import PrecomputeConfig, run_precompute

    shutil.rmtree(out, ignore_errors=True)
    cfg = PrecomputeConfig(model=model, data=data, out=out, max_length=max_length, batch_size=8, dtype="fp32",
                           model_dtype="fp32", num_proc=1, limit=limit, **setting)  # fmt: skip
    cfg.check()
    started = time.perf_counter()
    manifest = run_precompute(cfg, progress=False)
    return time.perf_counter() - started, manifest


def startup(model: str, data: str, out: str, max_length: int, setting: dict) -> float:
    """Seconds of a run of ``setting`` on the first row of ``data``, best of two: the first also pays what a
    process does once (imports, the modelling code)."""
    return min(precompute(model, data, out, max_length, setting, limit=1)[0] for _ in range(2))


def compare_caches(a: str, b: str) -> tuple[float, int, int]:
    """Check that cache ``b`` holds what ``a`` does; returns (largest feature difference relative to the sample's
    largest value, bitwise-equal samples, samples). Raises AssertionError when files, sizes, token keys or features
    (beyond :data:`FEATURE_TOLERANCE`) differ."""
    import torch

    from speccache.read import CacheDataset

    def sizes(path: str) -> dict[str, int]:
        return {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n != "manifest.json"}

    assert sizes(a) == sizes(b), f"{b}: files or sizes differ from {a}: {sizes(a)} != {sizes(b)}"
    x, y = CacheDataset(a), CacheDataset(b)
    assert len(x) == len(y), f"{b}: {len(y)} samples, {a}: {len(x)}"
    worst, equal = 0.0, 0
    for i in range(len(x)):
        p, q = x[i], y[i]
        assert p.keys() == q.keys(), f"sample {i}: keys {sorted(p)} != {sorted(q)}"
        same = True
        for key in p:
            if p[key].is_floating_point():
                scale = float(p[key].abs().max()) if p[key].numel() else 0.0
                diff = float((p[key] - q[key]).abs().max()) / scale if scale else float(q[key].abs().max())
                assert diff <= FEATURE_TOLERANCE, f"sample {i} {key}: {b} differs from {a} by {diff}"
                worst, same = max(worst, diff), same and diff == 0
            else:
                assert torch.equal(p[key], q[key]), f"sample {i} {key}: {b} differs from {a}"
        equal += same
    return worst, equal, len(x)


def cache_lengths(path: str) -> list[int]:
    """Each sample's token count, in stored order."""
    from speccache.read import CacheDataset

    ds = CacheDataset(path)
    return [int(ds[i]["input_ids"].numel()) for i in range(len(ds))]


def forwards(lengths: list[int], setting: dict, shard_size: int = 256) -> int:
    """``compute_batch`` calls of a run of ``setting`` over samples of these ``lengths``."""
    from speccache.format import ceil_div
    from speccache.write.loops import shard_batches

    total = 0
    for start in range(0, len(lengths), shard_size):
        shard = lengths[start : start + shard_size]
        if setting.get("batching") == "ordered":
            total += ceil_div(len(shard), 8)
        else:
            total += len(shard_batches(shard, 8, setting.get("max_batch_tokens")))
    return total


def padding_by_shard_size(
    lengths: list[int], settings: list[tuple[str, dict]], sizes: tuple[int, ...]
) -> dict[int, list[float]]:
    """Per shard size, computed / real tokens of each setting on samples of these ``lengths`` (no model)."""
    from speccache.precompute import PrecomputeConfig
    from speccache.precompute.report import computed_tokens

    def ratio(size: int, setting: dict) -> float:
        cfg = PrecomputeConfig(model="", data="", out="", shard_size=size, **setting)
        return computed_tokens(lengths, cfg) / sum(lengths)

    return {size: [ratio(size, setting) for _, setting in settings] for size in sizes}


def top_batches(lengths: list[int], count: int = 2) -> str:
    """Where sorted batches of 8 leave their padding in one shard: the longest batches and their share of it."""
    from speccache.write.loops import shard_batches

    batches = [[lengths[i] for i in b] for b in shard_batches(lengths, 8)]
    pads = [len(b) * b[0] - sum(b) for b in batches]
    share = sum(pads[:count]) / (sum(pads) or 1)
    shown = "; ".join(", ".join(str(n) for n in b) for b in batches[:count])
    return f"its {count} longest batches of 8 ({shown} tokens) hold {share:.0%} of the shard's padding"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=128, help="long-tailed rows (default 128)")
    p.add_argument("--mean", type=float, default=1000.0, help="their mean length before the cut (default 1000)")
    p.add_argument("--sigma", type=float, default=0.8, help="the lognormal's sigma (default 0.8)")
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--budgets", type=int, nargs="+", default=[4096], help="--max-batch-tokens values to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", nargs="+", choices=["tiny", "wide"], default=["tiny", "wide"])
    p.add_argument("--no-demo", action="store_true", help="no demo-data rows (by default, on the tiny target)")
    p.add_argument("--work-dir", default="bench-out/batching", help="targets, data and caches (caches removed)")
    p.add_argument("--out", default=None, help="markdown file whose batching section is replaced (or appended)")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    vllm = importlib.util.find_spec("vllm") is not None
    if vllm:
        from engines import vllm_environment  # benchmarks/, beside this script

        vllm_environment()

    import torch

    from speccache.demo import build_tiny_model_dir, demo_data_path

    torch.set_num_threads(1)
    began, load_before = time.perf_counter(), load_average()
    work = args.work_dir
    os.makedirs(work, exist_ok=True)
    builders = {"tiny": lambda path: build_tiny_model_dir(path, "llama"), "wide": build_wide_target}
    models = {target: builders[target](os.path.join(work, target)) for target in args.targets}
    lengths = long_tailed_lengths(args.samples, args.mean, args.sigma, args.max_length, args.seed)
    long_tailed = write_rows(os.path.join(work, "long-tailed.jsonl"), lengths, WIDE["vocab_size"], args.seed)
    settings = [
        ("`--batching ordered --batch-size 8`", {"batching": "ordered"}),
        ("`--batching sorted --batch-size 8`", {}),
        *[(f"`--max-batch-tokens {b}`", {"max_batch_tokens": b}) for b in args.budgets],
    ]
    startup_row = demo_data_path("sharegpt")
    rows, ratios, checks, startups = [], {}, [], {}
    for target in args.targets:
        model = models[target]
        own = {"aux_layers": WIDE_AUX_LAYERS} if target == "wide" else {}
        startups[target] = startup(model, startup_row, os.path.join(work, "startup"), args.max_length, own)
        # The demo rows are short: on the wide target they would add minutes and show what the tiny one does.
        data = {"long-tailed": long_tailed, **({} if args.no_demo or target != "tiny" else {"demo": startup_row})}
        runs = [(name, path, label, {**own, **setting}) for name, path in data.items() for label, setting in settings]
        if vllm and target == "wide":
            vllm_setting = {**own, "engine": "vllm"}
            startups["vllm"] = startup(model, startup_row, os.path.join(work, "startup"), args.max_length, vllm_setting)
            runs.append(("long-tailed", long_tailed, "`--engine vllm`", vllm_setting))
        reference: dict[str, tuple[str, float, list[int]]] = {}
        for name, path, label, setting in runs:
            out = os.path.join(work, f"{target}-{name}-{len(rows)}")
            seconds, manifest = precompute(model, path, out, args.max_length, setting)
            engine = setting.get("engine", "hf")
            compute = seconds - startups["vllm" if engine == "vllm" else target]
            real, computed = manifest.stats["tokens"], manifest.stats["computed_tokens"]
            rate = real / compute
            if name not in reference:
                reference[name] = (out, rate, cache_lengths(out))
                check = "(the reference)"
            else:
                worst, equal, n = compare_caches(reference[name][0], out)
                checks.append(worst)
                check = f"equal: {equal} of {n} samples bitwise, features within {worst:.0e}"
                shutil.rmtree(out)
            steps = forwards(reference[name][2], setting)
            if engine == "vllm":  # it pads nothing; the manifest counts the padding of the hf engine's batches
                ratio = f"1.00 (stats: {computed / real:.3f})"
            else:
                ratio = f"{computed / real:.3f}"
                ratios.setdefault(name, {})[label] = computed / real
            rows.append(
                f"| {target} | {name} | {label} | {steps} | {ratio} | {compute:.1f} | {rate:.0f} | "
                f"{rate / reference[name][1]:.2f}x | {check} |"
            )
            print(rows[-1], flush=True)
        for out, _, _ in reference.values():
            shutil.rmtree(out)
    shutil.rmtree(os.path.join(work, "startup"), ignore_errors=True)
    minutes = (time.perf_counter() - began) / 60
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_minutes = (usage.ru_utime + usage.ru_stime) / 60

    tail = ratios["long-tailed"]
    real = sum(lengths)
    analysis = settings + [(f"`--max-batch-tokens {b}`", {"max_batch_tokens": b}) for b in (8192, 16384)
                           if b not in args.budgets]  # fmt: skip
    draw = [n for s in DRAW_SEEDS for n in long_tailed_lengths(4096, args.mean, args.sigma, args.max_length, s)]
    by_size = padding_by_shard_size(draw, analysis, SHARD_SIZES)
    lines = [
        BEGIN,
        "## hf batching: padded in stored order, sorted, token budget",
        "",
        f"Generated by `python benchmarks/batching.py {' '.join(sys.argv[1:])}` (run by `make bench`) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {minutes:.1f} min, {cpu_minutes:.1f} min of CPU "
        f"(load average {load_before} at start, {load_average()} at end), "
        f"{machine_summary()} (shared), OMP_NUM_THREADS=1, torch {torch.__version__}"
        f"{', vLLM installed' if vllm else ''}. Each row is a whole `run_precompute` of EAGLE-3 features (fp32 "
        f"target and storage, `--shard-size 256`, `--max-length {args.max_length}`), one run each.",
        "",
        f"- long-tailed: {args.samples} synthetic pre-tokenized rows (random token ids), lognormal lengths "
        f"(sigma {args.sigma}, mean {args.mean:.0f} before the cut) cut to [16, {args.max_length}]: "
        f"{real} tokens, mean {real / len(lengths):.0f}, median {sorted(lengths)[len(lengths) // 2]}, longest "
        f"{max(lengths)}, {sum(n >= 2048 for n in lengths)} rows of 2048 or more;",
        *(
            ["- demo (tiny target only): the 240 demo ShareGPT rows (`demo_data_path('sharegpt')`, short);"]
            if "demo" in ratios
            else []
        ),  # fmt: skip
        "- targets: "
        + "; ".join(
            {
                "tiny": "tiny, the demo Llama (hidden 64, 8 layers, 4 heads of 16)",
                "wide": f"wide, a random Llama of hidden {WIDE['hidden_size']}, {WIDE['num_hidden_layers']} layers "
                f"(aux layers {WIDE_AUX_LAYERS}), {WIDE['num_attention_heads']} heads of {WIDE['head_dim']}, MLP "
                f"{WIDE['intermediate_size']}",
            }[t]
            for t in args.targets
        )
        + ".",
        "",
        "Seconds: the run's wall time less its start-up (the same run on one demo row, best of two: planning, "
        "loading, "
        + ", ".join(f"{t} {s:.1f} s" for t, s in startups.items())
        + "). Real tokens/s: `stats.tokens` / those seconds. Computed / real: `stats.computed_tokens` / "
        "`stats.tokens` of the manifest (the padded tokens the forwards held). Cache: each cache against the "
        "ordered one of the same target and data (files and sizes, token ids, masks, source rows equal; the "
        "largest feature difference relative to the sample's largest value).",
        "",
        "| target | measured |  |",
        "|---|---|---|",
    ]
    for label, setting in settings[1:]:
        for where, got in (
            (f"the {args.samples} long-tailed rows (one shard)", tail[label]),
            (f"{len(draw)} such rows in shards of 256 (computed)", by_size[256][settings.index((label, setting))]),
        ):
            verdict = "met" if got <= TARGET else "**not met**"
            lines.append(f"| computed / real <= {TARGET}, {label}, {where} | {got:.3f} | {verdict} |")
    lines += [
        f"| sorted caches hold the ordered one's samples (features within {FEATURE_TOLERANCE:g} of their largest; "
        f"checked, the "
        f"script stops otherwise) | largest difference {max(checks):.0e} | met |",
        "",
        "| target | data | batching | forwards | computed / real | seconds | real tokens/s | vs ordered | cache |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Computed / real by shard size, on {len(draw)} rows drawn from the same lengths (no model: "
        "`computed_tokens`, the function the manifest's figure comes from; batches never cross a shard):",
        "",
        "| shard size | " + " | ".join(label for label, _ in analysis) + " |",
        "|---|" + "---|" * len(analysis),
        *(
            f"| {size}{' (default)' if size == 256 else ''} | " + " | ".join(f"{c:.3f}" for c in cells) + " |"
            for size, cells in by_size.items()
        ),
        "",
        "Why sorted batches of 8 keep some padding on a long tail: a shard's samples are sorted, then cut every 8, "
        "so each batch is padded to its longest; in the body of the distribution neighbours differ by a few "
        f"tokens, but its tail is sparse: in the measured shard, {top_batches(lengths[:256])}. A smaller "
        "shard holds fewer of the tail's samples, further apart, so sorting within 64 samples leaves more "
        "padding, not less, and larger shards fill the tail in. A token budget caps the padding where it is: a "
        "long sample gets a batch of its own or few neighbours (more, smaller forwards). The stored order, and so "
        "every cache, is the same whatever the batches; only fp32 rounding differs with a batch's shape (the last "
        "column), which is why a resume and the audit recompute each shard in its own batches.",
        "",
        f"So on this mix `--batch-size 8` alone keeps computed / real within {TARGET} only in shards of "
        f"{next((f'{n}' for n in SHARD_SIZES if by_size[n][1] <= TARGET), f'more than {SHARD_SIZES[-1]}')} samples "
        f"or more; at the default 256, a token budget near `--max-length` is what meets it"
        + (f" ({settings[2][0]}: {by_size[256][2]:.3f})" if len(settings) > 2 else "")
        + ". On short rows a budget is a cap on tokens, not samples: its batches hold more of them, and can pad "
        "more than batches of 8 (the demo rows). The default batches stay as they are: other batches would change "
        "the float bytes of every sorted cache written by the same command, and the batches the audit recomputes "
        "for caches already written. Tokens/s gains exceed the computed-token ones (ordered / sorted: "
        f"{tail[settings[0][0]] / tail[settings[1][0]]:.2f}x the tokens on the long-tailed rows): a forward's "
        "attention grows with the square of its padded length, which a tail sample sets for its whole batch.",
        END,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        replace_section(args.out, text, BEGIN, END)


if __name__ == "__main__":
    main()
