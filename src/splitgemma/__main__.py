"""``python -m splitgemma`` = the ``splitgemma`` command."""
import sys

from splitgemma.cli import main

sys.exit(main())
