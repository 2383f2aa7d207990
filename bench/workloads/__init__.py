"""Workload traces: agent, chat and shared-prompt generators, and public trace loaders."""
