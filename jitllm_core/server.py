"""`jitllm serve`: the engine behind an OpenAI-compatible HTTP API (the standard library's threading server).

POST /v1/chat/completions and /v1/completions (whole replies, or server-sent events with "stream": true;
log probabilities, and a completion's prompt echoed with its own: what evaluation harnesses ask), GET /v1/models
and /health. Each request runs in its own thread; the engine decodes the requests' replies together (the decode
steps they wait for at once run as one batched step, up to `--max-sequences` of them; prompts take their steps in
turn), so replies stream side by side -- and so do a request's `n` choices, each a generation of its own. A
request's options are checked before any token (400, naming the option); a client that goes away mid-stream
ends its generations (their sequences parked for the prompt cache, as any finished one's).
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .engine import log_probs
from .errors import JitllmError, check_whole, is_whole

# OpenAI's finish reasons for the engine's: the context filling up is a length limit too
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
# request fields that change what OpenAI returns, which this server does not compute: refused, not ignored
UNSUPPORTED = ("best_of", "suffix", "tools", "functions", "response_format", "logit_bias")
MAX_LOGPROBS = 20  # alternatives per token, at most (OpenAI's limit)


class BadRequest(JitllmError):
    """A request the API refuses (400), naming the field."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


def _options(body, eng, chat):
    """The engine's generate options from a request body (OpenAI's names and defaults; top_k and ignore_eos as
    llama.cpp's server takes them)."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], {}):
            raise BadRequest(f"{name} is not supported by this server", name)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    # each value checked by generate, which names it: the reply to a bad one is a 400 before any token
    return {"max_tokens": eng.max_context if limit is None else limit, "logprobs": _logprobs(body, chat),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "top_k": body.get("top_k", 0), "seed": body.get("seed"), "stop": body.get("stop"),
            "ignore_eos": bool(body.get("ignore_eos", False))}


def _prompts(body):
    """A completion's prompts: a string or token ids, or a list of those (a batch of prompts)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or isinstance(prompt, list) and all(map(is_whole, prompt)):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) or isinstance(p, list) and all(map(is_whole, p))
                                        for p in prompt):
        return prompt
    raise BadRequest("prompt must be a string or a list of token ids (or a list of such prompts)", "prompt")


def _choices(body, eng, prompts):
    """The choices a request asks for per prompt (OpenAI's n): its `prompts` x n generations at most the
    sequences the engine decodes at once."""
    n, most = body.get("n", 1), eng.model.sequences
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise BadRequest(f"n must be a whole number from 1 to {most} (the server's --max-sequences)", "n")
    if prompts * n > most:
        raise BadRequest(f"{prompts} prompts x n = {prompts * n} generations; at most {most} at once (the server's "
                         "--max-sequences)", "prompt")
    return n


def _logprobs(body, chat):
    """Alternatives per token the request asks for, None for no log probabilities: a completion's logprobs: N, a
    chat's logprobs: true with top_logprobs: N."""
    field = "top_logprobs" if chat else "logprobs"
    if chat and body.get("top_logprobs") and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true", field)
    n = (body.get("top_logprobs", 0) if body.get("logprobs") else None) if chat else body.get("logprobs")
    if n is None or n is False:
        return None
    try:
        check_whole(field, n, 0)
    except JitllmError as e:
        raise BadRequest(str(e), field) from None
    if n > MAX_LOGPROBS:
        raise BadRequest(f"at most {MAX_LOGPROBS} log probabilities per token", field)
    return n


def _messages(body):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] needs a role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            m = {**m, "content": "".join(p["text"] for p in content)}
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be text", "messages")
        messages[i] = m
    return messages


class Api:
    """The routes, over one engine."""

    def __init__(self, eng, name=None):
        self.eng = eng
        self.name = name or Path(eng.model_path).name

    def models(self):
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "jitllm",
                                            "created": 0}]}

    def start(self, path, body):
        """A Request for a POST, every option checked."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        chat = path == "/v1/chat/completions"
        options = _options(body, self.eng, chat)
        prompts = [self.eng.apply_chat_template(_messages(body))] if chat else _prompts(body)
        echo = bool(body.get("echo")) and not chat
        ids = [self.eng.encode(p) for p in prompts]
        for one in ids if echo else ():  # scored whole: as a prompt, within the context
            if not 0 < len(one) <= self.eng.max_context:
                raise BadRequest(f"the prompt has {len(one)} tokens; echo scores 1 to max_context "
                                 f"({self.eng.max_context})", "prompt")
        generates = not echo or options["max_tokens"]
        n = _choices(body, self.eng, len(prompts) if generates else 0)
        # each choice a generation of its own (decoded together: `Engine._decode`), a seed given seeding each apart
        seed, choices = options.pop("seed"), []
        for one in ids:
            for _ in range(n):
                stream = self.eng.generate(one, stream=True, seed=seed + len(choices) if is_whole(seed) else seed,
                                           **options) if generates else None
                choices.append(Choice(one, echo, stream))
        return Request(self, chat, choices, options["logprobs"], sum(map(len, ids)))

    def pieces(self, ids, lps):
        """A completion's logprobs object for tokens and their (logprob, alternatives), None where unknown."""
        tok = self.eng.tokenizer
        return {"tokens": [tok.token_to_piece(i) for i in ids],
                "token_logprobs": [lp and lp[0] for lp in lps],
                "top_logprobs": [lp and {tok.token_to_piece(i): v for i, v in lp[1]} for lp in lps]}

    def chat_pieces(self, ids, lps):
        """A chat's logprobs object: each token with its bytes and alternatives."""
        tok = self.eng.tokenizer

        def one(i, v):
            piece = tok.token_to_piece(i)
            return {"token": piece, "logprob": v, "bytes": list(piece.encode())}
        return {"content": [{**one(i, lp[0]), "top_logprobs": [one(j, v) for j, v in lp[1]]}
                            for i, lp in zip(ids, lps)]}


@dataclass
class Choice:
    """One choice of a request: its prompt's token ids (scored and prepended where echoed) and its generation
    (None: the prompt echoed alone)."""
    ids: list
    echo: bool
    stream: object = None


class Request:
    """One POST's choices (n per prompt), each a generation of its own: the reply whole, or as server-sent event
    payloads."""

    def __init__(self, api, chat, choices, logprobs, prompt_tokens):
        self.api, self.chat, self.choices, self.logprobs = api, chat, choices, logprobs
        self.prompt_tokens = prompt_tokens  # each prompt's once
        self.kind = "chat.completion" if chat else "text_completion"
        self.closed = threading.Event()  # set: the choices' threads stop after their current token
        self.runner = None  # the thread running a streamed reply's choices (more than one)

    def close(self):
        """End every choice's generation (each parks or frees its sequence, finished or not): after the threads
        that iterate them have stopped (a generator is closed from no thread while another runs it)."""
        self.closed.set()
        if self.runner is not None:
            self.runner.join()
        for c in self.choices:
            if c.stream is not None:
                c.stream.close()

    def _echoes(self):
        """Each echoed prompt (by its ids' identity) as its text and its tokens' (logprob, alternatives) (the first
        has none): scored once, however many choices it has."""
        out, tok = {}, self.api.eng.tokenizer
        for c in self.choices:
            if c.echo and id(c.ids) not in out:
                lps = None
                if self.logprobs is not None:
                    logits = self.api.eng.score(c.ids)
                    lps = [None] + [log_probs(logits[i - 1], c.ids[i], self.logprobs) for i in range(1, len(c.ids))]
                out[id(c.ids)] = tok.decode(c.ids), c.ids, lps
        return out

    def _usage(self):
        """Each prompt's tokens once, every choice's completion tokens."""
        done = sum(len(c.stream.result.token_ids) for c in self.choices if c.stream is not None)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def _at_once(self, work):
        """work(i, choice) for every choice, each in a thread of its own but the first (their generations decode
        together); the first error raised again here."""
        errors = []

        def run(i, c):
            try:
                work(i, c)
            except BaseException as e:  # noqa: BLE001 -- raised again in the request's thread
                errors.append(e)
                self.closed.set()
        threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(self.choices)][1:]
        for t in threads:
            t.start()
        run(0, self.choices[0])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _drain(self, i, choice):
        for _ in choice.stream or ():
            if self.closed.is_set():
                break

    def reply(self, created, rid):
        """The whole reply, once every choice's generation ends."""
        echoes = self._echoes()
        self._at_once(self._drain)
        choices = []
        for i, c in enumerate(self.choices):
            text, ids, lps = echoes[id(c.ids)] if c.echo else ("", [], [])
            r = c.stream.result if c.stream is not None else None
            if r is not None:
                text, ids, lps = text + r.text, ids + r.token_ids, (lps or []) + (r.logprobs or [])
            if self.chat:
                choice = {"message": {"role": "assistant", "content": text},
                          "logprobs": None if self.logprobs is None else self.api.chat_pieces(ids, lps)}
            else:
                choice = {"text": text, "logprobs": None if self.logprobs is None else self.api.pieces(ids, lps)}
            choices.append({"index": i, **choice, "finish_reason": FINISH[r.finish_reason if r else "length"]})
        return {"id": rid, "object": self.kind, "created": created, "model": self.api.name, "choices": choices,
                "usage": self._usage()}

    def chunks(self, created, rid):
        """The reply as server-sent event payloads, each choice's (a completion's echoed prompt first) as its
        tokens come, its last carrying its finish reason; the usage on the last chunk of a single choice, or on a
        chunk of its own after several."""
        base = {"id": rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": created, "model": self.api.name}
        echoes = self._echoes()

        def choice_chunks(i, c):
            first = True

            def chunk(text, ids, lps, finish=None):
                nonlocal first
                if self.chat:
                    part = {"delta": {"role": "assistant", "content": text} if first else {"content": text}}
                    if self.logprobs is not None:
                        part["logprobs"] = self.api.chat_pieces(ids, lps)
                else:
                    part = {"text": text, "logprobs": None if self.logprobs is None else self.api.pieces(ids, lps)}
                first = False
                return {**base, "choices": [{"index": i, **part, "finish_reason": finish}]}
            if c.echo:
                text, ids, lps = echoes[id(c.ids)]
                yield chunk(text, ids, lps or [None] * len(ids))
            reason = "length"
            if c.stream is not None:
                for ev in c.stream:
                    if self.closed.is_set():
                        return
                    if ev.text or first or ev.logprob:
                        yield chunk(ev.text, [ev.token_id], [ev.logprob])
                reason = c.stream.result.finish_reason
            yield chunk("", [], [], FINISH[reason])
        if len(self.choices) == 1:
            last = None
            for last in choice_chunks(0, self.choices[0]):
                if last["choices"][0]["finish_reason"] is None:
                    yield last
            yield {**last, "usage": self._usage()}
            return
        out, done, failed = queue.Queue(), object(), []

        def work(i, c):
            try:
                for part in choice_chunks(i, c):
                    out.put(part)
            finally:
                out.put(done)

        def run_all():
            try:
                self._at_once(work)
            except BaseException as e:  # noqa: BLE001 -- raised again below, in the request's thread
                failed.append(e)
        self.runner = threading.Thread(target=run_all, daemon=True)
        self.runner.start()
        ended = 0
        while ended < len(self.choices):
            part = out.get()
            if part is done:
                ended += 1
            else:
                yield part
        self.runner.join()
        if failed:
            raise failed[0]
        yield {**base, "choices": [], "usage": self._usage()}


class Handler(BaseHTTPRequestHandler):
    api: Api = None  # set by make_server
    protocol_version = "HTTP/1.1"
    quiet = False

    def log_message(self, fmt, *args):
        if not self.quiet:
            super().log_message(fmt, *args)

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, message, param=None, kind="invalid_request_error"):
        self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

    def do_GET(self):
        if self.path in ("/v1/models", "/models"):
            self._send(200, self.api.models())
        elif self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self):
        path = self.path if self.path.startswith("/v1/") else "/v1" + self.path
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._error(404, f"no route POST {self.path}")
            return
        try:
            size = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(size) or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            self._error(400, f"the request body is not JSON: {e}")
            return
        try:
            req = self.api.start(path, body)
        except BadRequest as e:
            self._error(400, str(e), e.param)
            return
        except JitllmError as e:  # the engine's own checks (an option's value, the context limit)
            self._error(400, str(e))
            return
        created, rid = int(time.time()), f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            if body.get("stream"):
                self._stream(req.chunks(created, rid))
            else:
                self._send(200, req.reply(created, rid))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left: its generation ends below
        except JitllmError as e:  # e.g. the engine closed mid-reply
            if not body.get("stream"):
                self._error(500, str(e), kind="server_error")
        finally:
            req.close()

    def _stream(self, chunks):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for chunk in chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def make_server(eng, host="127.0.0.1", port=8080, name=None, quiet=False):
    """A ThreadingHTTPServer serving eng (port 0: any free port, `server.server_address[1]`)."""
    handler = type("JitllmHandler", (Handler,), {"api": Api(eng, name), "quiet": quiet})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
