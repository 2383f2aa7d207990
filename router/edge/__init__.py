"""The router's one HTTP server: every request a client, an operator or a sibling process
sends arrives here, is read and checked once, and is answered by the handler its
``(method, path)`` names in one route table."""
