"""OpenAI-compatible HTTP server for jaxserve: `python -m api`, or `create_app(engine)`."""

from api.server import create_app

__all__ = ["create_app"]
