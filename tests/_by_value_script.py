"""Code that works under fork, run under the start method ``TMX_METHOD`` with the library
``TMX_IMPL`` (``torch_mp_ext`` or ``torch``, meaning stock ``torch.multiprocessing``).

tests/test_start_methods.py runs this file as a script, as ``python -c`` and from stdin (the
last two leave ``__main__`` unimportable by children). It prints one line, ``RESULTS: {json}``,
mapping each case to its result, or to ``"error: <type>: <message>"`` when it failed, so
that a failure of stock torch.multiprocessing is recorded, not hidden. A case that needs
torch_mp_ext (TaskPool, pipeline stages) is left out for stock torch.
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

if os.environ.get("TMX_IMPL", "torch_mp_ext") == "torch":
    import torch.multiprocessing as mp
else:
    import torch_mp_ext as mp

METHOD = os.environ.get("TMX_METHOD", "spawn")
T = 120  # seconds: spawn children import torch, on 2 busy cores


class Point:
    """Defined in __main__: children of ``python -c`` or stdin cannot import it."""

    def __init__(self, x, y):
        self.x, self.y = x, y


def add_point(q_in, q_out):
    p = q_in.get(timeout=T)
    q_out.put((type(p).__name__, p.x + p.y))


def finish(process, q):
    process.join(T)
    if process.exitcode != 0:
        raise RuntimeError(f"the child exited with code {process.exitcode}")
    return q.get(timeout=10)


def lambda_target(ctx):
    q = ctx.Queue()
    p = ctx.Process(target=lambda q, x: q.put(x * 2), args=(q, 21))
    p.start()
    return finish(p, q)


def local_function_to_spawn(ctx):
    q = ctx.Queue()

    def work(i, q, base):
        q.put(base + i)

    mp.start_processes(work, args=(q, 10), nprocs=2, start_method=METHOD)
    return sorted([q.get(timeout=10), q.get(timeout=10)])


def main_class_through_queue(ctx):
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=add_point, args=(q_in, q_out))
    p.start()
    q_in.put(Point(1, 2))
    return list(finish(p, q_out))


def pool_map_lambda(ctx):
    with ctx.Pool(2) as pool:
        return pool.map_async(lambda x: x * x, range(5)).get(timeout=T)


def executor_submit_lambda(ctx):
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=ctx) as executor:
        return executor.submit(lambda x: x + 1, 41).result(timeout=T)


def task_pool_local(ctx):
    def cube(x):
        return x ** 3

    with mp.TaskPool(1, start_method=METHOD) as pool:
        return pool.submit(cube, 3).get(timeout=T)


def pipeline_local_stage(ctx):
    @mp.stage(buffer_size=2, start_method=METHOD)
    def plus_one(items):
        for x in items:
            yield x + 1

    return list(plus_one(range(4)))


def dataloader_lambda_collate(ctx):  # and a lambda worker_init_fn
    class Squares(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return i * i

    loader = DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context=ctx,
                        collate_fn=lambda batch: [x * 10 for x in batch], timeout=T,
                        worker_init_fn=lambda worker_id: torch.manual_seed(worker_id))
    return [batch for batch in loader]


CASES = [lambda_target, local_function_to_spawn, main_class_through_queue, pool_map_lambda,
         executor_submit_lambda, dataloader_lambda_collate]
OURS_ONLY = [task_pool_local, pipeline_local_stage]


def run_cases():
    ctx = mp.get_context(METHOD)
    mp.set_start_method(METHOD, force=True)
    torch.set_num_threads(1)
    cases = CASES + (OURS_ONLY if mp.__name__ == "torch_mp_ext" else [])
    results = {}
    for case in cases:
        try:
            results[case.__name__] = case(ctx)
        except Exception as e:  # noqa: BLE001 (recorded: stock torch fails)
            results[case.__name__] = f"error: {type(e).__name__}: {e}"
    print("RESULTS: " + json.dumps(results), flush=True)


if __name__ == "__main__":
    run_cases()
    sys.stdout.flush()
