"""`python -m flexh2o.eval` = `flexh2o-eval`."""
import sys

from flexh2o.eval.cli import main

sys.exit(main())
