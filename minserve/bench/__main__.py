"""`python -m minserve.bench EXPERIMENT ...`: `minserve bench` without the server's imports."""

import sys

from .cli import main

sys.exit(main())
