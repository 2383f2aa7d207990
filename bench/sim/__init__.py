"""A simulated vLLM / SGLang engine: OpenAI API, prefix-cached KV blocks, roofline timing."""
