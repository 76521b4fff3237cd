"""`python -m trainyard`: the same as the `trainyard` command."""
import sys

from trainyard.app.cli import main

# Guarded: multiprocessing may import the main module again (as __mp_main__) in job processes.
if __name__ == "__main__":
    sys.exit(main())
