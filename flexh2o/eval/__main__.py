"""`python -m flexh2o.eval` = `flexh2o-eval`."""
import sys

from flexh2o.cli.eval import main

sys.exit(main())
