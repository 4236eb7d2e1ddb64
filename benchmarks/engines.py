"""Tokens/s of the ``hf`` and ``vllm`` engines on the same tokenized samples, side by side, on this machine.

Runs in the engine's environment (it needs vLLM): ``.venv-vllm/bin/python benchmarks/engines.py --out
docs/benchmarks.md``. The samples are the demo chat data tokenized exactly as ``speccache precompute`` does
(:func:`speccache.precompute.run.make_plan`); each engine computes the EAGLE-3 features of all of them through
the method's own ``compute_batch`` (the writer is left out: it is the same for both). ``hf`` runs the padded
batches of ``--batch-size`` in dataset order; ``vllm`` is given the same batches, and once all samples as one
batch (continuous batching without padding is where it gains). Real tokens / compute seconds; vLLM's start-up is
reported apart. One run of each, interleaved nowhere: on a shared machine, read the ratios, not the absolutes.

Usage: python benchmarks/engines.py [--model DIR] [--limit N] [--batch-size B] [--threads T] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import time

from harness import machine_summary, replace_section  # benchmarks/, beside this script

BEGIN, END = "<!-- engines-benchmark:begin -->", "<!-- engines-benchmark:end -->"


def vllm_environment() -> None:
    """vLLM's settings for a CPU benchmark (unless set): no core kept back, 2 GiB of KV cache, no hub."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo Llama with heads of 32)")
    p.add_argument("--limit", type=int, default=240, help="samples (default: all 240 demo rows)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--model-dtype", default="fp32")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--out", default=None, help="markdown file whose engines section is replaced (or appended)")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    vllm_environment()

    import torch
    from torch.utils.data import DataLoader

    from speccache.demo import build_tiny_model_dir, demo_data_path
    from speccache.devices import target_device
    from speccache.engines.hf import load_outer_modules, load_target
    from speccache.engines.vllm import VllmEngine, vllm_layer_ids, vllm_version
    from speccache.methods.decoder import final_norm
    from speccache.methods.eagle3 import Supervision
    from speccache.methods.eagle3_producer import Eagle3Target
    from speccache.precompute import PrecomputeConfig
    from speccache.precompute._tokens import TokenizedDataset, batch_pad_id, pad_tokens
    from speccache.precompute.run import make_plan

    torch.set_num_threads(args.threads)
    model_dir = args.model or build_tiny_model_dir("bench-out/engines-llama32", "llama", head_dim=32)
    cfg = PrecomputeConfig(
        model=model_dir,
        data=demo_data_path("sharegpt"),
        out="",
        limit=args.limit,
        max_length=args.max_length,
        batch_size=args.batch_size,
        shard_size=args.batch_size,
        dtype="fp32",
        model_dtype=args.model_dtype,
    )
    cfg.check()
    plan = make_plan(cfg)
    real = plan.num_tokens
    pad = batch_pad_id(plan.tokenizer)
    dataset = TokenizedDataset(plan.samples)
    aux = plan.method_plan.settings.aux_layers
    num_layers = int(plan.model_config.get_text_config().num_hidden_layers)
    selected = torch.arange(plan.vocab_size)
    supervision = Supervision.parse("hidden")

    def batches(size: int) -> list:
        return list(DataLoader(dataset, batch_size=size, collate_fn=lambda b: pad_tokens(b, pad)))

    def timed(target: Eagle3Target, size: int) -> tuple[float, int]:
        todo = batches(size)
        start = time.perf_counter()
        for batch in todo:
            target.compute_batch(batch)
        return time.perf_counter() - start, sum(int(b["input_ids"].numel()) for b in todo)

    rows = []
    hf = Eagle3Target(load_target(model_dir, args.model_dtype, target_device(None)).model, aux,
                      supervision, selected, torch.float32)  # fmt: skip
    seconds, computed = timed(hf, args.batch_size)
    rows.append(("hf", f"padded batches of {args.batch_size}, dataset order", seconds, computed))

    outer = load_outer_modules(model_dir, args.model_dtype).model
    lengths = (plan.samples.offsets[1:] - plan.samples.offsets[:-1]).max()
    engine = VllmEngine(model_dir, vllm_layer_ids(aux, False, num_layers), dtype=args.model_dtype,
                        max_model_len=int(lengths) + 1)  # fmt: skip
    started = time.perf_counter()
    engine.start()
    startup = time.perf_counter() - started
    capture = engine.capture(final_norm(outer), num_layers)
    vllm = Eagle3Target(outer, aux, supervision, selected, torch.float32, capture=capture)
    seconds, _ = timed(vllm, args.batch_size)
    rows.append(("vllm", f"the same batches of {args.batch_size}", seconds, real))
    seconds, _ = timed(vllm, len(dataset))
    rows.append(("vllm", f"all {len(dataset)} samples as one batch", seconds, real))
    engine.close()

    base = real / rows[0][2]
    lines = [
        BEGIN,
        "## Engines: `--engine hf` against `--engine vllm`",
        "",
        f"Generated by `.venv-vllm/bin/python benchmarks/engines.py{'' if args.out is None else ' --out ' + args.out}"
        f"{'' if args.model is None else ' --model ' + args.model} --limit {args.limit} --threads {args.threads}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine_summary()} "
        f"(shared), OMP_NUM_THREADS={args.threads}, vLLM {vllm_version()}, torch "
        f"{torch.__version__}: EAGLE-3 features (aux layers {aux}, fp32) of {len(dataset)} demo "
        f"samples, {real} real tokens, target {os.path.basename(model_dir.rstrip('/'))}. One run each; vLLM's "
        f"start-up ({startup:.0f} s) is not counted.",
        "",
        "| engine | batches | seconds | computed / real tokens | real tokens/s | vs hf |",
        "|---|---|---|---|---|---|",
    ]
    for name, how, seconds, computed in rows:
        lines.append(
            f"| {name} | {how} | {seconds:.2f} | {computed / real:.2f} | {real / seconds:.0f} | "
            f"{real / seconds / base:.1f}x |"
        )
    lines += [
        "",
        "vLLM computes no padding (computed = real tokens). CPU ratios do not carry over to a GPU, where both "
        "sides are faster and vLLM adds CUDA graphs: `benchmarks/engine_gpu.sh` runs the same comparison there.",
        END,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        replace_section(args.out, text, BEGIN, END)


if __name__ == "__main__":
    main()
