"""EngineArgs: every option of one flexh2o-run, declared once. Each field's metadata is its `Flag` (cli/flags.py):
flexh2o-run's (and flexh2o-serve's) options are generated from them (`run_flags`, `add_flags`), and the Python API
(api.py) fills an EngineArgs from keywords directly (`EngineArgs.from_options`), each value what its flag would
parse it to, so names, defaults, help texts and refusals are one. The groups shared with other scripts are declared
beside their code (kv_flags.py with each KV policy's Params, compress_flags.py with the fields of
kv/cache_quant.CacheQuant, request_job.py, flexgen_flags.py); this module declares the rest, in --help's order.
Imports no torch (--help and a flag's error stay quick)."""
from __future__ import annotations

from dataclasses import fields, make_dataclass

from flexh2o import paths
from flexh2o.cli.compress_flags import compression_flags
from flexh2o.cli.flags import declare
from flexh2o.cli.flexgen_flags import flexgen_flags, str2bool
from flexh2o.cli.help_text import model_help
from flexh2o.cli.kv_flags import kv_flags
from flexh2o.cli.request_job import request_flags


def _model_flags() -> tuple:
    """The model, the placement, the batch and lengths, the files, the dtypes, the device and the tier capacities."""
    flags: list = []
    a = declare(flags)
    a("--model", default=None, help=model_help("opt-125m", "or a local Hugging Face folder or .gguf file "
      "(converted once into ~/.cache/flexh2o/models; nothing is downloaded) or a converted checkpoint; not with "
      "--path"))
    a("--path", default="_DUMMY_", help="converted checkpoint dir (flexh2o-convert), a Hugging Face folder or .gguf "
      "file (converted once, as --model), or _DUMMY_ for seeded weights")
    a("--percent", nargs="+", default=["100", "0", "100", "0", "100", "0"],
      help="weights-gpu weights-cpu cache-gpu cache-cpu [act-gpu act-cpu], in %%; disk gets the rest of each pair")
    a("--gpu-batch-size", default=None, help="sequences per GPU batch, or 'auto' (largest that fits); default: "
      "the prompts of --prompt-file over --num-gpu-batches, else 4")
    a("--num-gpu-batches", type=int, default=1, help="GPU batches that share each weight load in the block schedule "
      "(FlexGen's); sequences in flight = --gpu-batch-size x this")
    a("--prompt-len", type=int, default=512, help="tokens per synthetic prompt (with --prompt-file: the longest "
      "prompt's length)")
    a("--gen-len", type=int, default=32, help="tokens generated per sequence")
    a("--prompt-file", help=".json list of token-id lists, or text (one prompt per line) with --tokenizer")
    a("--tokenizer", help="local tokenizer file or folder (never downloaded; default: the --model .gguf, or its "
                          "folder's tokenizer.json)")
    a("--output-file", help="write generated tokens (and text) as JSON")
    a("--log-file", help="append one JSON record of this run")
    a("--dtype", default="auto", help="storage dtype of weights and cache, or auto (a checkpoint's own dtype, "
      "never narrower unasked; seeded weights: the compute dtype when all is in memory and fits, else 16 bits; see "
      "flexh2o/planning/dtype_choice.py)")
    a("--compute-dtype", default="auto", help="auto: on CUDA the storage dtype where fast, on CPU the fastest in a "
      "cached probe of this machine")
    a("--device", default=None, help="cuda or cpu (default: cuda when present)")
    a("--overlap", type=str2bool, nargs="?", const=True, default=True, help="overlap I/O with compute (true/false)")
    a("--cpu-cache-compute", action="store_true", help="decode attention next to a cpu-tier cache")
    a("--gpu-mem", help="gpu tier capacity (e.g. 16GB); default: detected")
    a("--cpu-mem", help="cpu tier capacity; default: detected")
    a("--disk-mem", help="disk tier capacity; default: free space of --offload-dir")
    a("--offload-dir", default=paths.offload_dir(), help="where the disk tier's files go (in a per-run directory, "
      "removed at exit; $FLEXH2O_OFFLOAD_DIR where set, else ~/flexh2o_offload)")
    return tuple(flags)


def _sampling_flags() -> tuple:
    """The H2O port's --hh-all, sampling and seed, the placement search and the hardware profile."""
    flags: list = []
    a = declare(flags)
    a("--hh-all", type=str2bool, nargs="?", const=True, default=None, help="the H2O port's eviction at every "
      "decode step: what flexh2o's h2o always does (false is refused)")
    a("--temperature", type=float, default=0.0, help="0 = greedy")
    a("--top-p", type=float, default=1.0, help="with --temperature > 0: sample from the smallest set of tokens whose "
      "probability reaches this, in (0, 1]; 1 = all")
    a("--seed", type=int, default=0, help="seed of the dummy weights, synthetic prompts, sampling and the random "
      "policy")
    a("--policy", choices=["given", "auto"], default="given",
      help="given: the placement and batch of the flags; auto: search --percent and batch sizes for the best "
      "predicted throughput (cost model)")
    a("--max-seqs", type=int, help="--policy auto: run at most this many sequences at once (gpu batch x GPU "
      "batches; default: the prompts of --prompt-file, else no limit)")
    a("--hardware", default="auto", help="hardware profile for predictions, --dry-run and --policy auto: auto (this "
      "machine's, cached; measured once, under a minute, the first time --dry-run or --policy auto needs it), a "
      "shipped name (t4_paper, a100_80gb) or a flexh2o-profile JSON file")
    return tuple(flags)


def _job_flags() -> tuple:
    """--dry-run and --no-warmup."""
    flags: list = []
    a = declare(flags)
    a("--dry-run", action="store_true", help="print the memory plan (and predicted figures) and exit")
    a("--no-warmup", action="store_true", help="skip the untimed warm-up run (timings then include one-time costs)")
    return tuple(flags)


def _stage_flags() -> tuple:
    """Pipeline stages under torchrun."""
    flags: list = []
    a = declare(flags)
    a("--stage-layers", help="under torchrun: decoder layers per stage, one count per rank (e.g. 12,12); default: "
      "split by weight bytes")
    a("--stage-timeout", type=float, default=300.0, help="under torchrun: seconds a stage waits for a peer before "
      "the job stops")
    return tuple(flags)


def run_flags() -> tuple:
    """Every Flag of flexh2o-run, in --help's order."""
    return (_model_flags() + kv_flags() + _sampling_flags() + compression_flags() + _job_flags() + request_flags()
            + flexgen_flags() + _stage_flags())


class _Methods:
    """What EngineArgs does beside holding the options."""

    @classmethod
    def flags(cls) -> tuple:
        """Every option's Flag, in --help's order."""
        return tuple(f.metadata["flag"] for f in fields(cls))

    @classmethod
    def from_options(cls, options: dict, not_options: tuple = ()):
        """The options given as keywords (flexh2o-run's flags' names: gen_len=8, percent=(0, 100, 100, 0)), each
        what its flag parses the value to, the rest their defaults. ValueError naming an unknown keyword (or one
        of `not_options`, the options a caller does not take)."""
        flags = {f.dest: f for f in run_flags() if f.dest not in not_options}
        for key in options:
            if key not in flags:
                raise ValueError(f"unknown option {key!r}: LLM takes flexh2o-run's flags as keywords "
                                 f"({', '.join(sorted(flags))})")
        names = {f.name for f in fields(cls)}
        extra = {f.dest: f.default for f in flags.values() if f.dest not in names}  # parameters of later policies
        return cls._made({**extra, **{key: flags[key].value(value) for key, value in options.items()}})

    @classmethod
    def from_namespace(cls, ns):
        """The options argparse parsed (a parser made from run_flags, perhaps with more of its own)."""
        live = {f.dest for f in run_flags()}
        return cls._made({k: v for k, v in vars(ns).items() if k in live})

    @classmethod
    def _made(cls, values: dict):
        """An EngineArgs of `values`; a KV policy registered after this class was made (its Params are flags from
        then on: kv_flags reads the registry) keeps its parameters as attributes beside the fields."""
        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in values.items() if k in names})
        for k, v in values.items():
            if k not in names:
                setattr(args, k, v)
        return args


EngineArgs = make_dataclass("EngineArgs", [(f.dest, object, f.field()) for f in run_flags()], bases=(_Methods,),
                            namespace={"__module__": __name__})
EngineArgs.__doc__ = ("Every option of one flexh2o-run (the attribute of each flag: gen_len, kv_policy, ...), as its "
                      "flag parses it. Made by the CLI from its parsed flags and by the API from keywords.")
