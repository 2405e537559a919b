"""OpenAI- and Anthropic-compatible HTTP server over one generation worker (``dflash2-mlx serve``).

One subpackage per API surface, each its router (``routes``) and its request conversion and
response shapes (``api``): ``openai`` (chat and text completions, models), ``anthropic`` (messages),
``responses`` (OpenAI's Responses API; also ``output``, its Response objects and stream events, and
``store``, the stored responses behind ``previous_response_id``). The shared core stays here:
``app`` (the app: lifespan, error shapes, limits; includes the routers), ``admin`` (/health,
/metrics), ``config`` (``ServerConfig``), ``dependencies`` (what the routes share: state, API-key
checks, body reading), ``worker`` (the thread that owns the model, the queue, cancellation, the
prefix cache), ``scheduler``, ``chat`` (prompt rendering, reasoning and tool-call parsing),
``markup``, ``stream`` (one request's lifecycle: waiting, streaming, disconnects, timeouts),
``params`` (sampling parameters -> engine settings), ``structured`` (JSON mode, JSON schemas and
forced tool calls as one output constraint), ``argument_bounds``, ``stall_trace``, ``schemas``,
``errors``, ``metrics``.
"""

from dflash2_mlx.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
