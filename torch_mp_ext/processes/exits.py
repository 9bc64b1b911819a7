"""Why a process ended: each failed process explained in one line, signal deaths in detail.

torch.multiprocessing reports a signal death as "process 0 terminated with signal SIGKILL"
and leaves the user to guess. The usual senders are few, and each leaves a trace the parent
can read:

- SIGKILL from the kernel's OOM killer: the ``oom_kill`` counters of the cgroup
  (``memory.events`` in v2, ``memory.oom_control`` in v1) and of the machine
  (``/proc/vmstat``) rise. The parent reads them when the processes start and again when one
  is found dead (Note [OOM kill evidence]).
- SIGBUS: a page of a shared mapping that cannot be backed, almost always ``/dev/shm`` too
  small for what the processes share (Docker's default is 64 MB).
- SIGSEGV, SIGABRT, SIGFPE, SIGILL: native code crashed. The child runs with ``faulthandler``
  writing to a file next to its error file, and the parent quotes that stack.

Note [OOM kill evidence]
The counters say that the OOM killer killed *some* process, not which. A SIGKILL that no one
in torch_mp_ext sent, while a counter rose, is reported as a probable OOM kill, naming the
counter and its values so the user can judge; a machine-wide counter (``/proc/vmstat``) is
weaker evidence than the cgroup's, and the message says which one rose. cgroup v1 counts a
kill in the cgroup where it happened only, so a child in a nested cgroup shows up in
``/proc/vmstat`` alone.
"""

from __future__ import annotations

import os
import signal

from ..sharing.limits import cgroup_memory_dirs

__all__ = ["explain_exit", "oom_kill_counts", "read_fault_file", "signal_name", "summarize"]

_VMSTAT = "/proc/vmstat"
_MAX_STACK_LINES = 120


def signal_name(signum: int) -> str:
    """torch's name for a signal number: ``"SIGSEGV"``, or ``"<Unknown signal N>"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"<Unknown signal {signum}>"


def _read_counter(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def oom_kill_counts() -> dict[str, int]:
    """The OOM-kill counters readable here: path -> count (Note [OOM kill evidence])."""
    counts = {}
    paths = [
        os.path.join(d, "memory.events" if version == 2 else "memory.oom_control")
        for version, d in cgroup_memory_dirs()
    ]
    for path in paths + [_VMSTAT]:
        count = _read_counter(path, "oom_kill")
        if count is not None:
            counts[path] = count
    return counts


def _memory_limit() -> str:
    for version, d in cgroup_memory_dirs():
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        try:
            with open(os.path.join(d, name)) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:
            return f"the cgroup's limit of {_size(int(value))} ({os.path.join(d, name)}) allows"
    return "was available to them"


def _size(nbytes: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while nbytes >= 1024 and i < len(units) - 1:
        nbytes /= 1024
        i += 1
    return f"{nbytes:.0f} B" if i == 0 else f"{nbytes:.1f} {units[i]}"


def _shm_usage() -> str:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return "/dev/shm is missing"
    free, total = _size(st.f_bavail * st.f_frsize), _size(st.f_blocks * st.f_frsize)
    return f"/dev/shm has {free} free of {total}"


def read_fault_file(path: str) -> str:
    """The stack ``faulthandler`` wrote at a crash, trimmed; "" if there is none."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return ""
    lines = [line for line in lines if not line.startswith("Extension modules:")]
    if len(lines) > _MAX_STACK_LINES:
        lines = lines[:_MAX_STACK_LINES] + [f"  ... ({len(lines) - _MAX_STACK_LINES} more lines)"]
    return "\n".join(lines)


def _oom_evidence(before: dict[str, int] | None) -> str | None:
    if not before:
        return None
    after = oom_kill_counts()
    risen = [(p, before[p], after[p]) for p in before if p in after and after[p] > before[p]]
    # A cgroup's counter is the stronger evidence: name it first.
    risen.sort(key=lambda item: item[0] == _VMSTAT)
    if not risen:
        return None
    path, old, new = risen[0]
    where = "on this machine" if path == _VMSTAT else "in this cgroup"
    return (f"oom_kill in {path} rose from {old} to {new} while it ran "
            f"({new - old} OOM kill(s) {where})")


def explain_exit(
    exit_code: int, *, oom_before: dict[str, int] | None = None, fault_text: str = ""
) -> tuple[str, str]:
    """Classifies how a process without an error file ended.

    Args:
        exit_code: ``Process.exitcode`` (negative: killed by that signal).
        oom_before: :func:`oom_kill_counts` from before the process started.
        fault_text: what :func:`read_fault_file` found (the crash stack).

    Returns:
        ``(reason, explanation)``: a :class:`~torch_mp_ext.errors.ProcessFailure` reason and
        the sentences to add below torch's one-line message (possibly "").
    """
    stack = f"\nStack of the crashed process (faulthandler):\n{fault_text}" if fault_text else ""
    if exit_code >= 0:
        if exit_code == 1 and fault_text == "":
            return "exit_code", (
                "It exited with code 1 without an error from fn: it may have failed before "
                "fn ran (fn or its arguments could not be unpickled there; see its stderr)."
            )
        return "exit_code", ""
    signum = -exit_code
    if signum == signal.SIGKILL:
        evidence = _oom_evidence(oom_before)
        if evidence is not None:
            return "oom_kill", (
                f"The kernel's OOM killer most likely killed it: {evidence}. The processes "
                f"needed more memory than {_memory_limit()}: use less per process (smaller "
                "batches, fewer processes) or raise the limit (docker --memory, the job's "
                "memory request)."
            )
        checked = ", ".join(oom_before) if oom_before else "no OOM counter is readable here"
        return "signal", (
            "SIGKILL came from outside torch_mp_ext: a scheduler, a timeout, a kill -9, or "
            f"the kernel's OOM killer (no OOM kill was recorded; checked: {checked})."
        )
    if signum == signal.SIGBUS:
        return "bus_error", (
            "A bus error almost always means shared memory that /dev/shm could not back: "
            f"the processes share more than it holds ({_shm_usage()}). Enlarge it: "
            "`docker run --shm-size=16g` (or `--ipc=host`), an emptyDir with "
            "`medium: Memory` mounted at /dev/shm on Kubernetes, or "
            "`mount -o remount,size=16G /dev/shm`; or share less at once." + stack
        )
    if signum == signal.SIGSEGV:
        return "segfault", (
            "A segmentation fault: native code (a C/C++/CUDA extension, a custom op, a "
            "library bug) touched invalid memory." + stack
        )
    if signum == signal.SIGABRT:
        return "abort", (
            "abort() in native code: a failed C/C++ assertion or an uncaught C++ exception "
            "(its message is on the process's stderr)." + stack
        )
    if signum in (signal.SIGFPE, signal.SIGILL):
        return "signal", f"{signal.strsignal(signum)} in native code." + stack
    if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        return "signal", (
            "It was stopped from outside torch_mp_ext (a scheduler, a timeout, Ctrl-C or "
            "kill)." + stack
        )
    return "signal", stack.lstrip("\n")


def summarize(reason: str, exit_code: int | None, traceback_text: str = "") -> str:
    """One line for a failure: the exception's last line, or the exit and its reason."""
    if reason == "raised":
        lines = traceback_text.strip().splitlines()
        return "raised " + (lines[-1] if lines else "an exception")
    if exit_code is None or exit_code >= 0:
        return f"exited with code {exit_code}"
    words = {"oom_kill": " (probably the OOM killer)", "bus_error": " (bus error: /dev/shm?)",
             "segfault": " (segmentation fault)", "abort": " (abort)"}
    return f"terminated with signal {signal_name(-exit_code)}{words.get(reason, '')}"
