"""The engine fixes glibc's mmap threshold (storage/freed_memory.py): large blocks freed below a live heap block
leave the process's resident memory instead of staying there. Each case runs in its own process: the setting is
the process's, and the pattern needs a fresh allocator."""
import os
import platform
import subprocess
import sys

import pytest

from flexh2o.storage.freed_memory import checked_after

PATTERN = r"""
import ctypes, sys
sys.path.insert(0, {root!r})
from flexh2o.storage.freed_memory import return_freed_blocks
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
{setup}
set_ = {fix} and return_freed_blocks()
MiB = 1 << 20
def block(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)  # resident
    return p
libc.free(block(12 * MiB))  # a mapped block freed: glibc's dynamic threshold rises to 12 MiB
base = rss()
blocks = [block(6 * MiB) for _ in range(14)]  # a prefill's transients: from the heap once the threshold rose
top = block(2 * MiB)  # a tensor still live above them (no free heap chunk below is that large)
for p in blocks:
    libc.free(p)
print(set_, (rss() - base) // MiB)
"""


GLIBC = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")


# a decode step's blocks under the mmap threshold: freed at the top of the heap, kept there for the next step (up to
# KEPT_AT_TOP) instead of returned and faulted in again; n blocks of 3 MiB freed in reverse, what stays resident
TOP = PATTERN.split("libc.free(block(12")[0] + r"""
base = rss()
blocks = [block(3 * MiB) for _ in range({n})]
for p in reversed(blocks):
    libc.free(p)
print(set_, (rss() - base) // MiB)
"""


# blocks under the mmap threshold freed below a live one, in the main arena or in a thread's own arena: resident
# until FreedMemory gives them back (malloc_trim), once they pass its bound; 24 blocks of 2 MiB (48 MiB) freed, a
# 1 MiB block live above them
HOLES = PATTERN.split("libc.free(block(12")[0] + r"""
import threading
from flexh2o.storage.freed_memory import FreedMemory
def holes(out):
    blocks = [block(2 * MiB) for _ in range(24)]
    out.append(block(1 * MiB))  # live above them: none of their memory is at the heap's top
    for p in blocks:
        libc.free(p)
base = rss()
freed = FreedMemory({bound} * MiB)
live = []
if {thread}:
    t = threading.Thread(target=holes, args=(live,))
    t.start()
    t.join()
else:
    holes(live)
kept = (rss() - base) // MiB
gave = freed.check()
print(set_, kept, (rss() - base) // MiB, gave)
"""


def _run(fix: bool, env_extra=None, setup: str = "", pattern: str = PATTERN, **fields) -> tuple:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra or {})
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    code = pattern.format(root=root, fix=fix, setup=setup, **fields)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return (out[0] == "True", *(int(x) for x in out[1:3]), *(x == "True" for x in out[3:]))


@GLIBC
def test_freed_transients_leave_the_resident_memory_with_the_fixed_threshold():
    unset, kept = _run(False)[:2]
    assert not unset and kept >= 70  # glibc's default: the 84 MiB of freed transients stay resident
    was_set, left = _run(True)[:2]
    assert was_set and left <= 8  # unmapped when freed
    user = _run(True, {"MALLOC_TRIM_THRESHOLD_": "131072"})[0]
    assert not user  # the user's own glibc setting wins: nothing changed


@GLIBC
def test_freed_blocks_at_the_heap_top_are_kept_for_reuse_up_to_the_bound():
    unset, gone = _run(False, pattern=TOP, n=2)[:2]
    assert not unset and gone <= 1  # glibc's default maps 3 MiB blocks and unmaps them when freed
    was_set, kept = _run(True, pattern=TOP, n=2)[:2]
    assert was_set and kept >= 5  # 6 MiB freed at the top of the heap: kept for the next step's blocks
    over = _run(True, pattern=TOP, n=12)[1]
    assert over <= 3  # past KEPT_AT_TOP (32 MiB) free at the top it was returned: the last block freed stays


@GLIBC
def test_an_engine_fixes_the_threshold_for_its_process():
    setup = ("import torch, tempfile\nfrom flexh2o.config import ModelConfig\nfrom flexh2o.engine import Engine\n"
             "from flexh2o.placement import Percent\nfrom flexh2o.run_config import RunConfig\n"
             "cfg = ModelConfig('tiny', 'opt', hidden=64, num_layers=2, num_heads=4, ffn=128, vocab=100, "
             "max_positions=32)\n"
             "with Engine(RunConfig(model=cfg, percent=Percent.parse([100, 0, 100, 0]), gpu_batch_size=1, "
             "prompt_len=4, gen_len=1, dtype=torch.float32, offload_dir=tempfile.mkdtemp())):\n    pass")
    left = _run(False, setup=setup)[1]
    assert left <= 8  # the engine set it: the freed transients left


@GLIBC
@pytest.mark.parametrize("thread", [False, True], ids=["main arena", "a thread's arena"])
def test_freed_memory_below_a_live_block_is_given_back_past_the_bound(thread):
    was_set, kept, left, gave = _run(True, pattern=HOLES, thread=thread, bound=32)
    assert was_set and gave
    assert kept >= 40  # the 48 MiB freed below the live block stayed resident (2 MiB blocks: under the threshold)
    assert left <= 8  # past the 32 MiB bound: malloc_trim returned them; what stays is the live 1 MiB block
    _, kept, left, gave = _run(True, pattern=HOLES, thread=thread, bound=64)
    assert not gave and kept >= 40 and left >= 40  # 48 MiB is within a 64 MiB bound: kept for the next blocks


def test_freed_memory_is_checked_after_each_prefill_layer_and_once_a_decode_step():
    head = 5
    assert all(checked_after(0, layer, head) for layer in range(head + 1))
    assert [layer for layer in range(head + 1) if checked_after(3, layer, head)] == [head]
    stage = range(0, 3)  # a pipeline stage without the head: checked after its own last layer at a decode step
    assert [layer for layer in stage if checked_after(3, layer, stage[-1])] == [2]


def test_a_run_checks_its_freed_memory_where_the_rule_says(monkeypatch, tmp_path):
    """The run checks its heaps' free memory once per freed layer of the prefill and once per decode step (after
    the head): a tiny model of 2 decoder layers (4 layers with the embedding and the head), 3 generated tokens."""
    import torch
    from flexh2o.config import ModelConfig
    from flexh2o.engine import Engine
    from flexh2o.placement import Percent
    from flexh2o.run_config import RunConfig
    from flexh2o.storage.freed_memory import FreedMemory
    calls = []
    monkeypatch.setattr(FreedMemory, "check", lambda self: calls.append(1) or False)
    cfg = ModelConfig("tiny", "opt", hidden=64, num_layers=2, num_heads=4, ffn=128, vocab=100, max_positions=32)
    rc = RunConfig(model=cfg, percent=Percent.parse([100, 0, 100, 0]), gpu_batch_size=2, prompt_len=4, gen_len=3,
                   dtype=torch.float32, offload_dir=str(tmp_path))
    with Engine(rc) as eng:
        eng.generate([[1, 2, 3, 4], [5, 6, 7, 8]], 3)
    assert len(calls) == 4 + 2  # 4 layers freed at the prefill, then the head of each of the 2 decode steps
