"""`python -m jaxcb.bench NAME [flags]`: run one benchmark of jaxcb/bench/commands/."""

import sys

from jaxcb.bench.commands import main

if __name__ == "__main__":
    sys.exit(main())
