"""flexh2o-run's batch jobs over requests (flexh2o/requests.py): flags, loading, resume and the run itself.

A run is a request job when --prompt-file is .jsonl (a request per line, or the OpenAI batch format:
batch/openai_job.py), --prompt gives the prompts or --output-file is .jsonl. Such a job stops each row at the
model's EOS token(s) and its chat template's end-of-turn token (unless --ignore-eos), at its stop strings or at its
max_new_tokens, and appends one JSON line per finished request to --output-file as it finishes (--resume skips the
ids already there); --prompt without --output-file prints each answer's text to stdout. The older formats with
a .json or no output file keep FlexGen's fixed-length rows, so its benchmark commands keep their meaning.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from flexh2o.batch.openai_job import is_openai_batch, load_openai_batch
from flexh2o.cli.flags import add_flags, declare
from flexh2o.requests import Defaults, fit_positions, load_requests, request_from, requests_from_prompts


def request_flags() -> tuple:
    """The Flags of request jobs (--top-k, --prompt, --chat, --ignore-eos, --eos-id, --resume, --no-refill)."""
    flags: list = []
    a = declare(flags)
    a("--top-k", type=int, default=0, help="with --temperature > 0: sample from the k likeliest tokens (before "
      "--top-p); 0 = all")
    a("--prompt", action="append", default=None, metavar="TEXT", help="a prompt as text (repeatable): answered as "
      "a request job, each answer's text printed to stdout (with --output-file: its .jsonl result lines)")
    a("--chat", action="store_true", help="with --prompt: each prompt is one user turn rendered with the model's "
      "chat template (an instruct model's way of being asked)")
    a("--ignore-eos", action="store_true", help="request jobs (.jsonl): generate every row to its max_new_tokens "
      "(FlexGen's fixed length) instead of stopping at the model's EOS token")
    a("--eos-id", type=int, nargs="+", default=None, help="request jobs: the EOS token id(s) rows stop at "
      "(default: the model's config; with dummy weights its family's usual id)")
    a("--resume", action="store_true", help="request jobs: skip the ids already answered in the .jsonl "
      "--output-file (a torn last line left by a crash is dropped first)")
    a("--no-refill", action="store_true", help="request jobs: answer the requests in FlexGen's fixed batches of "
      "num_seqs (a batch ends once all its rows have finished) instead of refilling each finished row with the next "
      "request inside the block schedule")
    return tuple(flags)


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """request_flags() added to parser `p`."""
    add_flags(p, request_flags())


def is_request_job(args) -> bool:
    return bool(args.prompt) or any(str(getattr(args, f) or "").endswith(".jsonl")
                                    for f in ("prompt_file", "output_file"))


def reads_requests(args) -> bool:
    """The prompts come as requests (a .jsonl --prompt-file), each with its own settings; else every row takes the
    flags' (--temperature, --top-p, --gen-len)."""
    return bool(args.prompt) or str(args.prompt_file or "").endswith(".jsonl")


def defaults_of(args) -> Defaults:
    return Defaults(args.gen_len, args.temperature, args.top_p, args.seed, args.top_k)


def chat_template_of(args, tokenizer):
    """The model's ChatTemplate (chat.py): kept with its tokenizer (a .gguf, a Hugging Face folder) or its
    converted checkpoint; None when neither holds one."""
    from flexh2o.chat import ChatTemplate
    for source in (args.tokenizer, None if args.path == "_DUMMY_" else args.path):
        found = ChatTemplate.from_source(source, tokenizer)
        if found is not None:
            return found
    return None


def load_request_file(args, cfg, tokenizer) -> Optional[list]:
    """The requests of a .jsonl --prompt-file (None for other prompt files); --gen-len becomes the longest
    max_new_tokens so the plan counts it. Checks the job's flags first, so a refusal comes before anything runs."""
    check_job_flags(args)
    if not reads_requests(args):
        return None
    chat = chat_template_of(args, tokenizer)
    if args.prompt:
        reqs = prompt_requests(args.prompt, args.chat, defaults_of(args), cfg, tokenizer, chat)
    elif not os.path.isfile(args.prompt_file):
        raise ValueError(f"--prompt-file {args.prompt_file} does not exist")
    elif is_openai_batch(args.prompt_file):  # kept on args for run_request_job, which writes its output lines
        args.openai_batch = load_openai_batch(args.prompt_file, defaults_of(args), cfg.vocab, tokenizer,
                                              cfg.max_positions, chat, cfg.name)
        reqs = args.openai_batch.requests
    else:
        reqs = load_requests(args.prompt_file, defaults_of(args), cfg.vocab, tokenizer, cfg.max_positions, chat)
    args.gen_len = max((r.max_new_tokens for r in reqs), default=args.gen_len)
    return reqs


def prompt_requests(texts: list, as_chat: bool, defaults: Defaults, cfg, tokenizer, chat) -> list:
    """--prompt's texts as requests '0', '1', ... (--chat: each one user turn of the chat template)."""
    out = []
    for i, text in enumerate(texts):
        field = {"messages": [{"role": "user", "content": text}]} if as_chat else {"prompt": text}
        try:
            out.append(request_from({"id": str(i), **field}, defaults, cfg.vocab, tokenizer, cfg.max_positions,
                                    chat))
        except ValueError as e:
            raise ValueError(f"--prompt {i + 1}: {e}") from None
    fit_positions(out, cfg.max_positions, lambda r: f"--prompt {int(r.id) + 1}")
    return out


def check_job_flags(args) -> None:
    """The flags that only a request job takes (--resume, --no-refill, --ignore-eos, --eos-id; --ignore-eos wins
    over --eos-id) and the output file a job would overwrite or continue: refused with the reason and the fix."""
    out = args.output_file
    if args.prompt and args.prompt_file:
        raise ValueError("--prompt and --prompt-file both give the prompts: keep one")
    if args.prompt and out and not out.endswith(".jsonl"):
        raise ValueError(f"--output-file {out}: --prompt's answers are written as .jsonl result lines: name a "
                         ".jsonl file, or leave it out to see the texts on stdout")
    if args.chat and not args.prompt:
        raise ValueError("--chat renders --prompt's texts with the chat template: give --prompt TEXT (a .jsonl "
                         "--prompt-file takes `messages` lines instead)")
    if args.resume and not is_request_job(args):
        raise ValueError("--resume continues a request job: give a .jsonl --output-file")
    for flag, why in (("no_refill", "fixed-length runs already use FlexGen's fixed batches"),
                      ("ignore_eos", "fixed-length runs already generate --gen-len tokens whatever they sample"),
                      ("eos_id", "fixed-length runs generate --gen-len tokens whatever they sample")):
        if getattr(args, flag, None) and not is_request_job(args):
            raise ValueError(f"--{flag.replace('_', '-')} applies to request jobs: give a .jsonl --prompt-file or "
                             f"--output-file ({why})")
    if is_request_job(args) and (args.cut_gen_len is not None or args.debug_mode == "fewer_batch"):
        shortened = "--cut-gen-len" if args.cut_gen_len is not None else "--debug-mode fewer_batch"
        raise ValueError(f"{shortened} shortens FlexGen's fixed-length benchmark runs; a request job answers every "
                         "request in full: drop it (or lower max_new_tokens / --gen-len)")
    if args.resume and not out:
        raise ValueError("--resume needs the .jsonl --output-file of the run to continue")
    if (out and out.endswith(".jsonl") and not args.resume and os.path.exists(out)
            and os.path.getsize(out) > 0):
        raise ValueError(f"--output-file {out} already holds results: pass --resume to continue that job, or "
                         "move the file away to start over")


def stop_rule(args, cfg, tokenizer, chat=None):
    """EOS ids (the model's, its tokenizer's and the chat template's end-of-turn token) unless --ignore-eos or
    --eos-id says otherwise."""
    from flexh2o.batch.stopping import StopRule
    if args.ignore_eos:
        return StopRule(frozenset(), tokenizer)
    if args.eos_id is not None:
        bad = [i for i in args.eos_id if not 0 <= i < cfg.vocab]
        if bad:
            raise ValueError(f"--eos-id {bad[0]} is outside the vocabulary (0..{cfg.vocab - 1})")
        return StopRule(frozenset(args.eos_id), tokenizer)
    ids = {cfg.eos_token_id} | ({tokenizer.eos_id} if tokenizer is not None and tokenizer.eos_id is not None
                                else set()) | (chat.stop_token_ids(tokenizer) if chat is not None else set())
    return StopRule(frozenset(i for i in ids if i is not None), tokenizer)


def rounds_line(n: int, num_seqs: int, what: str = "requests") -> str:
    """FlexGen's fixed rounds: every round starts once all rows of the one before have finished."""
    return (f"{n} {what} run in {-(-n // num_seqs)} rounds of {num_seqs} sequences (--gpu-batch-size x "
            "--num-gpu-batches)")


def schedule_line(n: int, num_seqs: int, refill: bool) -> str:
    """How n requests share num_seqs rows: refilled rows (no rounds), or --no-refill's fixed rounds."""
    if not refill:
        return rounds_line(n, num_seqs)
    return (f"{n} requests run on {num_seqs} rows (--gpu-batch-size x --num-gpu-batches); a row that finishes "
            "takes the next request at once (--no-refill: fixed rounds)")


def run_request_job(args, rc, cfg, reqs: Optional[list], prompts: list, tokenizer, opts) -> int:
    """Answer the requests (or the older formats' prompts as requests '0', '1', ...) not yet in the output."""
    from flexh2o.batch.progress import Progress
    from flexh2o.batch.results import ResultWriter, done_ids
    from flexh2o.batch.run import run_requests
    from flexh2o.metrics import append_json_line
    from flexh2o.pipeline.group import launched_by_torchrun
    if launched_by_torchrun():
        raise ValueError("request jobs (.jsonl) run in one process: drop torchrun, or use the .json formats")
    rule = stop_rule(args, cfg, tokenizer, chat_template_of(args, tokenizer))
    reqs = reqs if reqs is not None else requests_from_prompts(prompts, defaults_of(args))
    batch = getattr(args, "openai_batch", None)  # an OpenAI batch file's lines (batch/openai_job.py)
    done = done_ids(args.output_file, "custom_id" if batch else "id") if args.resume else set()
    todo = batch.todo(done) if batch else [r for r in reqs if r.id not in done]
    writer = ResultWriter(args.output_file) if args.output_file else None
    on_result = _on_result(args, batch, done, writer)
    if not todo:
        if writer is not None:
            writer.close()
        if done:
            print(f"flexh2o-run: every request is already answered in {args.output_file}", file=sys.stderr)
        return 0
    if len(todo) > rc.num_seqs:  # a request job's own line: it counts the requests still to answer
        print(f"flexh2o-run: {schedule_line(len(todo), rc.num_seqs, refill=not args.no_refill)}", file=sys.stderr)
    with Progress(len(reqs), len(reqs) - len(todo), enabled=opts.verbose >= 1) as bar:
        try:
            stats = run_requests(rc, todo, rule, on_result, writer.sync if writer else None, bar,
                                 warmup=not args.no_warmup, refill=not args.no_refill)
        finally:
            if writer is not None:
                writer.close()
    if args.prompt and writer is None:  # each answer's text, in --prompt's order
        print("\n".join(r.text for r in sorted(stats.results, key=lambda r: int(r.id))), flush=True)
    if opts.verbose >= 1:
        print(stats.summary(), file=sys.stdout if writer else sys.stderr)
    if opts.log_file:
        from flexh2o.job import policy_flags
        append_json_line(opts.log_file, {"model": rc.model.name, "policy": policy_flags(rc),
                                         "requests": stats.requests, "generated_tokens": stats.generated_tokens,
                                         "seconds": stats.seconds, "useful_throughput": stats.tokens_per_s})
    return 0


def _on_result(args, batch, done: set, writer):
    """Where a finished request goes: the results file, stdout as a JSON line, or (--prompt alone) nowhere until its
    text is printed at the end; an OpenAI batch's lines gather their n choices first, its failed lines written now."""
    sink = writer.write if writer else None if args.prompt else _print_result
    if batch is None:
        return sink
    _write_failed(batch.failed_lines(done), sink or _print_result, writer)
    return batch.collector(sink or _print_result)


def _write_failed(records: list, sink, writer) -> None:
    """The OpenAI batch lines this model cannot answer, written first (each names its error), and said once."""
    for record in records:
        sink(record)
    if writer is not None:
        writer.sync()
    if records:
        print(f"flexh2o-run: {len(records)} line(s) failed; each has its error in the output "
              f"({records[0].line['error']['message']})", file=sys.stderr)


def _print_result(result) -> None:
    import json
    print(json.dumps(result.record(), ensure_ascii=False), flush=True)
