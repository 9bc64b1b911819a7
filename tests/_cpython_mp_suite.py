"""CPython's own multiprocessing tests, run against torch_mp_ext's queues and Pool.

``multiprocessing.Queue``, ``JoinableQueue``, ``SimpleQueue`` and ``Pool`` are rebound to
torch_mp_ext's before ``test._test_multiprocessing`` is imported: its mixins capture those
names at class creation. Children (spawn, forkserver) find the test classes in this module,
so they import it, and rebind, before the test module too. The start method comes from
``TMX_CPYTHON_MP_METHOD`` (inherited by children). Run by ``test_cpython_multiprocessing.py``:
``python -m unittest _cpython_mp_suite`` with ``tests/`` on the path.

The tests that check a documented, intended difference are removed (``INTENDED``); each is
explained in docs/migration.md ("CPython's multiprocessing tests").
"""

import multiprocessing
import os
import unittest

import torch_mp_ext as mp

multiprocessing.Queue = mp.Queue
multiprocessing.JoinableQueue = mp.JoinableQueue
multiprocessing.SimpleQueue = mp.SimpleQueue
multiprocessing.Pool = mp.Pool

import test._test_multiprocessing as _cpython  # noqa: E402  (after the rebinding, on purpose)

METHOD = os.environ.get("TMX_CPYTHON_MP_METHOD", "fork")
CLASSES = ("WithProcessesTestQueue", "TestSimpleQueue", "WithProcessesTestPool",
           "WithProcessesTestPoolWorkerErrors", "WithProcessesTestPoolWorkerLifetime")
#: (class, test) pairs left out, each an intended difference (docs/migration.md).
INTENDED = {
    # put() pickles in the caller's thread: an unpicklable item raises there, there is no
    # feeder thread to survive it (nor _on_queue_feeder_error to override).
    ("WithProcessesTestQueue", "test_queue_feeder_donot_stop_onexc"),
    ("WithProcessesTestQueue", "test_queue_feeder_on_queue_feeder_error"),
    # A lambda a worker returns is pickled by value (Note [By-value fallback] in
    # sharing/byvalue.py): it reaches the caller instead of failing as MaybeEncodingError.
    ("WithProcessesTestPoolWorkerErrors", "test_unpickleable_result"),
}

_found: dict = {"__name__": __name__}
_cpython.install_tests_in_module_dict(_found, METHOD, only_type="processes")
_found["TestSimpleQueue"] = type("TestSimpleQueue", (_cpython.TestSimpleQueue,), {})
for _name in CLASSES:
    if _name not in _found:
        continue
    _cls = _found[_name]
    _cls.__module__ = __name__
    for _cls_name, _test in INTENDED:
        if _cls_name == _name and hasattr(_cls, _test):
            setattr(_cls, _test, unittest.skip("intended difference: docs/migration.md")(
                getattr(_cls, _test)))
    globals()[_name] = _cls
_set_up = _found["setUpModule"]


def setUpModule() -> None:
    _set_up()
    # The server imports torch once for all its children, as a torch user's would.
    multiprocessing.set_forkserver_preload(list(_cpython.PRELOAD) + [__name__])


tearDownModule = _found["tearDownModule"]

#: Under spawn every worker imports torch (seconds on 2 cores; the forkserver preloads it), so
#: the spawn run is split in two cases, these and the rest, both in the slow tier
#: (TMX_CPYTHON_MP_SELECT: "all", "quick" or "rest").
QUICK = ("TestSimpleQueue", "WithProcessesTestQueue.test_put",
         "WithProcessesTestQueue.test_closed_queue_put_get_exceptions",
         "WithProcessesTestPool.test_map_no_failfast", "WithProcessesTestPool.test_map",
         "WithProcessesTestPool.test_apply", "WithProcessesTestPool.test_traceback",
         "WithProcessesTestPoolWorkerErrors.test_unpickleable_result")


def _selected(test: unittest.TestCase, select: str) -> bool:
    name = test.id().split(".", 1)[1]
    quick = any(name == q or name.startswith(q + ".") for q in QUICK)
    return select == "all" or quick == (select == "quick")


def load_tests(loader: unittest.TestLoader, tests: unittest.TestSuite, pattern: object) -> object:
    select = os.environ.get("TMX_CPYTHON_MP_SELECT", "all")
    out = unittest.TestSuite()
    for name in CLASSES:
        for test in loader.loadTestsFromTestCase(globals()[name]):
            if _selected(test, select):
                out.addTest(test)
    return out
