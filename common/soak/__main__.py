"""``python -m kvpack.soak`` is ``kvpack soak``."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
