"""OpenAI's Responses API surface: ``routes`` (/v1/responses), ``api`` (the request and its
translation into a chat request), ``output`` (Response objects, stream events) and ``store``
(stored responses for ``previous_response_id``)."""
