"""`tokenmill serve` with a LLaVA model, driven by the official openai client: image_url parts (data: URIs
and, behind --mm-allow-remote-urls, http URLs on loopback), video_url parts, and bad images that get a 400
while the server keeps serving."""
import base64
import io
import http.server
import threading
import time

import httpx
import openai
import pytest
from PIL import Image

from tokenmill import SamplingParams
from llava_fixtures import build_llava, random_image
from server_fixtures import ServerProcess

GREEDY = dict(temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
GREEDY_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def png_uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def gif_uri(frames) -> str:
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(10)  # far past the fetch timeout: the check below cannot mistake a slow run for it
        if self.path not in ("/cat.png", "/slow.png"):
            self.send_error(404)
            return
        body = base64.b64decode(png_uri(random_image(7)).split(",", 1)[1])
        try:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the slow one: the server gave up on it
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava-serve")
    build_llava(str(path), "llama")
    srv = ServerProcess(str(path), tmp_path_factory.mktemp("llava-log") / "server.log", "--mm-allow-remote-urls",
                        "--mm-fetch-timeout-s", "1", "--mm-max-image-pixels", "40000", "--mm-video-num-frames", "2",
                        "--limit-mm-per-prompt", '{"image": 2, "video": 1}')
    try:
        srv.wait_ready()
        yield srv, str(path)
    finally:
        assert srv.terminate() == 0, srv.logs()


@pytest.fixture(scope="module")
def client(llava_server):
    return openai.OpenAI(base_url=llava_server[0].url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, *parts, **kw):
    content = [{"type": "text", "text": "To be"}, *parts]
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                          **{**GREEDY, **kw})


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def offline(llava_server):
    from conftest import make_llm

    return make_llm(llava_server[1], mm_video_num_frames=2)


def offline_chat(llm, *parts):
    conv = [{"role": "user", "content": [{"type": "text", "text": "To be"}, *parts]}]
    return llm.chat(conv, GREEDY_PARAMS, use_tqdm=False)[0].outputs[0].text


def test_images_and_video_by_data_uri_match_the_offline_engine(client, offline):
    a, b = random_image(1), random_image(2)
    got = ask(client, image_part(png_uri(a)), image_part(png_uri(b)))
    assert got.choices[0].message.content == offline_chat(offline, image_part(png_uri(a)), image_part(png_uri(b)))
    assert got.usage.prompt_tokens > 32  # two images' placeholders
    clip = [random_image(10 + i) for i in range(4)]
    video = {"type": "video_url", "video_url": {"url": gif_uri(clip)}}
    assert ask(client, video).choices[0].message.content == offline_chat(offline, video)
    stream = ask(client, image_part(png_uri(a)), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        offline_chat(offline, image_part(png_uri(a)))


def test_http_image_url_on_loopback(client, offline, image_host):
    got = ask(client, image_part(f"{image_host}/cat.png"))
    assert got.choices[0].message.content == offline_chat(offline, image_part(png_uri(random_image(7))))


@pytest.mark.parametrize("part, message", [
    (image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode()), "could not decode image"),
    (image_part("data:text/plain;base64,aGVsbG8="), "could not decode image"),
    (image_part(png_uri(random_image(3, size=(300, 300)))), "pixel"),
    (image_part("file:///etc/passwd"), "unsupported URL scheme"),
    (image_part("ftp://127.0.0.1/x.png"), "unsupported URL scheme"),
    (image_part("data:image/png;base64,@@@"), "bad data URI"),
])
def test_bad_images_get_a_400_and_the_server_keeps_serving(client, part, message):
    with pytest.raises(openai.BadRequestError, match=message) as e:
        ask(client, part)
    assert e.value.body["param"] == "messages"  # (not the first quoted word of the message: 'file', 'idna')
    assert ask(client, image_part(png_uri(random_image(4)))).choices[0].message.content


def test_an_image_too_thin_to_resize_is_a_400(client):
    """A 1 x N image resizes its short edge up to the model's and its long edge by as much: refused before the
    resize, which for a 1 x 1,000,000 image took 9 s on the tokenizer thread (or ran out of memory)."""
    with pytest.raises(openai.BadRequestError, match="aspect ratio") as e:
        ask(client, image_part(png_uri(Image.new("RGB", (30000, 1)))))
    assert e.value.body["param"] == "messages"


def test_tokenize_counts_the_tokens_the_engine_runs_for_images(llava_server, client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "To be"}, image_part(png_uri(random_image(1))),
                                             image_part(png_uri(random_image(2)))]}]
    count = httpx.post(llava_server[0].url + "/tokenize", json={"model": "tiny", "messages": messages},
                       timeout=60).json()["count"]
    usage = client.chat.completions.create(model="tiny", messages=messages, **GREEDY).usage
    assert count == usage.prompt_tokens


def test_a_slow_image_fetch_holds_up_no_other_request(client, image_host):
    """Images are fetched and decoded on media threads of their own: one request's slow URLs (here two that time
    out, a second each) held the single tokenizer thread, and every other request waited behind them."""
    done = {}

    def slow():
        try:
            ask(client, image_part(f"{image_host}/slow.png"), image_part(f"{image_host}/slow.png"))
        except openai.BadRequestError:
            pass
        done["slow"] = time.monotonic()

    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(0.3)  # the slow request is fetching
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "To be"}],
                                          **GREEDY).choices[0].message.content
    done["text"] = time.monotonic()
    worker.join(30)
    assert done["text"] < done["slow"], done


def test_too_many_images_a_timeout_and_a_404_are_400s(client, image_host):
    with pytest.raises(openai.BadRequestError, match="at most 2 images"):
        ask(client, *[image_part(png_uri(random_image(i))) for i in range(3)])
    t0 = time.time()
    with pytest.raises(openai.BadRequestError, match="timed out"):
        ask(client, image_part(f"{image_host}/slow.png"))
    assert time.time() - t0 < 8
    with pytest.raises(openai.BadRequestError, match="404"):
        ask(client, image_part(f"{image_host}/missing.png"))
    with pytest.raises(openai.BadRequestError, match="content"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}], max_tokens=2)
    assert ask(client, image_part(png_uri(random_image(5)))).choices[0].message.content
