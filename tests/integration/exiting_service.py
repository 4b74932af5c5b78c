"""A child for the supervisor tests: `python -m tests.integration.exiting_service --after S --code C`
lives S seconds, then exits with code C (the supervisor's --port/--port-file flags are ignored)."""

import argparse
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--after", type=float, required=True)
parser.add_argument("--code", type=int, default=1)
args, _ = parser.parse_known_args()
time.sleep(args.after)
sys.exit(args.code)
