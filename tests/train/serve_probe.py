#!/usr/bin/env python3
"""Client side of tests/train/serve_robustness_test.sh: drives `megatron serve` (a tiny random model
with a byte-level BPE vocabulary, so sampled tokens split characters all the time) as users and
hostile clients would. Standard library only. Exits non-zero with a message at the first failure.

  serve_probe.py vocab DIR          write a 256-byte GPT-2-format vocabulary (+ <|endoftext|>)
  serve_probe.py stdout-utf8 FILE   the file is valid UTF-8 (`megatron generate` output)
  serve_probe.py URL STEP...        run the steps in order against the server at URL:
    utf8                            UTF-8 prompts, invalid bytes, typed fields, n / echo / stop
    sweep=N                         N seeded sampling requests: all 200, JSON, valid UTF-8
    load=TIMEOUT                    144 connections (128 idle, 16 half-sent) beside a real request
    busy                            --max-queued-requests 1: 503 with Retry-After while busy
"""
import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse


def fail(msg):
    print("FAIL:", msg, flush=True)
    sys.exit(1)


def bytes_to_unicode():
    # GPT-2's byte <-> printable character table (openai/gpt-2 encoder.py).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def write_vocab(d):
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = 256
    with open(f"{d}/vocab.json", "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(f"{d}/merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")


class Client:
    def __init__(self, url, timeout=30):
        u = urllib.parse.urlparse(url)
        self.host, self.port, self.timeout = u.hostname, u.port, timeout
        self.conn = None

    def request(self, method, path, body):
        """(status, raw body bytes, headers); body: bytes or a JSON-able object."""
        data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode("utf-8")
        for attempt in range(2):  # the server may have closed an idle keep-alive connection
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                return r.status, r.read(), dict(r.getheaders())
            except (ConnectionError, http.client.BadStatusLine, http.client.RemoteDisconnected):
                self.conn.close()
                self.conn = None
                if attempt == 1:
                    raise

    def json(self, method, path, body, want_status=200):
        status, raw, _ = self.request(method, path, body)
        try:
            text = raw.decode("utf-8")  # strict: a reply must be valid UTF-8
        except UnicodeDecodeError as e:
            fail(f"{method} {path} {body!r}: reply is not UTF-8 ({e}): {raw[:200]!r}")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            fail(f"{method} {path} {body!r}: reply is not JSON ({e}): {text[:200]}")
        if status != want_status:
            fail(f"{method} {path} {body!r}: HTTP {status}, expected {want_status}: {text[:300]}")
        return doc


def expect_error(c, method, path, body, *parts, status=400):
    doc = c.json(method, path, body, want_status=status)
    msg = doc.get("error", "")
    for p in parts:
        if p not in msg:
            fail(f"{body!r}: error '{msg}' does not mention '{p}'")


def check_utf8(url):
    c = Client(url)
    prompts = ["héllo wörld", "😀 emoji 🎉", "日本語のテキスト", "Привет, мир", "mixed: ÿ € 𝄞 ✓"]
    # Megatron's API: the text starts with the prompt exactly; segments concatenate to the text.
    for seed in range(4):
        doc = c.json("PUT", "/api", {"prompts": prompts, "tokens_to_generate": 12, "random_seed": seed})
        for p, t, seg in zip(prompts, doc["text"], doc["segments"]):
            if not t.startswith(p):
                fail(f"/api text {t!r} does not start with the prompt {p!r}")
            if "".join(seg) != t:
                fail(f"/api segments {seg!r} do not concatenate to {t!r}")
        doc = c.json("POST", "/v1/completions", {"prompt": prompts, "max_tokens": 12, "seed": seed, "echo": True})
        for p, ch in zip(prompts, doc["choices"]):
            if not ch["text"].startswith(p):
                fail(f"echo: {ch['text']!r} does not start with {p!r}")
    # Raw invalid bytes in a prompt: 400 naming the field (today: 500).
    expect_error(c, "PUT", "/api", b'{"prompts": ["ok", "a\xff b"]}', "'prompts[1]'", "not valid UTF-8", "0xFF")
    expect_error(c, "POST", "/v1/completions", b'{"prompt": "caf\xc3", "max_tokens": 2}', "'prompt'", "0xC3")
    expect_error(c, "POST", "/v1/completions", b'{"prompt": "x", "\xed\xa0\x80": 1}', "a key", "0xED")
    expect_error(c, "PUT", "/api", b'{"prompts": ["\\ud800"]}', "not valid JSON")  # a lone surrogate escape
    # Fields validated as the type they are, the value named as given.
    expect_error(c, "PUT", "/api", {"prompts": ["a"], "random_seed": -1}, "'random_seed'", "got -1")
    expect_error(c, "PUT", "/api", {"prompts": ["a"], "tokens_to_generate": 3.7}, "'tokens_to_generate'", "got 3.7")
    expect_error(c, "PUT", "/api", b'{"prompts": ["a"], "tokens_to_generate": 9223372036854775808}',
                 "'tokens_to_generate'", "got 9223372036854775808")
    # The largest value is accepted and generates up to the context (the baseline crashed on it).
    doc = c.json("PUT", "/api", b'{"prompts": ["a"], "tokens_to_generate": 9223372036854775807, "top_k": 1}')
    if len(doc["segments"][0]) != 64:
        fail(f"tokens_to_generate 2^63 - 1 did not fill the context of 64 tokens: {doc}")
    expect_error(c, "PUT", "/api", {"prompts": ["a"], "top_k": 2.5}, "'top_k'", "got 2.5")
    expect_error(c, "PUT", "/api", {"prompts": ["a"], "temperature": "hot"}, "'temperature'", '"hot"')
    expect_error(c, "PUT", "/api", {"prompts": ["a"], "beam_width": 2}, "'beam_width'", "not supported")
    expect_error(c, "POST", "/v1/completions", {"prompt": "a", "seed": -5}, "'seed'", "got -5")
    expect_error(c, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 1e30}, "'max_tokens'", "got 1e+30")
    expect_error(c, "POST", "/v1/completions", {"prompt": "a", "n": 0}, "'n'", "got 0")
    expect_error(c, "POST", "/v1/completions", {"prompt": "a", "stream": True}, "'stream'", "not supported")
    expect_error(c, "POST", "/v1/completions", {"prompt": "a", "best_of": 3}, "'best_of'", "not supported")
    expect_error(c, "POST", "/v1/completions", {"prompt": "a", "logprobs": 5}, "'logprobs'", "not supported")
    # n: 3 completions per prompt, each its own sample (OpenAI's order: prompt-major).
    doc = c.json("POST", "/v1/completions", {"prompt": ["Once", "Twice"], "max_tokens": 16, "n": 3, "seed": 7})
    if [ch["index"] for ch in doc["choices"]] != list(range(6)):
        fail(f"n=3 for 2 prompts: {doc['choices']}")
    if len({ch["text"] for ch in doc["choices"][:3]}) < 2:
        fail(f"n=3: the completions of one prompt are all equal: {doc['choices'][:3]}")
    # stop: the text ends before the first stop string.
    doc = c.json("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 24, "seed": 3})
    full = doc["choices"][0]["text"]
    if len(full) >= 4:
        stop = full[2:4]
        doc = c.json("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 24, "seed": 3, "stop": [stop]})
        ch = doc["choices"][0]
        if ch["text"] != full[: full.find(stop)] or ch["finish_reason"] != "stop":
            fail(f"stop {stop!r}: {ch} (full text {full!r})")
    print("utf8: OK", flush=True)


def sweep(url, n):
    c = Client(url)
    t0 = time.time()
    for i in range(n):
        if i % 3 == 0:
            doc = c.json("PUT", "/api", {"prompts": ["The sea", "日本"], "tokens_to_generate": 10, "random_seed": i,
                                         "temperature": 1.0 + (i % 4) * 0.5})
            texts = doc["text"]
        else:
            doc = c.json("POST", "/v1/completions", {"prompt": "Call me", "max_tokens": 10, "seed": i,
                                                     "temperature": 1.5, "top_p": 0.99 if i % 2 else 1.0})
            texts = [ch["text"] for ch in doc["choices"]]
        for t in texts:
            try:
                t.encode("utf-8")  # no lone surrogates (\\ud800 escapes) either
            except (UnicodeEncodeError, AttributeError) as e:
                fail(f"request {i}: text {t!r}: {e}")
    print(f"sweep: {n} requests, all 200 with valid UTF-8 JSON, in {time.time() - t0:.2f} s", flush=True)


def load(url, timeout):
    """128 idle connections and 16 half-sent bodies, opened within the read timeout (a burst the
    listen backlog must hold), stay open while a real request is made: it must be answered within
    the server's read timeout; then the server must have closed the stalled connections itself
    (idle ones after the keep-alive timeout, half-sent bodies after the read timeout)."""
    u = urllib.parse.urlparse(url)
    idle, half = [], []
    t_connect = time.time()
    for _ in range(128):
        idle.append(socket.create_connection((u.hostname, u.port)))
    for _ in range(16):
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                  b'{"prompts": ["stalled')
        half.append(s)
    connect_s = time.time() - t_connect
    if connect_s >= timeout:  # a listen backlog of 5: dropped SYNs wait >= 1 s for retransmission
        fail(f"opening 144 connections took {connect_s:.2f} s")
    time.sleep(0.2)
    opened = time.time()
    c = Client(url, timeout=timeout)
    t0 = time.time()
    try:
        c.json("PUT", "/api", {"prompts": ["a real request"], "tokens_to_generate": 4, "random_seed": 1})
    except socket.timeout:
        fail(f"a valid request beside 128 idle and 16 half-sent connections got no answer in {timeout} s "
             "(the server's read timeout)")
    took = time.time() - t0
    if took >= timeout:
        fail(f"a valid request took {took:.2f} s beside idle connections (read timeout {timeout} s)")
    # The server closes what stalls: every stalled socket sees EOF (or an error reply, then EOF).
    # A half-sent body: the read times out, then the connection waits out a keep-alive timeout.
    bound = 2 * timeout + 2.0
    deadline = opened + bound
    for s in idle + half:
        s.settimeout(max(0.05, deadline - time.time()))
        try:
            while s.recv(4096):
                pass
        except socket.timeout:
            fail(f"a stalled connection was still open {bound:.1f} s later (read timeout {timeout} s)")
        except ConnectionError:
            pass
        s.close()
    print(f"load: 144 connections opened in {connect_s:.2f} s; a valid request answered in {took:.3f} s beside "
          f"them (128 idle + 16 half-sent); all "
          f"stalled connections closed by the server within {time.time() - opened:.1f} s", flush=True)


def busy(url):
    """One long request generates; requests beside it get 503 + Retry-After; afterwards 200 again."""
    long_result = {}

    def run_long():
        t = time.time()
        long_result["doc"] = Client(url, timeout=120).json("PUT", "/api", {"prompts": ["x"] * 48,
                                                                          "tokens_to_generate": 60})
        long_result["took"], long_result["end"] = time.time() - t, time.time()

    th = threading.Thread(target=run_long)
    th.start()
    time.sleep(0.2)
    answers = []  # (answered at, status)
    for _ in range(5):
        status, raw, headers = Client(url).request("POST", "/v1/completions", {"prompt": "y", "max_tokens": 2})
        answers.append((time.time(), status))
        doc = json.loads(raw.decode("utf-8"))
        if status == 503 and ("busy" not in doc.get("error", "") or headers.get("Retry-After") != "1"):
            fail(f"503 without the message or Retry-After: {doc} {headers}")
    th.join()
    if "doc" not in long_result:
        fail("the long request failed")
    during = [status for at, status in answers if at < long_result["end"]]
    if not during:
        fail(f"inconclusive: the long request ended ({long_result['took']:.2f} s) before the others were answered")
    if during != [503] * len(during):
        fail(f"while one request generated (--max-queued-requests 1), others got {during}, expected 503")
    Client(url).json("POST", "/v1/completions", {"prompt": "y", "max_tokens": 2})
    print(f"busy: {len(during)} requests beside a {long_result['took']:.2f} s generation got 503 with Retry-After; "
          "then 200", flush=True)


def stdout_utf8(path):
    raw = open(path, "rb").read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"{path} is not valid UTF-8: {e}: {raw[max(0, e.start - 20):e.start + 20]!r}")
    if text.count("----- sample") < 1:
        fail(f"{path}: no samples")


if __name__ == "__main__":
    if sys.argv[1] == "vocab":
        write_vocab(sys.argv[2])
    elif sys.argv[1] == "stdout-utf8":
        stdout_utf8(sys.argv[2])
    else:  # URL STEP...: the steps in order against one server (one Python start-up)
        steps = {"utf8": check_utf8, "sweep": lambda u, n: sweep(u, int(n)), "load": lambda u, t: load(u, float(t)),
                 "busy": busy}
        for step in sys.argv[2:]:
            name, *arg = step.split("=")
            if name not in steps:
                fail(f"unknown step {step}")
            steps[name](sys.argv[1], *arg)
