"""``kvrouter bench soak``: hours of sessions and faults against one router, watched for
leaks of memory, descriptors and tasks."""
