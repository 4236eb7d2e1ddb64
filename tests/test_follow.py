"""Training while the cache is written: the following reader, the disk cap, reclaiming, and both sides killed.

A producer (the synthetic one, or the CLI on the tiny target) writes while a follower reads; what the
follower yields must be the sealed cache's samples: as a multiset in the order shards appear, exactly in
order with ``ordered``. Reclaimed shards leave a record that the producer's resume, ``verify``, ``inspect``
and the plain reader all honour; the cap holds the disk to the cap plus one shard; and kill -9 of either side,
many times, loses and repeats nothing.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from speccache.cli import main as cli_main
from speccache.errors import CacheCorruptError, CacheFormatError, CacheIncompleteError, FollowTimeoutError, OutputError
from speccache.format import Manifest, shard_path
from speccache.format.names import SHARD_RE, reclaim_path
from speccache.read import CacheDataset
from speccache.read.follow import Follow
from speccache.testing.synthetic import write_synthetic_cache
from speccache.units import parse_bytes
from speccache.write import DiskCap
from support import SOAK, crashlib

N, SHARD = 96, 8


def _produce(out: str, **kwargs) -> threading.Thread:
    """Run the synthetic producer on a thread (its failures re-raised by ``join_ok``)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4, **kwargs)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def _join_ok(thread: threading.Thread) -> None:
    thread.join(120)
    assert not thread.is_alive()
    if thread.errors:  # type: ignore[attr-defined]
        raise thread.errors[0]  # type: ignore[attr-defined]


def _ids(samples) -> list[int]:
    return [int(s["sample_id"]) for s in samples]


def _sealed_samples(out: str) -> dict[int, dict[str, torch.Tensor]]:
    ds = CacheDataset(out)
    return {int(ds[i]["sample_id"]): ds[i] for i in range(len(ds))}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


FAST = dict(poll=0.01, timeout=60.0)


def test_a_follower_in_another_process_reads_every_sample_of_the_sealed_cache_once(tmp_path):
    out = str(tmp_path / "c")
    producer = subprocess.Popen(
        [sys.executable, "-m", "speccache.testing.synthetic", out, "--samples", str(N), "--shard-size", str(SHARD)]
        + ["--compute-delay", "0.01"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    read = list(CacheDataset(out, follow=Follow(shuffle=True, seed=3, **FAST)))
    assert producer.wait(120) == 0
    sealed = _sealed_samples(out)
    assert sorted(_ids(read)) == list(range(N))
    assert all(_same(s, sealed[int(s["sample_id"])]) for s in read)


def test_ordered_follow_yields_the_sealed_cache_in_order_and_its_state_resumes_exactly(tmp_path):
    out = str(tmp_path / "c")
    producer = _produce(out, compute_delay=0.005)
    stream = CacheDataset(out, follow=Follow(ordered=True, **FAST))
    it = iter(stream)
    first = [next(it) for _ in range(37)]
    state = stream.state_dict()
    rest = list(it)
    _join_ok(producer)
    assert _ids(first + rest) == list(range(N))
    ds = CacheDataset(out)
    assert all(_same(s, ds[i]) for i, s in enumerate(first + rest))
    again = CacheDataset(out, follow=Follow(ordered=True, **FAST))
    again.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint goes through JSON
    assert _ids(again) == _ids(rest)


def test_a_shuffled_follow_resumed_from_its_state_yields_the_rest_of_the_same_sequence(tmp_path):
    out = str(tmp_path / "c")
    producer = _produce(out, compute_delay=0.002)
    follow = Follow(shuffle=True, seed=7, replay=2, **FAST)
    stream = CacheDataset(out, follow=follow)
    it = iter(stream)
    head = [next(it) for _ in range(50)]
    state = stream.state_dict()
    tail = list(it)
    _join_ok(producer)
    resumed = CacheDataset(out, follow=follow)
    resumed.load_state_dict(state)
    assert _ids(resumed) == _ids(tail)
    ids = _ids(head + tail)
    assert sorted(ids) == sorted(list(range(N)) * 2)  # replay=2: every sample twice
    with pytest.raises(ValueError, match="seed=7"):
        CacheDataset(out, follow=Follow(shuffle=True, seed=8, replay=2)).load_state_dict(state)


def test_the_replay_window_reads_each_shard_k_times_within_k_shards_and_reclaims_it_after_its_last_use(tmp_path):
    out = str(tmp_path / "c")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    shards = N // SHARD
    ends, total = [], 0  # pass p reads the window of shards p - 2 .. p (cut at the ends of the stream)
    for p in range(shards + 2):
        total += SHARD * (min(p, shards - 1) - max(0, p - 2) + 1)
        ends.append(total)
    stream = CacheDataset(out, follow=Follow(ordered=True, replay=3, reclaim=True, **FAST))
    positions: dict[int, list[int]] = {}
    for position, sample in enumerate(stream):
        # the samples before this one are consumed: a shard is deleted once its last pass is, and only then
        for s in range(shards):
            assert os.path.exists(shard_path(out, s)) == (position < ends[s + 2]), (s, position)
        positions.setdefault(int(sample["sample_id"]) // SHARD, []).append(position)
    assert all(len(positions[s]) == 3 * SHARD for s in range(shards))
    for s in range(shards):  # its three reads are in the passes opened by shards s, s + 1 and s + 2
        passes = {next(p for p, end in enumerate(ends) if position < end) for position in positions[s]}
        assert passes == {s, s + 1, s + 2}
    assert not any(SHARD_RE.match(n) for n in os.listdir(out))


def test_dataloader_workers_and_trainer_ranks_get_disjoint_shares_of_every_sample(tmp_path):
    out = str(tmp_path / "c")
    producer = _produce(out, compute_delay=0.002)
    shares = []
    for rank in range(2):
        follow = Follow(shuffle=True, seed=1, rank=rank, world_size=2, **FAST)
        loader = CacheDataset(out, keys=["sample_id", "input_ids"], follow=follow).loader(5, num_workers=2)
        shares.append([i for b in loader for i in b["sample_id"].tolist()])
        assert loader.consumed == len(shares[-1])
    _join_ok(producer)
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(N))
    assert {i // SHARD % 2 for i in shares[1]} == {1}  # rank r reads shards i % 2 == r


def test_reclaimed_shards_are_counted_by_the_producers_resume_verify_inspect_and_refused_by_a_plain_reader(
    tmp_path, capsys
):
    out = str(tmp_path / "c")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    before = Manifest.read(out).to_json()
    stream = CacheDataset(out, follow=Follow(ordered=True, reclaim=True, **FAST))
    it = iter(stream)
    for _ in range(3 * SHARD + 1):  # three shards done, the fourth begun
        next(it)
    assert [os.path.exists(reclaim_path(out, i)) for i in range(5)] == [True, True, True, False, False]
    assert not os.path.exists(shard_path(out, 0))
    with pytest.raises(CacheIncompleteError, match=r"3 of its 12 shards were reclaimed.*shards \[0, 1, 2\]"):
        CacheDataset(out)
    # a resume of the (sealed) producer recomputes nothing and records the reclaimed shards
    sealed = write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4, resume=True)
    assert not os.path.exists(shard_path(out, 0))
    assert sealed.reclaimed == (0, 1, 2)
    assert {k: v for k, v in sealed.to_json().items() if k != "reclaimed"} == before
    assert cli_main(["verify", out]) == 0
    printed = capsys.readouterr().out
    assert "reclaimed shard-000000.safetensors" in printed and "9 shards checked, 3 reclaimed after use" in printed
    assert cli_main(["inspect", out]) == 0
    assert "reclaimed  3 shards" in capsys.readouterr().out
    # a fresh follower of the partly reclaimed cache reads the rest, saying what it skips
    rest = CacheDataset(out, follow=Follow(ordered=True, **FAST))
    assert _ids(rest) == list(range(3 * SHARD, N))


def test_a_shard_missing_with_no_record_is_a_verify_problem_and_a_damaged_record_is_named(tmp_path):
    out = str(tmp_path / "c")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    list(CacheDataset(out, follow=Follow(ordered=True, reclaim=True, **FAST)))
    os.unlink(reclaim_path(out, 4))
    assert cli_main(["verify", out]) == 1
    with open(reclaim_path(out, 5), "w") as f:
        f.write("{not json")
    with pytest.raises(CacheFormatError, match="shard-000005.reclaimed: a damaged reclaim record"):
        list(CacheDataset(out, follow=Follow(**FAST)))


def test_reclaim_to_moves_finished_shards_instead_of_deleting_them(tmp_path):
    out, keep = str(tmp_path / "c"), str(tmp_path / "cold")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    original = open(shard_path(out, 0), "rb").read()
    list(CacheDataset(out, follow=Follow(reclaim=True, reclaim_to=keep, **FAST)))
    assert sorted(os.listdir(keep)) == [os.path.basename(shard_path(out, i)) for i in range(N // SHARD)]
    assert open(os.path.join(keep, os.path.basename(shard_path(out, 0))), "rb").read() == original


def test_a_torn_or_replaced_shard_is_refused_by_the_follower(tmp_path):
    out = str(tmp_path / "c")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    path = shard_path(out, 2)
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CacheCorruptError, match="shard-000002"):
        list(CacheDataset(out, follow=Follow(ordered=True, **FAST)))


def test_a_follower_times_out_with_a_clear_error_without_a_producer_or_new_shards(tmp_path):
    with pytest.raises(FollowTimeoutError, match="no producer has started"):
        CacheDataset(str(tmp_path / "none"), follow=Follow(timeout=0.2, poll=0.05))
    out = str(tmp_path / "c")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    body = Manifest.read(out)
    body.complete = False
    body.write(out)  # as a producer killed before its seal
    for i in range(4, N // SHARD):
        os.unlink(shard_path(out, i))
    stream = CacheDataset(out, follow=Follow(ordered=True, timeout=0.3, poll=0.05))
    with pytest.raises(FollowTimeoutError, match=r"waits for shard 4 .*not sealed.*--resume"):
        list(stream)


def test_the_disk_cap_pauses_the_writer_until_a_trainer_reclaims_and_never_exceeds_cap_plus_one_shard(tmp_path):
    out = str(tmp_path / "c")
    cap = DiskCap(out, max_shards=2, poll=0.01)
    producer = _produce(out, cap=cap)
    high = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                names = os.listdir(out)
            except FileNotFoundError:
                continue
            high[0] = max(high[0], sum(1 for n in names if SHARD_RE.match(n) or ".safetensors.tmp-" in n))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.5)
    assert producer.is_alive()  # paused at 2 shards: nobody reclaims yet
    assert len([n for n in os.listdir(out) if SHARD_RE.match(n)]) == 2
    ids = _ids(CacheDataset(out, follow=Follow(reclaim=True, **FAST)))
    _join_ok(producer)
    stop.set()
    watcher.join()
    assert sorted(ids) == list(range(N))
    assert high[0] <= 2 + 1
    assert cap.waited > 0.4 and cap.pauses >= 1


def test_a_trainer_on_a_full_disk_stops_with_a_clear_error_and_keeps_the_shard(tmp_path, monkeypatch):
    out = str(tmp_path / "c")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    import speccache.format.reclaim as reclaim

    def full(path: str, data: bytes) -> str:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(reclaim, "write_bytes_file", full)
    with pytest.raises(OutputError, match="No space left on device.*free space"):
        list(CacheDataset(out, follow=Follow(ordered=True, reclaim=True, **FAST)))
    assert all(os.path.exists(shard_path(out, i)) for i in range(N // SHARD))
    assert not any(n.endswith(".reclaimed") for n in os.listdir(out))


def test_follow_settings_and_flags_are_checked(capsys):
    with pytest.raises(ValueError, match="replay must be"):
        Follow(replay=0)
    with pytest.raises(ValueError, match="needs reclaim=True"):
        Follow(reclaim_to="/tmp/x")
    with pytest.raises(ValueError, match="--max-cache-bytes '12Q' is not a size"):
        parse_bytes("12Q", "--max-cache-bytes")
    assert cli_main(["train", "c", "--out", "d", "--reclaim"]) == 2
    assert "add --follow" in capsys.readouterr().err


@pytest.mark.slow
def test_precompute_with_a_cap_and_train_follow_reclaim_side_by_side(tmp_path, tiny_models, offline_single_thread):
    from speccache.demo import demo_data_path
    from speccache.train.trainer import train

    out = str(tmp_path / "cache")
    cmd = [sys.executable, "-m", "speccache", "precompute", "--model", tiny_models("llama"), "--data"]
    cmd += [demo_data_path(), "--out", out, "--limit", "64", "--batch-size", "8", "--shard-size", "8"]
    cmd += ["--max-length", "256", "--max-cache-shards", "2", "--dtype", "fp32", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    producer = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    result = train(out, str(tmp_path / "draft"), batch_size=4, follow=Follow(reclaim=True, **FAST))
    _, err = producer.communicate(timeout=300)
    assert producer.returncode == 0, err
    assert result.steps == 16
    assert Manifest.read(out).complete
    assert not any(SHARD_RE.match(n) for n in os.listdir(out))  # every shard trained on, then reclaimed
    assert os.path.exists(tmp_path / "draft" / "model.safetensors")


KILLS = 10 if not SOAK else 40


@pytest.mark.slow
def test_kill_9_of_producer_and_trainer_at_random_moments_loses_and_repeats_nothing(tmp_path):
    """Both sides killed at least ``KILLS`` times each, each restarted (the producer with --resume, the trainer
    from its last checkpoint) until both finish: the trainer's checkpointed ids are every sample once, the disk
    never held more than the cap plus one shard, and the sealed cache is sound with every shard reclaimed."""
    rng = random.Random(int(os.environ.get("SPECCACHE_CRASH_SEED", "35")))
    samples, shard_size, cap = 240, 4, 3
    out, ckpt = str(tmp_path / "c"), str(tmp_path / "ckpt.json")
    producer_argv = [out, "--samples", str(samples), "--shard-size", str(shard_size), "--batch-size", "4"]
    producer_argv += ["--max-cache-shards", str(cap), "--compute-delay", "0.002"]
    # 80 steps of 40 ms: the trainer's work outlasts ten kills of at most 0.4 s
    trainer_argv = [
        out,
        ckpt,
        "--batch-size",
        "3",
        "--checkpoint-every",
        "2",
        "--timeout",
        "60",
        "--step-seconds",
        "0.04",
    ]
    servers = [crashlib.ForkServer(), crashlib.ForkServer()]
    kills = {"producer": 0, "trainer": 0}
    failures: list[str] = []
    high = [0]
    done = threading.Event()

    def side(name: str, server: crashlib.ForkServer, module: str, argv: list[str], pace: tuple[float, float]) -> None:
        for life in range(200):
            kill = rng.uniform(*pace) if kills[name] < KILLS else None
            resumed = argv + (["--resume"] if name == "producer" and life else [])
            result = server.run(module, resumed, str(tmp_path / f"{name}-{life}.log"), kill_after=kill, nofsync=True)
            if result.killed and result.sigkilled:
                kills[name] += 1
                continue
            if result.rc != 0:
                failures.append(f"{name} life {life} rc={result.rc}:\n{result.output()[-3000:]}")
            return

    def watch() -> None:
        while not done.is_set():
            try:
                names = os.listdir(out)
            except FileNotFoundError:
                continue
            high[0] = max(high[0], sum(1 for n in names if SHARD_RE.match(n) or ".safetensors.tmp-" in n))

    threads = [
        threading.Thread(target=side, args=("producer", servers[0], crashlib.PRODUCER, producer_argv, (0.05, 0.4))),
        threading.Thread(target=side, args=("trainer", servers[1], "follow_trainer", trainer_argv, (0.05, 0.4))),
        threading.Thread(target=watch, daemon=True),
    ]
    try:
        for t in threads:
            t.start()
        for t in threads[:2]:
            t.join(600)
    finally:
        done.set()
        for server in servers:
            server.close()
    assert not failures, "\n".join(failures)
    assert kills["producer"] >= KILLS and kills["trainer"] >= KILLS, kills
    with open(ckpt) as f:
        saved = json.load(f)
    assert saved.get("done") and sorted(saved["seen"]) == list(range(samples))
    assert high[0] <= cap + 1, high[0]
    manifest = Manifest.read(out)
    assert manifest.complete
    assert cli_main(["verify", out]) == 0
    assert not any(SHARD_RE.match(n) for n in os.listdir(out))


@pytest.fixture(scope="module")
def demo_run(tiny_models, tmp_path_factory):
    """``(precompute argv without --out, an uninterrupted cache of it)`` on the tiny target: 4 shards of 16."""
    from speccache.demo import demo_data_path

    argv = ["precompute", "--model", tiny_models("llama"), "--data", demo_data_path(), "--batch-size", "8"]
    argv += ["--shard-size", "16", "--max-length", "512", "--limit", "64", "--dtype", "fp32", "--quiet"]
    whole = str(tmp_path_factory.mktemp("demo-run") / "whole")
    assert cli_main([*argv, "--out", whole]) == 0
    return argv, whole


def _reclaim_first_shard(out: str, reclaim_to: str | None) -> None:
    """A trainer that follows ``out``, trains on one batch (shard 0's 16 samples), acknowledges it and stops."""
    loader = CacheDataset(out, follow=Follow(ordered=True, reclaim=True, reclaim_to=reclaim_to, **FAST)).loader(
        16, acknowledge="manual"
    )
    it = iter(loader)
    next(it)
    loader.acknowledge()
    del it


@pytest.mark.parametrize(
    "state,move", [("killed", False), ("killed", True), ("sealed", False), ("sealed", True)], ids=lambda v: str(v)
)
def test_a_producer_resumes_after_a_trainer_reclaimed_a_shard(demo_run, tmp_path, state, move, offline_single_thread):
    argv, whole = demo_run
    out = str(tmp_path / "c")
    moved = str(tmp_path / "cold") if move else None
    if state == "killed":  # paused at its cap of 2 unreclaimed shards after shard 2, then killed
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "speccache", *argv, "--out", out, "--max-cache-shards", "2"]
        producer = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
        try:
            _reclaim_first_shard(out, moved)
            deadline = time.monotonic() + 120
            while not os.path.exists(shard_path(out, 2)) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            producer.kill()
            producer.wait()
        assert not Manifest.read(out).complete
    else:
        assert cli_main([*argv, "--out", out]) == 0
        _reclaim_first_shard(out, moved)
    assert not os.path.exists(shard_path(out, 0)) and os.path.exists(reclaim_path(out, 0))
    assert cli_main([*argv, "--out", out, "--resume"]) == 0
    done, ref = Manifest.read(out), Manifest.read(whole)
    assert done.complete and done.reclaimed == (0,)
    assert (done.shards, done.num_samples, done.num_tokens, done.stats) == (ref.shards, ref.num_samples,
                                                                             ref.num_tokens, ref.stats)  # fmt: skip
    for index in range(1, 4):
        assert open(shard_path(out, index), "rb").read() == open(shard_path(whole, index), "rb").read()
    if move:
        assert (
            open(os.path.join(moved, "shard-000000.safetensors"), "rb").read()
            == open(shard_path(whole, 0), "rb").read()
        )


def test_the_resume_count_of_cleared_samples_reads_a_record_for_a_shard_reclaimed_meanwhile(tmp_path, monkeypatch):
    from speccache.methods import finite

    out = str(tmp_path / "c")
    write_synthetic_cache(out, num_samples=N, shard_size=SHARD, batch_size=4)
    schema = Manifest.read(out).schema
    stream = iter(CacheDataset(out, follow=Follow(ordered=True, reclaim=True, **FAST)))
    for _ in range(SHARD + 1):  # shard 0 read and reclaimed
        next(stream)
    record = json.loads(open(reclaim_path(out, 0)).read())
    assert record["cleared"] == 0 and not os.path.exists(shard_path(out, 0))
    record["cleared"] = 3  # as if a trainer had reclaimed a shard with three cleared samples
    with open(reclaim_path(out, 0), "w") as f:
        json.dump(record, f)
    counter = finite.ClearedCounter(lambda *args: "")
    counter.count_kept(out, schema, [0, 1])
    assert counter.counts == {0: 3, 1: 0}
    # the record appears only after the counter first looked (the trainer reclaimed shard 0 meanwhile)
    real, calls = finite.read_reclaims, []
    monkeypatch.setattr(finite, "read_reclaims", lambda d: real(d) if calls.append(d) or len(calls) > 1 else {})
    counter.count_kept(out, schema, [0])
    assert counter.counts[0] == 3 and len(calls) == 2
    monkeypatch.undo()
    os.unlink(shard_path(out, 2))  # gone with no record: not silently counted as 0
    with pytest.raises(FileNotFoundError, match="shard-000002.safetensors: a kept shard is gone, with no reclaim"):
        counter.count_kept(out, schema, [2])
