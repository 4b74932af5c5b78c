"""A child for the supervisor tests: `python -m tests.integration.exiting_service --after S --code C`
lives S seconds, then exits with code C (the supervisor's --port/--port-file flags are ignored).
With `--while-exists PATH` it exits only while PATH exists and otherwise lives on (a dependency
that comes back)."""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--after", type=float, required=True)
parser.add_argument("--code", type=int, default=1)
parser.add_argument("--while-exists", default="")
args, _ = parser.parse_known_args()
time.sleep(args.after)
if args.while_exists and not os.path.exists(args.while_exists):
    print("staying up", flush=True)
    time.sleep(600)
sys.exit(args.code)
