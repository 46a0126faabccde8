"""``python -m dist_resume``: the ``dist-resume`` command."""

import sys

from .cli import main

sys.exit(main())
