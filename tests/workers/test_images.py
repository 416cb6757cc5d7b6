"""Images in chat lines at validation (workers/images.py), without an engine: data: URLs and links
fetched from a real HTTP server on 127.0.0.1, each checked, stored once per distinct content and
written back as a reference; every bad image becomes its own line's refusal, named by its part,
never the file's failure. The engine's side (a batch of image lines on a vision model) is
tests/e2e/test_images_live.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import select

from api.services.tenants import create_tenant
from storage.models import Batch
from storage.runtime import Runtime
from storage.shards import read_rows
from storage.status import BatchStatus
from tests import factories
from tests.conftest import now
from tests.factories import data_url, image_bytes, image_line
from workers.images import (
    IMAGE_REF,
    REFUSED_REF,
    ImageRefused,
    ImageResolver,
    check_image,
    data_url_bytes,
    image_key,
    takes_images,
)
from workers.prompts import keyer_for
from workers.request_bodies import RequestError, parse_body
from workers.validation import validate_batch

RED = image_bytes(32, 32, (200, 30, 30))
BLUE = image_bytes(48, 24, (20, 30, 200), "JPEG")


def png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header says ``width`` x ``height`` (its CRC fixed up to match)."""
    data = bytearray(image_bytes(1, 1))
    struct.pack_into(">II", data, 16, width, height)  # IHDR's data starts at byte 16
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# -- pure checks ------------------------------------------------------------------------------------


def test_a_data_url_decodes_within_its_byte_limit() -> None:
    assert data_url_bytes(data_url(RED), 10_000) == RED
    with pytest.raises(ImageRefused) as too_big:
        data_url_bytes(data_url(RED), len(RED) - 1)
    assert too_big.value.code == "image_too_large"
    # refused from the text's length alone: a huge payload is never decoded
    with pytest.raises(ImageRefused) as huge:
        data_url_bytes("data:image/png;base64," + "A" * 4_000_000, 1000)
    assert huge.value.code == "image_too_large" and "limit is 1000" in huge.value.message
    for bad in ("data:image/png;base64,!!!!", "data:text/plain;base64,aGk=", "data:image/png,rawbytes"):
        with pytest.raises(ImageRefused) as refused:
            data_url_bytes(bad, 10_000)
        assert refused.value.code == "invalid_image"


def test_an_image_is_decoded_whole_and_its_pixels_read_from_the_header_first() -> None:
    assert check_image(RED, 10_000) == ("image/png", 32, 32)
    assert check_image(BLUE, 10_000) == ("image/jpeg", 48, 24)
    assert check_image(image_bytes(8, 8, fmt="WEBP"), 100)[0] == "image/webp"
    with pytest.raises(ImageRefused) as big:
        check_image(image_bytes(200, 100), 19_999)
    assert big.value.code == "image_too_large" and "200x100" in big.value.message
    # a PNG whose header claims more pixels than it holds: refused from the header, never decoded
    # (past Pillow's own decompression-bomb limit too)
    for width, height in ((5_000, 5_000), (20_000, 20_000)):
        started = time.monotonic()
        with pytest.raises(ImageRefused) as refused:
            check_image(png_claiming(width, height), 4096 * 4096)
        assert refused.value.code == "image_too_large" and time.monotonic() - started < 0.5
    for bad in (RED[: len(RED) // 2], b"not an image", image_bytes(8, 8, fmt="BMP")):
        with pytest.raises(ImageRefused) as undecodable:
            check_image(bad, 10_000)
        assert undecodable.value.code == "invalid_image"


def test_a_vision_model_is_told_by_its_config() -> None:
    assert takes_images({"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {"depth": 1}})
    assert not takes_images({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})


def test_image_parts_are_checked_for_shape_in_a_tenants_body_and_for_references_at_run_time() -> None:
    line = image_line("a", data_url(RED), model="demo")
    parse_body(factories.CHAT, line["body"])  # a data: URL passes the body's checks
    for part, param in (
        ({"type": "image_url", "image_url": {"url": ""}}, "messages.0.content.0.image_url"),
        ({"type": "image_url", "image_url": "https://x/y.png"}, "messages.0.content.0.image_url"),
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}, "uuid": "u"}, "messages.0.content.0.uuid"),
        ({"type": "image_url", "image_url": {"url": "https://x", "detail": "max"}}, "messages.0.content.0.image_url.detail"),
        ({"type": "input_audio", "input_audio": {}}, "messages.0.content.0"),
    ):  # fmt: skip
        body = {**line["body"], "messages": [{"role": "user", "content": [part]}]}
        with pytest.raises(RequestError) as bad:
            parse_body(factories.CHAT, body)
        assert bad.value.param == param, bad.value
    # a stored body holds references only: a tenant's URL there is not run
    with pytest.raises(RequestError) as unstored:
        parse_body(factories.CHAT, line["body"], validated=True)
    assert "no image validation stored" in unstored.value.message
    refused = {
        "type": "image_url",
        "image_url": {"url": REFUSED_REF},
        "refused": {"code": "image_too_large", "message": "`messages.0.content.0`: too big", "param": "messages.0.content.0"},
    }  # fmt: skip
    body = {**line["body"], "messages": [{"role": "user", "content": [refused]}]}
    with pytest.raises(RequestError) as error:
        parse_body(factories.CHAT, body, validated=True)
    assert (error.value.code, error.value.param) == ("image_too_large", "messages.0.content.0")


def test_the_prompt_key_names_the_image(demo_model) -> None:
    keyer = keyer_for(str(demo_model))

    def key(digest: str, text: str) -> bytes:
        parts = [
            {"type": "image_url", "image_url": {"url": IMAGE_REF + digest}},
            {"type": "text", "text": text},
        ]
        return keyer.key(factories.CHAT, {"messages": [{"role": "user", "content": parts}]})

    a, b = "a" * 64, "b" * 64
    assert key(a, "describe it") == key(a, "describe it")
    assert key(a, "describe it") != key(b, "describe it")
    # one image, two questions: the keys share the image before they part
    first, second = key(a, "describe the colours"), key(a, "count the shapes")
    shared = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert shared > len(key(a, "")) // 2


# -- the resolver on a real store, broker and HTTP server --------------------------------------------


class _Images(BaseHTTPRequestHandler):
    served: dict[str, bytes] = {}
    hits: dict[str, int] = {}

    def do_GET(self) -> None:
        _Images.hits[self.path] = _Images.hits.get(self.path, 0) + 1
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("location", "/red.png")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        data = _Images.served.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("content-length", str(len(data or b"")))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(data or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[str]:
    _Images.served = {
        "/red.png": RED,
        "/blue.jpg": BLUE,
        "/big.png": image_bytes(300, 300, (1, 2, 3), "BMP") * 3,
    }
    _Images.hits = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def rt(settings) -> Iterator[Runtime]:
    runtime = Runtime(
        replace(
            settings,
            image_fetch_allow_private_targets=True,
            image_fetch_timeout_seconds=1.0,
            image_max_bytes=100_000,
            max_file_bytes=4 * 1024 * 1024,
        )
    )
    yield runtime
    runtime.db.dispose()


def resolved(resolver: ImageResolver, url: str) -> dict:
    body = image_line("x", url)["body"]
    assert resolver.resolve("vlm", body)
    return body["messages"][0]["content"][0]


def test_each_distinct_image_is_stored_once_and_each_bad_one_refused_with_its_reason(
    rt, image_server
) -> None:
    resolver = ImageResolver(rt, "batch_images", "tenant_a", lambda model: True)
    red_ref = IMAGE_REF + hashlib.sha256(RED).hexdigest()
    # the same image as a data URL and as a link: one stored object, one reference
    assert resolved(resolver, data_url(RED)) == {"type": "image_url", "image_url": {"url": red_ref}}
    assert resolved(resolver, f"{image_server}/red.png")["image_url"]["url"] == red_ref
    assert resolved(resolver, f"{image_server}/moved.png")["image_url"]["url"] == red_ref  # redirect followed
    for _ in range(3):  # a link seen before is not fetched again
        assert resolved(resolver, f"{image_server}/blue.jpg")["image_url"]["url"].startswith(IMAGE_REF)
    assert _Images.hits["/blue.jpg"] == 1
    stored = sorted(rt.store.list("batches/batch_images/images/"))
    assert stored == sorted(image_key("batch_images", hashlib.sha256(d).hexdigest()) for d in (RED, BLUE))
    assert rt.store.open(stored[0]).read() in (RED, BLUE)

    def refusal(url: str) -> tuple[str, str]:
        part = resolved(resolver, url)
        assert (
            part["image_url"] == {"url": REFUSED_REF} and part["refused"]["param"] == "messages.0.content.0"
        )
        assert part["refused"]["message"].startswith("`messages.0.content.0`: ")
        return part["refused"]["code"], part["refused"]["message"]

    assert refusal(f"{image_server}/missing.png") == (
        "image_fetch_failed",
        "`messages.0.content.0`: fetching the image failed: HTTP 404",
    )
    assert refusal(f"{image_server}/big.png")[0] == "image_too_large"
    code, message = refusal(f"{image_server}/slow.png")
    assert code == "image_fetch_failed" and "no answer within 1 s" in message
    assert refusal("ftp://example.com/a.png")[0] == "invalid_image_url"
    assert refusal(IMAGE_REF + "0" * 64)[0] == "invalid_image_url"  # a tenant cannot name a stored image
    assert refusal(data_url(b"GIF89a broken", "image/gif"))[0] == "invalid_image"
    assert len(list(rt.store.list("batches/batch_images/images/"))) == 2  # nothing refused was stored


def test_an_image_another_resolver_of_the_batch_stored_is_not_checked_again(rt) -> None:
    """Each chunk of a chunked validation has a resolver of its own: an image a chunk before it
    checked and stored is referred to as it is (its stored object stands for the check), while an
    image no resolver of the batch stored yet is still checked. Told apart by a second resolver
    whose pixel limit both images are past; nor written again (``media_files.store_once``: a marker
    put in its place stays)."""
    first = ImageResolver(rt, "batch_chunked", "tenant_a", lambda model: True)
    red_ref = IMAGE_REF + hashlib.sha256(RED).hexdigest()
    assert resolved(first, data_url(RED))["image_url"]["url"] == red_ref
    rt.store.put_chunks(image_key("batch_chunked", red_ref[-64:]), [b"marker"])
    tight = Runtime(replace(rt.settings, image_max_pixels=16))
    try:
        second = ImageResolver(tight, "batch_chunked", "tenant_a", lambda model: True)
        assert resolved(second, data_url(RED))["image_url"]["url"] == red_ref
        with rt.store.open(image_key("batch_chunked", red_ref[-64:])) as stream:
            assert stream.read() == b"marker"
        assert resolved(second, data_url(BLUE))["refused"]["code"] == "image_too_large"
        # another batch's resolver finds nothing of this batch's: it checks the image itself
        other = ImageResolver(tight, "batch_other", "tenant_a", lambda model: True)
        assert resolved(other, data_url(RED))["refused"]["code"] == "image_too_large"
    finally:
        tight.db.dispose()
    assert list(rt.store.list("batches/batch_chunked/images/")) == [
        image_key("batch_chunked", hashlib.sha256(RED).hexdigest())
    ]
    assert not list(rt.store.list("batches/batch_other/images/"))


def test_links_to_private_addresses_are_refused_and_fetching_can_be_turned_off(rt, image_server) -> None:
    closed = replace(rt.settings, image_fetch_allow_private_targets=False)
    resolver = ImageResolver(Runtime(closed), "b1", "tenant_a", lambda model: True)
    part = resolved(resolver, f"{image_server}/red.png")
    assert (
        part["refused"]["code"] == "image_fetch_failed"
        and "not a public address" in part["refused"]["message"]
    )
    assert "FREIGHT_IMAGE_FETCH_ALLOW_PRIVATE_TARGETS" in part["refused"]["message"]
    resolver = ImageResolver(
        Runtime(replace(rt.settings, image_fetch=False)), "b1", "tenant_a", lambda m: True
    )
    assert resolved(resolver, f"{image_server}/red.png")["refused"]["code"] == "image_fetch_disabled"
    assert resolved(resolver, data_url(RED))["image_url"]["url"].startswith(
        IMAGE_REF
    )  # data: URLs still taken
    assert _Images.hits == {}


def test_a_tenants_fetches_in_flight_are_capped_across_processes(rt) -> None:
    slots = rt.queue.image_fetches
    t = time.time()
    taken = [slots.take("tenant_a", f"tok{i}", t, 30, 2) for i in range(3)]
    assert taken == [True, True, False]
    assert slots.take("tenant_b", "other", t, 30, 2)  # another tenant's are its own
    slots.give_back("tenant_a", "tok0")
    assert slots.take("tenant_a", "tok3", t, 30, 2)
    # a holder that died: its slot lapses after its lifetime
    assert not slots.take("tenant_a", "tok4", t, 30, 2)
    assert slots.take("tenant_a", "tok4", t + 31, 30, 2)


def test_a_batch_with_bad_images_validates_and_only_those_lines_carry_errors(rt) -> None:
    """The demo model takes no images: each image line's part is refused for that, the text line is
    untouched, and the batch goes on (an error line each when they run)."""
    tenant, _ = create_tenant(rt.db, "t", now())
    lines = [
        image_line("img", data_url(RED), model="demo"),
        factories.chat_line("text", "hello"),
        image_line("broken", "data:image/png;base64,%%%", model="demo"),
    ]
    batch_id = factories.upload_and_create(rt, tenant.id, lines).id
    validate_batch(rt, batch_id)
    with rt.db.read() as s:
        batch = s.get(Batch, batch_id)
        assert batch is not None and batch.status != BatchStatus.FAILED, batch.errors
        shards = list(s.scalars(select(Batch.id).where(Batch.id == batch_id)))
    assert shards
    rows = {}
    for key in rt.store.list(f"batches/{batch_id}/shards/"):
        for row in read_rows(rt.store, key, 0, 100):
            rows[row.custom_id] = json.loads(row.body_json)
    assert set(rows) == {"img", "text", "broken"}
    assert rows["text"]["messages"] == [{"role": "user", "content": "hello"}]
    for custom_id in ("img", "broken"):
        part = rows[custom_id]["messages"][0]["content"][0]
        assert (
            part["refused"]["code"] == "image_input_not_supported"
            and "'demo' does not take images" in part["refused"]["message"]
        )
        with pytest.raises(RequestError) as at_run_time:
            parse_body(factories.CHAT, rows[custom_id], validated=True)
        assert at_run_time.value.param == "messages.0.content.0"
    assert list(rt.store.list(f"batches/{batch_id}/images/")) == []


def test_a_responses_lines_input_image_is_taken_like_a_chat_image_part(rt) -> None:
    resolver = ImageResolver(rt, "batch_responses", "tenant_a", lambda model: True)
    body = {
        "model": "vlm",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(RED)},
                    {"type": "input_text", "text": "What colour is it?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,@@"},
                ],
            }
        ],
    }
    parse_body("/v1/responses", body)  # the tenant's body passes its shape checks
    assert resolver.resolve("vlm", body)
    good, _, bad = body["input"][0]["content"]
    assert good == {"type": "input_image", "image_url": IMAGE_REF + hashlib.sha256(RED).hexdigest()}
    assert bad["image_url"] == REFUSED_REF and bad["refused"]["code"] == "invalid_image"
    assert bad["refused"]["param"] == "input.0.content.2"
    # when it runs: the refusal is the line's error, naming the Responses part
    with pytest.raises(RequestError) as error:
        parse_body("/v1/responses", body, validated=True)
    assert (error.value.code, error.value.param) == ("invalid_image", "input.0.content.2")
    body["input"][0]["content"].pop()
    parsed = parse_body("/v1/responses", body, validated=True)
    assert parsed.request.messages[0]["content"][0]["image_url"]["url"] == good["image_url"]
