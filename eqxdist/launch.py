"""`python -m eqxdist.launch`: run a script as N cooperating JAX processes on this
machine. The launcher itself lives in `eqxdist._launch.cli` (see its docstring)."""

import sys

from ._launch.cli import main as main

if __name__ == "__main__":
    sys.exit(main())
