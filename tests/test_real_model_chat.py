"""A 6-turn chat with SmolLM2-135M-Instruct through real meshes, colocated and P/D, against
transformers' greedy output on the same GGUF (issue 19, acceptance 2).

A ~1.9K-token system prompt (a travel catalogue) and six questions: every turn's prompt is
~2K tokens, the history of the turns before it included. The colocated mesh answers each
turn; its answer is compared with transformers' greedy continuation of the same messages
(the prompt ids too: the router renders the template as transformers does), and becomes the
history of the next turn. The P/D mesh (`up --pd` with decode reuse) then serves the same six
prompts and must give the same text, and report the decode engine's reuse: turn k+1's
`cached_tokens` (= `decode_prefix_len`) covers turn k's prompt, which the decode engine kept.

Transformers computes the shared system prompt once and continues every turn from a copy of
its KV (`DynamicCache`), as its prompt-reuse recipe does (turn 1 checked against a full
prefill: the same ids); six full 2K-token prefills would cost minutes on a 2-core CPU. Each
mesh first serves two short requests with a third and two thirds of the system prompt
(`warm_up`), so no request waits on a cold 2K-token prefill.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from fault_helpers import MeshSpec, UpMesh, running_mesh

from gpu_worker.model.gguf import preset_path

pytestmark = pytest.mark.timeout(900)

SMOLLM2 = "smollm2-135m-instruct"
PAGE = 16
MAX_TOKENS = 20
EOS = 2  # <|im_end|>: the end of an assistant turn
FLAGS = ("--model", SMOLLM2, "--dtype", "float32", "--page-size", str(PAGE))

_PLACES = [
    ("Paris", "France", "the Seine", "the Louvre", "May"),
    ("Rome", "Italy", "the Tiber", "the Colosseum", "April"),
    ("Vienna", "Austria", "the Danube", "Schonbrunn Palace", "September"),
    ("Prague", "the Czech Republic", "the Vltava", "Charles Bridge", "June"),
    ("Budapest", "Hungary", "the Danube", "the Parliament", "September"),
    ("London", "the United Kingdom", "the Thames", "the British Museum", "June"),
    ("Lisbon", "Portugal", "the Tagus", "the Belem Tower", "October"),
    ("Cairo", "Egypt", "the Nile", "the Pyramids of Giza", "November"),
    ("Kyoto", "Japan", "the Kamo", "Kinkaku-ji", "November"),
    ("Bangkok", "Thailand", "the Chao Phraya", "the Grand Palace", "December"),
    ("Warsaw", "Poland", "the Vistula", "the Old Town", "May"),
    ("Dublin", "Ireland", "the Liffey", "Trinity College", "July"),
    ("Seville", "Spain", "the Guadalquivir", "the Alcazar", "March"),
    ("Cologne", "Germany", "the Rhine", "the Cathedral", "August"),
    ("Florence", "Italy", "the Arno", "the Uffizi Gallery", "October"),
    ("Quebec City", "Canada", "the Saint Lawrence", "the Chateau Frontenac", "July"),
    ("Montreal", "Canada", "the Saint Lawrence", "the Old Port", "June"),
    ("New Orleans", "the United States", "the Mississippi", "the French Quarter", "March"),
    ("Saint Petersburg", "Russia", "the Neva", "the Hermitage", "July"),
    ("Belgrade", "Serbia", "the Danube", "the Kalemegdan Fortress", "May"),
    ("Bratislava", "Slovakia", "the Danube", "the Castle", "June"),
    ("Lyon", "France", "the Rhone", "the Basilica of Fourviere", "September"),
    ("Porto", "Portugal", "the Douro", "the Ribeira district", "September"),
    ("Basel", "Switzerland", "the Rhine", "the Kunstmuseum", "August"),
    ("Hamburg", "Germany", "the Elbe", "the Elbphilharmonie", "July"),
    ("Dresden", "Germany", "the Elbe", "the Frauenkirche", "May"),
    ("Zaragoza", "Spain", "the Ebro", "the Basilica del Pilar", "October"),
    ("Turin", "Italy", "the Po", "the Egyptian Museum", "April"),
    ("Shanghai", "China", "the Huangpu", "the Bund", "October"),
    ("Hanoi", "Vietnam", "the Red River", "the Temple of Literature", "November"),
    ("Phnom Penh", "Cambodia", "the Mekong", "the Royal Palace", "December"),
    ("Khartoum", "Sudan", "the Nile", "the National Museum", "January"),
    ("Baghdad", "Iraq", "the Tigris", "the Abbasid Palace", "March"),
    ("Manaus", "Brazil", "the Amazon", "the Teatro Amazonas", "July"),
    ("Buenos Aires", "Argentina", "the Rio de la Plata", "the Teatro Colon", "April"),
]
HEADER = (
    "You are a helpful assistant for a travel agency. Answer in one short sentence, using "
    "only the catalogue below.\n\nCatalogue of destinations:\n"
)
ENTRIES = [
    f"- {city} is a city in {country}. The river that flows through {city} is {river}. "
    f"Its most famous sight is {sight}, and the best month to visit is {month}. "
    f"Travellers often combine {city} with a boat trip on {river} in {month}.\n"
    for city, country, river, sight, month in _PLACES
]
SYSTEM = HEADER + "".join(ENTRIES)
QUESTIONS = [
    "Which river flows through Vienna?",
    "What is the most famous sight in Lisbon?",
    "When is the best time to visit Kyoto?",
    "In which country is Seville?",
    "Which river flows through Dresden?",
    "What should I see in Buenos Aires?",
]


@pytest.fixture(scope="module")
def transformers_chat() -> Iterator[Any]:
    """`answer(messages) -> (prompt ids, greedy ids, text)` by transformers on the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    path = preset_path(SMOLLM2)
    assert path is not None
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    system = ids_of(tok, [{"role": "system", "content": SYSTEM}], generation_prompt=False)
    prefix = DynamicCache()
    with torch.inference_mode():
        hf(torch.tensor([system]), cache=prefix)

    def answer(messages: list[dict[str, str]]) -> tuple[list[int], list[int], str]:
        ids = ids_of(tok, messages, generation_prompt=True)
        assert ids[: len(system)] == system
        prompt = torch.tensor([ids])
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            cache=copy.deepcopy(prefix),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=EOS,
        )[0, len(ids) :].tolist()
        return ids, out, str(tok.decode(out, skip_special_tokens=True))

    yield answer


def ids_of(tok: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def client_of(mesh: UpMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=300, max_retries=0)


def ask(client: openai.OpenAI, messages: list[dict[str, str]]) -> Any:
    return client.chat.completions.create(
        model=SMOLLM2,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )


def warm_up(client: openai.OpenAI) -> None:
    """Two requests with the first third, then two thirds, of the catalogue, so that no
    request computes more than ~700 prompt tokens cold: a cold 2K-token prefill of this
    model takes 10-15 s on an idle 2-core CPU, and more than the router's 30 s for a first
    token on a loaded one (issue 19, defect 2)."""
    for n in (len(ENTRIES) // 3, 2 * len(ENTRIES) // 3):
        system = HEADER + "".join(ENTRIES[:n])
        client.chat.completions.create(
            model=SMOLLM2,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            max_tokens=1,
            temperature=0,
        )


@pytest.fixture(scope="module")
def colocated_chat(
    tmp_path_factory: pytest.TempPathFactory, transformers_chat: Any
) -> list[tuple[list[dict[str, str]], Any, tuple[list[int], list[int], str]]]:
    """The six turns on a colocated mesh: (messages, response, transformers' answer)."""
    spec = MeshSpec(engines=1, max_total_tokens=4096, extra=FLAGS)
    turns = []
    with running_mesh(spec, tmp_path_factory, "chat-colocated", timeout_s=300) as mesh:
        client = client_of(mesh)
        warm_up(client)
        messages = [{"role": "system", "content": SYSTEM}]
        for question in QUESTIONS:
            messages = [*messages, {"role": "user", "content": question}]
            out = ask(client, messages)
            turns.append((messages, out, transformers_chat(messages)))
            messages = [*messages, {"role": "assistant", "content": answer_of(out)}]
    return turns


def without_eos(ids: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] == EOS else ids


def answer_of(out: Any) -> str:
    return str(out.choices[0].message.content or "")


def check_turns(
    turns: list[tuple[list[dict[str, str]], Any, tuple[list[int], list[int], str]]],
    outs: list[Any],
) -> None:
    for k, ((_, _, (ids, want_ids, want_text)), out) in enumerate(zip(turns, outs, strict=True)):
        assert out.usage.prompt_tokens == len(ids), f"turn {k + 1}: another prompt"
        assert 1800 < len(ids) < 2400, len(ids)
        got_ids = without_eos(out.choices[0].model_extra["token_ids"])
        assert got_ids == without_eos(want_ids), f"turn {k + 1}: transformers' {want_ids}"
        assert answer_of(out) == want_text, f"turn {k + 1}"


def test_a_colocated_chat_equals_transformers(
    colocated_chat: list[tuple[list[dict[str, str]], Any, tuple[list[int], list[int], str]]],
) -> None:
    check_turns(colocated_chat, [out for _, out, _ in colocated_chat])
    for k in range(1, len(colocated_chat)):  # each turn reuses the history before it
        before = colocated_chat[k - 1][1].usage.prompt_tokens
        cached = colocated_chat[k][1].usage.prompt_tokens_details.cached_tokens
        assert cached >= before // PAGE * PAGE, (k, cached, before)


def test_a_pd_chat_equals_transformers_and_reuses_on_decode(
    colocated_chat: list[tuple[list[dict[str, str]], Any, tuple[list[int], list[int], str]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    extra = (*FLAGS, "--disaggregation-decode-enable-radix-cache")
    spec = MeshSpec(pd=True, max_total_tokens=4096, extra=extra)
    outs = []
    with running_mesh(spec, tmp_path_factory, "chat-pd", timeout_s=300) as mesh:
        client = client_of(mesh)
        warm_up(client)
        for messages, _, _ in colocated_chat:
            outs.append(ask(client, messages))
    check_turns(colocated_chat, outs)
    for k, out in enumerate(outs):
        usage = out.usage
        pd = usage.model_extra["disaggregation"]
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached == pd["decode_prefix_len"] > 0  # what the response calls cached
        assert pd["transferred_tokens"] == usage.prompt_tokens - pd["decode_prefix_len"]
        if k > 0:  # the decode engine kept turn k's history: only the new turn moved
            before = outs[k - 1].usage.prompt_tokens
            assert cached >= before // PAGE * PAGE, (k, cached, before)
            assert pd["transferred_tokens"] < 200
