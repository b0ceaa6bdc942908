"""`minipic` command line: inspect and maintain span stores.

    minipic store stats DIR [--json]        spans, blocks, bytes, hits per namespace
    minipic store verify DIR [--remove]     check every block file as an engine's load does
    minipic store evict DIR --max-bytes N   remove least recently used blocks down to N
                                            (bytes, or with a unit: 8GiB, 512MiB)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence


def _human(n: float) -> str:
    from minipic.sizes import format_size

    return format_size(n)


def _stats(args: argparse.Namespace) -> int:
    from minipic.connector.store.stats import NotAStore, scan_store

    try:
        namespaces = scan_store(args.dir)
    except NotAStore as e:
        print(f"minipic: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dataclasses.asdict(ns) for ns in namespaces], indent=2, default=str))
        return 0
    print(f"store {args.dir}: {len(namespaces)} namespace(s)")
    for ns in namespaces:
        fields = ns.fields or {}
        c = ns.counters
        print(f"\n{ns.path}")
        print(f"  model      {fields.get('model', '?')}  dtype {fields.get('dtype', '?')}  "
              f"block_size {fields.get('block_size', '?')}  "
              f"device {fields.get('kv_layout', {}).get('device', '?')}")
        print(f"  spans      {ns.spans}")
        print(f"  blocks     {ns.blocks}" + (f"  ({ns.unreadable} unreadable)" if ns.unreadable else ""))
        print(f"  bytes      {ns.bytes} ({_human(ns.bytes)})")
        print(f"  hits       {c['hit_blocks']} blocks loaded from disk ({_human(c['hit_bytes'])})")
        if c["load_jobs"]:
            seconds = c["load_us"] / 1e6
            print(f"  loads      {c['load_jobs']} jobs, {seconds / c['load_jobs'] * 1e3:.1f} ms "
                  f"each on average, {_human(c['hit_bytes'] / seconds)}/s while loading")
        print(f"  writes     {c['stored_blocks']} stored, {c['duplicate_blocks']} already present, "
              f"{c['store_failures']} failed")
        unauthenticated = c["unauthenticated_blocks"]
        print(f"  rejected   {c['rejected_blocks']} bad files skipped"
              + (f" ({unauthenticated} not authenticated)" if unauthenticated else ""))
        print(f"  evicted    {c['evicted_blocks']} blocks ({_human(c['evicted_bytes'])})")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from minipic.connector.store.namespace import is_store_root
    from minipic.connector.store.secret import SecretError, load_secret
    from minipic.connector.store.verify import verify_store

    if not is_store_root(args.dir):
        print(f"minipic: {args.dir} is not a minipic store", file=sys.stderr)
        return 2
    try:
        secret = load_secret(args.secret_file)
    except SecretError as e:
        print(f"minipic: {e}", file=sys.stderr)
        return 2
    result = verify_store(args.dir, secret=secret, remove=args.remove)
    bad, kept = result.bad, result.kept
    removed = f" ({result.removed} removed, {kept} could not be)" if args.remove and bad else ""
    problems = f", {result.bad_namespaces} namespace problem(s)" if result.bad_namespaces else ""
    print(f"{result.good} good, {bad} bad{removed}{problems}")
    # Bad files left in the store are a failure; engines never load them either way.
    return 1 if (bad and (not args.remove or kept)) or result.bad_namespaces else 0


def _evict(args: argparse.Namespace) -> int:
    from minipic.connector.store.eviction import evict_lru
    from minipic.connector.store.namespace import is_store_root
    from minipic.connector.store.stats import record_evictions

    if not is_store_root(args.dir):
        print(f"minipic: {args.dir} is not a minipic store", file=sys.stderr)
        return 2
    try:
        result = evict_lru(args.dir, args.max_bytes, low_watermark=1.0)
    except OSError as e:  # e.g. a read-only store: no lock file, no unlink
        print(f"minipic: cannot evict in {args.dir}: {e}", file=sys.stderr)
        return 1
    if not result.ran:
        print("another process is evicting; try again later", file=sys.stderr)
        return 1
    record_evictions(result.removed)  # `minipic store stats` counts these too
    print(f"removed {result.removed_files} blocks ({_human(result.removed_bytes)}), "
          f"{_human(result.remaining_bytes)} left")
    return 0


def _non_negative_size(text: str) -> int:
    from minipic.sizes import SizeError, parse_size

    try:
        value = parse_size(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from minipic import __version__
    from minipic.help_format import DefaultsHelpFormatter

    # Every parser shows defaults in its --help (subparsers take their own formatter).
    helpful = {"formatter_class": DefaultsHelpFormatter}
    parser = argparse.ArgumentParser(prog="minipic", description=__doc__.splitlines()[0],
                                     **helpful)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    store = commands.add_parser("store", help="inspect and maintain span stores", **helpful)
    store_commands = store.add_subparsers(dest="store_command", required=True)

    def add_command(name: str, **kwargs) -> argparse.ArgumentParser:
        return store_commands.add_parser(name, **helpful, **kwargs)

    stats = add_command("stats", help="spans, blocks, bytes and hits")
    stats.add_argument("dir", help="the store_dir of MiniPICConnector")
    stats.add_argument("--json", action="store_true", help="print JSON instead of text")
    stats.set_defaults(run=_stats)

    verify = add_command("verify", help="check every block file")
    verify.add_argument("dir", help="the store_dir of MiniPICConnector")
    verify.add_argument("--remove", action="store_true", help="delete bad files")
    verify.add_argument("--secret-file", help="file holding the store secret, for stores "
                        "whose blocks are authenticated (or set MINIPIC_STORE_SECRET)")
    verify.set_defaults(run=_verify)

    evict = add_command("evict", help="remove LRU blocks down to a size")
    evict.add_argument("dir", help="the store_dir of MiniPICConnector")
    evict.add_argument("--max-bytes", type=_non_negative_size, required=True,
                       help="size to evict down to: bytes, or with a unit like 8GiB or 512MiB")
    evict.set_defaults(run=_evict)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
