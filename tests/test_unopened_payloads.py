"""A spawn child that dies before it opens its start payload gives nothing away for ever
(Note [Unopened payloads] in torch_mp_ext/processes/payload.py), and a queue inside a queue
item nobody takes is let go with it (Note [Releasing dropped frames])."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

import torch_mp_ext as mp
from torch_mp_ext.sharing.arena import memory_stats

SCRIPT = Path(__file__).resolve().parent / "_unopened_script.py"


@pytest.mark.parametrize("mode", [pytest.param("kill", marks=pytest.mark.slow), "raise"])
def test_a_child_that_never_opened_its_payload_leaves_no_reference(mode, tmp_path):
    # The child holds a Queue, a SimpleQueue, an arena tensor and a StateDictChannel in its
    # payload. Killed while it imports the main module (or failing to), it never unpickles
    # them; the parent, once it drops its own, must have no live block left (before: the two
    # rings, the tensor and the channel).
    out = subprocess.run([sys.executable, str(SCRIPT), mode, str(tmp_path / "flag")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exitcode"] == (-9 if mode == "kill" else 1), result
    assert result["live_blocks"] == 0 and result["live_refs"] == 0, result


def test_a_queue_inside_an_item_never_taken_is_let_go():
    before = memory_stats()["live_blocks"]
    outer, inner = mp.Queue(), mp.Queue()
    inner.put(mp.zeros(1024))
    outer.put(inner)  # inner's pickle carries a holder in flight
    assert memory_stats()["live_blocks"] == before + 3  # two rings and the tensor
    del outer  # the last holder drops the frame: the holder it carried goes with it
    gc.collect()
    assert memory_stats()["live_blocks"] == before + 2
    del inner  # now the last holder of inner: its tensor goes too
    gc.collect()
    assert memory_stats()["live_blocks"] == before
