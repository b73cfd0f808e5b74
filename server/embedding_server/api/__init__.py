"""The HTTP API: ``create_app(settings, engine=None)`` builds the FastAPI application."""

from embedding_server.api.app import create_app

__all__ = ["create_app"]
