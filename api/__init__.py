"""OpenAI-compatible HTTP server for jaxserve: `python -m api`, or `create_app(engine)`."""

__all__ = ["create_app"]


def __getattr__(name: str):
    # Lazy: `python -m api.router` and the --data-parallel-size parent import no jax.
    if name == "create_app":
        from api.server import create_app

        return create_app
    raise AttributeError(f"module 'api' has no attribute {name!r}")
