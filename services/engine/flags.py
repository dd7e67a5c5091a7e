"""The engine's command-line flags (named like SGLang's), without importing torch.

`hicache-mesh up`, `hicache-mesh generate`, the bench and the engine service all define
their engine flags here, so a launcher parses and forwards them without loading torch;
`services/engine/config.py` maps the parsed flags onto an `EngineConfig` (that one needs
torch). The choice lists repeat the names `gpu_worker` validates (a test checks that they
agree).
"""

from __future__ import annotations

import argparse

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HOST_LAYOUTS = ("layer_first", "page_first")
LOAD_POLICIES = ("always", "cost")
STORAGE_BACKENDS = ("file",)
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_WRITE_POLICIES = ("write_through", "write_through_selective")
KEY_SCHEMES = ("rank-suffix", "unified")
CP_SPLITS = ("zigzag", "interleave", "none")  # gpu_worker.parallel.config.CP_SPLITS
SPEC_ALGORITHMS = ("standalone",)  # gpu_worker.scheduler.spec_config.SPEC_ALGORITHMS
DRAFT_QUANTIZATIONS = ("none", "int4", "int5", "int6", "int8")  # ... .DRAFT_QUANTIZATIONS
DRAFT_HOST_MODES = ("auto", "packed", "sidecar")  # ... .DRAFT_HOST_MODES
# gpu_worker.parallel.config.CP_GATHER_TRANSPORTS
CP_GATHER_TRANSPORTS = ("auto", "collective", "shm")
# `up`, `generate`, the engine service and compose serve the real model unless told otherwise
DEFAULT_MODEL = "smollm2-135m-instruct"
# auto: float64 for the random presets, float32 (CPU) or bfloat16 (GPU) for real checkpoints
DTYPES = ("auto", "float64", "float32", "bfloat16", "float16")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=DEFAULT_MODEL,
        help="a preset (smollm2-135m-instruct, the default: a real chat model; tiny, tiny-tp, "
        "tiny-mla: random weights, for tests), a *.gguf file or a Hugging Face checkpoint "
        "directory",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients use for the model (default: the --model value)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template file instead of the model's own",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="auto: float64 for the random presets, float32 (CPU) / bfloat16 (GPU) otherwise",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--model-seed", type=int, default=0, help="seed of a preset's random weights")
    g.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="max prompt + output tokens (default: the model's); a preset's random weights "
        "take any length, a checkpoint is capped at its own",
    )
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument(
        "--max-total-tokens", type=int, default=32768, help="device KV pool size in tokens"
    )
    g.add_argument("--chunked-prefill-size", type=int, default=512)
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix reuse at all (the oracle's cold run)",
    )
    g.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="every row's result is independent of the batch around it (slower; the cache "
        "oracle compares logits bit for bit with it)",
    )
    g.add_argument(
        "--disaggregation-mode",
        default="null",
        choices=["null", "prefill", "decode"],
        help="P/D role of the engine (null: colocated prefill and decode)",
    )
    g.add_argument(
        "--disaggregation-decode-enable-radix-cache",
        action="store_true",
        help="decode engines reuse their own prefix cache (off: every turn's KV "
        "comes from prefill)",
    )
    g.add_argument(
        "--debug-fail-loads",
        type=int,
        default=0,
        help="test hook: the next N host->device loads fail",
    )
    g.add_argument(
        "--debug-layer-delay-ms",
        type=float,
        default=0.0,
        help="test hook: every decoder layer of every forward first sleeps N ms, on every "
        "rank (a prefill slower than the router's --request-timeout)",
    )
    sd = parser.add_argument_group("speculative decoding")
    sd.add_argument(
        "--speculative-algorithm",
        choices=SPEC_ALGORITHMS,
        default=None,
        help="standalone: a separate draft model proposes --speculative-num-steps tokens per "
        "request and step, the target verifies them in one forward (greedy: the same tokens; "
        "sampled: the target's distribution). Single-rank engines without P/D for now",
    )
    sd.add_argument(
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        dest="speculative_draft_model_path",
        default=None,
        help="the draft: a preset (tiny-draft for tiny), a *.gguf file or a checkpoint "
        "directory of the target's vocabulary, or self (a copy of the target's weights)",
    )
    sd.add_argument(
        "--speculative-num-steps",
        type=int,
        default=4,
        help="draft tokens proposed per request and step (K; the verify runs K+1 positions)",
    )
    sd.add_argument(
        "--speculative-draft-quantization",
        choices=DRAFT_QUANTIZATIONS,
        default=None,
        help="re-quantize the draft's weights (group 32; int4/int5/int6/int8 or none). Default: "
        "int8 for a self draft of a real checkpoint (95%% of SmolLM2's proposals accepted at "
        "half the target's decode time: BENCHMARKS.md), none otherwise (a float64 preset's "
        "self draft is the exact copy the tests use)",
    )
    sd.add_argument(
        "--speculative-draft-host-mode",
        choices=DRAFT_HOST_MODES,
        default="auto",
        help="the draft's KV in the host tier and L3: packed (its layers appended to the "
        "target's host rows and storage objects; needs the target's KV heads, head dim and "
        "dtype), sidecar (its own host pool and storage objects at the same pages), or auto "
        "(packed where the shapes allow it)",
    )
    p = parser.add_argument_group("parallelism")
    p.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tp_size",
        type=int,
        default=1,
        help="tensor-parallel ranks (KV heads are split across them)",
    )
    p.add_argument(
        "--pp-size",
        "--pipeline-parallel-size",
        dest="pp_size",
        type=int,
        default=1,
        help="pipeline stages (layers are split evenly across them)",
    )
    p.add_argument(
        "--cp-size",
        "--context-parallel-size",
        dest="cp_size",
        type=int,
        default=1,
        help="context-parallel ranks per pipeline stage, each a whole TP group (the engine "
        "runs TP x CP x PP ranks); they share a sequence's KV pages. Every CP rank holds every "
        "page unless --enable-kv-cache-sharding",
    )
    p.add_argument(
        "--enable-kv-cache-sharding",
        action="store_true",
        help="with --cp-size N > 1: shard the device KV cache by page over the CP ranks; each "
        "rank holds only the pages it owns (1/N of --max-total-tokens' rows, plus gather "
        "buffers) and all-gathers a layer's pages before its attention",
    )
    p.add_argument(
        "--cp-gather-buffer-mb",
        type=float,
        default=1024.0,
        help="with --enable-kv-cache-sharding and the collective gather: MiB per rank for the "
        "two gather scratch buffers together; a request waits until the running batch's "
        "gathers leave room for its pages, and one that could never fit fails with an error "
        "(the shm transport reads the owners' rows and has no scratch buffer)",
    )
    p.add_argument(
        "--cp-gather-transport",
        choices=CP_GATHER_TRANSPORTS,
        default="auto",
        help="with --enable-kv-cache-sharding: how a layer's gather reads the other CP ranks' "
        "pages: collective (an all-gather per layer), shm (CPU ranks on one host map each "
        "other's KV rows in shared memory and read them directly: no collective per layer) "
        "or auto (shm on CPU when every CP rank is on this host, else collective)",
    )
    p.add_argument(
        "--cp-split",
        choices=CP_SPLITS,
        default="zigzag",
        help="with --cp-size N > 1: how a prefill's new tokens divide over the CP ranks, each "
        "computing only its own and all-gathering each layer's new K/V: zigzag (2N chunks "
        "a request, rank r takes chunks r and 2N-1-r: balanced causal work), interleave "
        "(token i on rank i %% N) or none (every rank computes every token)",
    )
    p.add_argument(
        "--debug-transfer-delay-ms",
        type=float,
        default=0.0,
        help="test hook: each host<->device copy first sleeps a random [0, N] ms, "
        "seeded per rank, so ranks see different readiness",
    )
    p.add_argument(
        "--debug-disable-agreement",
        default="none",
        choices=["none", "pp_sync", "tp_min", "all"],
        help="test hook: ranks consume their own ready-ACK counts instead of the agreed "
        "ones (the rank consensus checker must then report a divergence)",
    )
    p.add_argument(
        "--debug-rank-raise",
        default=None,
        metavar="RANK:TOKEN",
        help="test hook: rank RANK raises in its step loop when a request whose prompt "
        "holds TOKEN is admitted",
    )
    p.add_argument(
        "--debug-perturb-sampler",
        action="store_true",
        help="test hook: every request's 3rd output token becomes (token + 1) mod vocab "
        "(replay must then report a mismatch)",
    )
    p.add_argument(
        "--debug-silent-flush",
        action="store_true",
        help="test hook: a flush drops the cache without telling the index (its predictions "
        "go stale: the router's prefix audit must report it)",
    )
    h = parser.add_argument_group("hierarchical cache")
    h.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="back the device cache with a host-memory tier",
    )
    h.add_argument(
        "--hicache-ratio",
        type=float,
        default=2.0,
        help="host pool size as a multiple of the device pool",
    )
    h.add_argument(
        "--hicache-size",
        type=float,
        default=0.0,
        help="host pool size in GB (overrides --hicache-ratio when > 0)",
    )
    h.add_argument("--hicache-write-policy", default="write_through", choices=WRITE_POLICIES)
    h.add_argument("--hicache-mem-layout", default="layer_first", choices=HOST_LAYOUTS)
    h.add_argument(
        "--hicache-load-policy",
        default="always",
        choices=LOAD_POLICIES,
        help="cost: load a host hit only when the measured copy is cheaper than "
        "recomputing it (rank 0 measures, every rank decides from its figures)",
    )
    h.add_argument(
        "--hicache-write-through-threshold",
        type=int,
        default=2,
        help="hits before write_through_selective backs a node up",
    )
    s = parser.add_argument_group("external storage (L3)")
    s.add_argument(
        "--hicache-storage-backend",
        default=None,
        choices=STORAGE_BACKENDS,
        help="a third tier behind the host one (needs --enable-hierarchical-cache); "
        "engines pointed at one directory share it, across restarts too",
    )
    s.add_argument(
        "--hicache-storage-dir",
        default="",
        metavar="DIR",
        help="the file backend's directory (default: $HICACHE_STORAGE_DIR, else "
        "~/.cache/hicache-mesh/storage)",
    )
    s.add_argument(
        "--hicache-storage-size",
        type=float,
        default=None,
        metavar="GB",
        help="cap on the store's bytes (least recently used objects go first); 0: no cap "
        "(default: a tenth of the directory's filesystem, at most half the space free for "
        "the store at start-up)",
    )
    s.add_argument(
        "--hicache-storage-key-file",
        default="",
        metavar="FILE",
        help="the secret that authenticates stored objects (keyed blake2b; objects with "
        "another key's MAC are quarantined, not served); engines sharing a store share it "
        "(default: DIR/.key, made with mode 0600 on first use and kept across restarts)",
    )
    s.add_argument(
        "--hicache-storage-prefetch-policy",
        default="timeout",
        choices=PREFETCH_POLICIES,
        help="when a waiting request stops waiting for its read from storage: once it could "
        "be admitted (best_effort), when the read is complete, or at a deadline that grows "
        "with the tokens to read (timeout)",
    )
    s.add_argument(
        "--hicache-storage-prefetch-timeout-base",
        type=float,
        default=0.5,
        metavar="S",
        help="the timeout policy's deadline: this many seconds ...",
    )
    s.add_argument(
        "--hicache-storage-prefetch-timeout-per-ki-token",
        type=float,
        default=0.25,
        metavar="S",
        help="... plus this many per 1024 tokens to read ...",
    )
    s.add_argument(
        "--hicache-storage-prefetch-timeout-max",
        type=float,
        default=10.0,
        metavar="S",
        help="... at most this many",
    )
    s.add_argument(
        "--hicache-storage-write-policy",
        default="write_through",
        choices=STORAGE_WRITE_POLICIES,
        help="write host pages to storage when they reach the host, or once their node was "
        "matched --hicache-storage-write-threshold times",
    )
    s.add_argument(
        "--hicache-storage-write-threshold",
        type=int,
        default=2,
        help="matches before write_through_selective writes a node to storage",
    )
    s.add_argument(
        "--hicache-storage-key-scheme",
        default="rank-suffix",
        choices=KEY_SCHEMES,
        help="rank-suffix: one object per page per rank (only the same TP/PP layout reads "
        "it); unified: objects on a grid of layer ranges x KV-head groups that every layout "
        "of the model shares (the host pool becomes page_unified)",
    )
    s.add_argument(
        "--hicache-storage-layer-partition",
        type=int,
        default=0,
        metavar="L",
        help="unified scheme: layers per object (must divide every pipeline stage's layer "
        "count); 0: all the model's layers",
    )
    s.add_argument(
        "--hicache-storage-head-partition",
        type=int,
        default=1,
        metavar="H",
        help="unified scheme: KV heads per object (must divide every TP rank's KV heads)",
    )
    s.add_argument(
        "--debug-storage-read-delay-ms",
        type=float,
        default=0.0,
        help="test hook: each storage read batch first sleeps a random [0, N] ms, per rank",
    )


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """SGLang's multi-node flags: an engine whose ranks span hosts (the engine service only:
    every node is started with the same engine flags plus its own `--node-rank`)."""
    n = parser.add_argument_group("engines across hosts")
    n.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="with --nnodes above 1: node 0's address, where it hosts the ranks' rendezvous "
        "(gloo binds to the interface toward HOST unless GLOO_SOCKET_IFNAME is set)",
    )
    n.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="hosts the engine's ranks are split over, evenly and contiguously",
    )
    n.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this host's index: 0 serves (NATS, the API), above 0 only runs its ranks and "
        "exits when the world ends",
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line (only those not at their default).

    `hicache-mesh up` passes its engine flags on to each engine process with this, so the
    flags an engine gets are exactly the ones `add_engine_args` defines.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return _changed(parser, args)


def _changed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """`parser`'s flags whose value in `args` is not their default, as a command line."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def add_pd_transfer_args(parser: argparse.ArgumentParser) -> None:
    """How a P/D prefill engine sends KV to decode engines (`services/engine/pd.py`): the
    engine service takes them, `hicache-mesh up` passes them on to its prefill engines."""
    g = parser.add_argument_group("P/D KV transfer")
    g.add_argument(
        "--disaggregation-frame-bytes",
        type=int,
        default=0,
        metavar="BYTES",
        help="largest KV frame on the bus, header included; 0: the NATS server's max_payload "
        "(from its INFO). A page shard over it is sent in parts",
    )
    g.add_argument(
        "--disaggregation-window",
        type=int,
        default=8,
        metavar="N",
        help="KV frames in flight per transfer before waiting for decode's ACKs",
    )
    g.add_argument(
        "--disaggregation-window-bytes",
        type=int,
        default=32 * 1024 * 1024,
        metavar="BYTES",
        help="KV bytes in flight per prefill engine, all its transfers together (keep it well "
        "below the server's slow-consumer limit, 64 MiB by default)",
    )
    g.add_argument(
        "--disaggregation-ack-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a transfer fails when decode ACKs none of its frames for this long",
    )


def pd_transfer_argv(args: argparse.Namespace) -> list[str]:
    """The P/D transfer flags of `args` that are not at their default, as a command line."""
    parser = argparse.ArgumentParser(add_help=False)
    add_pd_transfer_args(parser)
    return _changed(parser, args)
