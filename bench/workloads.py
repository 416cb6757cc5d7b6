"""Deterministic scheduler-benchmark workloads, written as OpenAI batch files.

    python -m bench.workloads OUT_DIR [--scale 0.1] [--model models/demo]

writes OUT_DIR/unique.jsonl, shared_prefix.jsonl, system_prompts.jsonl, multi_job_shared_prefix.jsonl
and manifest.json (requests and measured prompt tokens per workload). `split_multi_job` cuts a file
into the multi-job pieces; `split_multi_job_shared_prefix` deals multi_job_shared_prefix over the
tenants' jobs.

Text is random words from the fixed list below, drawn with `random.Random(seed)`; lengths are
measured with the demo model's own tokenizer, so "a 1,000-token document" is 1,000 tokens of the
model that runs it. The same seed, scale and tokenizer give byte-identical files.

* unique: one user message of about UNIQUE_PROMPT_TOKENS fresh tokens per request (no shared
  128-token block, so prefix caching cannot help).
* shared_prefix: DOCS documents of about DOC_TOKENS tokens, QUESTIONS_PER_DOC questions each; the
  document comes first in the message, so the questions of one document share its blocks.
  Lines shuffled: which requests share a prefix is left for the runner to find.
* system_prompts: SYSTEM_PROMPT_REQUESTS requests over SYSTEM_PROMPTS system prompts of about
  SYSTEM_PROMPT_TOKENS tokens, each with its own short user message; shuffled.
* multi_job (split_multi_job): a file cut into MULTI_JOB_BATCHES consecutive pieces, tenants
  assigned round-robin over TENANTS.
* multi_job_shared_prefix: few-shot classification run by several teams: FEW_SHOT_PROMPTS system
  messages of about FEW_SHOT_PROMPT_TOKENS tokens (a task line and FEW_SHOT_EXAMPLES labelled
  examples), FEW_SHOT_ITEMS items each (a short user message), FEW_SHOT_OUTPUT_TOKENS out; shuffled.
  `split_multi_job_shared_prefix` deals every prompt's items over len(TENANTS) x
  FEW_SHOT_JOBS_PER_TENANT jobs (seeded), so every job holds items of every prompt;
  `merge_by_tenant` joins each tenant's jobs into one.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

SEED = 3  # the issue number; every generator derives its own Random from it
MODEL_NAME = "demo"  # body.model: the served name in every system
ENDPOINT = "/v1/chat/completions"

UNIQUE_REQUESTS = 2000
UNIQUE_PROMPT_TOKENS = 100
UNIQUE_OUTPUT_TOKENS = 64

DOCS = 200
DOC_TOKENS = 1000
QUESTIONS_PER_DOC = 10
QUESTION_TOKENS = 20
SHARED_PREFIX_OUTPUT_TOKENS = 16

SYSTEM_PROMPTS = 20
SYSTEM_PROMPT_TOKENS = 400
SYSTEM_PROMPT_REQUESTS = 2000
USER_MESSAGE_TOKENS = 40
SYSTEM_PROMPTS_OUTPUT_TOKENS = 64

MULTI_JOB_BATCHES = 20
TENANTS = ("tenant-a", "tenant-b", "tenant-c")

FEW_SHOT_PROMPTS = 40  # 40 x 800 = 32k distinct prefix tokens: more than the tight KV cache holds
FEW_SHOT_PROMPT_TOKENS = 800
FEW_SHOT_EXAMPLES = 10
FEW_SHOT_LABELS = 4
FEW_SHOT_ITEMS = 30
FEW_SHOT_ITEM_TOKENS = 20
FEW_SHOT_OUTPUT_TOKENS = 8
FEW_SHOT_JOBS_PER_TENANT = 2

WORKLOAD_FILES = {
    "unique": "unique.jsonl",
    "shared_prefix": "shared_prefix.jsonl",
    "system_prompts": "system_prompts.jsonl",
    "multi_job_shared_prefix": "multi_job_shared_prefix.jsonl",
    "blend": "blend.jsonl",
    "long_prefix": "long_prefix.jsonl",
    "dups": "dups.jsonl",
    "request_rate": "request_rate.jsonl",
}

# Fixed word list (plain English words; no punctuation, so token counts stay predictable).
_WORD_TEXT = """
able about above across after again against air all almost along also always among amount
animal answer any appear apple area arm around art ask away back ball bank base basket bear
beauty bed before begin behind believe bell below best better between big bird black blood
blue board boat body bone book border born both bottom box boy brain branch bread break bridge
bright bring brother brown build burn business busy buy call camp can capital car card care
carry case cat catch cause cell center chair chance change charge chart check child choose
church circle city class clean clear climb clock close cloud coast cold collect color column
come common company compare complete condition consider contain control cook cool copy corn
corner correct cost cotton could count country course cover cow create crop cross crowd cry
current cut dance dark day dead deal dear death decide deep degree depend describe desert
design detail develop die differ direct discuss distant divide doctor dog dollar door double
down draw dream dress drink drive drop dry duck during early earth east easy eat edge effect
egg eight either electric element end enemy energy engine enough enter equal even evening
event ever every exact example except exercise expect experience explain eye face fact fair
fall family famous far farm fast father fear feed feel few field fig fight figure fill final
find fine finger finish fire first fish fit five flat floor flow flower fly follow food foot
force forest form forward four free fresh friend front fruit full game garden gas gather gentle
girl give glad glass gold good govern grand grass gray great green ground group grow guess
guide gun hair half hand happen happy hard hat head hear heart heat heavy help high hill history
hold hole home hope horse hot hour house huge human hunt hurry ice idea inch industry insect
instant iron island job join joy jump keep key kind king kitchen knew know lady lake land
language large last late laugh law lead learn leave left leg length letter level lie life lift
light line liquid list listen little live long look lost loud love low machine main major make
man many map mark market master match matter meant measure meat meet melody metal method middle
might mile milk mind minute miss modern moment money month moon morning mother mountain mouth
move music name nation natural nature near need neighbor never night noise north nose note
notice number ocean offer office oil old open order organ original other oxygen page paint
pair paper paragraph parent part party pass past path pattern people period person picture
piece place plain plan plane planet plant play please plural poem point pole poor port pose
position possible pound power practice prepare present press pretty print problem process
produce product protect provide pull push quart question quick quiet quite quotient race radio
rain raise range rather reach read ready real reason receive record region remember repeat
reply rest result rich ride right ring rise river road rock roll room root rope rose round row
rule run safe sail salt same sand save say scale school science score sea search season seat
second section see seed select self sell send sense sentence separate serve set settle seven
shape share sharp sheet shell shine ship shoe shop shore short shoulder shout show side sight
sign silent silver simple since sing single sister sit size skill skin sky sleep slow small
smell smile snow soft soil soldier solution song sound south space speak special speed spell
spend spring square stand star start state station stay steam steel step stick still stone
stood stop store story straight strange stream street stretch string strong student study
subject success sugar suggest summer sun supply support sure surface surprise swim syllable
symbol system table tail take talk tall teach team teeth tell temperature test thank thick thin
thing think third thought thousand three through throw tie time tiny tire together tone tool
top total touch toward town track trade train travel tree triangle trip trouble truck true try
tube turn twenty type under unit until usual valley value various verb very view village visit
voice vowel wait walk wall want warm wash watch water wave wear weather week weight west wheel
white whole wide wife wild will wind window winter wire wish woman wonder wood word work world
write wrong yard year yellow young zero
"""
WORDS = _WORD_TEXT.split()


def load_tokenizer(model_dir: str | Path = "models/demo") -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.model_max_length = 10**9  # texts are measured whole, never fed to the model from here
    return tokenizer


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def text_of_tokens(rng: random.Random, tokenizer: Any, target: int) -> str:
    """Random words whose tokenization is the shortest prefix reaching `target` tokens.

    Always draws 2 x target words (whatever the tokenizer), so the random stream, and with it
    every later text, does not depend on where the cut falls.
    """
    words = [rng.choice(WORDS) for _ in range(2 * target)]
    lo, hi = 1, len(words)
    while lo < hi:  # smallest k with count(words[:k]) >= target
        mid = (lo + hi) // 2
        if count_tokens(tokenizer, " ".join(words[:mid])) >= target:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def request_line(custom_id: str, messages: list[dict[str, str]], output_tokens: int) -> dict[str, Any]:
    """One batch line that generates exactly ``output_tokens`` (min_tokens, ignore_eos, greedy): the
    shape of every workload's requests, public so the other benchmarks (request_rate) build theirs
    the same way."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": ENDPOINT,
        "body": {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": output_tokens,
            "min_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0,
        },
    }


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def unique_lines(tokenizer: Any, scale: float = 1.0, seed: int | str = SEED) -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}-unique")
    return [
        request_line(
            f"unique-{i:05d}",
            [{"role": "user", "content": text_of_tokens(rng, tokenizer, UNIQUE_PROMPT_TOKENS)}],
            UNIQUE_OUTPUT_TOKENS,
        )
        for i in range(_scaled(UNIQUE_REQUESTS, scale))
    ]


def shared_prefix_lines(
    tokenizer: Any, scale: float = 1.0, seed: int | str = SEED, doc_tokens: int = DOC_TOKENS
) -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}-shared-prefix")
    lines = []
    for d in range(_scaled(DOCS, scale)):
        doc = text_of_tokens(rng, tokenizer, doc_tokens)
        for q in range(QUESTIONS_PER_DOC):
            question = text_of_tokens(rng, tokenizer, QUESTION_TOKENS)
            content = f"Read the document, then answer the question.\n\n{doc}\n\nQuestion: {question}?"
            lines.append(
                request_line(
                    f"doc{d:03d}-q{q:02d}",
                    [{"role": "user", "content": content}],
                    SHARED_PREFIX_OUTPUT_TOKENS,
                )
            )
    random.Random(f"{seed}-shared-prefix-order").shuffle(lines)
    return lines


def system_prompt_lines(tokenizer: Any, scale: float = 1.0, seed: int | str = SEED) -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}-system-prompts")
    prompts = [text_of_tokens(rng, tokenizer, SYSTEM_PROMPT_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    lines = []
    for i in range(_scaled(SYSTEM_PROMPT_REQUESTS, scale)):
        s = i % SYSTEM_PROMPTS  # equal share per system prompt
        messages = [
            {"role": "system", "content": prompts[s]},
            {"role": "user", "content": text_of_tokens(rng, tokenizer, USER_MESSAGE_TOKENS)},
        ]
        lines.append(request_line(f"sys{s:02d}-r{i:05d}", messages, SYSTEM_PROMPTS_OUTPUT_TOKENS))
    random.Random(f"{seed}-system-prompts-order").shuffle(lines)
    return lines


def few_shot_prompt(
    rng: random.Random, tokenizer: Any, task: int, target: int = FEW_SHOT_PROMPT_TOKENS
) -> str:
    """A classification system message of about `target` tokens: the task and its labels, then
    FEW_SHOT_EXAMPLES labelled examples of random words."""
    labels = rng.sample(WORDS, FEW_SHOT_LABELS)
    header = (
        f"Task {task}: label each text with one of: {', '.join(labels)}. "
        "Answer with the label only.\n\nExamples:\n"
    )
    per_example = (target - count_tokens(tokenizer, header)) // FEW_SHOT_EXAMPLES
    examples = []
    for _ in range(FEW_SHOT_EXAMPLES):
        label = rng.choice(labels)
        frame = f"\nText: \nLabel: {label}\n"
        text = text_of_tokens(rng, tokenizer, max(1, per_example - count_tokens(tokenizer, frame)))
        examples.append(f"\nText: {text}\nLabel: {label}\n")
    return header + "".join(examples)


def multi_job_shared_prefix_lines(
    tokenizer: Any, scale: float = 1.0, seed: int | str = SEED
) -> list[dict[str, Any]]:
    """FEW_SHOT_PROMPTS (scaled) few-shot prompts x FEW_SHOT_ITEMS items, shuffled."""
    rng = random.Random(f"{seed}-multi-job-shared-prefix")
    lines = []
    for p in range(_scaled(FEW_SHOT_PROMPTS, scale)):
        system = few_shot_prompt(rng, tokenizer, p)
        for i in range(FEW_SHOT_ITEMS):
            item = text_of_tokens(rng, tokenizer, FEW_SHOT_ITEM_TOKENS)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Text: {item}\nLabel:"},
            ]
            lines.append(request_line(f"fs{p:02d}-i{i:02d}", messages, FEW_SHOT_OUTPUT_TOKENS))
    random.Random(f"{seed}-multi-job-shared-prefix-order").shuffle(lines)
    return lines


# extract: answers that copy spans of their prompt (where n-gram speculation, which drafts tokens
# by matching the context so far, should pay): EXTRACT_DOCS documents x EXTRACT_QUESTIONS asks to
# copy the passage that follows a quoted start, EXTRACT_OUTPUT_TOKENS out (issue #51 part 4)
EXTRACT_DOCS = 100
EXTRACT_DOC_TOKENS = 400
EXTRACT_QUESTIONS = 4
EXTRACT_OUTPUT_TOKENS = 64


def extract_lines(tokenizer: Any, scale: float = 1.0, seed: int | str = SEED) -> list[dict[str, Any]]:
    """EXTRACT_DOCS (scaled) documents, each asked EXTRACT_QUESTIONS times to copy out the text
    after a quoted start of a few of its words, verbatim; shuffled."""
    rng = random.Random(f"{seed}-extract")
    lines = []
    for d in range(_scaled(EXTRACT_DOCS, scale)):
        words = text_of_tokens(rng, tokenizer, EXTRACT_DOC_TOKENS).split()
        for q in range(EXTRACT_QUESTIONS):
            at = rng.randrange(max(1, len(words) - 40))
            start = " ".join(words[at : at + 4])
            content = (
                f"Document:\n{' '.join(words)}\n\nCopy the document's text that begins with "
                f'"{start}", word for word, and nothing else.'
            )
            lines.append(
                request_line(f"ex{d:03d}-q{q}", [{"role": "user", "content": content}], EXTRACT_OUTPUT_TOKENS)
            )
    random.Random(f"{seed}-extract-order").shuffle(lines)
    return lines


# --- issue #51's workloads: blend, long_prefix, dups, request_rate (each its own seeded Random)

BLEND_PROMPTS = 20  # shared system prompts (few-shot classification, FEW_SHOT_PROMPT_TOKENS each)
BLEND_ITEMS = 30  # items per prompt; every BLEND_GENERATE_EVERY-th item asks for a long answer
BLEND_GENERATE_EVERY = 4  # 1 in 4 items generates BLEND_GENERATE_TOKENS, the rest classify
BLEND_CLASSIFY_TOKENS = 8
BLEND_GENERATE_TOKENS = 256

LONG_PREFIX_DOCS = 12
LONG_PREFIX_QUESTIONS = 20  # questions per document
LONG_PREFIX_OUTPUT_TOKENS = 16
CONTEXT_TOKENS = 2048  # the benchmark's max_model_len (bench/scheduler.py MAX_MODEL_LEN)
# a document leaves this much of the context to the instruction, question, chat template and output
LONG_PREFIX_HEADROOM = 48 + QUESTION_TOKENS + LONG_PREFIX_OUTPUT_TOKENS

DUPS_ORIGINALS = 800  # distinct requests; DUPS_ORIGINALS // 4 more lines copy one of them each
DUPS_OUTPUT_TOKENS = 64

REQUEST_RATE_REQUESTS = 5000
REQUEST_RATE_OUTPUT_TOKENS = 2


def blend_lines(tokenizer: Any, scale: float = 1.0, seed: int | str = SEED) -> list[dict[str, Any]]:
    """8-token classification and 256-token generation over the same shared few-shot prompts:
    BLEND_PROMPTS (scaled) prompts x BLEND_ITEMS items, one item in BLEND_GENERATE_EVERY asking for
    a long answer (custom_id ...-gen), the rest for the label (...-cls); shuffled."""
    rng = random.Random(f"{seed}-blend")
    lines = []
    for p in range(_scaled(BLEND_PROMPTS, scale)):
        system = few_shot_prompt(rng, tokenizer, p)
        for i in range(BLEND_ITEMS):
            item = text_of_tokens(rng, tokenizer, FEW_SHOT_ITEM_TOKENS)
            if i % BLEND_GENERATE_EVERY == 0:
                ask, tokens, kind = (
                    "Explain at length which label fits and why.",
                    BLEND_GENERATE_TOKENS,
                    "gen",
                )
            else:
                ask, tokens, kind = "Label:", BLEND_CLASSIFY_TOKENS, "cls"
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Text: {item}\n{ask}"},
            ]
            lines.append(request_line(f"bl{p:02d}-i{i:02d}-{kind}", messages, tokens))
    random.Random(f"{seed}-blend-order").shuffle(lines)
    return lines


def long_prefix_lines(
    tokenizer: Any, scale: float = 1.0, seed: int | str = SEED, context_tokens: int = CONTEXT_TOKENS
) -> list[dict[str, Any]]:
    """LONG_PREFIX_DOCS (scaled) documents of context_tokens - LONG_PREFIX_HEADROOM tokens, each
    followed by LONG_PREFIX_QUESTIONS questions: every line's prompt and output fit the context, the
    document fills most of it. Shuffled."""
    rng = random.Random(f"{seed}-long-prefix")
    lines = []
    for d in range(_scaled(LONG_PREFIX_DOCS, scale)):
        doc = text_of_tokens(rng, tokenizer, context_tokens - LONG_PREFIX_HEADROOM)
        for q in range(LONG_PREFIX_QUESTIONS):
            question = text_of_tokens(rng, tokenizer, QUESTION_TOKENS)
            content = f"Read the document, then answer the question.\n\n{doc}\n\nQuestion: {question}?"
            lines.append(
                request_line(
                    f"long{d:02d}-q{q:02d}", [{"role": "user", "content": content}], LONG_PREFIX_OUTPUT_TOKENS
                )
            )
    random.Random(f"{seed}-long-prefix-order").shuffle(lines)
    return lines


def dups_lines(tokenizer: Any, scale: float = 1.0, seed: int | str = SEED) -> list[dict[str, Any]]:
    """Greedy requests of the unique shape, exactly 20% of them duplicates: DUPS_ORIGINALS (scaled,
    a multiple of 4) distinct requests, and a quarter as many lines whose body is a copy of one of
    them (each original copied at most once; custom_id dup-NNNNN-of-MMMMM). Shuffled."""
    rng = random.Random(f"{seed}-dups")
    originals = 4 * max(1, round(DUPS_ORIGINALS * scale / 4))
    lines = [
        request_line(
            f"orig-{i:05d}",
            [{"role": "user", "content": text_of_tokens(rng, tokenizer, UNIQUE_PROMPT_TOKENS)}],
            DUPS_OUTPUT_TOKENS,
        )
        for i in range(originals)
    ]
    for k, i in enumerate(sorted(rng.sample(range(originals), originals // 4))):
        lines.append(
            {
                **lines[i],
                "custom_id": f"dup-{k:05d}-of-{i:05d}",
                "body": json.loads(json.dumps(lines[i]["body"])),
            }
        )
    random.Random(f"{seed}-dups-order").shuffle(lines)
    return lines


def request_rate_shape_lines(
    tokenizer: Any, scale: float = 1.0, seed: int | str = SEED
) -> list[dict[str, Any]]:
    """The request-rate shape (bench/request_rate.py's lines): REQUEST_RATE_REQUESTS (scaled) short
    unique prompts, REQUEST_RATE_OUTPUT_TOKENS output tokens each. `tokenizer` is unused: the
    prompts are a few made-up words, their length is not measured."""
    from bench.request_rate import lines

    return lines(_scaled(REQUEST_RATE_REQUESTS, scale), seed, output_tokens=REQUEST_RATE_OUTPUT_TOKENS)


GENERATORS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "unique": unique_lines,
    "shared_prefix": shared_prefix_lines,
    "system_prompts": system_prompt_lines,
    "multi_job_shared_prefix": multi_job_shared_prefix_lines,
    "blend": blend_lines,
    "long_prefix": long_prefix_lines,
    "dups": dups_lines,
    "request_rate": request_rate_shape_lines,
}


def write_jsonl(path: Path, lines: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_token_ids(tokenizer: Any, line: dict[str, Any]) -> list[int]:
    """The prompt as the engine sees it: the chat template applied, generation prompt added."""
    ids = tokenizer.apply_chat_template(line["body"]["messages"], tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def prompt_tokens(tokenizer: Any, line: dict[str, Any]) -> int:
    return len(prompt_token_ids(tokenizer, line))


def sort_by_prompt(
    tokenizer: Any, lines: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """The lines sorted by their rendered prompt token ids, and those ids in the same order."""
    from bench.prefix import sort_order

    ids = [prompt_token_ids(tokenizer, line) for line in lines]
    order = sort_order(ids)
    return [lines[i] for i in order], [ids[i] for i in order]


def describe(tokenizer: Any, lines: list[dict[str, Any]]) -> dict[str, Any]:
    from bench.prefix import shared_prefix_tokens

    ids = [prompt_token_ids(tokenizer, line) for line in lines]
    lengths = [len(x) for x in ids]
    outputs = [int(line["body"]["max_tokens"]) for line in lines]
    return {
        "requests": len(lines),
        "prompt_tokens_total": sum(lengths),
        "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1),
        "prompt_tokens_max": max(lengths),
        "output_tokens_per_request": max(outputs),
        "output_tokens_total": sum(outputs),
        "shared_prefix_tokens": shared_prefix_tokens(ids),  # distinct tokens on shared prefixes
    }


def generate(
    out_dir: str | Path,
    scale: float = 1.0,
    model_dir: str | Path = "models/demo",
    doc_tokens: int = DOC_TOKENS,
    unique_repeats: int = 1,
    repeat_all: bool = False,
) -> dict[str, Any]:
    """Write every workload file into out_dir; return the manifest (also written as manifest.json).

    ``doc_tokens`` sets the shared_prefix document length (the issue's shape is about 1,000).
    ``unique_repeats`` > 1 adds unique-r1.jsonl, ...: the same shape with other prompts (seed
    ``SEED-r1``...), so a repeated run on a warm engine finds nothing of the last one cached; and
    as many multi_job_shared_prefix-r1.jsonl, ... (other few-shot prompts, items and order).
    ``repeat_all``: every other workload gets its repeats too (``repeat_files``), and every workload
    a warm-up file (``warmup_files``, NAME-warm.jsonl, seed ``SEED-warm``): the same shape with other
    prompts, run unmeasured by every system before its measured runs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model_dir)
    manifest: dict[str, Any] = {
        "seed": SEED, "scale": scale, "tokenizer": str(model_dir), "doc_tokens": doc_tokens, "workloads": {},
    }  # fmt: skip
    for name, make in GENERATORS.items():
        options = {"doc_tokens": doc_tokens} if name == "shared_prefix" else {}
        lines = make(tokenizer, scale, **options)
        write_jsonl(out / WORKLOAD_FILES[name], lines)
        manifest["workloads"][name] = {"file": WORKLOAD_FILES[name], **describe(tokenizer, lines)}
    manifest["unique_repeat_files"] = [WORKLOAD_FILES["unique"]]
    manifest["multi_job_shared_prefix_repeat_files"] = [WORKLOAD_FILES["multi_job_shared_prefix"]]
    for r in range(1, unique_repeats):
        name = repeat_file(r)
        write_jsonl(out / name, unique_lines(tokenizer, scale, seed=f"{SEED}-r{r}"))
        manifest["unique_repeat_files"].append(name)
        name = repeat_file(r, "multi_job_shared_prefix")
        write_jsonl(out / name, multi_job_shared_prefix_lines(tokenizer, scale, seed=f"{SEED}-r{r}"))
        manifest["multi_job_shared_prefix_repeat_files"].append(name)
    if repeat_all:
        manifest["repeat_files"], manifest["warmup_files"] = {}, {}
        for workload, make in GENERATORS.items():
            options = {"doc_tokens": doc_tokens} if workload == "shared_prefix" else {}
            names = [repeat_file(r, workload) for r in range(unique_repeats)]
            for r, name in enumerate(names[1:], 1):
                if workload not in ("unique", "multi_job_shared_prefix"):  # written above
                    write_jsonl(out / name, make(tokenizer, scale, seed=f"{SEED}-r{r}", **options))
            manifest["repeat_files"][workload] = names
            warm = f"{Path(WORKLOAD_FILES[workload]).stem}-warm.jsonl"
            write_jsonl(out / warm, make(tokenizer, scale, seed=f"{SEED}-warm", **options))
            manifest["warmup_files"][workload] = warm
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def repeat_file(r: int, workload: str = "unique") -> str:
    """File name of repeat r of a workload (r = 0 is the workload's own file)."""
    return WORKLOAD_FILES[workload] if r == 0 else f"{Path(WORKLOAD_FILES[workload]).stem}-r{r}.jsonl"


def split_multi_job(
    path: str | Path,
    out_dir: str | Path,
    batches: int = MULTI_JOB_BATCHES,
    tenants: tuple[str, ...] = TENANTS,
) -> list[dict[str, Any]]:
    """Cut `path` into `batches` consecutive pieces (sizes differ by at most one line), tenant i % 3.

    Returns [{"tenant", "path", "requests"}] in submission order; the pieces together are exactly
    the lines of `path`, in order.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    lines = [line for line in lines if line.strip()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches = max(1, min(batches, len(lines)))
    pieces = []
    start = 0
    for i in range(batches):
        size = len(lines) // batches + (1 if i < len(lines) % batches else 0)
        piece = out / f"{Path(path).stem}-part{i:02d}.jsonl"
        piece.write_text("".join(lines[start : start + size]), encoding="utf-8")
        pieces.append({"tenant": tenants[i % len(tenants)], "path": str(piece), "requests": size})
        start += size
    return pieces


def split_multi_job_shared_prefix(
    path: str | Path,
    out_dir: str | Path,
    tenants: tuple[str, ...] = TENANTS,
    jobs_per_tenant: int = FEW_SHOT_JOBS_PER_TENANT,
    seed: int = SEED,
) -> list[dict[str, Any]]:
    """Deal the lines of `path` over len(tenants) x jobs_per_tenant jobs, every job holding items of
    every prompt: each prompt's lines (grouped by their first message, the few-shot system prompt)
    are shuffled and dealt round-robin from a random job on (seeded), so job sizes differ by at
    most one line per prompt. A job keeps its lines in file order.

    Returns [{"tenant", "job", "path", "requests"}] in submission order (job 0 of every tenant,
    then job 1, ...); the jobs together hold every line of `path` exactly once.
    """
    lines = [
        line for line in Path(path).read_text(encoding="utf-8").splitlines(keepends=True) if line.strip()
    ]
    jobs = [(tenant, j) for j in range(jobs_per_tenant) for tenant in tenants]
    groups: dict[str, list[int]] = {}  # first message -> line indices, in order of first appearance
    for i, raw in enumerate(lines):
        groups.setdefault(json.loads(raw)["body"]["messages"][0]["content"], []).append(i)
    rng = random.Random(f"{seed}-multi-job-shared-prefix-split")
    owner: dict[int, int] = {}
    for indices in groups.values():
        dealt = list(indices)
        rng.shuffle(dealt)
        first = rng.randrange(len(jobs))  # remainders do not always fall to the first jobs
        for k, i in enumerate(dealt):
            owner[i] = (first + k) % len(jobs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pieces = []
    for n, (tenant, j) in enumerate(jobs):
        mine = [lines[i] for i in range(len(lines)) if owner[i] == n]
        piece = out / f"{Path(path).stem}-{tenant}-job{j}.jsonl"
        piece.write_text("".join(mine), encoding="utf-8")
        pieces.append({"tenant": tenant, "job": j, "path": str(piece), "requests": len(mine)})
    return pieces


def merge_by_tenant(
    pieces: list[dict[str, Any]], out_dir: str | Path, stem: str = "per-tenant"
) -> list[dict[str, Any]]:
    """One job per tenant (OUT_DIR/STEM-TENANT.jsonl): its pieces' lines joined in piece order.

    Returns [{"tenant", "path", "requests"}] in order of each tenant's first piece."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_tenant: dict[str, list[str]] = {}
    for piece in pieces:
        text = Path(piece["path"]).read_text(encoding="utf-8")
        by_tenant.setdefault(piece["tenant"], []).extend(
            x for x in text.splitlines(keepends=True) if x.strip()
        )
    merged = []
    for tenant, lines in by_tenant.items():
        path = out / f"{stem}-{tenant}.jsonl"
        path.write_text("".join(lines), encoding="utf-8")
        merged.append({"tenant": tenant, "path": str(path), "requests": len(lines)})
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--scale", type=float, default=1.0, help="request counts x this (0.1 for smoke runs)")
    parser.add_argument("--model", default="models/demo", help="checkpoint whose tokenizer measures lengths")
    args = parser.parse_args(argv)
    manifest = generate(args.out_dir, args.scale, args.model)
    for name, info in manifest["workloads"].items():
        print(
            f"{name:15s} {info['requests']:6d} requests, prompt tokens mean {info['prompt_tokens_mean']:7.1f}"
            f" max {info['prompt_tokens_max']:5d}, output {info['output_tokens_per_request']} -> "
            f"{Path(args.out_dir) / info['file']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
