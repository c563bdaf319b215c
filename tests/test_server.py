"""`jitllm serve`'s OpenAI-compatible API over HTTP: replies equal the engine's own generations, streamed or
whole, side by side; bad requests are refused before any token, naming the field; a client that leaves mid-stream
ends its generation."""
import http.client
import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import jitllm_core as jl
from jitllm_core.server import make_server

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(default_model, cpu):
    eng = jl.Engine(default_model, devices=["cpu"])
    server = make_server(eng, port=0, quiet=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield eng, server.server_address[1]
    server.shutdown()
    server.server_close()
    eng.close()


def request(port, method, path, body=None, raw=None):
    """(status, the JSON reply or the list of server-sent event payloads)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method, path, body=raw if raw is not None else (json.dumps(body) if body is not None else None),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read().decode()
    conn.close()
    if r.getheader("Content-Type") == "text/event-stream":
        events = [line[len("data: "):] for line in data.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        return r.status, [json.loads(e) for e in events[:-1]]
    return r.status, json.loads(data)


def test_models_and_health(served):
    eng, port = served
    assert request(port, "GET", "/health") == (200, {"status": "ok"})
    status, models = request(port, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert request(port, "GET", "/v1/nothing")[0] == 404


def test_chat_completion_is_the_engines_reply(served):
    eng, port = served
    want = eng.chat(CHAT, max_tokens=24)
    status, got = request(port, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24,
                                                                 "temperature": 0})
    assert status == 200 and got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert got["choices"][0]["finish_reason"] == {"eos": "stop", "length": "length"}[want.finish_reason]
    assert got["usage"]["completion_tokens"] == len(want.token_ids) and got["usage"]["prompt_tokens"] == \
        want.timings["prompt_tokens"]


def test_streamed_completions_side_by_side(served):
    """Two streams at once (the engine interleaves their steps), each the text a generation alone gives."""
    eng, port = served
    prompts = ["Once upon a time", "The three primary colors are"]
    want = [eng.generate(p, max_tokens=20, ignore_eos=True) for p in prompts]
    got = [None, None]

    def fetch(i):
        got[i] = request(port, "POST", "/v1/completions", {"prompt": prompts[i], "max_tokens": 20, "temperature": 0,
                                                           "ignore_eos": True, "stream": True})
    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (status, chunks), w in zip(got, want):
        assert status == 200 and len(chunks) > 2
        assert "".join(c["choices"][0]["text"] for c in chunks) == w.text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 20
    # a chat stream: the role first, then the content in pieces
    status, chunks = request(port, "POST", "/chat/completions", {"messages": CHAT, "max_tokens": 24,
                                                                 "temperature": 0, "stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == eng.chat(CHAT, max_tokens=24).text


def test_n_choices_are_generations_of_their_own_decoded_together(served, monkeypatch):
    """n choices: each the engine's generation alone (sampled ones seeded seed, seed + 1, ...), whole and streamed
    (each choice's chunks under its index, the usage after them all), their decode steps batched."""
    from jitllm_core import engine as engine_mod
    monkeypatch.setattr(engine_mod, "BATCH_WAIT", 1.0)  # a busy machine's threads still meet (test_batched_decode)
    eng, port = served
    kw = dict(max_tokens=16, temperature=0.9, seed=7)
    want = [eng.generate("Once upon a time", **{**kw, "seed": 7 + i}) for i in range(3)]
    assert len({tuple(w.token_ids) for w in want}) > 1  # the seeds give different replies
    eng.reset_stats()
    status, got = request(port, "POST", "/v1/completions", {"prompt": "Once upon a time", "n": 3, **kw})
    assert status == 200 and [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert [c["text"] for c in got["choices"]] == [w.text for w in want]
    assert got["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    assert got["usage"]["prompt_tokens"] == want[0].timings["prompt_tokens"] and eng.stats["batched_steps"] > 0
    chat = [eng.chat(CHAT, max_tokens=12, temperature=0.9, seed=3 + i).text for i in range(2)]
    status, chunks = request(port, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "n": 2,
                                                                    "temperature": 0.9, "seed": 3, "stream": True})
    assert status == 200 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    for i, text in enumerate(chat):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] in ("stop", "length")
        assert "".join(c["delta"].get("content", "") for c in mine) == text


@pytest.mark.parametrize("body, words", [
    ({"prompt": "Hi", "temperature": -1}, "temperature must be a finite number >= 0"),
    ({"prompt": "Hi", "max_tokens": -3}, "max_tokens must be a whole number >= 0"),
    ({"prompt": "Hi", "n": 0}, "n must be a whole number from 1 to 4 (the server's --max-sequences)"),
    ({"prompt": "Hi", "n": 5}, "n must be a whole number from 1 to 4"),
    ({"prompt": "Hi", "tools": [{"type": "function"}]}, "tools is not supported"),
    ({"prompt": "Hi", "logprobs": 50}, "at most 20 log probabilities per token"),
    ({"prompt": "Hi", "logprobs": -1}, "logprobs must be a whole number >= 0"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"prompt": {"text": "Hi"}}, "prompt must be a string or a list of token ids"),
    ({"prompt": ["a", "b", "c"], "n": 2}, "3 prompts x n = 6 generations; at most 4 at once"),
    ({"prompt": ""}, "the prompt is empty"),
    ({"prompt": "", "echo": True, "max_tokens": 0}, "the prompt has 0 tokens; echo scores 1 to max_context"),
    ({"prompt": "Hi", "stop": [""]}, "stop is a non-empty string or a list of them"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts are supported"),
    ([1, 2], "the request body must be a JSON object"),
])
def test_bad_requests_are_refused_naming_the_field(served, body, words):
    eng, port = served
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    status, reply = request(port, "POST", path, body)
    assert status == 400 and words in reply["error"]["message"], reply
    assert request(port, "POST", "/v1/completions", raw="{not json")[0] == 400


def log_softmax(row):
    z = row.astype(np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def test_completion_logprobs_are_the_models(served):
    """Each token's log probability (and its likeliest alternatives) against the engine's own scores of the
    prompt and reply, an independent path (a prefill of every position)."""
    eng, port = served
    status, got = request(port, "POST", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True, "logprobs": 3})
    assert status == 200
    lp, prompt = got["choices"][0]["logprobs"], eng.tokenizer.encode("The capital of France is")
    out = eng.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    rows = eng.score(prompt + out)[len(prompt) - 1:-1]
    assert lp["tokens"] == [eng.tokenizer.token_to_piece(t) for t in out]
    for row, tok, value, top in zip(rows, out, lp["token_logprobs"], lp["top_logprobs"]):
        want = log_softmax(row)
        assert abs(value - want[tok]) < 1e-3 and len(top) == 3
        assert abs(max(top.values()) - want.max()) < 1e-3 and top[eng.tokenizer.token_to_piece(tok)] == value  # greedy


def test_echo_scores_the_prompt(served):
    """lm-evaluation-harness's log-likelihood request: the prompt echoed with its tokens' log probabilities, no
    token generated."""
    eng, port = served
    text = "Paris is the capital of France."
    status, got = request(port, "POST", "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True,
                                                           "logprobs": 1})
    ids = eng.tokenizer.encode(text)
    want = [log_softmax(row)[t] for row, t in zip(eng.score(ids)[:-1], ids[1:])]
    choice = got["choices"][0]
    assert status == 200 and choice["text"] == eng.tokenizer.decode(ids)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert np.allclose(choice["logprobs"]["token_logprobs"][1:], want, atol=1e-4)
    assert got["usage"]["prompt_tokens"] == len(ids) and got["usage"]["completion_tokens"] == 0


def test_a_batch_of_prompts(served):
    """A completion's list of prompts (lm-evaluation-harness batches its requests so): n choices per prompt, in
    order, each the engine's generation; echoed and scored, each prompt's log probabilities its own."""
    eng, port = served
    prompts = ["Once upon a time", eng.tokenizer.encode("The three primary colors are")]
    status, got = request(port, "POST", "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 10,
                                                           "temperature": 0})
    want = [eng.generate(p, max_tokens=10).text for p in prompts]
    assert status == 200 and [c["text"] for c in got["choices"]] == [want[0], want[0], want[1], want[1]]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert got["usage"]["prompt_tokens"] == sum(len(eng.encode(p)) for p in prompts)
    texts = ["Paris is the capital of France.", "Water boils at 100 degrees."]
    status, got = request(port, "POST", "/v1/completions", {"prompt": texts, "max_tokens": 0, "echo": True,
                                                           "logprobs": 1})
    for choice, text in zip(got["choices"], texts):
        ids = eng.tokenizer.encode(text)
        want = [log_softmax(row)[t] for row, t in zip(eng.score(ids)[:-1], ids[1:])]
        assert choice["text"] == eng.tokenizer.decode(ids)
        assert np.allclose(choice["logprobs"]["token_logprobs"][1:], want, atol=1e-4)
    assert status == 200 and len(got["choices"]) == 2


def test_chat_logprobs_streamed_and_whole(served):
    eng, port = served
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    status, whole = request(port, "POST", "/v1/chat/completions", body)
    content = whole["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == whole["usage"]["completion_tokens"]
    assert "".join(c["token"] for c in content) .startswith(whole["choices"][0]["message"]["content"])
    assert all(len(c["top_logprobs"]) == 2 and bytes(c["bytes"]).decode() == c["token"] for c in content)
    status, chunks = request(port, "POST", "/v1/chat/completions", {**body, "stream": True})
    streamed = [c for ch in chunks for c in (ch["choices"][0].get("logprobs") or {}).get("content", [])]
    assert [c["logprob"] for c in streamed] == [c["logprob"] for c in content[:len(streamed)]]
    assert len(streamed) >= len(content) - 1  # a stop string's last token sends no text


def test_the_official_openai_client(served):
    """OpenAI's own Python client, unchanged, against the server: a chat, a stream, a completion's log
    probabilities, and a bad option as the client's BadRequestError."""
    openai = pytest.importorskip("openai")
    eng, port = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == eng.chat(CHAT, max_tokens=24).text and r.usage.completion_tokens > 0
    parts = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts) == r.choices[0].message.content
    c = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == 5 and c.choices[0].text == \
        eng.generate("Once upon a time", max_tokens=5).text
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="Hi", temperature=-2)


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_leaves_ends_its_generation(served, n):
    """A client that leaves mid-stream ends its generation: every one of its n choices'."""
    eng, port = served
    with socket.create_connection(("127.0.0.1", port)) as s:
        body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True,
                           "stream": True, "n": n}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        seen = b""
        while b"data: " not in seen:  # streaming has begun
            seen += s.recv(4096)
    for _ in range(200):  # the server notices at its next write (a whole reply would take half a minute)
        if len(eng.sequences) == len(eng.parked):  # no generation under way: its sequence parked, pages kept
            break
        threading.Event().wait(0.05)
    steps = eng.stats["steps"]
    threading.Event().wait(0.3)
    assert eng.stats["steps"] == steps and len(eng.sequences) == len(eng.parked)
    assert request(port, "GET", "/health")[0] == 200


def test_serve_command_refuses_a_bad_port():
    out = subprocess.run([sys.executable, "-m", "jitllm_core.cli", "serve", "--port", "-1"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "port must be a whole number >= 0" in out.stderr
