"""Peak anonymous memory per rank of ``--shard-target fsdp`` and ``tp`` against ``replicate``, on random Llamas.

``python benchmarks/shard_memory.py`` builds each target's model directory once (``--model-dir``: the narrow target,
32 small layers; ``--wide-dir``: the wide one, 8 layers of 4096-wide MLPs), then for each target, world size and
mode runs a torchrun world of Gloo ranks on the CPU: each rank records its peak of anonymous memory (``RssAnon`` of
/proc/self/status, sampled by a thread) after importing torch and transformers and joining the group, then loads the
target through ``speccache.engines.hf.load_target``, runs ``--forwards`` (4) forwards of a 2x64-token batch,
and records its peak again. Anonymous memory leaves out the page cache of the memory-mapped checkpoint, which
``ru_maxrss`` counts; it does count what the allocator keeps after a free, which is what a rank's host really loses.
The bound is ``fixed overhead + M / W + 3 U`` (``M`` the model's bytes, ``U`` its largest FSDP unit: a decoder
layer, the embedding or the LM head), the overhead being the peak of the same run on the tiny demo model (imports,
the process group, the modelling code: nothing that grows with the model). It prints one JSON object per run and a
markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
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
# Wide layers: hidden 1024, MLPs of 4096, 8 layers (55 MB each in fp32). Each MLP weight is a 16 MB (8 MB per rank
# at W = 2) allocation, below glibc's largest dynamic mmap threshold (32 MB), so the allocator keeps what is freed.
WIDE = {**SHAPE, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}
TARGETS = {"narrow": (SHAPE, [2, 4]), "wide": (WIDE, [2])}


def build_model_dir(path: str, shape: dict) -> str:
    """Write a random Llama of ``shape`` (fp32 safetensors) to ``path`` unless it is there already."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape, dtype="float32")).save_pretrained(path)
    return path


class AnonPeak:
    """The peak of this process's anonymous memory (``RssAnon``), sampled every millisecond by a daemon thread."""

    def __init__(self) -> None:
        self.peak_kb = self.now_kb()
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now_kb() -> int:
        """``RssAnon`` now, in KiB."""
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1])
        raise RuntimeError("/proc/self/status has no RssAnon line (not Linux?)")

    def _sample(self) -> None:
        while True:
            self.peak_kb = max(self.peak_kb, self.now_kb())
            time.sleep(0.001)

    def peak_mb(self) -> float:
        """The peak so far, a last sample included, in MiB."""
        self.peak_kb = max(self.peak_kb, self.now_kb())
        return self.peak_kb / 1024


def _weights_mb(model: object) -> float:
    """The parameter bytes this rank holds: its local shard of each sharded (DTensor) parameter, else all of it."""
    total = 0
    for p in model.parameters():  # type: ignore[attr-defined]
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total / 2**20


def worker(model_dir: str, mode: str, forwards: int) -> None:
    """One rank: fixed overhead, then load + ``forwards`` forwards; rank 0 prints every rank's figures as JSON."""
    import torch
    import transformers  # noqa: F401 - part of the fixed overhead, as in a real run

    from speccache.engines.hf import load_target
    from speccache.write.dist import init_from_env, shutdown

    anon = AnonPeak()
    torch.set_num_threads(1)
    comm = init_from_env(torch.device("cpu"), 600.0)
    base = anon.peak_mb()
    loaded = load_target(model_dir, "auto", torch.device("cpu"), mode)
    ids = torch.arange(128).reshape(2, 64)
    # several forwards, as in a run: memory the allocator keeps after each gather shows as growth
    for _ in range(forwards):
        with torch.no_grad():
            loaded.model.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    row = {"rank": comm.rank, "base_mb": base, "peak_mb": anon.peak_mb(), "weights_mb": _weights_mb(loaded.model)}
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


def measure(model_dir: str, mode: str, world: int, forwards: int = 4) -> dict:
    """Run one torchrun world and return its figures."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    cmd += [os.path.abspath(__file__), "--worker", mode, "--model-dir", model_dir, "--forwards", str(forwards)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the allocator as the loader sets it, not as this shell does
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        first = proc.stderr.find("Traceback")  # the failing rank's, before torchrun's report of it
        raise RuntimeError(f"{mode} at W={world} failed:\n{proc.stderr[max(first, 0) :][:4000]}")
    return json.loads(line[len("RESULT ") :])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", default="bench-out/shard-memory-model", help="the narrow target's directory")
    p.add_argument("--wide-dir", default="bench-out/shard-memory-wide", help="the wide target's directory")
    p.add_argument("--tiny-dir", default="bench-out/shard-memory-tiny")
    p.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    p.add_argument("--world", type=int, nargs="+", default=None, help="world sizes (default: narrow 2 4, wide 2)")
    p.add_argument("--modes", nargs="+", default=["replicate", "fsdp", "tp"], help="--shard-target modes to measure")
    p.add_argument("--forwards", type=int, default=4, help="forwards of a 2x64-token batch after loading")
    p.add_argument("--out", default=None, help="a markdown file whose shard-memory section is replaced (or appended)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        from speccache.write.dist import exit_after_group

        worker(args.model_dir, args.worker, args.forwards)
        return exit_after_group(0)  # as the CLI: the sharded target's groups outlive shutdown (docs/distributed.md)
    from speccache.demo import build_tiny_model_dir

    build_tiny_model_dir(args.tiny_dir, "llama", seed=0)
    dirs = {"narrow": args.model_dir, "wide": args.wide_dir}
    rows = []
    for name in args.targets:
        shape, worlds = TARGETS[name]
        build_model_dir(dirs[name], shape)
        rows += run(name, dirs[name], args.tiny_dir, args.world or worlds, args.modes, args.forwards)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        write_section(args.out, rows, args.forwards)
    return 0


BEGIN, END = "<!-- shard-memory:begin -->", "<!-- shard-memory:end -->"


def write_section(path: str, rows: list[dict], forwards: int) -> None:
    """Replace (or append) this benchmark's section of the markdown file ``path``."""
    lines = [
        BEGIN,
        "## Peak anonymous memory per rank: `--shard-target fsdp` and `tp` against `replicate`",
        "",
        f"Generated by `python benchmarks/shard_memory.py --out docs/benchmarks.md` (run by `make bench`) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: torchrun worlds of Gloo ranks on the CPU; each rank "
        f"loads the target with `load_target` and runs {forwards} forwards of 2 x 64 tokens, while a thread samples "
        "its `RssAnon` (/proc/self/status) every millisecond. Random fp32 Llamas:",
        "",
    ]
    for name in dict.fromkeys(r["target"] for r in rows):
        fig = next(r for r in rows if r["target"] == name)
        lines.append(
            f"- {name}: M = {fig['model_mb']:.0f} MiB, decoder layers of {fig['layer_mb']:.0f} MiB, largest FSDP "
            f"unit U = {fig['unit_mb']:.0f} MiB"
        )
    lines += [
        "",
        "The fixed overhead is the same run's peak on the tiny demo model; the bound is overhead + M/W + 3 U.",
        "",
        "| target | W | mode | weights held per rank | peak RssAnon per rank | above the fixed overhead "
        "| M/W + 3 U | bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['world']} | {r['mode']} | {r['weights_mb']:.0f} MiB | {r['peak_mb']:.0f} MiB | "
            f"{r['peak_mb'] - r['overhead_mb']:.0f} MiB | {r['bound_mb'] - r['overhead_mb']:.0f} MiB | "
            f"{'met' if r['peak_mb'] <= r['bound_mb'] else 'not met'} |"
        )
    lines += [
        "",
        "An `fsdp` rank holds its share plus at most two gathered units (FSDP2's all-gather output and the "
        "unsharded parameters copied out of it) and activations. Its loader sets glibc's mmap threshold to 64 KiB, "
        "so that each freed gather goes back to the system, and on the CPU gathers with `async_op`, so that FSDP2 "
        "frees each all-gather output once copied out rather than during the next unit's gather; before, a rank "
        "of the wide target peaked at 1,162 MiB over the same run (docs/distributed.md). A `replicate` rank holds "
        "all of M (the weights column), but as views of the memory-mapped checkpoint: file pages, which RssAnon "
        "leaves out (ru_maxrss counts them), so its anonymous memory stays near the overhead; a `tp` rank (one "
        "group of W ranks) keeps some of its slices as such views too. At W = 4 the narrow model's 2 key-value "
        "heads do not split, so `tp` is measured at W = 2 only.",
        END,
    ]
    from harness import replace_section  # benchmarks/, beside this script (the tests load this file alone)

    replace_section(path, "\n".join(lines) + "\n", BEGIN, END)


def _splits(model_dir: str, tiny_dir: str, world: int) -> bool:
    """Whether a tensor-parallel group of ``world`` ranks splits both models' attention and key-value heads."""
    from transformers import AutoConfig

    from speccache.engines.hf import check_tp_plan

    try:
        for path in (model_dir, tiny_dir):
            check_tp_plan(AutoConfig.from_pretrained(path), world)
    except ValueError:
        return False
    return True


def run(
    target: str, model_dir: str, tiny_dir: str, worlds: list[int], modes: list[str], forwards: int = 4
) -> list[dict]:
    """Every (W, mode) row of one target: the max peak RssAnon per rank, the tiny model's (the fixed overhead), and
    the bound ``overhead + M / W + 3 U``."""
    fig = model_figures(model_dir)
    rows = []
    table = [f"{target}: | W | mode | peak RssAnon per rank (MiB) | fixed overhead (MiB) | bound (MiB) | |"]
    for world in worlds:
        for mode in modes:
            if mode == "tp" and not _splits(model_dir, tiny_dir, world):
                print(f"{target}: tp at W={world}: skipped, {world} ranks do not split the models' heads")
                continue
            big = measure(model_dir, mode, world, forwards)["ranks"]
            tiny = measure(tiny_dir, mode, world, forwards)["ranks"]
            peak, overhead = max(r["peak_mb"] for r in big), max(r["peak_mb"] for r in tiny)
            bound = overhead + fig["model_mb"] / world + 3 * fig["unit_mb"]
            row = {"target": target, "world": world, "mode": mode, "peak_mb": peak, "overhead_mb": overhead}
            row |= {"bound_mb": bound, "weights_mb": max(r["weights_mb"] for r in big), **fig}
            rows.append(row)
            met = "met" if peak <= bound else "not met"
            table.append(f"{target}: | {world} | {mode} | {peak:.0f} | {overhead:.0f} | {bound:.0f} | {met} |")
    print(f"{target}: model {fig['model_mb']:.0f} MiB, largest decoder layer {fig['layer_mb']:.0f} MiB")
    print("\n".join(table), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
