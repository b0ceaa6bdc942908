"""The --help layout of minipic's commands (`minipic`, `minipic-preload`)."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                            argparse.RawDescriptionHelpFormatter):
    """argparse's "(default: ...)" after every option's help, and the description and
    epilog kept as written. Nothing is added where there is no default (None) or where
    the help states it in words: "(default: None)" says nothing, and a default read
    from the environment (an API key) must not be printed."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)
