"""The OpenAI-compatible HTTP server: ``build_app(AsyncEngine, name)`` (see :mod:`bytediet.server.app`)."""
