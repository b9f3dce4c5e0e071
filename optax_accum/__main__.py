"""``python -m optax_accum demo``: the demo's command line (``optax_accum.demo.cli``)."""

import sys

from optax_accum.demo.cli import main

if __name__ == "__main__":
  sys.exit(main())
