"""`python -m rlctl.trainer --run-dir DIR`: one trainer rank (see rlctl.trainer.train)."""
import logging
import os
import sys

from rlctl.trainer.train import main

if __name__ == "__main__":
    os.umask(0o077)  # checkpoints (DCP writes with default modes) and weights: the owner's only
    code = main()
    # Everything is written and the process group is gone: skip the interpreter's teardown, where
    # torch's C++ statics and gloo's threads can abort (SIGABRT) a process that finished its work.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
