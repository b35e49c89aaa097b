"""OpenAI-compatible server: `python scripts/serve.py [--config configs/X.yaml] [--flags]`.

See `--help` for the flags (every engine config field is one) and jaxcb/server/ for the code.
"""

import sys

from jaxcb.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
