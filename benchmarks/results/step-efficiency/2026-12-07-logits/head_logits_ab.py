"""An fp32 decode step's head (opt-125m's 50272 x 768 table, b rows) three ways, alternated in one process, the order
rotated each round: 'copied' = the head's fresh logits (models/common.head_linear: oneDNN on an AVX-512 CPU) copied
into a held (b, vocab) record (Sequences.emit before), 'kept' = the fresh logits kept as they came (Sequences.emit
after: no copy), 'into' = the head's chunks (F.linear) written into the held record (torch.cat out=: a reused output
buffer, no fresh mapping). Prints medians of each, its page faults a call, and the paired ratios to 'copied'.

    OMP_WAIT_POLICY=PASSIVE flock /tmp/flexh2o-timed.lock python head_logits_ab.py BATCH ROUNDS"""
import resource, statistics, sys, time
import torch
import torch.nn.functional as F
from flexh2o.models.common import head_linear, HEAD_CHUNK_BYTES
from flexh2o.storage.freed_memory import return_freed_blocks
return_freed_blocks()
b, vocab, h, rounds = int(sys.argv[1]), 50272, 768, int(sys.argv[2])
g = torch.Generator().manual_seed(0)
w, x = torch.randn(vocab, h, generator=g), torch.randn(b, 1, h, generator=g)
held = torch.empty(b, vocab)
rows = max(1, HEAD_CHUNK_BYTES // (h * 4))
def copied():
    held.copy_(head_linear(x, w)[:, 0])
def kept():
    return head_linear(x, w)[:, 0]
def into():
    torch.cat([F.linear(x[:, 0], part) for part in w.split(rows)], -1, out=held)
fns = {"copied": copied, "kept": kept, "into": into}
torch.testing.assert_close(head_linear(x, w)[:, 0], (into(), held)[1], rtol=1e-4, atol=1e-4)
res, flt = {n: [] for n in fns}, {n: [] for n in fns}
names = list(fns)
with torch.inference_mode():
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter(); out = fns[name](); res[name].append(time.perf_counter() - t0); del out
            flt[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
for n in names:
    pairs = [c / t for c, t in zip(res["copied"], res[n])]
    print(f"batch {b} {n}: median {statistics.median(res[n]) * 1e3:.2f} ms, faults {statistics.median(flt[n]):.0f} a call,"
          f" copied/{n} paired median {statistics.median(pairs):.2f}")
