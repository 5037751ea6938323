"""flexh2o (full and h2o) against its peers, alternating runs (A B C D A B C D ...), medians and ratios.

Every system runs as its own process with the same model (seeded dummy weights; flexh2o at --dtype/--compute-dtype,
default auto, the peers at --peer-dtype, default the dtype fastest here stored and computed alike), prompts,
lengths and the
same memory caps: flexh2o with --gpu-mem/--cpu-mem (each policy at the largest batch that fits, as in the paper),
transformers + Accelerate with max_memory={"cpu": --cpu-mem} and an offload folder (what does not fit goes to
"disk"), plain transformers all in memory (no cap: a reference); the peers run flexh2o full's batch unless
--peer-batch says otherwise (see benchmarks/RESULTS.md). The machine is shared, so the systems alternate within each
round and the table shows medians; every record carries the load average before and after its run.

    # disk-streamed weights (default): flexh2o reads every weight from disk each step (direct I/O);
    # Accelerate gets max_memory cpu 64MB, so its whole model maps to "disk" (safetensors, read through mmap)
    python benchmarks/compare.py --repeats 3
    # memory-resident weights: flexh2o's weights in its cpu tier, Accelerate's max_memory holds them all
    python benchmarks/compare.py --percent "0 100 100 0 100 0" --cpu-mem 1GB --repeats 3
    # the same disk-streamed caps, and every process under a hard 1.25 GiB memory cgroup (page cache included), so
    # that Accelerate's memory-mapped "disk" weights cannot stay cached between steps (needs root; see memcap.py)
    python benchmarks/compare.py --repeats 3 --mem-cap 1.25GB

The peers' checkpoint (flexh2o's dummy weights, converted) is written once per invocation, outside any cap, and
its page cache is dropped before every peer run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench_common import (add_dtype_args, add_h2o_args, bench_env, disk_read_probe, dry_run_batches, flag_args, gbs,
                          h2o_flags,
                          hardware_args, load_avg, median, mib, run_flexh2o, run_peer, table)
from bench_common import regime as placement_regime  # noqa: E402 (the name `regime` is the fair check's below)
from memcap import MemCap, drop_cached

from flexh2o.units import parse_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("accelerate", "transformers")
SYSTEMS = ("full", "h2o", "h2o-q4", "accelerate", "transformers")  # h2o-q4: h2o + 4-bit weights and cache


def prepare_checkpoint(args, env: dict, workdir: str) -> str:
    """The peers' checkpoint, written once (uncapped) by hf_accelerate.py --prepare."""
    ckpt = os.path.join(workdir, "ckpt")
    script = os.path.join(HERE, "baselines", "hf_accelerate.py")
    p = subprocess.run([sys.executable, script, "--prepare", "--checkpoint", ckpt, "--model", args.model, "--dtype",
                        args.peer_dtype], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"writing the peers' checkpoint failed: {p.stderr.strip().splitlines()[-1:]}")
    return ckpt


def commands(args, batches: dict, ckpt: str) -> dict:
    """system -> (runner, argv)."""
    base = {"model": args.model, "path": "_DUMMY_", "percent": args.percent, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "dtype": args.dtype, "compute_dtype": args.compute_dtype, "gpu_mem": args.gpu_mem,
            "cpu_mem": args.cpu_mem, "cpu_cache_compute": args.cpu_cache_compute, "num_gpu_batches": 1}
    peer_batch = args.peer_batch or batches["full"]
    peer = ["--model", args.model, "--batch-size", str(peer_batch), "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len), "--dtype", args.peer_dtype, "--cpu-mem", args.cpu_mem, "--gpu-mem",
            args.gpu_mem, "--checkpoint", ckpt, "--offload-dir", os.path.dirname(ckpt)]  # removed at the end
    hw = hardware_args(args.hardware)
    return {
        "full": (run_flexh2o, flag_args({**base, "kv_policy": "full", "gpu_batch_size": batches["full"]}) + hw),
        "h2o": (run_flexh2o, flag_args({**base, **h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len,
                                                             args.gen_len), "gpu_batch_size": batches["h2o"]}) + hw),
        "h2o-q4": (run_flexh2o, flag_args({**base, **h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len,
                                                                args.gen_len), "gpu_batch_size": batches["h2o"],
                                           "compress_weight": True, "compress_cache": True}) + hw),
        "accelerate": (run_peer, ["--mode", "accelerate"] + peer),
        "transformers": (run_peer, ["--mode", "plain"] + peer),
    }


def summarize(system: str, recs: list, failures: list) -> dict:
    row = {"system": system, "runs": f"{len(recs)}/{len(recs) + len(failures)}"}
    if not recs:
        row["note"] = failures[-1] if failures else ""
        return row
    tps = [r["total_throughput"] for r in recs]
    row.update(batch=recs[0]["num_seqs"], total=median(tps), spread=f"{min(tps):.1f}-{max(tps):.1f}",
               prefill=f"{median([r['prefill_s'] for r in recs]):.2f}",
               decode=f"{median([r['decode_s'] for r in recs]):.2f}",
               dec_tp=f"{median([r['decode_throughput'] for r in recs]):.1f}",
               rss=mib(max(r["peak_bytes"]["cpu_rss"] for r in recs)),
               gpu=mib(max(r["peak_bytes"]["gpu"] or 0 for r in recs)),
               disk=mib(max(r["peak_bytes"]["disk"] or 0 for r in recs)),
               note=failures[-1] if failures else "")
    caps = [r["mem_cap"] for r in recs if r.get("mem_cap")]
    if caps:
        row["cg_peak"] = mib(max(c["peak_charged"] or 0 for c in caps))
        row["cg_hits"] = str(max(c["times_at_limit"] or 0 for c in caps))
    ratios = [r["decode_ratio_measured_to_predicted"] for r in recs if r.get("decode_ratio_measured_to_predicted")]
    if ratios:
        row["vs_bound"] = f"{median(ratios):.2f}"
        row["pred_dec"] = f"{median([r['predicted']['decode_throughput'] for r in recs]):.1f}"
        row["bottleneck"] = "/".join(sorted({(r["predicted"].get("bottleneck") or {}).get("decode", "?")
                                             for r in recs}))
    place = recs[0]["policy"].get("placement") or {}
    if place.get("devices_used"):
        row["where"] = "+".join(place["devices_used"]) + (
            f" ({mib(place.get('weight_bytes_on_disk'))} MiB on disk)" if "disk" in place["devices_used"] else "")
    elif recs[0]["policy"].get("percent"):
        row["where"] = f"--percent {recs[0]['policy']['percent']}"
    else:
        row["where"] = (place.get("device_map") or "")
    return row


COLUMNS = (("system", "system"), ("weights", "where"), ("runs ok", "runs"), ("batch", "batch"),
           ("median total tok/s", lambda r: f"{r['total']:.1f}" if "total" in r else "-"), ("min-max", "spread"),
           ("prefill s", "prefill"), ("decode s", "decode"), ("decode tok/s", "dec_tp"),
           ("model decode tok/s", "pred_dec"), ("decode / model", "vs_bound"), ("model bottleneck", "bottleneck"),
           ("peak gpu MiB", "gpu"),
           ("peak rss MiB", "rss"), ("peak disk MiB", "disk"), ("cgroup peak MiB", "cg_peak"),
           ("times at cap", "cg_hits"), ("note", "note"))


def ratio_lines(rows: dict, paired: dict) -> list:
    pairs = [("full", "accelerate"), ("full", "transformers"), ("h2o", "full"), ("h2o", "accelerate"),
             ("h2o-q4", "accelerate")]
    out = []
    for a, b in pairs:
        if "total" in rows.get(a, {}) and "total" in rows.get(b, {}):
            per_round = [x / y for x, y in zip(paired[a], paired[b]) if x and y]
            out.append(f"{a} / {b}: {rows[a]['total'] / rows[b]['total']:.2f}x (ratio of medians; per round "
                       f"{', '.join(f'{r:.2f}' for r in per_round)}; median of per-round "
                       f"{median(per_round):.2f}x)")
    return out


def regime(args, systems: list, mem_cap: int) -> list:  # noqa: F811
    """fair.check_regime for each system's storage dtype (flexh2o's auto: bfloat16, the least it stores)."""
    from fair import check_regime
    two = {"auto": "bfloat16"}
    return check_regime(args.model, {s: "int4" if s == "h2o-q4" else two.get(args.peer_dtype if s in PEERS else
                                                                                args.dtype, args.peer_dtype if s in
                                                                                PEERS else args.dtype)
                                     for s in systems}, mem_cap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="flexh2o full/h2o vs transformers(+Accelerate), alternating runs.")
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--percent", default="0 0 100 0 100 0", help="default: weights on disk, cache in the gpu tier")
    ap.add_argument("--cpu-cache-compute", action="store_true")
    ap.add_argument("--gpu-mem", default="512MB")
    ap.add_argument("--cpu-mem", default="64MB", help="flexh2o's cpu tier and Accelerate's max_memory['cpu']")
    add_h2o_args(ap)
    add_dtype_args(ap)
    ap.add_argument("--batch", type=int, help="flexh2o's batch (default: each policy's largest that fits)")
    ap.add_argument("--peer-batch", type=int, help="batch of the peers (default: flexh2o full's largest batch)")
    ap.add_argument("--systems", help=f"comma-separated, of {','.join(SYSTEMS)} (default: all; with --mem-cap all "
                    "but transformers, which needs the whole model in memory)")
    ap.add_argument("--mem-cap", help="run every process in a memory cgroup of this size (its memory and page "
                    "cache), e.g. 1.25GB; needs root")
    ap.add_argument("--fair", action="store_true", help="with --mem-cap: every system at its best configuration "
                    "under the cap (fair.py: flexh2o's own search inside the cap, Accelerate's largest completing "
                    "batch)")
    ap.add_argument("--fair-overhead", default="measure", help="process memory outside flexh2o's tiers (--fair). "
                    "Default: measured per system on the plan that runs (a batch-1 probe, then the "
                    "searched plan run for 2 tokens; fair_overhead.py). BYTES: a fixed figure for every plan that "
                    "bypasses the measurement (no probe, no margin)")
    ap.add_argument("--fair-max-batch", type=int, default=256, help="most sequences at once (--fair): the largest "
                    "Accelerate batch tried and flexh2o's search limit (--max-seqs)")
    ap.add_argument("--fair-peer-batches", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="Accelerate's batches tried (--fair), e.g. 16,32,64,128: in increasing order up to the first "
                    "that does not complete, instead of doubling from 1 and bisecting (fair.largest_completing)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every process (default: torch's choice)")
    ap.add_argument("--hardware", help="hardware profile for flexh2o-run's predictions (default: flexh2o-run's)")
    ap.add_argument("--log-file", default=os.path.join(HERE, "results", "peers", "compare.jsonl"))
    args = ap.parse_args(argv)
    env = bench_env(args.threads)
    systems = (args.systems or ",".join(s for s in SYSTEMS if s != "h2o-q4" and not (args.mem_cap and
                                                                                      s == "transformers"))).split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        print(f"compare.py: error: unknown system {bad[0]!r} in --systems; choose from {', '.join(SYSTEMS)}",
              file=sys.stderr)
        return 2
    try:
        mem_cap = parse_bytes(args.mem_cap) if args.mem_cap else None
        if args.fair and not mem_cap:
            raise ValueError("--fair needs --mem-cap (the cap every system is sized to)")
        if args.fair:
            regime(args, systems, mem_cap)  # refused before the dry runs (peers' auto dtype: 2 bytes at the least)
        if mem_cap:
            MemCap(mem_cap, "probe").close()  # fails early, with what to do, where cgroups are not writable
    except (ValueError, RuntimeError) as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        return 2
    base = {"model": args.model, "percent": args.percent, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "dtype": args.dtype, "compute_dtype": args.compute_dtype, "gpu_mem": args.gpu_mem, "cpu_mem": args.cpu_mem,
            "gpu_batch_size": 1, "cpu_cache_compute": args.cpu_cache_compute,
            **h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len, args.gen_len)}
    batches = dry_run_batches(flag_args(base), env)
    if args.batch:
        batches = {k: min(v, args.batch) for k, v in batches.items()}
    if min(batches.values()) < 1:
        sys.exit(f"compare.py: not even batch 1 fits these caps ({batches}): raise --gpu-mem/--cpu-mem")
    if args.peer_dtype == "auto":  # resolved once, so the peers' checkpoint and runs agree
        from flexh2o.planning.dtype_choice import fastest_uniform
        args.peer_dtype = fastest_uniform(args.peer_batch or batches["full"], args.prompt_len, args.gen_len)
    if args.fair:
        args.regime = regime(args, systems, mem_cap)
    os.makedirs(os.path.dirname(os.path.abspath(args.log_file)), exist_ok=True)
    offload = os.path.join(os.path.expanduser("~"), "flexh2o_offload")
    os.makedirs(offload, exist_ok=True)
    return in_checkpoint_dir(offload, lambda workdir: _compare(args, env, systems, batches, mem_cap, workdir))


def in_checkpoint_dir(offload: str, body) -> int:
    """body(workdir) in a fresh folder under `offload`, removed however it ends. SIGTERM and SIGHUP unwind it like
    Ctrl-C (flexh2o's console.stop_signals_as_interrupts: the folder removed, the flexh2o-run it waits on killed by
    subprocess.run, a second signal ignored meanwhile) and give exit status 128 + the signal."""
    from flexh2o.cli.console import Terminated, stop_signals_as_interrupts
    try:
        with stop_signals_as_interrupts():
            workdir = tempfile.mkdtemp(prefix="hf-ckpt-", dir=offload)
            try:
                return body(workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    except Terminated as e:
        print(f"compare.py: stopped ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum


def _compare(args, env: dict, systems: list, batches: dict, mem_cap, workdir: str) -> int:
    peers = [s for s in systems if s in PEERS]
    ckpt = prepare_checkpoint(args, env, workdir) if peers else os.path.join(workdir, "ckpt")
    cmds = commands(args, batches, ckpt)
    if args.fair:
        from fair import fair_commands
        cmds = fair_commands(args, env, mem_cap, {s: cmds[s] for s in systems}, ckpt,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
        systems = [s for s in systems if s in cmds]  # a system with no plan inside the cap was left out (logged)
    run_id, started, load0 = time.strftime("%Y%m%d-%H%M%S"), time.perf_counter(), load_avg()
    recs, failures = {s: [] for s in systems}, {s: [] for s in systems}
    paired = {s: [] for s in systems}
    probes = []
    for rep in range(args.repeats):
        probes.append(disk_read_probe(env))
        for system in systems:
            runner, argv_ = cmds[system]
            print(f"[round {rep + 1}/{args.repeats}] {system}: {' '.join(argv_)}", file=sys.stderr, flush=True)
            before = load_avg()
            if system in peers:
                drop_cached(ckpt)
            out = runner(argv_, args.timeout, env, mem_cap)
            paired[system].append(out.record["total_throughput"] if out.record else None)
            meta = {"run_id": run_id, "system": system, "round": rep, "argv": out.argv, "loadavg_before": before,
                    "loadavg_after": load_avg(), "disk_read_bw_probe": probes[-1], "mem_cap": mem_cap,
                    "timeout_s": args.timeout, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
            if out.status != "ok":  # recorded too, so that tables show what did not finish and why
                failures[system].append(f"{out.status}: {out.message}")
                record = {"model": args.model, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                          "status": out.status, "message": out.message, "compare": meta}
            else:
                record = out.record
                record["compare"] = meta
                recs[system].append(record)
            with open(args.log_file, "a") as f:
                f.write(json.dumps(record) + "\n")
    rows = {s: summarize(s, recs[s], failures[s]) for s in systems}
    h2o = " ".join(flag_args(h2o_flags(args.hh_ratio, args.budget_pct, args.prompt_len, args.gen_len))[2:])
    print(f"\n{args.model}  prompt {args.prompt_len} + gen {args.gen_len}  --percent {args.percent}"
          f"{'  --cpu-cache-compute' if args.cpu_cache_compute else ''}  --gpu-mem {args.gpu_mem}  --cpu-mem "
          f"{args.cpu_mem}{'  --mem-cap ' + args.mem_cap if mem_cap else ''}  flexh2o dtype "
          f"{args.dtype}/{args.compute_dtype}  peers "
          f"{args.peer_dtype}  h2o {h2o}  {args.repeats} "
          f"rounds  threads "
          f"{env.get('OMP_NUM_THREADS', 'default')}  OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}  run {run_id}  "
          f"[{placement_regime({'policy': {'percent': args.percent}})}]")
    print(f"largest batch that fits: {batches}")
    for s, d, b, x in getattr(args, "regime", []):
        print(f"regime: {s} weights at {d} {b / 2**30:.2f} GiB = {x:.2f}x the cap"
              + (" (flexh2o --dtype auto: the 2-byte storage it picks at the least)" if d == "bfloat16" and
                 args.dtype == "auto" and s not in PEERS else ""))
    print(table([rows[s] for s in systems], COLUMNS))
    print("\n".join(ratio_lines(rows, paired)))
    print(f"disk tier read rate before each round (direct I/O): {', '.join(gbs(p) for p in probes)}")
    print(f"({time.perf_counter() - started:.0f} s; load average {load0} at start, {load_avg()} at end; records "
          f"appended to {args.log_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
