"""OpenAI- and Anthropic-compatible HTTP server over one generation worker (``dflash2-mlx serve``).

Modules: ``app`` (the app: lifespan, error shapes, limits), ``config`` (``ServerConfig``), one router per
API surface (``routes_openai``, ``routes_responses``, ``routes_anthropic``, ``routes_admin``), ``dependencies``
(what the routes share: state, API-key checks, body reading), ``worker`` (the thread that owns the model, the
queue, cancellation, the prefix cache), ``openai_api`` / ``anthropic_api`` (request conversion and response
shapes), ``chat`` (prompt rendering, reasoning and tool-call parsing), ``stream`` (one request's
lifecycle: waiting, streaming, disconnects, timeouts), ``params`` (sampling parameters -> engine
settings), ``structured`` (JSON mode, JSON schemas and forced tool calls as one output constraint),
``schemas``, ``errors``, ``metrics``.
"""

from dflash2_mlx.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
