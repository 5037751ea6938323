"""Console scripts, one module each: flags -> configs, user errors -> one line and exit status 2."""
import sys as _sys

from flexh2o.cli.startup import quiet_startup_interrupt as _quiet

_quiet(_sys.argv[0] if _sys.argv else "")  # Ctrl-C while torch imports: exit 130, one line (startup.py)
