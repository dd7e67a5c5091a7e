"""`hicache-mesh replay FILE`: re-send recorded traffic and check the mesh answers alike.

The pipeline, one module per step:
- `recording`: read and validate the `--record` file (docs/recording.md, version 1) into a
  `Recording`; `sources` picks the reader for an input file (the hook for other traces).
- `plan`: what to send for each recorded request (body, seed, redaction) and when.
- `client`: sends the plan over HTTP at its times, measures TTFT, ITL and E2E, and keeps
  what each request got (`Observation`, defined in `observation`).
- `compare`: one request against its reference (the recording, or another arm): status,
  output tokens, cached tokens per tier.
- `summary`: percentiles, regressions, hit rates, the index-staleness audit.
- `report` (markdown) and `plot` (PNG); `cli` runs it all, per arm, with the flags `flags`
  declares.
"""
