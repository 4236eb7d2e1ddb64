"""Crash safety: kill a real producer at seeded random moments and named points, resume, compare.

Every scenario kills ``python -m speccache.testing.synthetic`` (run by the fork server of
``crashlib``) one to three times on the same directory, checks after each kill
that a reader sees only whole shards equal to the uninterrupted run's (and an
unsealed cache is refused with the resume command), then resumes with
``--resume`` and checks the directory is byte-identical to an uninterrupted run
(every shard, the manifest, no temporary or lock file) and ``speccache verify``
is clean.

Also here, because they share the fork servers and reference caches: Ctrl-C
(SIGINT) at random moments must leave no temporary file and no lock (and must
not hang); a real file-size limit (RLIMIT_FSIZE, EFBIG) must stop the producer
with a ShardWriteError naming the shard, and a resume must complete the cache;
the fault hook must work in a fresh interpreter
(``SPECCACHE_FAULT=... python -m speccache.testing.faults speccache.testing.synthetic``).

The normal suite kills at least 30 times; ``SPECCACHE_SOAK=1`` (``make soak``)
runs hundreds of kills (and interrupts) over larger caches and every encoding.
``SPECCACHE_CRASH_SEED`` picks another seed (failures print the runs).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import SOAK, crashlib
from support.crashlib import (
    CLI,
    FAULTS,
    PRODUCER,
    ForkServer,
    Kill,
    Producer,
    Reference,
    Scenario,
    check_after_kill,
    check_final,
    run_scenario,
)

# `make soak` runs it with SPECCACHE_SOAK=1, which multiplies its producers, scenarios and kills
pytestmark = pytest.mark.soak_suite

SEED = int(os.environ.get("SPECCACHE_CRASH_SEED", "20240611"))
WORKERS = 2
if SOAK:
    PRODUCERS = [Producer(samples=400, shard_size=6), Producer(samples=240, shard_size=4, encoding="zbf16"),
                 Producer(samples=240, shard_size=5, hidden=96, encoding="fp8")]  # fmt: skip
    MIN_SCENARIOS = int(os.environ.get("SPECCACHE_SOAK_SCENARIOS", "160"))
    TARGET_KILLS = MIN_KILLS = 300
else:
    PRODUCERS = [Producer(), Producer(samples=96, shard_size=4, encoding="zbf16")]
    MIN_SCENARIOS = 16
    TARGET_KILLS = 36
    MIN_KILLS = 30


@pytest.fixture(scope="module")
def servers():
    started = [ForkServer() for _ in range(WORKERS)]
    yield started
    for server in started:
        server.close()


@pytest.fixture(scope="module")
def refs(servers, tmp_path_factory):
    base = tmp_path_factory.mktemp("refs")
    out = {}
    for i, producer in enumerate(PRODUCERS):
        out[producer] = Reference.build(servers[0], producer, str(base / f"ref{i}"), sync=bool(i % 2))
    return out


def _run_all(servers, scenarios, refs, base, runner=run_scenario, enough=lambda outcomes: False):
    """Run ``scenarios`` in order, one per fork server at a time, until all ran or ``enough(outcomes so far)``."""
    pending = iter(enumerate(scenarios))
    outcomes: list[crashlib.Outcome] = []
    lock = threading.Lock()

    def worker(server: ForkServer) -> None:
        while True:
            with lock:
                if enough(outcomes):
                    return
                item = next(pending, None)
            if item is None:
                return
            index, scenario = item
            workdir = base / f"s{index:04d}"
            workdir.mkdir()
            outcome = runner(server, scenario, refs[scenario.producer], str(workdir))
            with lock:
                outcomes.append(outcome)

    with ThreadPoolExecutor(len(servers)) as ex:
        for future in [ex.submit(worker, server) for server in servers]:
            future.result()
    return outcomes


def test_sync_and_overlapped_writers_write_identical_caches(servers, refs, tmp_path):
    producer = PRODUCERS[0]
    other = Reference.build(servers[0], producer, str(tmp_path / "sync"), sync=True)
    assert other.files == refs[producer].files


@pytest.mark.slow
def test_killed_producer_resumes_to_identical_cache(servers, refs, tmp_path):
    rng = random.Random(SEED)
    # Kill times are random and a run may finish first, so scenarios keep coming (in seeded order)
    # until both MIN_SCENARIOS ran and TARGET_KILLS kills happened.
    scenarios = crashlib.make_scenarios(rng, refs, MIN_SCENARIOS * 3)

    def enough(done):
        return len(done) >= MIN_SCENARIOS and sum(o.kill_points for o in done) >= TARGET_KILLS

    t0 = time.monotonic()
    outcomes = _run_all(servers, scenarios, refs, tmp_path, enough=enough)
    kills = sum(o.kill_points for o in outcomes)
    early = sum(o.completed_early for o in outcomes)
    print(f"\ncrash harness: seed {SEED}, {len(outcomes)} scenarios, {kills} kill points "
          f"({early} runs finished before their kill), {time.monotonic() - t0:.1f}s")  # fmt: skip
    for o in outcomes:
        print(f"  {o.scenario.name}: " + "; ".join(o.notes))
    assert kills >= MIN_KILLS, f"only {kills} runs were killed (want >= {MIN_KILLS}); the kill times miss the run"
    # the fixed scenarios hit every named fault point
    hit = {k.fault.split(":")[0] for o in outcomes for k in o.scenario.kills if k.fault}
    assert hit >= {"after_manifest_begin", "mid_manifest_write", "mid_shard_write", "before_seal", "after_seal"}


def _interrupt_scenario(server: ForkServer, scenario: Scenario, ref: Reference, workdir: str) -> crashlib.Outcome:
    """SIGINT (Ctrl-C, KeyboardInterrupt): the producer cleans up after itself: no temp file, no lock."""
    out = os.path.join(workdir, "cache")
    outcome = crashlib.Outcome(scenario)
    kill = scenario.kills[0]
    result = server.run(PRODUCER, scenario.producer.argv(out, sync=kill.sync), log=os.path.join(workdir, "run.log"),
                        kill_after=kill.seconds, signal_name="SIGINT", nofsync=True, timeout=30)  # fmt: skip
    assert result.rc != 124, f"the interrupted producer hung; its stacks:\n{result.output()}"
    assert result.rc in (0, 1, -signal.SIGINT), result.output()
    if result.rc != 0:
        outcome.kill_points += 1
        assert "KeyboardInterrupt" in result.output() or result.rc == -signal.SIGINT, result.output()
    found = check_after_kill(out, ref)
    assert found["temp"] == 0 and found["lock"] == 0, (
        f"interrupted at {kill.seconds:.3f}s left {found}:\n{result.output()}"
    )
    result = server.run(
        PRODUCER, scenario.producer.argv(out, resume=True), log=os.path.join(workdir, "final.log"), nofsync=True
    )
    assert result.rc == 0, result.output()
    check_final(out, ref)
    return outcome


def test_ctrl_c_leaves_no_temp_file_or_lock(servers, refs, tmp_path):
    rng = random.Random(SEED + 1)
    producer = PRODUCERS[0]
    span = refs[producer].fast_elapsed
    count = 300 if SOAK else 10
    # Ctrl-C lands anywhere; an interrupt inside a queue operation once deadlocked the overlapped writer.
    # A run faster than the reference finishes before a late Ctrl-C, so scenarios keep coming (in seeded order)
    # until both `count` ran and half of that many were interrupted.
    scenarios = [Scenario(f"sigint-{i}", producer, [Kill(seconds=rng.uniform(0.0, span), sync=rng.random() < 0.3)])
                 for i in range(count * 3)]  # fmt: skip

    def enough(done):
        return len(done) >= count and sum(o.kill_points for o in done) >= count // 2

    outcomes = _run_all(servers, scenarios, refs, tmp_path, runner=_interrupt_scenario, enough=enough)
    interrupted = sum(o.kill_points for o in outcomes)
    assert interrupted >= count // 2, f"only {interrupted} of {len(outcomes)} runs were interrupted; the times miss it"


def test_fault_hook_in_a_fresh_interpreter(refs, tmp_path):
    """The plain command lines, no fork server: the fault wrapper kills a fresh producer mid-shard.

    ``SPECCACHE_FAULT=mid_shard_write:N python -m speccache.testing.faults speccache.testing.synthetic OUT ...``
    arms the fault point, then runs the producer; the resume is a plain ``python -m speccache.testing.synthetic``.
    """
    producer = PRODUCERS[0]
    out = str(tmp_path / "cache")
    env = {**os.environ, "SPECCACHE_FAULT": f"mid_shard_write:{producer.num_shards // 2}", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-m", FAULTS, PRODUCER, *producer.argv(out)], env=env, capture_output=True,
                            text=True)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    check_after_kill(out, refs[producer])
    names = os.listdir(out)
    assert any(crashlib.classify(n) == "temp" for n in names), names  # the half-written shard
    assert ".speccache.lock" in names
    env.pop("SPECCACHE_FAULT")
    resumed = subprocess.run([sys.executable, "-m", PRODUCER, *producer.argv(out, resume=True)], env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"removed \d+ temporary file", resumed.stderr), resumed.stderr
    check_final(out, refs[producer])


def test_resume_of_a_sealed_cache_with_a_stale_lock_rewrites_nothing(servers, refs, tmp_path):
    producer = PRODUCERS[0]
    out = str(tmp_path / "cache")
    r = servers[0].run(PRODUCER, producer.argv(out), log=str(tmp_path / "a.log"), env={"SPECCACHE_FAULT": "after_seal"})
    assert r.sigkilled, r.output()
    assert json.loads(open(os.path.join(out, "manifest.json")).read())["complete"] is True
    mtimes = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out) if crashlib.classify(n) == "shard"}
    r = servers[0].run(PRODUCER, producer.argv(out, resume=True), log=str(tmp_path / "b.log"))
    assert r.rc == 0, r.output()
    check_final(out, refs[producer])
    assert mtimes == {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in mtimes}, "a resume rewrote whole shards"
    r = servers[0].run(CLI, ["verify", out], log=str(tmp_path / "v.log"))
    assert r.rc == 0, r.output()


def test_file_size_limit_stops_cleanly_and_resume_completes(servers, refs, tmp_path):
    """A real EFBIG: the producer process runs under RLIMIT_FSIZE (SIGXFSZ ignored), like a full quota.

    It must stop with a ShardWriteError naming the first shard that does not fit, leave every shard
    before it whole, no temporary file and no lock; without the limit, --resume completes the cache.
    """
    producer = PRODUCERS[0]
    ref = refs[producer]
    sizes = [len(ref.files[f"shard-{i:06d}.safetensors"]) for i in range(producer.num_shards)]
    first = next(j for j in range(3, len(sizes)) if sizes[j] > max(sizes[:j]))
    limit = max(max(sizes[:first]), len(json.dumps(ref.unsealed_manifest(), indent=2)) + 64)
    assert sizes[first] > limit
    out = str(tmp_path / "cache")
    for sync in (True, False):
        r = servers[0].run(PRODUCER, producer.argv(out, resume=not sync, sync=sync),
                           log=str(tmp_path / f"limit-{sync}.log"), fsize_limit=limit, nofsync=True)  # fmt: skip
        text = r.output()
        assert r.rc == 1, text
        assert (
            "ShardWriteError" in text and f"shard-{first:06d}.safetensors failed" in text and "File too large" in text
        ), text
        assert "--resume" in text, text
        found = check_after_kill(out, ref)
        assert found == {"shard": first, "temp": 0, "lock": 0, "manifest": 1}, found
    r = servers[0].run(PRODUCER, producer.argv(out, resume=True), log=str(tmp_path / "resume.log"), nofsync=True)
    assert r.rc == 0, r.output()
    check_final(out, ref)
