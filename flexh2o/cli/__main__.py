"""`python -m flexh2o.cli ...` is flexh2o-run."""
import sys

from flexh2o.cli.run import main

sys.exit(main())
