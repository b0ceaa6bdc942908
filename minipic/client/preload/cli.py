"""`minipic-preload CORPUS`: prefill a corpus's spans so later prompts hit them.

Against a running server started with minipic on: each document goes to the
server as text (POST /v1/minipic/preload), which cuts it into spans with its own
tokenizer, block size and markers, prefills them and answers with their token
ids for the manifest; no tokenizer is loaded here, and a server without minipic
is refused:

    minipic-preload corpus/ --url http://localhost:8000

(--trust-server, for vLLM 0.25.1 servers without minipic's routes, cuts spans
here with --tokenizer and sends token ids to /v1/completions; start that server
with --enable-prompt-tokens-details, so that hits are visible.)

In process, into a MiniPICConnector span store that servers then read:

    minipic-preload corpus/ --model meta-llama/Llama-3.1-8B-Instruct \\
        --connector-config '{"store_dir": "/data/spans"}'

Re-running is cheap: a span already stored costs one token (or, with
--trust-manifest, no request at all). The manifest (--manifest) lists every
document's spans for the RAG client; a run over part of a corpus adds to it,
and one written for other settings (model, block size, span size, markers) is
never overwritten. Exit status: 0 when every document was read, every span
prefilled and the manifest written, 1 when anything was skipped or failed
(listed on stderr), 2 when it could not run (bad arguments, no engine or
server, no document, a manifest that cannot be written or replaced).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from minipic.client.prompts.document_spans import DEFAULT_SPAN_TOKENS
from minipic.client.preload.manifest import FAILED, NEW, PENDING, PREFILLED, STORED
from minipic.client.preload.pipeline import PreloadReport, preload
from minipic import __version__
from minipic.config import connector_config
from minipic.help_format import DefaultsHelpFormatter
from minipic.protocol import SpanProtocol

EXIT_OK, EXIT_PROBLEMS, EXIT_CANNOT_RUN = 0, 1, 2
MAX_LISTED = 20  # problems printed one per line; the rest are counted


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minipic-preload", description="Prefill a corpus's spans into a minipic engine.",
        formatter_class=DefaultsHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("corpus", help="directory (or file) of .txt, .md, .jsonl, .parquet documents")
    engine = p.add_argument_group("engine")
    engine.add_argument("--url", help="a running vLLM server (OpenAI-compatible)")
    engine.add_argument("--model", help="with --url: the served model name (default: the "
                        "server's first); without: the model to load in-process")
    engine.add_argument("--block-size", type=int, help="the engine's KV block size (with --url: "
                        "read from the server; given, it must agree)")
    engine.add_argument("--tokenizer", help="with --url --trust-server: tokenizer to load "
                        "(default: the model); otherwise the server tokenizes")
    engine.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="with --url: the server's API key (default: $OPENAI_API_KEY)")
    engine.add_argument("--span-protocol", type=_json_arg, help="with --url: marker ids as "
                        "JSON (read from the server; given, they must agree)")
    engine.add_argument("--trust-server", action="store_true", help="with --url: do not ask "
                        "the server for its minipic settings (vLLM 0.25.1 servers have no such "
                        "route): cut spans here with --tokenizer and send token ids; needs "
                        "--block-size")
    engine.add_argument("--connector-config", type=_json_arg,
                        help="in-process: MiniPICConnector's extra config, JSON or a JSON file, "
                        "e.g. '{\"store_dir\": \"/data/spans\"}'")
    engine.add_argument("--engine-args", type=_json_arg, default={},
                        help="in-process: more vLLM engine arguments, JSON or a JSON file")
    layout = p.add_argument_group("documents")
    layout.add_argument("--span-tokens", type=int, default=DEFAULT_SPAN_TOKENS,
                        help="longest span, in tokens (rounded down to whole blocks)")
    layout.add_argument("--text-field", default="text", help="text field (.jsonl) or column "
                        "(.parquet)")
    layout.add_argument("--id-field", help="id field/column (default: the record number)")
    run = p.add_argument_group("run")
    run.add_argument("--concurrency", type=int, default=32, help="span prefills in flight "
                     "(with --url: documents in flight, each prefilled whole by the server)")
    run.add_argument("--manifest", default="minipic-manifest.parquet", help="manifest to write")
    run.add_argument("--trust-manifest", action="store_true",
                     help="skip spans the existing manifest lists as stored, without asking "
                     "the engine (wrong if the engine lost them since)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _json_arg(value: str) -> Any:
    """Inline JSON, or the path of a JSON file."""
    try:
        text = value if value.lstrip().startswith("{") else Path(value).read_text()
        return json.loads(text)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"neither JSON nor a readable file: {e}") from None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.url:
        if args.trust_server and args.block_size is None:
            parser.error("--trust-server needs --block-size: the server's KV block size (its "
                         "--block-size; 16 by default on GPU)")
        if args.connector_config is not None or args.engine_args:
            parser.error("--connector-config and --engine-args are for in-process runs, "
                         "not --url")
    else:
        if not args.model:
            parser.error("give --url (a running server) or --model (load it in-process)")
        if not isinstance(args.connector_config, dict) or "store_dir" not in args.connector_config:
            parser.error("in-process runs need --connector-config with a store_dir: without "
                         "a span store the spans would vanish when this process exits")
        if args.block_size is not None and args.block_size != args.engine_args.get(
                "block_size", args.block_size):
            parser.error("--block-size and --engine-args block_size disagree")


async def _backend(args: argparse.Namespace) -> Any:
    if args.url:
        from minipic.client.backends.openai_server import OpenAIServerBackend

        protocol = SpanProtocol.from_dict(args.span_protocol) if args.span_protocol else None
        return await OpenAIServerBackend.connect(
            args.url, model=args.model, api_key=args.api_key, block_size=args.block_size,
            tokenizer=args.tokenizer, protocol=protocol, trust_server=args.trust_server)
    from minipic.client.backends.in_process import AsyncLLMBackend

    engine_args = dict(args.engine_args)
    if args.block_size is not None:
        engine_args["block_size"] = args.block_size
    engine_args["kv_transfer_config"] = connector_config(args.connector_config)
    return AsyncLLMBackend.start(model=args.model, **engine_args)


async def _run(args: argparse.Namespace) -> PreloadReport:
    backend = await _backend(args)
    try:
        return await preload(
            args.corpus, backend, manifest_path=args.manifest, span_tokens=args.span_tokens,
            concurrency=args.concurrency, text_field=args.text_field, id_field=args.id_field,
            trust_manifest=args.trust_manifest, progress=not args.no_progress)
    finally:
        if not args.url:  # this process owns the engine: let the store take every block first
            await _let_store_settle(args.connector_config["store_dir"])
        await backend.close()


async def _let_store_settle(store_dir: str) -> None:
    from minipic.connector.store.settle import wait_until_settled

    print(f"waiting for the engine to finish writing {store_dir} ...", file=sys.stderr)
    if not await asyncio.to_thread(wait_until_settled, store_dir):
        print("the store was still growing after 300 s (other replicas writing?); stopping "
              "anyway: blocks not yet written will be recomputed when used", file=sys.stderr)


def format_summary(report: PreloadReport) -> str:
    stored = report.count(STORED)
    lines = [
        f"documents  {report.documents} read, {len(report.problems)} skipped for problems, "
        f"{len(report.ignored_files)} other files ignored",
        f"spans      {report.spans} ({report.tokens:,} tokens): {report.count(NEW)} new, "
        f"{stored} already stored"
        + (f" ({report.trusted_from_manifest} per manifest)" if report.trusted_from_manifest
           else "")
        + (f", {report.count(PREFILLED)} prefilled (hits not reported by the server)"
           if report.count(PREFILLED) else "")
        + f", {report.count(FAILED)} failed"
        + (f", {report.count(PENDING)} not run" if report.count(PENDING) else ""),
        f"time       {report.seconds:.1f} s"
        + (f" ({report.tokens / report.seconds:,.0f} tokens/s)" if report.seconds > 0 else ""),
    ]
    if report.manifest_error:
        lines.append(f"manifest   NOT written to {report.manifest_path} ({report.manifest_error}); "
                     "a re-run finds the stored spans and writes it")
    elif report.manifest_path:
        lines.append(f"manifest   {report.manifest_path}")
    return "\n".join(lines)


def format_problems(report: PreloadReport) -> str:
    problems = report.problems + report.failed_spans
    lines = [f"  {p}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more (see the manifest's "
                     "status and error columns for failed spans)")
    return "\n".join(["problems:"] + lines) if lines else ""


def _setup_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "could not run" (span failures are reported, not raised)."""
    import openai

    return (ValueError, OSError, RuntimeError, openai.OpenAIError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        report = asyncio.run(_run(args))
    except KeyboardInterrupt:
        print("minipic-preload: interrupted; the manifest lists what was stored",
              file=sys.stderr)
        return EXIT_PROBLEMS
    except _setup_errors() as e:
        print(f"minipic-preload: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    print(format_summary(report))
    if problems := format_problems(report):
        print(problems, file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
