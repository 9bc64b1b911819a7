"""The kill-anywhere harness (issue 12), run by tests/test_crash_consistency.py in a fresh
interpreter: ``python _kill_anywhere.py ROUNDS SEED [STRATEGY]`` (children started by fork, or by
``TMX_KILL_START_METHOD``). Prints one JSON object of counts.

Each round picks a scenario, SIGKILLs one process of it (at a deterministic crash point of
the ring or doorbell protocol, or after a random delay), lets the survivors go on, then
checks that a *fresh* queue in this process delivers exactly what is sent and that the audit
(Note [Audit] in csrc/shm/audit.cpp) is clean. Scenarios: Queue / SimpleQueue /
JoinableQueue producers and consumers (items carry tensors and arrays: the arena hand-off,
sender and receiver side), SimpleQueue's wait() readiness, pipeline stages, TaskPool workers,
and a StateDictChannel writer.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import random
import signal
import sys
import time
from collections import Counter

import _crash_workers as cw
import torch

import torch_mp_ext as mp
from torch_mp_ext import _C
from torch_mp_ext.errors import PipelineError, WorkerDiedError
from torch_mp_ext.queues import compat as qc

T = 20.0
N = 40  # items per queue scenario
PUT_POINTS = [1, 2, 3]  # _C crash points: HoldingLock, PutBeforeCommit, PutAfterCommit
GET_POINTS = [1, 4, 5]  # HoldingLock, GetBeforeCommit, GetAfterCommit
# The start method of every child (TMX_KILL_START_METHOD: fork, the default, or forkserver).
CTX = mp.get_context(os.environ.get("TMX_KILL_START_METHOD", "fork"))


class Harness:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self.wrong = 0
        self.wedges = 0
        self.violations: list = []
        self.unfinished_mismatch = 0
        self.pipeline_no_signal = 0
        self.pids: set = {os.getpid()}
        self.killed = 0
        self.notes: list = []
        self.mode: tuple = ()
        self.leaks = 0
        self.last_leaks: list = []
        self.pool = mp.TaskPool(2, start_method="fork")

    # -- helpers ---------------------------------------------------------------------------
    def kill_mode(self, points: list) -> tuple:
        """(crash point or 0, delay before an outside SIGKILL or None)."""
        if self.rng.random() < 0.5:
            self.mode = (self.rng.choice(points), None)
        else:
            self.mode = (0, self.rng.uniform(0.0, 0.01))
        return self.mode

    def run_victim(self, target, args, delay) -> int:
        victim = CTX.Process(target=target, args=args)
        victim.start()
        self.pids.add(victim.pid)
        if delay is not None:
            time.sleep(delay)
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        victim.join(T)
        if victim.exitcode is None:
            victim.kill()
            victim.join()
            self.wedges += 1
        self.killed += victim.exitcode == -signal.SIGKILL
        return victim.exitcode

    def check_items(self, items, start=0, gaps=False) -> None:
        """Items must be tagged items in increasing order (a gap only where `gaps`)."""
        last = start - 1
        for kind, i, x in map(cw.unpack, items):
            if cw.wrong([(kind, i, x)], i) or i <= last or (not gaps and i != last + 1):
                self.wrong += 1
            last = i

    def fresh_queue_check(self) -> None:
        q = mp.Queue()
        sent = [cw.tagged(k) for k in range(6)]
        q.put_many(sent)
        got = [q.get(timeout=T) for _ in range(6)]
        self.wrong += cw.wrong(got, 0)
        q.close()

    def maybe_watch(self, q) -> None:
        """Half the SimpleQueues are watched from the start (as Pool and ProcessPoolExecutor
        do), so the victim runs the doorbell protocol and its crash points (Note [Doorbell]);
        the rest keep it off until the survivor's wait() arms it."""
        if self.rng.random() < 0.5:
            q._reader.fileno()

    # -- scenarios -------------------------------------------------------------------------
    def queue_producer(self) -> None:
        cls = self.rng.choice(["Queue", "SimpleQueue", "JoinableQueue"])
        q = getattr(CTX, cls)()
        if cls == "SimpleQueue":
            self.maybe_watch(q)
        points = PUT_POINTS + ([-qc.CRASH_RING_NO_BYTE] if cls == "SimpleQueue" else [])
        point, delay = self.kill_mode(points)
        self.run_victim(cw.produce_tagged, (q, N, point), delay)
        self.counts[f"{cls}-producer"] += 1
        if cls == "SimpleQueue" and q._ring.qsize() > 0:
            if not multiprocessing.connection.wait([q._reader], timeout=T):
                self.wedges += 1
        items = []
        taken = 0
        while q._ring.qsize() > 0:
            try:
                taken += 1
                items.append(q.get(timeout=T) if cls != "SimpleQueue" else q.get())
            except ConnectionRefusedError:
                # docs/sharing.md: a SIGKILLed sender's tensors that no receiver mapped yet
                # are lost with it (file_descriptor): the error names it, nothing else breaks.
                self.counts["undeliverable"] += 1
        self.check_items(items, gaps=self.counts["undeliverable"] > 0)
        if cls == "JoinableQueue":
            if q._ring.counts()[2] != taken:
                self.unfinished_mismatch += 1
            for _ in range(taken):
                q.task_done()
            if not q.join(timeout=T):
                self.wedges += 1
        q.close()

    def queue_consumer(self) -> None:
        cls = self.rng.choice(["Queue", "SimpleQueue", "JoinableQueue"])
        q = getattr(CTX, cls)()
        if cls == "SimpleQueue":
            self.maybe_watch(q)
        for i in range(N):
            q.put(cw.tagged(i))
        points = GET_POINTS + ([-qc.CRASH_GET_DRAINED] if cls == "SimpleQueue" else [])
        point, delay = self.kill_mode(points)
        self.run_victim(cw.consume, (q, N, point), delay)
        self.counts[f"{cls}-consumer"] += 1
        left = q._ring.qsize()
        if cls == "SimpleQueue" and left > 0:
            if not multiprocessing.connection.wait([q._reader], timeout=T):
                self.wedges += 1
        items = [q.get() if cls == "SimpleQueue" else q.get(timeout=T) for _ in range(left)]
        self.check_items(items, start=N - left)
        if cls == "JoinableQueue":
            # Note [Unfinished tasks of a killed consumer]: what it took stays unfinished.
            if q._ring.counts()[2] != N:
                self.unfinished_mismatch += 1
            for _ in range(N):
                q.task_done()
            if not q.join(timeout=T):
                self.wedges += 1
        q.close()

    def pipeline_stage(self) -> None:
        p = mp.pipeline(cw.tagged_source, cw.pass_through, cw.identity, cw.pass_through,
                        workers=2, buffer_size=3, start_method="fork")
        self.counts["pipeline-stage"] += 1
        got = []
        try:
            for item in p:
                got.append(item)
                if len(got) == 3:
                    self.pids.update(p.pids)
                    victim = self.rng.choice(p.pids)
                    time.sleep(self.rng.uniform(0.0, 0.005))
                    os.kill(victim, signal.SIGKILL)
                    self.killed += 1
        except PipelineError as e:
            if e.signal_name != "SIGKILL":
                self.pipeline_no_signal += 1
                self.notes.append(str(e)[:400])
        self.check_items(got)
        fresh = list(mp.pipeline(cw.tagged_source, cw.pass_through, cw.identity, workers=2,
                                 start_method="fork"))
        self.wrong += cw.wrong(fresh, 0) + abs(len(fresh) - 30)

    def pool_worker(self) -> None:
        """A TaskPool worker SIGKILLed at a random moment while tasks run; the pool forks its
        replacement while it lets task values go (Note [Mappings and fork] in
        csrc/shm/registry.h: this scenario found the fork over-drop, issue 12)."""
        self.counts["taskpool-worker"] += 1
        refs = [self.pool.submit(cw.tagged_values, 3, 10 * k) for k in range(6)]
        self.pids.update(self.pool.pids)
        time.sleep(self.rng.uniform(0.0, 0.01))
        victim = self.rng.choice(self.pool.pids)
        os.kill(victim, signal.SIGKILL)
        self.killed += 1
        for k, ref in enumerate(refs):
            try:
                self.wrong += cw.wrong(ref.get(timeout=T), 10 * k)
            except WorkerDiedError:
                pass
        deadline = time.monotonic() + T  # the pool replaces it (an idle victim's death is
        while victim in self.pool.pids:  # noticed a moment later: tasks sent to it fail)
            if time.monotonic() > deadline:
                self.wedges += 1
                break
            time.sleep(0.005)
        fresh = mp.get([self.pool.submit(cw.tagged_values, 2, 5)], timeout=T)[0]
        self.wrong += cw.wrong(fresh, 5)

    def channel_writer(self) -> None:
        self.counts["channel-writer"] += 1
        template = {f"w{i}": torch.zeros(20_000) for i in range(8)}
        ch = mp.StateDictChannel(template)
        ch.publish({k: torch.full_like(v, 1.0) for k, v in template.items()}, version=1)
        self.run_victim(cw.publish_forever, (ch,), self.rng.uniform(0.0, 0.02))
        version, state = ch.read(timeout=T)
        if any(not bool((t == float(version)).all()) for t in state.values()):
            self.wrong += 1
        ch.publish({k: torch.full_like(v, 1e6) for k, v in template.items()}, version=10**6)
        version, state = ch.read(timeout=T)
        self.wrong += version != 10**6 or any(
            not bool((t == 1e6).all()) for t in state.values())
        ch.close()

    def round(self) -> None:
        self.mode = ()
        scenarios = [self.queue_producer, self.queue_consumer, self.queue_producer,
                     self.queue_consumer, self.pipeline_stage, self.channel_writer]
        if os.environ.get("TMX_KILL_POOL", "1") != "0":  # TMX_KILL_POOL=0 leaves it out
            scenarios.append(self.pool_worker)
        only = os.environ.get("TMX_KILL_ONLY")
        if only:
            scenarios = [s for s in scenarios if s.__name__ in only.split(",")]
        scenario = self.rng.choice(scenarios)
        scenario()
        self.fresh_queue_check()
        problems = _C.audit(reclaim=os.environ.get("TMX_KILL_NORECLAIM") is None)
        leaks = [p for p in problems if p.startswith("leak: ")]
        if leaks and leaks != self.last_leaks:
            self.leaks += 1  # Note [Audit] 3.: a death inside a count-then-mark window
        self.last_leaks = leaks
        problems = [p for p in problems if not p.startswith("leak: ")]
        if problems:
            self.violations.append((scenario.__name__, problems[:5]))
            if os.environ.get("TMX_KILL_PROGRESS"):
                print("VIOLATION", scenario.__name__, self.mode, problems[:8],
                      file=sys.stderr, flush=True)


def main() -> None:
    kills, seed = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        mp.set_sharing_strategy(sys.argv[3])
    h = Harness(seed)
    started = time.monotonic()
    for _ in range(kills):
        h.round()
        if os.environ.get("TMX_KILL_PROGRESS"):
            print(h.killed, h.wrong, h.wedges, len(h.violations), file=sys.stderr, flush=True)
    h.pool.shutdown()
    print(json.dumps({
        "rounds": kills, "kills": h.killed, "by_scenario": dict(h.counts), "wrong": h.wrong,
        "wedges": h.wedges, "violations": h.violations[:20], "leaks": h.leaks,
        "unfinished_mismatch": h.unfinished_mismatch,
        "pipeline_no_signal": h.pipeline_no_signal, "notes": h.notes[:10], "pids": sorted(h.pids),
        "seconds": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
