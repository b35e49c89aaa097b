"""`python -m jaxcb.server [flags]`: the same as scripts/serve.py."""

import sys

from jaxcb.server.cli import main

sys.exit(main())
