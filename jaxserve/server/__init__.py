"""The OpenAI-compatible HTTP server: `create_app(engine_loop, config)` and `serve(engine)`."""

from jaxserve.server.app import create_app
from jaxserve.server.config import ServerConfig
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.http_server import make_server
from jaxserve.server.serve import serve

__all__ = ["EngineLoop", "ServerConfig", "create_app", "make_server", "serve"]
