"""`minipic` and `minipic-preload`: --version, and every --help shows the defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

import minipic

COMMANDS = {"minipic": "minipic.cli", "minipic-preload": "minipic.client.preload.cli"}


def run(module: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The command as a user runs it: a process of its own."""
    import os

    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


@pytest.mark.parametrize("name", COMMANDS)
def test_version(name):
    result = run(COMMANDS[name], "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"{name} {minipic.__version__}"


@pytest.mark.parametrize("args, shown", [
    (["store", "stats"], ["--json", "(default: False)"]),
    (["store", "verify"], ["--remove", "(default: False)"]),
    (["store", "evict"], ["8GiB"]),
])
def test_minipic_help_shows_defaults(args, shown):
    result = run(COMMANDS["minipic"], *args, "--help")
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert result.returncode == 0 and all(s in text for s in shown)
    assert "(default: None)" not in text


def test_preload_help_shows_defaults_but_no_secret():
    result = run(COMMANDS["minipic-preload"], "--help", OPENAI_API_KEY="sk-secret-123")
    assert result.returncode == 0
    help_text = " ".join(result.stdout.split())  # argparse wraps lines
    for default in ("(default: 32)", "(default: minipic-manifest.parquet)", "(default: 512)",
                    "(default: text)", "(default: False)"):
        assert default in help_text
    assert "sk-secret-123" not in help_text and "(default: $OPENAI_API_KEY)" in help_text
    assert "(default: None)" not in help_text
    assert "minipic-preload corpus/ --url" in result.stdout  # the epilog keeps its layout
