"""`python -m posttrain.cli` runs the `posttrain` command."""

import sys

from posttrain.cli import main

sys.exit(main())
