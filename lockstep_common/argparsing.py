"""The argument parser of every command (`lockstep ...`, `lockstep gateway`): whole flag names only, and short errors.

argparse's own parser takes any unambiguous prefix of a flag (`--api-key` became `--api-key-file`)
and answers a mistyped flag with the whole usage (140 lines for `lockstep serve`). This one takes
only whole names and answers every usage error with two lines at most: the error, naming the flag
and the value, then a "did you mean" for a mistyped flag or where the full help is; exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.other_flags: set[str] = set()  # flags another command takes from this one (`lockstep up`'s engines)

    def error(self, message: str):
        print(f"{self.prog}: error: {message}\n{self.hint(message)}", file=sys.stderr)
        sys.exit(2)

    def hint(self, message: str) -> str:
        """"Did you mean" for an unknown flag, else where the full help is."""
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            given = unknown.group(1).split("=", 1)[0]
            flags = sorted({flag for action in self._actions for flag in action.option_strings} | self.other_flags)
            flags = [flag for flag in flags if flag.startswith("--")]
            close = difflib.get_close_matches(given, flags, n=2, cutoff=0.75)
            if close:
                return f"did you mean {' or '.join(close)}? (`{self.prog} --help` lists every flag)"
        return f"`{self.prog} --help` lists every flag and its allowed values"


def port_number(text: str) -> int:
    """A TCP port to listen on: 1-65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: allowed 1-65535") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range: allowed 1-65535")
    return port
