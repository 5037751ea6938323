"""The engine fixes glibc's mmap threshold (storage/freed_memory.py): large blocks freed below a live heap block
leave the process's resident memory instead of staying there. Each case runs in its own process: the setting is
the process's, and the pattern needs a fresh allocator."""
import os
import platform
import subprocess
import sys

import pytest

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


def _run(fix: bool, env_extra=None, setup: str = "", pattern: str = PATTERN, **fields) -> tuple:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra or {})
    root = os.path.abspath(os.path.join(__file__, "../../.."))
    code = pattern.format(root=root, fix=fix, setup=setup, **fields)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


@GLIBC
def test_freed_transients_leave_the_resident_memory_with_the_fixed_threshold():
    unset, kept = _run(False)
    assert not unset and kept >= 70  # glibc's default: the 84 MiB of freed transients stay resident
    was_set, left = _run(True)
    assert was_set and left <= 8  # unmapped when freed
    user, _ = _run(True, {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not user  # the user's own glibc setting wins: nothing changed


@GLIBC
def test_freed_blocks_at_the_heap_top_are_kept_for_reuse_up_to_the_bound():
    unset, gone = _run(False, pattern=TOP, n=2)
    assert not unset and gone <= 1  # glibc's default maps 3 MiB blocks and unmaps them when freed
    was_set, kept = _run(True, pattern=TOP, n=2)
    assert was_set and kept >= 5  # 6 MiB freed at the top of the heap: kept for the next step's blocks
    _, over = _run(True, pattern=TOP, n=12)
    assert over <= 3  # past KEPT_AT_TOP (32 MiB) free at the top it was returned: the last block freed stays


@GLIBC
def test_an_engine_fixes_the_threshold_for_its_process():
    setup = ("import torch, tempfile\nfrom flexh2o.config import ModelConfig\nfrom flexh2o.engine import Engine\n"
             "from flexh2o.placement import Percent\nfrom flexh2o.run_config import RunConfig\n"
             "cfg = ModelConfig('tiny', 'opt', hidden=64, num_layers=2, num_heads=4, ffn=128, vocab=100, "
             "max_positions=32)\n"
             "with Engine(RunConfig(model=cfg, percent=Percent.parse([100, 0, 100, 0]), gpu_batch_size=1, "
             "prompt_len=4, gen_len=1, dtype=torch.float32, offload_dir=tempfile.mkdtemp())):\n    pass")
    _, left = _run(False, setup=setup)
    assert left <= 8  # the engine set it: the freed transients left
