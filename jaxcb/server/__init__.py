"""OpenAI-compatible HTTP server: `python scripts/serve.py --help` (or `python -m jaxcb.server`)."""

from jaxcb.server.app import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]
