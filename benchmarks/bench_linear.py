"""Float32 CPU matmuls of a whole model's linear layers: torch's default (`F.linear`, MKL on
x86 builds) against the same weights prepacked for oneDNN (`layers.pack_weight` /
`packed_linear`, what the engine runs since `LlamaModel.prepack_weights`).

One process builds SmolLM2-135M's linear weights (30 layers of q/k/v/o and gate/up/down,
and the 49152 x 576 LM head; random values: the speed does not depend on them), about
540 MB, far beyond the CPU caches, so each pass streams them from memory as a real decode
step does. For each row count the two ways run in interleaved rounds over the same
weights and inputs; the table reports the median pass time of each and their ratio, and
the largest difference of their outputs relative to the outputs' scale.

    .venv/bin/python benchmarks/bench_linear.py
    .venv/bin/python benchmarks/bench_linear.py --rows 1 8 64 512 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gpu_worker.model.layers import PACK_ROWS, can_prepack, pack_weight, packed_linear

HIDDEN, INTERMEDIATE, KV_DIM, VOCAB, LAYERS = 576, 1536, 192, 49152, 30


def model_shapes() -> list[tuple[int, int]]:
    """(out, in) of every linear layer of SmolLM2-135M, in forward order."""
    layer = [
        (HIDDEN, HIDDEN),  # q_proj
        (KV_DIM, HIDDEN),  # k_proj
        (KV_DIM, HIDDEN),  # v_proj
        (HIDDEN, HIDDEN),  # o_proj
        (INTERMEDIATE, HIDDEN),  # gate_proj
        (INTERMEDIATE, HIDDEN),  # up_proj
        (HIDDEN, INTERMEDIATE),  # down_proj
    ]
    return layer * LAYERS + [(VOCAB, HIDDEN)]


def one_pass(
    inputs: dict[int, torch.Tensor], weights: list[torch.Tensor], packed: bool
) -> tuple[float, list[torch.Tensor]]:
    """Seconds to run every layer once, and the last layer's output."""
    start = time.perf_counter()
    out = torch.empty(0)
    for w in weights:
        x = inputs[w.shape[1]]
        out = packed_linear(x, w, None) if packed else F.linear(x, w)
    return time.perf_counter() - start, [out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = [torch.randn(o, i) / i**0.5 for o, i in model_shapes()]
    if not can_prepack(plain[0]):
        raise SystemExit(
            "this torch build has no oneDNN (torch.backends.mkldnn): nothing to compare"
        )
    packed = [pack_weight(w) for w in plain]
    weights_mb = sum(w.numel() for w in plain) * 4 / 1e6
    print(
        f"{len(plain)} float32 linear layers of SmolLM2-135M ({weights_mb:.0f} MB), oneDNN "
        f"packed for {PACK_ROWS} rows; median of {args.rounds} interleaved rounds, "
        f"torch threads {args.threads}"
    )
    print(
        f"{'rows':>5} {'F.linear ms':>12} {'packed ms':>10} {'packed/F.linear':>16} {'max rel diff':>13}"
    )
    for rows in args.rows:
        inputs = {d: torch.randn(rows, d) for d in (HIDDEN, INTERMEDIATE)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds + 1):  # round 0 warms both up
            for way in (r % 2 == 0, r % 2 == 1):
                seconds, _ = one_pass(inputs, packed if way else plain, way)
                if r:
                    times[way].append(seconds)
        want = F.linear(inputs[HIDDEN], plain[-1])
        got = packed_linear(inputs[HIDDEN], packed[-1], None)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        ms = {way: statistics.median(t) * 1e3 for way, t in times.items()}
        print(
            f"{rows:>5} {ms[False]:>12.1f} {ms[True]:>10.1f} {ms[True] / ms[False]:>15.2f}x {rel:>13.1e}"
        )


if __name__ == "__main__":
    main()
