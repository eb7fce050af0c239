"""`python -m l3pool ...` = the `l3pool` command."""

import sys

from l3pool.cli import main

sys.exit(main())
