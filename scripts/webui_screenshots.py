"""Screenshots of the built-in web page (docs/images/webui_chat.png, docs/images/webui_engine.png).

Serves SmolLM2-135M-Instruct on CPU in this process, opens the page in headless Debian chromium
(Playwright), has a short chat, then starts a burst of requests that share a long system
prompt (so the block map shows cached and shared blocks next to private ones) and captures the
engine view while they run.

    python scripts/webui_screenshots.py [--out docs] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import requests
from playwright.sync_api import sync_playwright

from jaxserve import EngineConfig, LLMEngine
from jaxserve.server import EngineLoop, ServerConfig, create_app, make_server
from models.registry import model_path

SYSTEM = ("You are a helpful assistant for engineers who run language models. Answer in two "
          "or three short sentences, plainly, without lists. Prefer concrete numbers.")
QUESTIONS = ["Why does a paged KV cache waste less memory?", "What is prefix caching?",
             "What does a batch slot hold?", "When is a request preempted?",
             "Why share KV blocks between requests?", "What is copy-on-write?",
             "What limits decode throughput?", "What is time to first token?",
             "Why bucket shapes for XLA?", "How does block size change fragmentation?"]


def serve_in_thread(engine):
    loop = EngineLoop(engine).start()
    config = ServerConfig(served_model_name="smollm2-135m")
    server = make_server(create_app(loop, config), "127.0.0.1", 0, config)
    threading.Thread(target=server.run, daemon=True).start()
    return loop, server, f"http://127.0.0.1:{server.effective_port}"


def chat(url: str, question: str, max_tokens: int) -> None:
    body = {"model": "smollm2-135m", "max_tokens": max_tokens, "temperature": 0.7,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}
    requests.post(url + "/v1/chat/completions", data=json.dumps(body), timeout=600)


def shoot_chat(page, out: Path) -> None:
    page.fill("#system", SYSTEM)
    page.fill("#max_tokens", "80")
    page.fill("#seed", "3")
    for question in ("What is a paged KV cache, in one paragraph?", "And why do blocks get shared?"):
        page.fill("#prompt", question)
        page.press("#prompt", "Enter")
        page.wait_for_function("[...document.querySelectorAll('li.msg.assistant')]"
                               ".every(li => li.dataset.done === 'true')", timeout=600_000)
    page.screenshot(path=str(out / "webui_chat.png"))


def shoot_engine(page, url: str, out: Path) -> None:
    page.click("#tab-engine")
    time.sleep(3)  # a few idle points on the charts
    threads = [threading.Thread(target=chat, args=(url, q, 96), daemon=True) for q in QUESTIONS]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.3 if i < 6 else 1.0)  # a staggered burst: some wait, some decode
    page.wait_for_function("document.querySelectorAll('#slots tbody tr[data-request-id]')"
                           ".length >= 4", timeout=600_000)
    time.sleep(4)
    page.screenshot(path=str(out / "webui_engine.png"), full_page=True)
    for t in threads:
        t.join(600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/images", type=Path)
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=str(model_path("smollm2-135m")), warmup=False,
                                    max_num_seqs=6, max_model_len=512, block_size=16,
                                    max_num_batched_tokens=256, dtype="float32",
                                    kv_cache_memory=6 * 512 * 2 * 30 * 3 * 64 * 4))
    loop, server, url = serve_in_thread(engine)
    chat(url, "Hello", 4)  # first-use compiles before the camera rolls
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
        page.goto(url + "/")
        shoot_chat(page, args.out)
        shoot_engine(page, url, args.out)
        browser.close()
    server.close()
    loop.stop()
    print(f"wrote {args.out / 'webui_chat.png'} and {args.out / 'webui_engine.png'}")


if __name__ == "__main__":
    main()
