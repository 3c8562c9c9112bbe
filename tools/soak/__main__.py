"""``python -m kvpack.tools.soak`` is ``kvpack soak``."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
