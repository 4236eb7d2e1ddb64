"""One life of a killable trainer that follows a cache being written (run by crashlib's fork server).

``main([OUT, CHECKPOINT, ...])`` reads the cache with ``follow`` and ``reclaim``, "trains" on each batch by
recording its ``sample_id`` values, and every ``--checkpoint-every`` batches saves, atomically and durably,
the loader's state with every id trained on so far; only then does it acknowledge (``acknowledge="manual"``),
so a shard is reclaimed only once a checkpoint covers it. A restarted life loads the checkpoint and goes
on. After the last life the checkpoint's ids are exactly what a trainer that was never killed saw.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from speccache.read import CacheDataset
from speccache.read.follow import Follow


def save(path: str, body: dict) -> None:
    """Write ``body`` to ``path`` atomically and durably."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    """Train (record ids) until the followed cache is sealed and read; returns 0."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("checkpoint")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--step-seconds", type=float, default=0.0, help="time each training step takes")
    a = p.parse_args(argv)
    follow = Follow(shuffle=True, seed=a.seed, replay=a.replay, reclaim=True, poll=0.01, timeout=a.timeout)
    stream = CacheDataset(a.out, keys=["sample_id"], follow=follow)
    loader = stream.loader(a.batch_size, acknowledge="manual")
    seen: list[int] = []
    if os.path.exists(a.checkpoint):
        with open(a.checkpoint) as f:
            saved = json.load(f)
        loader.load_state_dict(saved["loader"])
        seen = saved["seen"]
    for step, batch in enumerate(loader, 1):
        seen += batch["sample_id"].tolist()
        time.sleep(a.step_seconds)
        if step % a.checkpoint_every == 0:
            save(a.checkpoint, {"loader": loader.state_dict(), "seen": seen})
            loader.acknowledge()
    save(a.checkpoint, {"loader": loader.state_dict(), "seen": seen, "done": True})
    loader.acknowledge()
    return 0
