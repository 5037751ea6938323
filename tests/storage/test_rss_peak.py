"""metrics.RssPeak reports the kernel's high-water mark, so a transient between two samples counts (a run's peak
under a memory cap is what the cap sees, not what the step hook happened to sample), and only this process's: not
the peak of the process that started it."""
import subprocess
import sys

import pytest


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status: Linux")
def test_a_transient_between_samples_is_in_the_peak():
    code = ("import torch\nfrom flexh2o.metrics import RssPeak\nr = RssPeak()\nbefore = r.peak\n"
            "x = torch.ones(256 << 20, dtype=torch.uint8); del x\n"  # 256 MiB resident, then freed, never sampled
            "r.sample()\nprint(r.sampled - before, r.peak - before)")
    sampled, peak = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            check=True).stdout.split())
    assert sampled < 32 << 20 and peak >= 200 << 20


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status: Linux")
def test_the_peak_is_not_the_parents():
    big = bytearray(512 << 20)  # this process holds 512 MiB more than the child will
    big[::4096] = b"x" * len(big[::4096])
    code = "from flexh2o.metrics import RssPeak\nprint(RssPeak().peak)"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert child < 400 << 20  # python, psutil and flexh2o.metrics alone
    del big
