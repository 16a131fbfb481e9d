"""pytest setup: tests import their helpers from this directory; the package comes from the
installed wheel, or from python/ in a checkout with SUPEROFFLOAD_LIBRARY pointing at a built
library (scripts/python_test.sh does either)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
