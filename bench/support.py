"""What the benchmark scripts share: the package's declarations of the C ABI, and the flags of
earlier versions (refused with the name they have now, never taken with another meaning)."""
import argparse
import os
import sys


def import_abi():
    """superoffload._abi of the installed package, else of the source checkout holding this script
    (bench/../python). Importing it loads neither a library nor torch."""
    try:
        from superoffload import _abi
        return _abi
    except ImportError:
        pass
    checkout = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    if os.path.isfile(os.path.join(checkout, "superoffload", "_abi.py")):
        sys.path.insert(0, checkout)
        from superoffload import _abi
        return _abi
    raise SystemExit("error: this script needs the superoffload Python package (its ctypes declarations of the "
                     "C ABI): `pip install` the package, or run the script from a source checkout "
                     f"(it looks for {checkout}/superoffload)")


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
