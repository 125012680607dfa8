"""`python -m rlctl.trainer --run-dir DIR`: one trainer rank (see rlctl.trainer.train)."""
import sys

from rlctl.trainer.train import main

if __name__ == "__main__":
    sys.exit(main())
