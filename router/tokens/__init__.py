"""Real tokens: a model's tokenizer and chat template, as the engine applies them."""
