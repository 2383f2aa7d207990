"""State shared by router replicas through Redis: a local mirror kept current by a stream."""
