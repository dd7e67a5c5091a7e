"""The parallel layout of one engine: PP x CP x TP ranks, which rank holds what.

Torch-free, so launchers and flags can describe a layout without loading torch. Ranks are
numbered stage-major, TP innermost: `rank = (pp_rank * cp_size + cp_rank) * tp_size +
tp_rank`, so the ranks of one pipeline stage are consecutive, those of one TP group too, and
world rank 0 is TP rank 0 of the first stage (the rank that talks to the engine service).
With `cp_size` 1 this is `pp_rank * tp_size + tp_rank`.

Context parallelism (CP): `cp_size` ranks of a stage (each a whole TP group) run the same
scheduler over the same logical pages. Their KV is either replicated (every CP rank holds
every page) or, with `kv_sharding` (`--enable-kv-cache-sharding`), sharded by page: each
rank holds the pages of its owner class (`parallel/cp_layout.py`) and gathers a layer's
pages before attending (`memory/sharded_pool.py`).

Compute is split apart from placement (`cp_split`, `--cp-split`): a prefill's new tokens are
divided over the CP ranks (`model/cp_split.py`), each rank runs the layers for its own
tokens only and all-gathers each layer's new K/V, so every rank writes (its rows of) the
whole chunk and attends its own queries over all of it; the rank that computes a token's
K/V need not own its page. `zigzag` (the default) cuts each request's new tokens into
`2 * cp_size` chunks and gives rank r chunks r and `2 * cp_size - 1 - r`: an early chunk
(few keys) and a late one (many), so every rank does about the same causal work.
`interleave` gives rank r tokens r, r + N, ...: balanced too, but each rank's queries reach
the end of the sequence, so each attends over all the keys (about twice zigzag's work).
`none` computes every token on every rank (the reference). Decode rows (one new token) and
requests too short to cut stay on every rank. With batch-invariant float64 every token's
math is the same whichever rank computes it, so a CP engine's outputs are CP1's.
"""

from __future__ import annotations

from dataclasses import dataclass

# --cp-gather-transport: how a sharded pool's gather reads peers' pages (`sharded_pool.py`)
CP_GATHER_TRANSPORTS = ("auto", "collective", "shm")
CP_SPLITS = ("zigzag", "interleave", "none")  # --cp-split: how a prefill's tokens divide


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where one world rank sits on each parallel axis."""

    pp: int  # pipeline stage
    cp: int  # context-parallel rank within the stage
    tp: int  # tensor-parallel rank within its TP group


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tp_size: int = 1  # --tp-size: KV heads (and attention/MLP weights) split across ranks
    pp_size: int = 1  # --pp-size: layers split across pipeline stages
    cp_size: int = 1  # --cp-size: ranks of a stage that share a sequence's KV pages
    kv_sharding: bool = False  # --enable-kv-cache-sharding: each CP rank keeps its pages only
    cp_split: str = "zigzag"  # --cp-split: which CP rank computes which prefill tokens
    cp_gather_transport: str = "auto"  # --cp-gather-transport: all-gather or shared memory

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
        if self.kv_sharding and self.cp_size == 1:
            raise ValueError(
                "--enable-kv-cache-sharding shards pages over the CP ranks: it needs "
                "--cp-size 2 or more"
            )
        if self.cp_gather_transport not in CP_GATHER_TRANSPORTS:
            raise ValueError(
                f"--cp-gather-transport must be one of {', '.join(CP_GATHER_TRANSPORTS)}, "
                f"not {self.cp_gather_transport!r}"
            )
        if self.cp_split not in CP_SPLITS:
            raise ValueError(
                f"--cp-split must be one of {', '.join(CP_SPLITS)}, not {self.cp_split!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.pp_size

    def rank_of(self, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return (pp_rank * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def coords(self, rank: int) -> RankCoords:
        """Where world rank `rank` sits: its stage, CP rank and TP rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        group, tp = divmod(rank, self.tp_size)
        pp, cp = divmod(group, self.cp_size)
        return RankCoords(pp, cp, tp)

    def stage_ranks(self, pp_rank: int, cp_rank: int = 0) -> list[int]:
        """The world ranks of TP group `cp_rank` of pipeline stage `pp_rank` (with CP 1:
        the whole stage), in TP order."""
        return [self.rank_of(pp_rank, t, cp_rank) for t in range(self.tp_size)]

    def stage_world(self, pp_rank: int) -> list[int]:
        """Every world rank of stage `pp_rank` (its TP x CP ranks, consecutive): the ranks
        that agree on rank 0's commands and the ready-ACK counts of a step."""
        first = self.rank_of(pp_rank, 0, 0)
        return list(range(first, first + self.tp_size * self.cp_size))

    def cp_ranks(self, pp_rank: int, tp_rank: int) -> list[int]:
        """The world ranks that share stage `pp_rank` and TP rank `tp_rank` (a CP group),
        in CP order."""
        return [self.rank_of(pp_rank, tp_rank, c) for c in range(self.cp_size)]

    def kv_ranks(self, replicated: bool) -> tuple[int, ...]:
        """The world ranks whose KV shards differ: every rank, or, with KV replicated over
        TP (MLA's latent), TP rank 0 of each stage (and CP rank; the others hold copies of
        its shard). Replicated CP is replication too: only CP rank 0's count."""
        cps = range(self.cp_size if self.kv_sharding else 1)
        tps = range(1 if replicated else self.tp_size)
        ranks = (self.rank_of(p, t, c) for p in range(self.pp_size) for c in cps for t in tps)
        return tuple(ranks)

    def kv_layout(self) -> ParallelConfig:
        """The layout a replicated CP engine's KV has: its CP1 layout (every CP rank holds
        what CP rank 0 holds); a CP1 or sharded layout is its own. P/D frames and storage
        objects name ranks of this layout (`kv_rank`)."""
        if self.cp_size == 1 or self.kv_sharding:
            return self
        return ParallelConfig(self.tp_size, self.pp_size)

    def kv_rank(self, rank: int) -> int:
        """World rank `rank`'s rank in `kv_layout()` (its CP rank 0 peer's place there)."""
        where = self.coords(rank)
        layout = self.kv_layout()
        return layout.rank_of(where.pp, where.tp, where.cp if layout is self else 0)

    def describe(self) -> str:
        cp = f"/CP{self.cp_size}" if self.cp_size > 1 else ""
        cp += " sharded" if self.kv_sharding else ""
        return f"TP{self.tp_size}/PP{self.pp_size}{cp}"


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The layers pipeline stage `pp_rank` runs: an even split, the first
    `num_layers % pp_size` stages taking one layer more (the last stage also runs the LM
    head, so it never gets the extra one)."""
    if num_layers < pp_size:
        raise ValueError(
            f"--pp-size {pp_size} needs at least {pp_size} layers; the model has {num_layers}"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def check_tp_divides(
    num_heads: int,
    num_kv_heads: int,
    intermediate: int,
    tp_size: int,
    kv_replicated: bool = False,
) -> None:
    """A clear start-up error when the model's heads or MLP do not split over `tp_size`.
    `kv_replicated`: every rank holds all KV heads (MLA's latent), so they need not split."""
    sizes = [("attention heads", num_heads), ("MLP intermediate size", intermediate)]
    if not kv_replicated:
        sizes.insert(1, ("KV heads", num_kv_heads))
    kv = "" if kv_replicated else f" and {num_kv_heads} KV heads"
    for what, n in sizes:
        if n % tp_size:
            raise ValueError(
                f"--tp-size {tp_size} does not divide the model's {n} {what}; "
                f"choose a TP size that divides {num_heads} heads{kv} "
                f"(preset tiny-tp has 8 and 8, tiny-mla 8 heads over one latent)"
            )
