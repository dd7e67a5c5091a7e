"""`hicache-mesh bench`: a multi-turn benchmark client that talks to the router over HTTP.

`dataset` builds the generated-shared-prefix conversations, `client` streams them against
`/v1/completions`, `records` holds one request's measurements, `report` summarizes and
plots them, `cli` runs the arms (each on a mesh of its own, or one running server) with the
flags `flags` declares.
"""
