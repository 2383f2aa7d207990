"""Workers found rather than configured: a file, DNS names, Kubernetes EndpointSlices,
reconciled into the fleet (``reconciler``) while the router runs."""
