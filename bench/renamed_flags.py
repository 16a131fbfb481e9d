"""Flags of earlier versions of the benchmark scripts: refused with the name they have now,
never taken with another meaning."""
import argparse


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, new, **kw):
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}")


def refuse_renamed(parser, renames):
    """Adds each (old, new) flag pair of `renames` to `parser`: the old name exits with the new."""
    for old, new in renames:
        parser.add_argument(old, nargs="?", action=_Renamed, new=new, help=argparse.SUPPRESS)
