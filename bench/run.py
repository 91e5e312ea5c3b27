"""Runs the fuseloop benchmark: `python bench/run.py [--quick] [--json PATH] [--plot PATH]`.

The same implementation as `fuseloop bench` (src/fuseloop/bench); see bench/README.md.
"""

import sys

from fuseloop.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
