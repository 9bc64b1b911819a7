"""Command line: ``python -m torch_mp_ext demo | doctor | cleanup``.

- ``demo``: worker processes sharing tensors and numpy arrays both ways, then a hand-off
  timing side by side with torch.multiprocessing.
- ``doctor``: what this machine offers and limits (``/dev/shm``, fd limit, memfd, start
  methods, leftover segments), with the fix for each problem found.
- ``cleanup``: removes torch_mp_ext segments in ``/dev/shm`` whose processes all died.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _cleanup(args: argparse.Namespace) -> int:
    from . import _C

    removed = _C.reap_dead_segments(
        directory=args.directory, dry_run=args.dry_run, include_inflight=args.include_inflight
    )
    if os.path.realpath(args.directory) == "/dev/shm":  # Note [Session names]: runs whose
        # last process was killed before it could sweep their names
        removed = list(dict.fromkeys(removed + _C.reap_dead_sessions(dry_run=args.dry_run)))
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} {os.path.join(args.directory, name)}")
    print(f"{verb} {len(removed)} segment(s) whose processes are all gone")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    import multiprocessing

    import torch

    from . import _C, __version__, get_sharing_strategy

    problems = 0
    print(f"torch_mp_ext {__version__}, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}")
    print(f"start methods: {multiprocessing.get_all_start_methods()}, "
          f"default {multiprocessing.get_start_method(allow_none=True) or 'fork (unset)'}")
    print(f"sharing strategy: {get_sharing_strategy()}, anonymous backend: "
          f"{_C.anonymous_backend()}")
    try:
        st = os.statvfs("/dev/shm")
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        print(f"/dev/shm: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
        if total < 1 << 30:
            problems += 1
            print("  ! /dev/shm is small (Docker's default is 64 MB): the file_system strategy "
                  "and torch's own share_memory_() are bounded by it. Start the container with "
                  "--shm-size=8g (or --ipc=host); the file_descriptor strategy of torch_mp_ext "
                  "uses memfd and is not bounded by it.")
    except OSError as e:
        problems += 1
        print(f"  ! /dev/shm is not usable ({e}): use the file_descriptor strategy")
    limit = _C.fd_limit()
    print(f"open-file limit (RLIMIT_NOFILE): {limit}")
    if limit < 1024:
        print("  note: low, but torch_mp_ext receivers hold no fd per tensor; torch's "
              "file_descriptor strategy would need one per live received storage")
    leftovers = _C.reap_dead_segments(dry_run=True)
    print(f"segments left by dead processes: {len(leftovers)}")
    if leftovers:
        problems += 1
        print("  ! run `python -m torch_mp_ext cleanup` to remove them")
    print(f"CUDA available: {torch.cuda.is_available()}")
    print("no problems found" if problems == 0 else f"{problems} problem(s) found")
    return 0 if problems == 0 else 1


def _demo(args: argparse.Namespace) -> int:
    from torch_mp_ext_demo.demo import run

    return run(repeats=args.repeats, quick=args.quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_mp_ext", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="share tensors with workers and time it against torch")
    demo.add_argument("--repeats", type=int, default=5, help="timed hand-offs per cell")
    demo.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    demo.set_defaults(func=_demo)
    doctor = sub.add_parser("doctor", help="check this machine's limits")
    doctor.set_defaults(func=_doctor)
    cleanup = sub.add_parser("cleanup", help="remove segments whose processes all died")
    cleanup.add_argument("--dry-run", action="store_true", help="only list them")
    cleanup.add_argument("--include-inflight", action="store_true",
                         help="also remove segments still named by undelivered messages")
    cleanup.add_argument("--directory", default="/dev/shm", help=argparse.SUPPRESS)
    cleanup.set_defaults(func=_cleanup)
    args = parser.parse_args(argv)
    return args.func(args)
