"""`python -m lockstep_operator` = `lockstep operator`."""

import sys

from lockstep_operator.main import main

sys.exit(main(sys.argv[1:]))
