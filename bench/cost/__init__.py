"""What one request, prompt or engine step costs: hashing and overhead, the simulated
engine's CPU, a long prompt's path, the tokenizer, one request's walk through the code."""
