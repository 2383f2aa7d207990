"""Trace replay against an OpenAI-compatible endpoint, with reports and comparisons."""
