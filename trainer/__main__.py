"""`python -m rlctl.trainer --run-dir DIR`: one trainer rank (see rlctl.trainer.train)."""
import os
import sys

from rlctl.trainer.train import main

if __name__ == "__main__":
    os.umask(0o077)  # checkpoints (DCP writes with default modes) and weights: the owner's only
    sys.exit(main())
