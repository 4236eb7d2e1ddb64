"""``speccache audit``: re-run the target on random samples of a cache and compare every stored feature.

Checksums prove the bytes are the ones written; the audit checks that they are
the right ones. It loads the target the manifest records (or ``--model``),
draws ``K`` random samples and recomputes each in the batch precompute computed
it in (``speccache.write.loops.batch_of``: its shard's samples by length, or for a
cache written with ``--batching ordered`` the ``batch_size`` consecutive samples
around it; fed their stored tokens and padded alike), and compares every
stored feature with that live forward. A forward of another batch shape would
differ by itself: in bf16 through SmolLM2-135M's 30 layers, batch size 1 against
8 moves ``last_hidden_state`` by 0.06-0.07 of the row's largest value. It also
compares the model directory's config and tokenizer (chat template included)
fingerprints with the recorded ones, and the side file's weight rows with the
live weights. So a different model, weights, dtype, aux layers, tokenizer or
chat template shows up as disagreement.

Tolerance (docs/format.md, "Audit"): a float feature's error is
``max |stored - live| / max |live row|`` over a sample's rows (the same measure
as the fp8 encoding error), and it must stay within

    rounding(storage dtype) + noise(dtype the target runs in) + encoding error bound

with rounding fp32 0, fp16 2^-11, bf16 2^-8 (two roundings of half an ulp at
the row's largest value); noise (the same batch on another device or kernel
than the one that wrote the cache; on the same device the forward repeats
exactly) fp32 1e-4, fp16 2^-8, bf16 2^-5; encoding raw and zbf16 0, fp8 2^-4
(e4m3 keeps 3 mantissa bits of a row scaled to its amax). Integer and boolean
features the target derives (``in_draft``, ``topk_ids``) must agree on at least
98% of a sample's rows: a near tie in the logits may flip between kernels.
Tokens, the loss mask and the source row are the forward's input, so they are
not compared. Samples cleared by ``--nonfinite skip`` (no supervised token) are
left out and counted.

A live forward that is not finite, or weights of the side file's rows that are
NaN or Inf, mean the model directory is broken: each is a disagreement naming
the sample (and the parameters that hold NaN or Inf) or the weight rows.

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

from speccache.data import load_chat_tokenizer, tokenizer_hash
from speccache.devices import DTYPES, target_device
from speccache.engines.hf import load_target
from speccache.errors import AuditError, SpeccacheError
from speccache.format import LENGTHS_KEY, SOURCE_ROW_KEY, Manifest
from speccache.methods.base import LoadedTarget, model_config_hash
from speccache.methods.eagle3 import CACHE_NAME as EAGLE3
from speccache.methods.eagle3 import SIDE_FILE as EAGLE3_SIDE
from speccache.methods.eagle3 import Supervision, read_side_file
from speccache.methods.eagle3_producer import Eagle3Target
from speccache.precompute._tokens import batch_pad_id, pad_tokens
from speccache.read import CacheDataset
from speccache.read.dataset import NO_VERIFY_HELP
from speccache.read.source import CacheSource, open_source
from speccache.read.view import ViewDataset
from speccache.write.loops import batch_of, batch_span

__all__ = ["AuditReport", "audit_cache", "feature_tolerance", "register_commands"]

ROUNDING = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}
"""Storage rounding of a value, relative to its row's largest value (two half-ulp roundings)."""
NOISE = {torch.float32: 1e-4, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5}
"""How far the same batch may drift on another device or kernel, by the dtype the target runs in."""
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
    selected = read_side_file(source.side_file(EAGLE3_SIDE), ("selected_token_ids",))["selected_token_ids"]
    # skip: a sample whose live features are not finite comes back cleared (no supervised token), which the audit
    # reports, instead of an error that would stop it, and that precompute's advice (--nonfinite skip) would not fix
    target = Eagle3Target(
        model, config["aux_layers"], Supervision.parse(config["supervision"]), selected, DTYPES[config["dtype"]], "skip"
    )
    return target.compute_batch


TARGETS: dict[str, Callable[[CacheSource, Mapping[str, Any], torch.nn.Module], Callable[..., Any]]] = {
    EAGLE3: _eagle3_target
}
"""cache_name -> (cache or view, manifest config, model) -> the method's ``compute_batch`` as precompute built it."""


def _check_fingerprints(model_dir: str, config: Mapping[str, Any], tokenizer: Any, report: AuditReport) -> None:
    from transformers import AutoConfig

    for name, found in (
        ("model_config_hash", lambda: model_config_hash(AutoConfig.from_pretrained(model_dir))),
        ("tokenizer_hash", lambda: tokenizer_hash(tokenizer)),
    ):
        if name in config and found() != config[name]:
            what = "model config" if name == "model_config_hash" else "tokenizer or chat template"
            report.problems.append(
                f"{model_dir}: its {what} differs from the one the cache was written with ({name}); "
                "the stored tokens and features belong to another target"
            )


def _rows_not_finite(value: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(value.reshape(value.shape[0], -1)).all(1)


def _compare_weight_rows(path: str, name: str, stored: torch.Tensor, live: torch.Tensor) -> list[str]:
    """Row by row, so that weights that are NaN or Inf are named as such rather than as a mismatch."""
    if stored.shape != live.shape:
        shapes = f"shape {list(stored.shape)}, the model's {list(live.shape)}"
        return [f"{path}: {name} differs from the live model's weights ({shapes})"]
    stored = stored.to(live.dtype)
    problems = []
    broken = torch.zeros(live.shape[0], dtype=torch.bool)
    for where, value in (("the live model's weights", live), ("the side file", stored)):
        bad = _rows_not_finite(value)
        broken |= bad
        if bad.any():
            problems.append(
                f"{path}: {name} holds NaN or Inf in {int(bad.sum())} of {bad.numel()} rows of {where} "
                f"(first: row {int(bad.nonzero()[0, 0])})"
                + ("; the model directory's weights are broken" if value is live else "")
            )
    differ = ~(stored == live).reshape(live.shape[0], -1).all(1) & ~broken
    if differ.any():
        problems.append(
            f"{path}: {name} differs from the live model's weights in {int(differ.sum())} of {differ.numel()} rows "
            f"(first: row {int(differ.nonzero()[0, 0])})"
        )
    return problems


def _check_side_weights(source: CacheSource, loaded: LoadedTarget, report: AuditReport) -> None:
    path = source.side_file(EAGLE3_SIDE)
    side = read_side_file(path, ("embed_tokens", "lm_head", "selected_token_ids"))
    live = {
        "embed_tokens": loaded.input_embeddings(),
        "lm_head": loaded.output_embeddings()[side["selected_token_ids"]],
    }
    for name, value in live.items():
        report.problems.extend(_compare_weight_rows(path, name, side[name], value))


def _nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]


def _nonfinite_live(index: int, model_dir: str, compute_dtype: torch.dtype, bad: list[str]) -> str:
    cause = (
        f"its weights {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} hold NaN or Inf"
        if bad
        else f"its weights are finite, so the forward overflows in {compute_dtype}"
    )
    return (
        f"sample {index}: the target's live forward is not finite (NaN or Inf): {model_dir} is broken ({cause}); "
        "check the model weights"
    )


def _live_rows(live: Mapping[str, torch.Tensor], schema: Mapping[str, Any], position: int) -> dict[str, torch.Tensor]:
    """The rows of one sample (its ``position`` in the batch) out of a computed batch's ragged rows."""
    offsets = [0, *live[LENGTHS_KEY].cumsum(0).tolist()]
    return {
        key: live[key][offsets[position] : offsets[position + 1]] if spec.ragged else live[key][position]
        for key, spec in schema.items()
        if key in live
    }


def _compare(
    index: int,
    sample: Any,
    live: Mapping[str, torch.Tensor],
    manifest: Manifest,
    compute_dtype: torch.dtype,
    report: AuditReport,
) -> None:
    for key, spec in manifest.schema.items():
        if key in INPUT_KEYS or key not in live:
            continue
        stored, value = sample[key], live[key]
        if spec.dtype.is_floating_point:
            error = _relative_error(stored, value)
            tolerance = feature_tolerance(manifest.config.get("dtype", "fp32"), compute_dtype, spec.encoding)
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


def audit_cache(
    cache_dir: str,
    model: str | None = None,
    samples: int = 8,
    seed: int = 0,
    device: str | None = None,
    verify: bool = True,
) -> AuditReport:
    """Re-run the target on the batches of ``samples`` random samples and compare every stored feature.

    Each drawn sample is recomputed in the batch precompute computed it in (its shard's samples by length as
    ``--batching sorted`` cuts them, or the manifest's ``batch_size`` consecutive samples for ``--batching
    ordered`` and for manifests that record neither; padded alike), so the forward is the one that wrote it,
    not one of another batch shape.

    Args:
        cache_dir: the cache (sealed or not: its whole shards are read), or a view (samples drawn from the view).
        model: the model directory (default: the one the manifest records).
        samples: how many samples to draw (all of them when the cache holds fewer).
        seed: the draw's seed.
        device: where to run the target (default: CUDA when available).
        verify: check the tensors read from each shard against their checksums first (``False``: ``--no-verify``,
            which compares damaged bytes with the live features instead).

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
    if "vision" in config:
        raise AuditError(
            f"{cache_dir}: a vision-language target's cache (its manifest records config.vision); the audit does "
            "not rebuild the images' pixels yet: check it with speccache verify"
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
    tokenizer = load_chat_tokenizer(model_dir)
    _check_fingerprints(model_dir, config, tokenizer, report)
    loaded = load_target(model_dir, config.get("model_dtype", "auto"), target_device(device))
    compute_dtype = next(loaded.model.parameters()).dtype
    # open_source checked that a view's sources share one side file: one target, one check of its weights
    compute_batch = TARGETS[manifest.cache_name](opened, config, loaded.model)
    _check_side_weights(opened, loaded, report)
    view = ViewDataset(cache_dir) if opened.view is not None else None
    manifests = opened.manifests
    datasets = [
        CacheDataset(d, cache_name=manifest.cache_name, allow_incomplete=True, verify=verify) for d in opened.dirs
    ]
    total = len(view) if view is not None else len(datasets[0])
    drawn = sorted(random.Random(seed).sample(range(total), min(samples, total)))
    batches: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}  # (source, its batch) -> [(drawn, local)]
    lengths: dict[int, list[int]] = {}
    for index in drawn:
        source, local = view.locate(index) if view is not None else (0, index)
        src = manifests[source].config
        batch_size = int(src.get("batch_size") or 1)
        if src.get("batching", "ordered") == "sorted":
            if source not in lengths:
                lengths[source] = datasets[source].sample_lengths()
            members = batch_of(
                local, lengths[source], manifests[source].shard_size, batch_size, src["max_batch_tokens"]
            )
        else:
            members = list(batch_span(local, batch_size, manifests[source].num_samples))
        batches.setdefault((source, tuple(members)), []).append((index, local))
    nonfinite_parameters: list[str] | None = None  # searched once, when a live forward is first not finite
    for (source, span), asked in batches.items():
        stored = [datasets[source][i] for i in span]
        live = compute_batch(pad_tokens([_forward_input(s) for s in stored], batch_pad_id(tokenizer)))
        for index, local in asked:
            sample = stored[span.index(local)]
            if not sample["loss_mask"].any():
                report.cleared.append(index)
                continue
            report.samples.append(index)
            rows = _live_rows(live, manifest.schema, span.index(local))
            if not rows["loss_mask"].any():  # the guard cleared it: see speccache.methods.finite
                if nonfinite_parameters is None:
                    nonfinite_parameters = _nonfinite_parameters(loaded.model)
                report.problems.append(_nonfinite_live(index, model_dir, compute_dtype, nonfinite_parameters))
                continue
            _compare(index, sample, rows, manifests[source], compute_dtype, report)
    return report


def _forward_input(sample: Any) -> dict[str, torch.Tensor]:
    return {"input_ids": sample["input_ids"].to(torch.int64), "loss_mask": sample["loss_mask"].to(torch.bool)}


def cmd_audit(args: argparse.Namespace) -> int:
    """Run ``speccache audit``: exit 0 when everything agrees, 1 when something does not, 2 on bad usage."""
    try:
        report = audit_cache(args.cache_dir, args.model, args.samples, args.seed, args.device, not args.no_verify)
    except (SpeccacheError, OSError, ValueError) as exc:
        print(f"speccache audit: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(
            f"audit of {report.cache_dir} against {report.model}: {len(report.samples)} samples, "
            "each recomputed in its precompute batch"
        )
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
    p.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    p.set_defaults(func=cmd_audit)
