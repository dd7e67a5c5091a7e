"""Speculative decoding's flags (SGLang's names) and what this first slice refuses.

The flags reach an `EngineConfig` (`services/engine/config.py`) and go on from `up` to its
engines unchanged (`engine_argv`); the choice lists agree with `gpu_worker`'s. Bad
combinations, and the topologies whose draft state is still to come (P/D, CP > 1), fail at
start with an error that names what is missing. A re-quantized `self` draft proposes, and
the output stays the target's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from test_hf_loader import save_hf_model

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler import spec_config
from gpu_worker.scheduler.spec_config import SpecConfig
from services.cli import main
from services.engine import flags
from services.engine.config import engine_config_from_args

SPEC = ("--speculative-algorithm", "standalone", "--speculative-draft-model-path")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    return parser.parse_args(["--model", "tiny", *argv])


def test_flags_reach_the_engine_config_and_up_passes_them_on() -> None:
    args = parse(*SPEC, "tiny-draft", "--speculative-num-steps", "3")
    spec = engine_config_from_args(args).spec
    assert spec == SpecConfig("standalone", "tiny-draft", 3, "none") and spec.enabled
    assert flags.engine_argv(args)[2:] == [*SPEC, "tiny-draft", "--speculative-num-steps", "3"]
    assert not engine_config_from_args(parse()).spec.enabled
    assert flags.SPEC_ALGORITHMS == spec_config.SPEC_ALGORITHMS
    assert flags.DRAFT_QUANTIZATIONS == spec_config.DRAFT_QUANTIZATIONS
    assert flags.DRAFT_HOST_MODES == spec_config.DRAFT_HOST_MODES
    args = parse(*SPEC, "self", "--speculative-draft-host-mode", "sidecar")
    assert engine_config_from_args(args).spec.draft_host_mode == "sidecar"
    assert flags.engine_argv(args)[-2:] == ["--speculative-draft-host-mode", "sidecar"]


def test_a_self_draft_of_a_real_model_defaults_to_int8() -> None:
    """The default draft quantization: int8 for `self` outside float64 (the measured choice
    for SmolLM2), none for a float64 preset's exact copy and for another draft model; a
    given value is kept."""

    def quant(*argv: str) -> str:
        return engine_config_from_args(parse(*argv)).spec.draft_quantization

    assert quant(*SPEC, "self") == "none"  # tiny: float64
    assert quant(*SPEC, "self", "--dtype", "float32") == "int8"
    assert quant(*SPEC, "tiny-draft", "--dtype", "float32") == "none"
    assert (
        quant(*SPEC, "self", "--dtype", "float32", "--speculative-draft-quantization", "none")
        == "none"
    )
    assert quant(*SPEC, "self", "--speculative-draft-quantization", "int4") == "int4"


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (("--speculative-draft-model-path", "self"), "need --speculative-algorithm standalone"),
        (("--speculative-algorithm", "standalone"), "needs --speculative-draft-model-path"),
        ((*SPEC, "self", "--speculative-num-steps", "0"), r"must be in \[1, 16\]"),
        ((*SPEC, "self", "--cp-size", "2"), "CP > 1"),
    ],
)
def test_bad_combinations_are_refused_clearly(argv: tuple[str, ...], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        engine_config_from_args(parse(*argv))


def test_the_engine_refuses_what_the_draft_cannot_do() -> None:
    with pytest.raises(ValueError, match="CP2"):
        EngineConfig(parallel=ParallelConfig(cp_size=2), spec=SpecConfig("standalone", "self"))
    with pytest.raises(ValueError, match="is not supported"):
        SpecConfig("eagle", "self")
    with pytest.raises(ValueError, match="choose one of"):
        SpecConfig("standalone", "self", draft_quantization="int3")
    with pytest.raises(ValueError, match="neither a preset"):
        Engine(EngineConfig(spec=SpecConfig("standalone", "no-such-draft")))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_a_requantized_self_draft_is_lossless_and_proposes(scheme: str) -> None:
    """`self` re-quantized (`gpu_worker/model/quant.py`) is another model: its proposals are
    sometimes rejected, yet the greedy output is the target's, token for token."""
    prompts = [[(7 * i + j) % 250 for j in range(20 + 3 * i)] for i in range(4)]
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = {}
    stats = {}
    for name, spec in {
        "off": SpecConfig(),
        "on": SpecConfig("standalone", "self", draft_quantization=scheme),
    }.items():
        eng = Engine(EngineConfig(batch_invariant=True, spec=spec))
        try:
            outputs[name] = [o.output_ids for o in eng.generate_batch(prompts, sampling)]
            stats[name] = eng.cache_stats()
        finally:
            eng.close()
    assert outputs["on"] == outputs["off"]
    proposed, accepted = stats["on"]["spec_proposed_tokens"], stats["on"]["spec_accepted_tokens"]
    assert proposed > 0 and 0 < accepted <= proposed


def test_generate_reports_the_accepted_proposals(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "tiny", *SPEC, "self", "--max-tokens", "11"]
    assert main([*argv, "--enable-deterministic-inference", "--input-ids", "5,6,7"]) == 0
    assert "speculative: 8/8 proposals accepted in 2 verify rounds" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny", *SPEC, "self", "--cp-size", "2"]) == 2
    assert "CP > 1" in capsys.readouterr().err


def test_a_checkpoint_draft_must_share_the_targets_vocabulary(tmp_path: Path) -> None:
    """A Hugging Face checkpoint directory drafts for tiny when its vocabulary is tiny's
    (greedy output still tiny's own), and is refused, naming both sizes, when it is not."""
    same, other = tmp_path / "same", tmp_path / "other"
    save_hf_model("llama", same, vocab_size=260)
    save_hf_model("llama", other)  # 128 tokens
    cache = CacheConfig(page_size=4, enable_radix_cache=False)
    plain = Engine(EngineConfig(cache=cache, batch_invariant=True))
    want = plain.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=9, ignore_eos=True))
    plain.close()
    eng = Engine(
        EngineConfig(cache=cache, batch_invariant=True, spec=SpecConfig("standalone", str(same)))
    )
    got = eng.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=9, ignore_eos=True))
    eng.close()
    assert got.output_ids == want.output_ids and got.spec_proposed > 0
    with pytest.raises(ValueError, match="vocabulary of 128 tokens, the target 'tiny' 260"):
        Engine(EngineConfig(spec=SpecConfig("standalone", str(other))))
