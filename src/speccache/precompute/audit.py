"""``speccache audit``: re-run the target on random samples of a cache and compare every stored feature.

Checksums prove the bytes are the ones written; the audit checks that they are
the right ones. It loads the target the manifest records (or ``--model``), runs
it at batch size 1 on ``K`` random samples, fed the cache's own stored tokens,
and compares every stored feature with the live forward. It also compares the
model directory's config and tokenizer (chat template included) fingerprints
with the recorded ones, and the side file's weight rows with the live weights.
So a different model, weights, dtype, aux layers, tokenizer or chat template
shows up as disagreement.

Tolerance (docs/format.md, "Audit"): a float feature's error is
``max |stored - live| / max |live row|`` over a sample's rows (the same measure
as the fp8 encoding error), and it must stay within

    rounding(storage dtype) + noise(dtype the target runs in) + encoding error bound

with rounding fp32 0, fp16 2^-11, bf16 2^-8 (two roundings of half an ulp at
the row's largest value); noise (a batched forward against batch size 1) fp32
1e-4, fp16 2^-8, bf16 2^-5; encoding raw and zbf16 0, fp8 2^-4 (e4m3 keeps 3
mantissa bits of a row scaled to its amax). Integer and boolean features the
target derives (``in_draft``, ``topk_ids``) must agree on at least 98% of a
sample's rows: a near tie in the logits may flip between batch sizes. Tokens,
the loss mask and the source row are the forward's input, so they are not compared. Samples
cleared by ``--nonfinite skip`` (no supervised token) are left out and counted.

Exit status: 0 every sample and fingerprint agrees, 1 some does not (each named
with its key, sample and error), 2 bad usage (no such cache, no recorded model).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from speccache.data import SOURCE_ROW_KEY, tokenizer_hash
from speccache.errors import AuditError, SpeccacheError
from speccache.format import ShardFile
from speccache.methods.eagle3 import CACHE_NAME as EAGLE3
from speccache.methods.eagle3 import SIDE_FILE as EAGLE3_SIDE
from speccache.methods.eagle3 import Eagle3Target, Supervision
from speccache.precompute.run import DTYPES, _config_hash
from speccache.precompute.target import load_target, target_device
from speccache.read import CacheDataset
from speccache.read.source import CacheSource, open_source

__all__ = ["AuditReport", "audit_cache", "feature_tolerance", "register_commands"]

ROUNDING = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}
"""Storage rounding of a value, relative to its row's largest value (two half-ulp roundings)."""
NOISE = {torch.float32: 1e-4, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5}
"""How far a batched forward may drift from batch size 1, by the dtype the target runs in."""
ENCODING_BOUND = {"raw": 0.0, "zbf16": 0.0, "fp8": 2.0**-4}
"""The largest error an encoding adds, relative to the row's largest value."""
INPUT_KEYS = frozenset({"input_ids", "loss_mask", SOURCE_ROW_KEY})
"""Keys that describe the data the forward is fed, not what the target computes from it."""
MIN_AGREEMENT = 0.98
"""Fraction of a sample's rows on which a derived integer feature must agree."""


def feature_tolerance(storage_dtype: str, compute_dtype: torch.dtype, encoding: str) -> float:
    """The largest relative error a float feature may show in the audit (see the module docstring).

    Raises:
        AuditError: an unknown dtype or encoding.
    """
    try:
        return ROUNDING[storage_dtype] + NOISE[compute_dtype] + ENCODING_BOUND[encoding]
    except KeyError as exc:
        raise AuditError(f"cannot derive an audit tolerance: {exc.args[0]} is not a known dtype or encoding") from None


@dataclass
class AuditReport:
    """What :func:`audit_cache` found.

    Attributes:
        cache_dir: the audited cache.
        model: the model directory that was run.
        samples: the sample indices compared.
        cleared: sample indices drawn but left out (cleared by ``--nonfinite skip``).
        keys: per key: ``max_error``, ``tolerance``, ``worst_sample``.
        problems: one line per disagreement.
    """

    cache_dir: str
    model: str
    samples: list[int] = field(default_factory=list)
    cleared: list[int] = field(default_factory=list)
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether everything agreed."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values."""
        return {
            "cache_dir": self.cache_dir,
            "model": self.model,
            "ok": self.ok,
            "samples": self.samples,
            "cleared": self.cleared,
            "keys": self.keys,
            "problems": self.problems,
        }


def _relative_error(stored: torch.Tensor, live: torch.Tensor) -> float:
    stored, live = stored.float().reshape(stored.shape[0], -1), live.float().reshape(live.shape[0], -1)
    scale = live.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return float(((stored - live).abs() / scale).max()) if stored.numel() else 0.0


def _eagle3_target(source: CacheSource, config: Mapping[str, Any], model: torch.nn.Module) -> Callable[..., Any]:
    side = ShardFile(source.side_file(EAGLE3_SIDE))
    try:
        selected = side.tensor("selected_token_ids").clone()
    finally:
        side.close()
    target = Eagle3Target(
        model, config["aux_layers"], Supervision.parse(config["supervision"]), selected, DTYPES[config["dtype"]]
    )
    return target.compute_batch


TARGETS: dict[str, Callable[[CacheSource, Mapping[str, Any], torch.nn.Module], Callable[..., Any]]] = {
    EAGLE3: _eagle3_target
}
"""cache_name -> (cache or view, manifest config, model) -> the method's ``compute_batch`` as precompute built it."""


def _check_fingerprints(model_dir: str, config: Mapping[str, Any], report: AuditReport) -> None:
    from transformers import AutoConfig, AutoTokenizer

    for name, found in (
        ("model_config_hash", lambda: _config_hash(AutoConfig.from_pretrained(model_dir))),
        ("tokenizer_hash", lambda: tokenizer_hash(AutoTokenizer.from_pretrained(model_dir))),
    ):
        if name in config and found() != config[name]:
            what = "model config" if name == "model_config_hash" else "tokenizer or chat template"
            report.problems.append(
                f"{model_dir}: its {what} differs from the one the cache was written with ({name}); "
                "the stored tokens and features belong to another target"
            )


def _check_side_weights(source: CacheSource, model: torch.nn.Module, report: AuditReport) -> None:
    path = source.side_file(EAGLE3_SIDE)
    side = ShardFile(path)
    try:
        rows = side.tensor("selected_token_ids").to(torch.int64)
        live = {
            "embed_tokens": model.get_input_embeddings().weight.detach().cpu(),
            "lm_head": model.get_output_embeddings().weight.detach().cpu()[rows],
        }
        for name, value in live.items():
            stored = side.tensor(name)
            if stored.shape != value.shape or not torch.equal(stored.to(value.dtype), value):
                report.problems.append(f"{path}: {name} differs from the live model's weights")
    finally:
        side.close()


def audit_cache(
    cache_dir: str,
    model: str | None = None,
    samples: int = 8,
    seed: int = 0,
    device: str | None = None,
) -> AuditReport:
    """Re-run the target on ``samples`` random samples at batch size 1 and compare every stored feature.

    Args:
        cache_dir: the cache (sealed or not: its whole shards are read), or a view (samples drawn from the view).
        model: the model directory (default: the one the manifest records).
        samples: how many samples to draw (all of them when the cache holds fewer).
        seed: the draw's seed.
        device: where to run the target (default: CUDA when available).

    Returns:
        The report; ``report.ok`` tells whether everything agreed.

    Raises:
        AuditError: bad ``samples``, no model to run, or a method the audit does not know.
        CacheFormatError, CacheCorruptError: the cache cannot be read.
    """
    if samples < 1:
        raise AuditError(f"--samples must be >= 1, got {samples}")
    opened = open_source(cache_dir)
    manifest = opened.manifest  # a view's sources share the target, settings and side files (merge checks it)
    config = manifest.config
    if manifest.cache_name not in TARGETS:
        raise AuditError(
            f"{cache_dir}: the audit does not know how to recompute a {manifest.cache_name!r} cache; "
            f"it knows {', '.join(sorted(TARGETS))}"
        )
    model_dir = model or config.get("model")
    if not model_dir:
        raise AuditError(f"{cache_dir}: the manifest records no model; pass --model DIR")
    if not os.path.isdir(model_dir):
        raise AuditError(
            f"--model {model_dir}: no such model directory (the manifest records {config.get('model')!r}); "
            "pass --model DIR with the target the cache was written from"
        )
    report = AuditReport(cache_dir, model_dir)
    _check_fingerprints(model_dir, config, report)
    loaded = load_target(model_dir, config.get("model_dtype", "auto"), target_device(device))
    compute_dtype = next(loaded.model.parameters()).dtype
    compute_batch = TARGETS[manifest.cache_name](opened, config, loaded.model)
    _check_side_weights(opened, loaded.model, report)
    dataset = CacheDataset(cache_dir, cache_name=manifest.cache_name, allow_incomplete=True)  # a view's too
    drawn = sorted(random.Random(seed).sample(range(len(dataset)), min(samples, len(dataset))))
    for index in drawn:
        sample = dataset[index]
        if "loss_mask" in sample and not sample["loss_mask"].any():
            report.cleared.append(index)
            continue
        report.samples.append(index)
        ids = sample["input_ids"].to(torch.int64).unsqueeze(0)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": sample["loss_mask"][None]}
        live = compute_batch(batch)
        for key, spec in manifest.schema.items():
            if key in INPUT_KEYS or key not in live:
                continue
            stored, value = sample[key], live[key]
            if spec.dtype.is_floating_point:
                error = _relative_error(stored, value)
                tolerance = feature_tolerance(config.get("dtype", "fp32"), compute_dtype, spec.encoding)
            else:
                error = float((stored != value.to(stored.dtype)).reshape(stored.shape[0], -1).any(1).float().mean())
                tolerance = 1.0 - MIN_AGREEMENT
            entry = report.keys.setdefault(key, {"max_error": 0.0, "tolerance": tolerance, "worst_sample": index})
            if error > entry["max_error"]:
                entry.update(max_error=error, worst_sample=index)
            if error > tolerance:
                report.problems.append(
                    f"sample {index}: {key} differs from the live forward by {error:.3g} "
                    f"({'of the row amax' if spec.dtype.is_floating_point else 'of its rows'}; tolerance "
                    f"{tolerance:.3g})"
                )
    return report


def cmd_audit(args: argparse.Namespace) -> int:
    """Run ``speccache audit``: exit 0 when everything agrees, 1 when something does not, 2 on bad usage."""
    try:
        report = audit_cache(args.cache_dir, args.model, args.samples, args.seed, args.device)
    except (SpeccacheError, OSError, ValueError) as exc:
        print(f"speccache audit: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(f"audit of {report.cache_dir} against {report.model}: {len(report.samples)} samples at batch size 1")
        if report.cleared:
            print(f"left out {len(report.cleared)} sample(s) cleared by --nonfinite skip: {report.cleared}")
        print(f"{'key':<20} {'max error':>12} {'tolerance':>12}  worst sample")
        for key, entry in report.keys.items():
            print(f"{key:<20} {entry['max_error']:>12.3g} {entry['tolerance']:>12.3g}  {entry['worst_sample']}")
        for problem in report.problems:
            print(f"DISAGREE {problem}")
        print(f"{report.cache_dir}: {'agrees' if report.ok else f'{len(report.problems)} disagreement(s)'}")
    return 0 if report.ok else 1


def register_commands(sub: Any) -> None:
    """Add ``audit`` to the CLI."""
    p = sub.add_parser("audit", help="re-run the target on random samples and compare the stored features")
    p.add_argument("cache_dir")
    p.add_argument("--model", default=None, help="model directory (default: the one the manifest records)")
    p.add_argument("--samples", type=int, default=8, help="how many random samples to recompute (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw (default 0)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_audit)
