"""`python -m minserve.figures [sync | set NAME VALUE]`: check or rewrite the docs' figures."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
