"""OpenAI's API surface: ``routes`` (/v1/chat/completions, /v1/completions, /v1/models) and ``api``
(request conversion, response shapes, stream chunks)."""
