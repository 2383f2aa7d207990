"""Workload traces: generators for agent, chat and shared-prompt sessions, and public trace loaders."""
