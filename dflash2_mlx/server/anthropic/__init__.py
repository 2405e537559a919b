"""Anthropic's API surface: ``routes`` (/v1/messages, /v1/messages/count_tokens) and ``api``
(request conversion, the Messages response and its stream events)."""
