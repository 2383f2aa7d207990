"""The client APIs besides Chat Completions, as the engines run them: each request
turned into the chat request vLLM renders it as (so its prefix key is chat's), and each
API's reply, usage and error shapes."""
