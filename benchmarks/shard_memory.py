"""Peak host memory per rank of ``--shard-target fsdp`` and ``tp`` against ``replicate``, on a random 514 MB Llama.

``python benchmarks/shard_memory.py --world 2 4`` builds the model directory once (``--model-dir``), then for
each world size and mode runs a torchrun world of Gloo ranks on the CPU: each rank records its peak RSS after
importing torch and transformers and joining the group (the fixed overhead), then loads the target through
``speccache.precompute.target.load_target`` and runs one forward of a 2x64-token batch, and records its
peak RSS again. It prints one JSON object per run and a markdown table (docs/benchmarks.md); the bound the
issue sets is ``model bytes / W + largest decoder layer + fixed overhead``, the overhead being the peak of the same
run on the tiny demo model (imports, the process group, the modelling code: nothing that grows with the model).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

# hidden 512, 32 layers of 3.8 M parameters (15 MB in fp32), an 8192-token vocabulary: 514 MB in all. Many small
# layers, as in a real target (Llama-3.3-70B: 80 layers of 1.2% of the model each), so that what FSDP keeps
# gathered at a time is small beside the model.
SHAPE = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=32,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def build_model_dir(path: str) -> str:
    """Write the random model (fp32 safetensors) to ``path`` unless it is there already."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE, dtype="float32")).save_pretrained(path)
    return path


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _weights_mb(model: object) -> float:
    """The parameter bytes this rank holds: its local shard of each sharded (DTensor) parameter, else all of it."""
    total = 0
    for p in model.parameters():  # type: ignore[attr-defined]
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total / 2**20


def worker(model_dir: str, mode: str) -> None:
    """One rank: fixed overhead, then load + one forward; rank 0 prints every rank's figures as JSON."""
    import torch
    import transformers  # noqa: F401 - part of the fixed overhead, as in a real run

    from speccache.precompute.target import load_target
    from speccache.write.dist import init_from_env, shutdown

    torch.set_num_threads(1)
    comm = init_from_env(torch.device("cpu"), 600.0)
    base = _peak_mb()
    loaded = load_target(model_dir, "auto", torch.device("cpu"), mode)
    ids = torch.arange(128).reshape(2, 64) % SHAPE["vocab_size"]
    with torch.no_grad():
        loaded.model.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    row = {"rank": comm.rank, "base_mb": base, "peak_mb": _peak_mb(), "weights_mb": _weights_mb(loaded.model)}
    rows = comm.all_gather(row)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"mode": mode, "world": comm.world_size, "ranks": rows}), flush=True)
    shutdown(comm)


def model_figures(model_dir: str) -> dict[str, float]:
    """The model's MB, its largest decoder layer's, and its largest FSDP unit's (a layer, the embedding or the
    LM head), from the checkpoint header."""
    from safetensors import safe_open

    total, layers = 0, {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            n = 4
            for d in sl.get_shape():
                n *= d
            total += n
            unit = key.split(".layers.")[1].split(".")[0] if ".layers." in key else key
            layers[unit] = layers.get(unit, 0) + n
    layer = max(n for unit, n in layers.items() if unit.isdigit())
    return {"model_mb": total / 2**20, "layer_mb": layer / 2**20, "unit_mb": max(layers.values()) / 2**20}


def measure(model_dir: str, mode: str, world: int) -> dict:
    """Run one torchrun world and return its figures."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    cmd += [os.path.abspath(__file__), "--worker", mode, "--model-dir", model_dir]
    # glibc's dynamic mmap threshold otherwise serves each freshly all-gathered layer from a heap that only grows
    # (freed layers are not given back), which measures the allocator, not what the ranks hold.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{mode} at W={world} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", default="bench-out/shard-memory-model")
    p.add_argument("--tiny-dir", default="bench-out/shard-memory-tiny")
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["replicate", "fsdp", "tp"], help="--shard-target modes to measure")
    p.add_argument("--out", default=None, help="a markdown file whose shard-memory section is replaced (or appended)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        from speccache.write.dist import exit_after_group

        worker(args.model_dir, args.worker)
        return exit_after_group(0)  # as the CLI: the sharded target's groups outlive shutdown (docs/distributed.md)
    rows = run(args.model_dir, args.tiny_dir, args.world, args.modes)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        write_section(args.out, rows)
    return 0


BEGIN, END = "<!-- shard-memory:begin -->", "<!-- shard-memory:end -->"


def write_section(path: str, rows: list[dict]) -> None:
    """Replace (or append) this benchmark's section of the markdown file ``path``."""
    fig = rows[0]
    lines = [
        BEGIN,
        "## Peak host memory per rank: `--shard-target fsdp` and `tp` against `replicate`",
        "",
        f"Generated by `python benchmarks/shard_memory.py --out docs/benchmarks.md` (run by `make bench`) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: torchrun worlds of Gloo ranks on the CPU; each rank "
        "loads the target with `load_target` and runs one forward of 2 x 64 tokens. Random Llama of "
        f"M = {fig['model_mb']:.0f} MiB (fp32), decoder layers of {fig['layer_mb']:.0f} MiB, largest FSDP unit "
        f"U = {fig['unit_mb']:.0f} MiB. The fixed overhead is the same run's peak on the tiny demo model.",
        "",
        "| W | mode | weights held per rank | peak RSS per rank | above the fixed overhead "
        "| issue's bound: M/W + 1 layer | M/W + 3 U |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = r["model_mb"] / r["world"]
        lines.append(
            f"| {r['world']} | {r['mode']} | {r['weights_mb']:.0f} MiB | {r['peak_mb']:.0f} MiB | "
            f"{r['peak_mb'] - r['overhead_mb']:.0f} MiB | {share + r['layer_mb']:.0f} MiB | "
            f"{share + 3 * r['unit_mb']:.0f} MiB |"
        )
    lines += [
        "",
        "An `fsdp` rank holds its share plus up to three units, above the issue's bound of one layer: gathering a "
        "unit holds FSDP2's all-gather output and the unsharded parameters copied out of it at once (2 U, seen "
        "with forward hooks), and U is the embedding here, larger than a layer (see docs/distributed.md). A `tp` "
        "rank (one group of W ranks) holds its slice of every layer (the weights column) and gathers none; its "
        "peak RSS is higher because on the CPU transformers keeps slices as views of the memory-mapped "
        "checkpoint where it can, and RSS counts the checkpoint pages those views touch (page cache shared by "
        "the ranks of a machine; a view of a row-parallel slice spans its whole tensor's pages). On a GPU the "
        "slices are copied to the device and the mapping closed. At W = 4 the benchmark model's 2 key-value "
        "heads do not split, so `tp` is measured at W = 2 only.",
        END,
    ]
    text = "\n".join(lines) + "\n"
    old = open(path).read() if os.path.exists(path) else ""
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + text + old[old.index(END) + len(END) + 1 :]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def _splits(model_dir: str, tiny_dir: str, world: int) -> bool:
    """Whether a tensor-parallel group of ``world`` ranks splits both models' attention and key-value heads."""
    from transformers import AutoConfig

    from speccache.precompute.target import check_tp_plan

    try:
        for path in (model_dir, tiny_dir):
            check_tp_plan(AutoConfig.from_pretrained(path), world)
    except ValueError:
        return False
    return True


def run(model_dir: str, tiny_dir: str, worlds: list[int], modes: list[str]) -> list[dict]:
    """Every (W, mode) row: the big model's max peak RSS per rank, the tiny model's (the fixed overhead), the bound."""
    from speccache.demo import build_tiny_model_dir

    build_model_dir(model_dir)
    build_tiny_model_dir(tiny_dir, "llama", seed=0)
    fig = model_figures(model_dir)
    rows = []
    table = ["| W | mode | peak RSS per rank (MB) | fixed overhead: same run, tiny model (MB) | bound (MB) |"]
    table.append("|---|---|---|---|---|")
    for world in worlds:
        for mode in modes:
            if mode == "tp" and not _splits(model_dir, tiny_dir, world):
                print(f"tp at W={world}: skipped, {world} ranks do not split the models' heads")
                continue
            big, tiny = measure(model_dir, mode, world)["ranks"], measure(tiny_dir, mode, world)["ranks"]
            peak, overhead = max(r["peak_mb"] for r in big), max(r["peak_mb"] for r in tiny)
            bound = overhead + fig["model_mb"] / world + fig["layer_mb"]
            rows.append(
                {
                    "world": world,
                    "mode": mode,
                    "peak_mb": peak,
                    "overhead_mb": overhead,
                    "bound_mb": bound,
                    "weights_mb": max(r["weights_mb"] for r in big),
                    **fig,
                }
            )
            table.append(f"| {world} | {mode} | {peak:.0f} | {overhead:.0f} | {bound:.0f} |")
    print(f"model {fig['model_mb']:.0f} MB, largest decoder layer {fig['layer_mb']:.0f} MB")
    print("\n".join(table))
    return rows


if __name__ == "__main__":
    sys.exit(main())
