"""What the router and its workbench both speak, one home for each fact of it:

* ``http1`` — HTTP/1.1 responses as bytes (the router's own server, the simulated
  engine's);
* ``blocks`` — a prompt's token ids as bytes and their chained block hashes (the
  router's prefix keys, the simulated engine's cache and KV events);
* ``headers`` — the header names kvrouter adds or reads;
* ``streams`` — reading a reply in each client API: its text, errors and usage (the
  router's reply capture, the replay's stream readers);
* ``buckets`` — the engines' histogram bounds the router's own histograms follow.
"""
