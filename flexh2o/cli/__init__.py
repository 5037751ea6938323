"""Console scripts, one module each: flags -> configs, user errors -> one line and exit status 2."""
