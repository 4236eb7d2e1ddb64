"""``python -m speccache`` (and ``torchrun -m speccache``) runs the command line."""

import sys

from speccache.cli import main

sys.exit(main())
