"""Fixtures of the server tests.

Offline tokenizers, trained in a second on Python stdlib sources:
`tokenizer`: byte-level BPE with a ChatML template (GPT-2/Qwen/SmolLM2 style);
`sp_tokenizer`: Metaspace BPE with byte fallback (Llama-2/Mistral style), for leading-space and <0xNN> cases;
`server_tokenizer` / `server_sp_tokenizer`: the same as the HTTP process loads them (server/tokenizer.py);
`smollm2_tokenizers`: the embedded model's, both ways.

Live servers (real `python -m server serve` subprocesses on the embedded SmolLM2, CPU, free ports):
`server` (n-gram speculation) and `plain_server` (no speculation, API key, admission limit), with
`http` / `plain_http` (httpx) and `oai` / `plain_oai` (openai SDK) clients."""
from __future__ import annotations

import ctypes
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _corpus(n: int) -> list[str]:
    return sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:n]


def build_byte_level_tokenizer(folder: str, vocab_size: int = 2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(_corpus(40), trainer)  # 40 files (~1 MB) train in ~0.4 s on 2 cores; all 168 take ~2 s
    tok.save(os.path.join(folder, "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), eos_token="<|im_end|>",
                                   pad_token="<|pad|>", bos_token=None, unk_token=None, chat_template=CHATML,
                                   additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def build_sentencepiece_style_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    base.train(_corpus(8), trainers.BpeTrainer(vocab_size=800, min_frequency=2, show_progress=False))
    spec = json.loads(base.to_str())["model"]
    # Byte tokens are ordinary vocabulary entries (not special), as in Llama-2 style tokenizers.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in spec["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_byte_level_tokenizer(str(tmp_path_factory.mktemp("bpe-tokenizer")))


@pytest.fixture(scope="session")
def sp_tokenizer():
    return build_sentencepiece_style_tokenizer()


def server_tokenizer_of(hf_tokenizer, folder: str):
    """The HTTP process's tokenizer (server/tokenizer.py) of a transformers tokenizer, through the engine's
    export (engine/tokenizer_export.py), as a served model gets it."""
    from engine.tokenizer_export import export_tokenizer
    from server.tokenizer import Tokenizer

    return Tokenizer(export_tokenizer(hf_tokenizer, folder, cache_root=folder))


@pytest.fixture(scope="session")
def server_tokenizer(tokenizer, tmp_path_factory):
    """`tokenizer` as the server loads it."""
    return server_tokenizer_of(tokenizer, str(tmp_path_factory.mktemp("bpe-export")))


@pytest.fixture(scope="session")
def server_sp_tokenizer(sp_tokenizer, tmp_path_factory):
    """`sp_tokenizer` as the server loads it."""
    return server_tokenizer_of(sp_tokenizer, str(tmp_path_factory.mktemp("sp-export")))


@pytest.fixture(scope="session")
def smollm2_tokenizers(tmp_path_factory):
    """(transformers tokenizer, server tokenizer) of the embedded SmolLM2-135M-Instruct, loaded as the engine
    loads it."""
    from engine.model.embedded import embedded_model_dir
    from engine.model.loader import load_tokenizer

    hf = load_tokenizer(embedded_model_dir())
    return hf, server_tokenizer_of(hf, str(tmp_path_factory.mktemp("smollm2-export")))


# ------------------------------------------------------------------------------- live server fixtures
# Real `python -m server serve` subprocesses on the embedded SmolLM2 (CPU), each on a free port. Two per
# session at most: `server` speculates with the n-gram drafter; `plain_server` runs without speculation and
# with an API key and a small admission limit (auth, 429, and spec-vs-plain equivalence tests).

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 240  # the first start converts the embedded GGUF into the cache (~60 s on 2 cores)
PLAIN_API_KEY = "sk-test-0123456789"
PLAIN_MAX_QUEUE_LEN = 4


@dataclass
class LiveServer:
    base_url: str
    api_key: str | None
    proc: subprocess.Popen
    log_path: str
    saw_503_while_loading: bool = False

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec only calls it
except OSError:
    _LIBC = None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when pytest dies (killed by a timeout, say), so that no server
    outlives the session whatever happens to the fixtures' teardown (Linux; elsewhere teardown only)."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_dir, name: str, *flags: str, api_key: str | None = None,
                 env: dict[str, str] | None = None, kv_cache_memory: str | None = "256M",
                 model: str | None = None) -> LiveServer:
    """`api_key` goes through DDTREE_API_KEY (as a deployment should pass it: not on the command line);
    `env` adds environment variables (DDTREE_TEST_FAULT_SEED, say)."""
    import httpx

    port = free_port()
    log_path = os.path.join(str(log_dir), f"{name}.log")
    cmd = [sys.executable, "-m", "server", "serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "2048", "--log-level", "warning",
           *(["--kv-cache-memory", kv_cache_memory] if kv_cache_memory else []), *flags]
    # One intra-op thread: on a busy 2-core machine (CI running other suites, developers' runs side by side)
    # two OpenMP threads that wait for each other at every op run ~20x slower than one.
    env = {**{k: v for k, v in os.environ.items() if k not in ("DDTREE_API_KEY", "DDTREE_TEST_FAULT_SEED")},
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("DDTREE_TEST_THREADS", "1"), **(env or {})}
    if api_key:
        env["DDTREE_API_KEY"] = api_key
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                preexec_fn=_die_with_parent)
    server = LiveServer(f"http://127.0.0.1:{port}", api_key, proc, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    saw_503 = False
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode} during startup:\n{server.log_tail()}")
        try:
            status = httpx.get(server.base_url + "/health", timeout=5).status_code
            if status == 200:
                break
            saw_503 = saw_503 or status == 503
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            pytest.fail(f"{name} not healthy after {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")
        time.sleep(0.25)
    server.saw_503_while_loading = saw_503
    return server


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def engine_pid(server: LiveServer) -> int:
    """The engine process among the server's children (the other is multiprocessing's resource tracker)."""
    for pid in child_pids(server.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError("the server has no engine process")


def stop_server(server: LiveServer) -> int:
    """SIGTERM, as an orchestrator would; the engine process must go with the server."""
    children = child_pids(server.proc.pid)
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{c}") and not _is_zombie(c) for c in children):
        if time.monotonic() > deadline:
            for c in children:
                try:
                    os.kill(c, signal.SIGKILL)
                except OSError:
                    pass
            pytest.fail(f"engine process outlived the server (pids {children})")
        time.sleep(0.1)
    return server.proc.returncode


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@contextmanager
def serving(log_dir, name: str, *flags: str, **kwargs):
    """start_server() for the block's duration; the server must then stop cleanly (exit status 0)."""
    s = start_server(log_dir, name, *flags, **kwargs)
    try:
        yield s
    finally:
        code = stop_server(s)
    assert code == 0, f"{name} server exited with {code}:\n{s.log_tail()}"


# The main test server: n-gram speculation on. A small step token budget keeps trees cheap on CPU when 64 requests
# run at once.
NGRAM_SERVER_FLAGS = ("--drafter", "ngram", "--max-num-batched-tokens", "512")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The main test server (NGRAM_SERVER_FLAGS)."""
    with serving(tmp_path_factory.mktemp("server-logs"), "server", *NGRAM_SERVER_FLAGS) as s:
        yield s


@pytest.fixture(scope="session")
def plain_server(tmp_path_factory):
    """No speculation, an API key, and an admission limit of PLAIN_MAX_QUEUE_LEN engine requests."""
    import httpx

    s = start_server(tmp_path_factory.mktemp("plain-server-logs"), "plain", "--drafter", "none",
                     "--max-queue-len", str(PLAIN_MAX_QUEUE_LEN), api_key=PLAIN_API_KEY)
    try:
        yield s
        # Graceful drain: a stream in flight when SIGTERM arrives still runs to [DONE].
        body = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 24,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=s.base_url, headers=s.headers, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                s.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]", rest[-3:]
    finally:
        code = stop_server(s)
    assert code == 0, f"plain server exited with {code}:\n{s.log_tail()}"


@pytest.fixture
def http(server):
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture
def plain_http(plain_server):
    import httpx

    with httpx.Client(base_url=plain_server.base_url, timeout=120, headers=plain_server.headers) as client:
        yield client


@pytest.fixture
def oai(server):
    import openai

    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture
def plain_oai(plain_server):
    import openai

    with openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key=PLAIN_API_KEY, max_retries=0,
                       timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def model_name(server):
    import httpx

    return httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
