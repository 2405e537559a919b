"""Text: stop strings, chat-template message boundaries and the reasoning split, shared by the CLI and
the server."""
