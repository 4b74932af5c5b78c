"""Load generator; same as `llmserve bench`. Run `.venv/bin/python bench/load.py --help`."""

import sys

from llmserve.loadgen import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
