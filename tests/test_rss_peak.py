"""metrics.RssPeak reports the kernel's high-water mark, so a transient between two samples counts (a run's peak
under a memory cap is what the cap sees, not what the step hook happened to sample)."""
import subprocess
import sys

import pytest


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB: Linux")
def test_a_transient_between_samples_is_in_the_peak():
    code = ("import torch\nfrom flexh2o.metrics import RssPeak\nr = RssPeak()\nbefore = r.peak\n"
            "x = torch.ones(256 << 20, dtype=torch.uint8); del x\n"  # 256 MiB resident, then freed, never sampled
            "r.sample()\nprint(r.sampled - before, r.peak - before)")
    sampled, peak = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            check=True).stdout.split())
    assert sampled < 32 << 20 and peak >= 200 << 20
