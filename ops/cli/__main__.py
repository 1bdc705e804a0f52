"""`python -m ops.cli`: how `up` starts its children."""

import sys

from ops.cli import entry

sys.exit(entry())
