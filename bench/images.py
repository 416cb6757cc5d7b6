"""Images-in-chat benchmark (issue #47 part 1): chat lines with images, Freight end to end against
vLLM's ``LLM.chat`` on Freight's order and against ``vllm run-batch`` on the file as written.

    python -m bench.images [--repeats 3] [--out FILE]
    python -m bench.images --quick --out /tmp/images-quick.json    # 100 lines over 5 images: the plumbing

The workload: LINES chat lines over IMAGES distinct PNG images (drawn shapes on a gradient, a patch
of noise and a label; edges of 96-768 pixels in 8 aspect ratios; seeded, fresh per repeat) and
TEMPLATES prompt templates. Every line is one system prompt, then a user message of the template's
question, the image as a base64 ``data:`` URL, and a suffix of its own (so no two lines are equal);
line i is template (i // IMAGES) % TEMPLATES of image i % IMAGES, and the file is written shuffled
(seeded): "the file as written". Greedy, exactly OUTPUT_TOKENS output tokens (max_tokens =
min_tokens, ignore_eos). The model is the demo vision-language model (``models/vlm``, ``make
vlm-model``: a random Idefics3, 94 prompt tokens for a square image), served as ``vlm``.

Systems, each on every repeat's lines, at the same limits (the model in the dtype Freight picks
here, max_num_seqs, max_num_batched_tokens, KV cache bytes, max_model_len, prefix caching,
enforce_eager as Freight's worker takes them):

  freight       the live stack (bench/freight_runner.py), the model registered as an operator does
                (``freight models add vlm --path models/vlm``) and its engine worker started (the
                demo model's worker stopped: one engine on the machine, as in the baselines), warm
                on image lines; the file as one batch with the official ``openai`` client, from the
                upload to the poll that saw the batch completed with its output file. Two warm
                stacks side by side in the rotation (CACHE_MODES): ``freight`` with
                FREIGHT_PREFIX_CACHE_SHARING=global and ``freight_tenant`` in Freight's default
                mode, tenant (one tenant: the same hits; what is left is the salt's cost), reported
                as ``tenant_over_global``, the default mode with its own target
                (``freight_tenant_vs_llm_chat_sorted``).
  llm_chat      vLLM's ``LLM.chat`` in-process (bench/images_engine.py, stats logging off), engine
                start-up excluded as Freight's is (a warm stack), on the same lines sorted the way
                Freight sorts them: Freight's own prompt key (``workers.prompt_tokens`` renderer, the
                keyer of ``workers.prompts`` for image lines) of each body with its images replaced
                by ``freight-image:<sha256>`` references (what validation stores), ordered by
                ``scheduler.ordering.sort_records``. The images in two forms: the data URLs of the
                file, and PIL images decoded once per distinct image (``image_pil`` parts, no uuid);
                each with the engine core in a process of its own and inline
                (bench/request_rate.py's two placements). Target: Freight >= 0.95x the fastest of
                the four in each repeat (``freight_vs_llm_chat_sorted``).
  runbatch      ``python -m vllm.entrypoints.openai.run_batch`` on the file as written (shuffled),
                timed as a whole process, engine start-up included (bench/runbatch_baseline.py).
                Target: Freight >= 1.5x (``freight_vs_runbatch``).

Idle systems are paused (SIGSTOP, bench/freeze.py) while one is measured; the order rotates per
repeat. Ratios are lines/s ratios per repeat (every system runs the same lines and writes the same
output tokens), median reported. Prefix-cache hits: Freight's batch usage (cached_tokens), the
engine's ``num_cached_tokens``, run_batch's ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import io
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.provenance import STACK, Run, machine_facts
from bench.scheduler import REPO, RESULTS_DIR, WORK_DIR, log, serving_dtype, write_report

MODEL_DIR = Path("models/vlm")
MODEL_NAME = "vlm"
LINES = 2000
IMAGES = 50
SYSTEM = (
    "You are a careful visual assistant for a warehouse team. You look at one photo of a shelf, a "
    "label or a parcel at a time and answer the question about it in a few plain words, without "
    "guessing what the image does not show."
)
TEMPLATES = ("Describe the image.", "List the colours in the image.", "Is there text in the image?")
OUTPUT_TOKENS = 8
ASPECTS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (2, 1), (1, 2), (3, 2))
EDGE = (96, 768)  # the longer edge, pixels, uniform
QUICK = {"lines": 100, "images": 5, "repeats": 1}
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's LLMEngine default on CPU: what Freight's engine gets
MAX_MODEL_LEN = 2048
KV_BYTES = 256 * 1024**2
ENGINE_CORES = {"process": {}, "inline": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
FORMS = ("data_url", "pil")  # bench/images_engine.py: how LLM.chat is given the images
TARGETS = {
    "freight_vs_llm_chat_sorted": 0.95,
    "freight_vs_runbatch": 1.5,
    "freight_tenant_vs_llm_chat_sorted": 0.95,  # the same in Freight's default cache mode
}
CACHE_MODES = {"freight": "global", "freight_tenant": "tenant"}  # system -> FREIGHT_PREFIX_CACHE_SHARING


# ------------------------------------------------------------------------------------- workload


# the repository paths this benchmark measures: a commit to one makes its result stale (bench/provenance.py)
MEASURES = (
    *STACK,
    "bench/images.py",
    "bench/images_engine.py",
    "bench/engine_baseline.py",
    "bench/runbatch_baseline.py",
    "bench/freight_runner.py",
)


def make_image(rng: random.Random) -> bytes:
    """A PNG of a random size and aspect ratio: shapes on a gradient, a patch of noise (so it does
    not compress to nothing, as photos do not) and a short label."""
    from PIL import Image, ImageDraw

    edge = rng.randint(*EDGE)
    a, b = rng.choice(ASPECTS)
    w, h = (edge, max(32, edge * b // a)) if a >= b else (max(32, edge * a // b), edge)
    background = tuple(rng.randrange(256) for _ in range(3))
    image = Image.blend(
        Image.linear_gradient("L").resize((w, h)).convert("RGB"), Image.new("RGB", (w, h), background), 0.6
    )
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 12)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        box = [x0, y0, x0 + rng.randrange(8, w // 2 + 9), y0 + rng.randrange(8, h // 2 + 9)]
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=colour)
    pw, ph = max(1, w // 4), max(1, h // 4)
    noise = Image.frombytes("RGB", (pw, ph), rng.randbytes(pw * ph * 3))
    image.paste(noise, (rng.randrange(w - pw + 1), rng.randrange(h - ph + 1)))
    draw.text(
        (rng.randrange(w // 2 + 1), rng.randrange(h // 2 + 1)), f"LOT {rng.randrange(1000)}", fill=(0, 0, 0)
    )
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def lines(n: int, images: int, seed: int | str) -> tuple[list[dict[str, Any]], list[bytes]]:
    """``n`` image chat lines over ``images`` distinct images (seeded, fresh per seed), shuffled;
    and the images' bytes. Line i (before the shuffle) is template (i // images) % TEMPLATES of
    image i % images, with a suffix of its own."""
    rng = random.Random(f"images-{seed}")
    pngs = [make_image(rng) for _ in range(images)]
    urls = [data_url(png) for png in pngs]
    out = []
    for i in range(n):
        question = TEMPLATES[(i // images) % len(TEMPLATES)]
        suffix = f" (item {i}: {' '.join(rng.choice(wl.WORDS) for _ in range(3))})"
        content = [
            {"type": "text", "text": question + " "},
            {"type": "image_url", "image_url": {"url": urls[i % images]}},
            {"type": "text", "text": suffix},
        ]
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
        line = wl.request_line(f"img-{seed}-{i:05d}", messages, OUTPUT_TOKENS)  # type: ignore[arg-type]
        line["body"]["model"] = MODEL_NAME
        out.append(line)
    rng.shuffle(out)
    return out, pngs


def stored_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body as Freight's validation stores it: each data: URL replaced by a reference to the
    image's content (workers.images.IMAGE_REF + the sha256 of its bytes)."""
    from workers.images import IMAGE_REF, image_parts, part_url

    out = copy.deepcopy(body)
    for _, part in image_parts(out):
        data = base64.b64decode(str(part_url(part)).partition(",")[2])
        part["image_url"] = {"url": IMAGE_REF + hashlib.sha256(data).hexdigest()}
    return out


def freight_order(model: Path, all_lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines in the order Freight's validation sorts them: Freight's prompt key of each stored
    body (``workers.prompt_tokens.renderer_for``, as ``workers.validation`` renders a line; for an
    image line that is ``workers.prompts.PromptKeyer.key``, the image standing as its digest),
    sorted by ``scheduler.ordering.sort_records`` (the line number breaks ties)."""
    from scheduler.ordering import sort_records
    from storage.settings import Settings
    from workers.prompt_tokens import renderer_for
    from workers.request_bodies import CHAT

    renderer = renderer_for(str(model.resolve()), Settings.from_env({}).sort_key_tokens)
    records = (
        (renderer.render(CHAT, stored_body(line["body"])).key, i, b"") for i, line in enumerate(all_lines)
    )
    return [all_lines[i] for _, i, _ in sort_records(records, memory_bytes=1 << 30)]


def describe(all_lines: list[dict[str, Any]], pngs: list[bytes], path: Path) -> dict[str, Any]:
    from PIL import Image

    sizes = [Image.open(io.BytesIO(png)).size for png in pngs]
    return {
        "lines": len(all_lines),
        "distinct_images": len(pngs),
        "templates": list(TEMPLATES),
        "system_prompt": SYSTEM,
        "file_bytes": path.stat().st_size,
        "image_bytes_mean": round(sum(map(len, pngs)) / len(pngs)),
        "image_bytes_max": max(map(len, pngs)),
        "image_pixels": {
            "min": min(sizes, key=lambda s: s[0] * s[1]),
            "max": max(sizes, key=lambda s: s[0] * s[1]),
        },
        "aspect_ratios": [f"{a}:{b}" for a, b in ASPECTS],
        "output_tokens": OUTPUT_TOKENS,
    }


# ------------------------------------------------------------------------------------ the systems


def freight_stack(work: Path, warm: Path, eager: bool, system: str = "freight") -> Any:
    """A warm Freight stack serving the vision-language model: started (the demo model warms the
    path up), ``freight models add vlm``, the model's engine worker started and the demo model's
    stopped (one engine in the stack, as in the baselines), then the warm-up file of image lines
    run. ``system`` names its cache mode (CACHE_MODES) and its folder."""
    from bench.freight_runner import FreightStack
    from infra.processes import FREIGHT, engine_names, wait_for

    stack = FreightStack(
        work / system, Path("models/demo"), max_num_seqs=MAX_NUM_SEQS, kv_cache_bytes=KV_BYTES,
        max_model_len=MAX_MODEL_LEN, enforce_eager=eager,
        extra_env={"FREIGHT_PREFIX_CACHE_SHARING": CACHE_MODES[system]},
    ).start()  # fmt: skip
    try:
        subprocess.run(
            [*FREIGHT, "models", "add", MODEL_NAME, "--path", str(MODEL_DIR.resolve())],
            cwd=REPO, env=stack.env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        live = stack.stack
        (name,) = engine_names(MODEL_NAME, 1)
        proc = live.spawn(name, [*FREIGHT, "worker", "--model", MODEL_NAME, "--name", f"{name}@%h"])
        wait_for(lambda: live.started(name), f"engine worker {name}", 600, proc, live.log(name))
        (demo,) = engine_names(wl.MODEL_NAME, 1)
        live.stop_process(demo)
        live.processes.pop(demo)
        result = stack.run_jobs([(stack.tenants[0], warm)], timeout=1800)
        if result["errors"]:
            raise RuntimeError(f"image warm-up failed: {result}")
    except BaseException:
        stack.stop()
        raise
    return stack


def limits(eager: bool) -> dict[str, Any]:
    return {
        "model": str(MODEL_DIR),
        "served_model_name": MODEL_NAME,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_bytes": KV_BYTES,
        "enforce_eager": eager,
        "dtype": serving_dtype(MODEL_DIR),
    }


def engine_argv(eager: bool) -> list[str]:
    engine = limits(eager)
    return [
        "--model", engine["model"], "--served-model-name", MODEL_NAME,
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", str(KV_BYTES), "--dtype", engine["dtype"],
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip


def sorted_files(sorted_lines: list[dict[str, Any]], directory: Path, stem: str) -> dict[str, Path]:
    """The sorted lines once on disk, named for each form bench/images_engine.py reads them in."""
    first = directory / f"{stem}.{FORMS[0]}.jsonl"
    wl.write_jsonl(first, sorted_lines)
    files = {FORMS[0]: first}
    for form in FORMS[1:]:
        files[form] = directory / f"{stem}.{form}.jsonl"
        files[form].unlink(missing_ok=True)
        files[form].symlink_to(first.name)
    return files


def cell(run: dict[str, Any], lines_count: int) -> dict[str, Any]:
    """A measured run with its lines/s, prompt tokens/s and prefix-cache hit share."""
    wall, prompt, cached = run.get("wall_s"), run.get("prompt_tokens"), run.get("cached_tokens")
    return {
        **run,
        "lines_per_s": lines_count / wall if wall else None,
        "prompt_tok_s": prompt / wall if wall and prompt else None,
        "cache_hit": cached / prompt if prompt and cached is not None else None,
    }


def measure(systems: dict[str, Any], these: dict[str, Any], r: int, runbatch: Any) -> dict[str, Any]:
    """One repeat: every warm system in turn (the first one rotating), the others paused; each
    engine runs both forms; then run_batch (``runbatch``: a callable, or None to skip it)."""
    roles = list(systems)
    cells: dict[str, Any] = {}
    count = these["lines"]
    for role in roles[r % len(roles) :] + roles[: r % len(roles)]:
        handle = systems[role]
        handle.resume()
        try:
            if role in CACHE_MODES:
                log(f"images: repeat {r + 1}: {role}")
                cells[role] = cell(handle.run_jobs([(handle.tenants[0], these["file"])]), count)
            else:
                for form in FORMS[r % 2 :] + FORMS[: r % 2]:
                    log(f"images: repeat {r + 1}: llm_chat {form}, core {role.removeprefix('engine_')}")
                    cells[f"llm_chat_{form}_{role.removeprefix('engine_')}"] = cell(
                        handle.run(these["sorted"][form]), count
                    )
        finally:
            handle.pause()
    if runbatch is not None:
        log(f"images: repeat {r + 1}: runbatch")
        cells["runbatch"] = cell(runbatch(these["file"], r), count)
    return cells


# ---------------------------------------------------------------------------------------- ratios


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def fastest(cells: dict[str, Any], prefix: str) -> float | None:
    """The shortest wall of the error-free runs whose name starts with ``prefix``."""
    walls = [
        c["wall_s"]
        for n, c in cells.items()
        if n.startswith(prefix) and not c.get("errors") and c.get("wall_s")
    ]
    return min(walls) if walls else None


def wall(cell: dict[str, Any] | None) -> float | None:
    """One system's wall, None where it failed or did not run (a Freight stack: one run a repeat)."""
    return cell["wall_s"] if cell and not cell.get("errors") and cell.get("wall_s") else None


def paired_ratios(repeats: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Lines/s ratios per repeat (walls inverted: every system runs the same lines); a repeat where
    a side failed or did not run counts for none."""
    names = {
        "freight_vs_llm_chat_sorted": "llm_chat_",
        **{f"freight_vs_llm_chat_sorted_{form}": f"llm_chat_{form}_" for form in FORMS},
        "freight_vs_runbatch": "runbatch",
    }
    out: dict[str, list[float]] = {name: [] for name in (*names, "freight_tenant_vs_llm_chat_sorted")}
    out["tenant_over_global"] = []  # the isolation's cost: tenant mode's lines/s over global's
    for cells in repeats:
        freight, tenant = wall(cells.get("freight")), wall(cells.get("freight_tenant"))
        for name, prefix in names.items():
            theirs = fastest(cells, prefix)
            if theirs and freight:
                out[name].append(theirs / freight)
        chat = fastest(cells, "llm_chat_")
        for name, theirs, mine in (
            ("freight_tenant_vs_llm_chat_sorted", chat, tenant),
            ("tenant_over_global", freight, tenant),
        ):
            if theirs and mine:
                out[name].append(theirs / mine)
    return out


def targets(ratios: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    return {
        name: {"value": ratios.get(name), "bound": bound, "pass": (ratios.get(name) or 0) >= bound}
        for name, bound in TARGETS.items()
    }


# ------------------------------------------------------------------------------------------ main


def write_repeats(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each repeat's file as written and its Freight-sorted copies; the first repeat's description."""
    files: list[dict[str, Any]] = []
    described: dict[str, Any] = {}
    for r in range(args.repeats):
        rep = work / f"r{r}"
        rep.mkdir()
        these, pngs = lines(args.lines, args.images, r)
        wl.write_jsonl(rep / "images.jsonl", these)
        sorted_paths = sorted_files(freight_order(MODEL_DIR, these), rep, "sorted")
        files.append({"file": rep / "images.jsonl", "sorted": sorted_paths, "lines": len(these)})
        if r == 0:
            described = describe(these, pngs, rep / "images.jsonl")
    return files, described


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=LINES)
    parser.add_argument("--images", type=int, default=IMAGES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runbatch-repeats", type=int, default=None, help="repeats that run run_batch (all)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager in every system")
    parser.add_argument("--quick", action="store_true", help="100 lines over 5 images, one repeat")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "images.json")
    args = parser.parse_args(argv)
    prov = Run("bench.images", MEASURES, argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    runbatch_repeats = args.repeats if args.runbatch_repeats is None else args.runbatch_repeats

    from bench import runbatch_baseline
    from bench.engine_baseline import EngineServer

    started = time.monotonic()
    work = WORK_DIR / "images"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log(f"images: {args.lines} lines over {args.images} images, {args.repeats} repeats")
    warm_lines, _ = lines(max(40, args.lines // 4), args.images, "warm")
    wl.write_jsonl(work / "warm.jsonl", warm_lines)
    warm_sorted = sorted_files(freight_order(MODEL_DIR, warm_lines), work, "warm-sorted")
    files, workload = write_repeats(args, work)
    engine = limits(args.eager)

    systems: dict[str, Any] = {}
    repeats: list[dict[str, Any]] = []
    freight_settings: dict[str, Any] = {}
    engine_facts: dict[str, Any] = {}
    try:
        for system, sharing in CACHE_MODES.items():
            log(f"images: starting a Freight stack ({system}, {sharing} cache sharing) with the model")
            stack = systems[system] = freight_stack(work, work / "warm.jsonl", args.eager, system)
            freight_settings[system] = stack.settings()
            stack.pause()
        for core, env in ENGINE_CORES.items():
            role = f"engine_{core}"
            log(f"images: starting the in-process engine ({role})")
            warm_args = [a for path in warm_sorted.values() for a in ("--warmup-file", str(path))]
            systems[role] = EngineServer(
                [*engine_argv(args.eager), *warm_args],
                work / f"{role}.log",
                env,
                module="bench.images_engine",
            )
            engine_facts[role] = systems[role].facts
            systems[role].pause()

        def runbatch(path: Path, r: int) -> dict[str, Any]:
            return runbatch_baseline.run(path, work / f"runbatch-{r}", **engine)

        for r, these in enumerate(files):
            repeats.append(measure(systems, these, r, runbatch if r < runbatch_repeats else None))
    finally:
        for handle in systems.values():
            handle.stop()

    paired = paired_ratios(repeats)
    ratios = {name: median(values) for name, values in paired.items()}
    report: dict[str, Any] = {
        "benchmark": "images in chat: Freight end to end vs vLLM's LLM.chat and run_batch (issue #47 part 1)",
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine_facts(),
        "provenance": prov.finish(paired),
        "workload": {
            **workload,
            "repeats": args.repeats,
            "runbatch_repeats": min(runbatch_repeats, args.repeats),
            "fresh_per_repeat": "images, suffixes and the shuffle (seed = the repeat)",
        },
        "settings": {**engine, "engines": engine_facts, "freight": freight_settings},
        "runs": repeats,
        "paired_ratios": paired,
        "ratios": ratios,
        "targets": targets(ratios),
        "notes": (
            "Ratios are lines/s ratios (the other system's wall over Freight's; every system runs the "
            "same lines and writes the same output tokens), per repeat, median reported. "
            "freight_vs_llm_chat_sorted: against the fastest of LLM.chat's four runs of the repeat "
            "(images as data URLs or as PIL images decoded once per image, engine core in a process "
            "of its own or inline), on the lines in Freight's order, engine start-up and warm-up "
            "excluded (Freight's stack is warm too); the _data_url and _pil ratios are against each "
            "form's faster placement. freight_vs_runbatch: run_batch on the file as written, whole "
            "process (engine start-up included). Freight's wall runs from the upload of the file to "
            "the poll that saw its batch completed. Freight runs twice, warm stacks side by side in the "
            "same rotation: freight with FREIGHT_PREFIX_CACHE_SHARING=global and freight_tenant with "
            "the default, tenant (one tenant: the same hits; the difference is the salt's cost); "
            "tenant_over_global is freight's wall over freight_tenant's per repeat, and "
            "freight_tenant_vs_llm_chat_sorted the default mode's target."
        ),
    }
    write_report(args.out, report)
    log(f"written {args.out}: {json.dumps(ratios)}")
    return 0 if all(t["pass"] for t in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
