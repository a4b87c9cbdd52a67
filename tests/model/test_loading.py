"""How checkpoints are loaded (engine.model.loader): safetensors streamed tensor by tensor (host memory bounded by
about one tensor, sharded folders, packed experts from a file), GGUF dequantized per tensor to the target dtype,
generation_config.json and its sampling defaults, load_format="dummy", and the load log lines."""
from __future__ import annotations

import json
import logging
import os
import shutil
import weakref

import pytest
import torch

from engine.model.errors import CheckpointError
from engine.model.loader import build_model, default_sampling, load_model, read_config
from ext.metadata import build_metadata
from tests.conftest import tiny_hf_config


class LiveBytes:
    """Bytes of host tensors handed out by a reader and still alive, with the peak and the largest one."""

    def __init__(self):
        self.live = self.peak = self.total = self.largest = self.count = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.live += n
        self.total += n
        self.count += 1
        self.peak, self.largest = max(self.peak, self.live), max(self.largest, n)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.live -= n


def track_safetensors_reads(monkeypatch) -> LiveBytes:
    """Wraps safetensors.safe_open so that every tensor read from a file is tracked until it is freed."""
    import safetensors

    tracker, real = LiveBytes(), safetensors.safe_open

    class TrackedHandle:
        def __init__(self, *args, **kwargs):
            self._handle = real(*args, **kwargs)

        def __enter__(self):
            self._file = self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def get_tensor(self, name):
            return tracker.track(self._file.get_tensor(name))

        def __getattr__(self, name):
            return getattr(self._file, name)

    monkeypatch.setattr(safetensors, "safe_open", TrackedHandle)
    return tracker


def many_tensor_checkpoint(folder, num_layers=12, shards=3, seed=0) -> dict[str, torch.Tensor]:
    """A Llama checkpoint of many similar-sized fp32 tensors (12 layers: 111 tensors) in `shards` files with a
    model.safetensors.index.json; returns its state dict."""
    import transformers as tf
    from safetensors.torch import save_file

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    cfg.save_pretrained(folder)
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in tf.LlamaForCausalLM(cfg).state_dict().items()}
    state = {k: torch.randn(s, generator=g) * 0.05 + (1.0 if len(s) == 1 else 0.0) for k, s in shapes.items()}
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return state


def assert_params_equal(model, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Every parameter equals its checkpoint tensor cast to `dtype` (fused q/k/v and gate/up included)."""
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv.to(dtype))
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up.to(dtype))
    rest = {model.hf_name(n): p for n, p in model.named_parameters()
            if "qkv_proj" not in n and "gate_up_proj" not in n}
    for key, p in rest.items():
        assert p.dtype == dtype and torch.equal(p, state[key].to(dtype)), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_stream_keeps_about_one_tensor_in_host_memory(tmp_path, monkeypatch, dtype):
    state = many_tensor_checkpoint(str(tmp_path))
    tracker = track_safetensors_reads(monkeypatch)
    model = load_model(str(tmp_path), dtype).model
    assert tracker.count == len(state) and tracker.total >= 20 * tracker.largest  # many tensors were read...
    assert tracker.peak <= 2 * tracker.largest, (tracker.peak, tracker.largest)  # ...about one at a time
    assert tracker.live == 0
    assert_params_equal(model, state, dtype)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc (Linux)")
def test_resident_memory_stays_near_the_model_not_the_checkpoint(tmp_path, monkeypatch):
    """The process's resident set (anonymous memory and mapped file pages alike), sampled at every tensor read,
    grows by about the loaded model plus MAX_MAPPED_BYTES and a tensor or two, not by the checkpoint: an 88 MiB
    fp32 file loaded as bf16 (44 MiB of parameters) on the CPU."""
    import transformers as tf
    from safetensors.torch import save_file

    import engine.model.weights as weights

    cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    cfg.save_pretrained(str(tmp_path))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in tf.LlamaForCausalLM(cfg).state_dict().items()}
    save_file({k: torch.full(s, 0.01) for k, s in shapes.items()}, str(tmp_path / "model.safetensors"))
    file_bytes = os.path.getsize(tmp_path / "model.safetensors")
    monkeypatch.setattr(weights, "MAX_MAPPED_BYTES", 8 << 20)
    tracker = track_safetensors_reads(monkeypatch)
    samples = []
    real_track = tracker.track
    monkeypatch.setattr(tracker, "track", lambda t: (samples.append(rss_bytes()), real_track(t))[1])
    start = rss_bytes()
    model = load_model(str(tmp_path), "bf16").model
    samples.append(rss_bytes())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    growth = max(samples) - start
    assert file_bytes > 80 << 20 and model_bytes < 45 << 20
    print(f"RSS grew {growth >> 20} MiB for {model_bytes >> 20} MiB of parameters from a {file_bytes >> 20} MiB file")
    assert growth <= model_bytes + (8 << 20) + 3 * tracker.largest + (16 << 20), (growth >> 20, model_bytes >> 20)


def test_loader_errors_name_the_tensor_before_reading_data(tmp_path, monkeypatch):
    """Names and shapes come from the headers: a bad tensor fails the load before any tensor data is read."""
    from safetensors.torch import save_file

    many_tensor_checkpoint(str(tmp_path), num_layers=2, shards=2)
    index = tmp_path / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta["weight_map"]["extra"] = "extra.safetensors"
    index.write_text(json.dumps(meta))
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(tmp_path / "extra.safetensors"))
    tracker = track_safetensors_reads(monkeypatch)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(str(tmp_path), "fp32")
    assert tracker.count == 0
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is also stored in"):
        load_model(str(tmp_path), "fp32")


def test_packed_experts_stream_from_a_file(tiny_checkpoints, tmp_path):
    """Qwen3-MoE in HF's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) saved
    to disk loads into the same parameters as the per-expert layout save_pretrained writes."""
    from safetensors.torch import save_file

    folder, hf = tiny_checkpoints("qwen3_moe")
    packed = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in packed
    shutil.copy(os.path.join(folder, "config.json"), tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in packed.items()}, str(tmp_path / "model.safetensors"))
    ours = load_model(str(tmp_path), "fp32").model
    ref = load_model(folder, "fp32").model
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name


def test_packed_experts_beyond_the_config_are_unexpected(tiny_checkpoints, tmp_path):
    from safetensors.torch import save_file

    folder, hf = tiny_checkpoints("qwen3_moe")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.1.mlp.experts.down_proj"] = torch.zeros(9, 64, 32)  # one expert more than the config's 8
    shutil.copy(os.path.join(folder, "config.json"), tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\.mlp\.experts\.8\.down_proj"):
        load_model(str(tmp_path), "fp32")


# ---- GGUF ------------------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_gguf(tmp_path):
    from tests.model.test_gguf import _tiny_llama, _write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _tiny_llama({"rope_type": "default", "rope_theta": 10000.0}), fp16=True)
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_dequantized_per_tensor_to_the_target_dtype(tiny_gguf, monkeypatch, dtype):
    import engine.model.gguf as gguf_module
    from engine.model.gguf import load_gguf

    _, state = load_gguf(tiny_gguf)  # the whole-dict reader, float32: the reference
    tracker, real = LiveBytes(), gguf_module._dequantize
    monkeypatch.setattr(gguf_module, "_dequantize", lambda path, t: tracker.track(real(path, t)))
    model = load_model(tiny_gguf, dtype).model
    assert tracker.count == len(state) and tracker.total >= 8 * tracker.largest
    assert tracker.peak <= 2 * tracker.largest, (tracker.peak, tracker.largest)
    assert_params_equal(model, state, dtype)


def test_gguf_dummy_reads_only_the_metadata(tiny_gguf, monkeypatch):
    import engine.model.gguf as gguf_module

    def no_data(path, tensor):
        raise AssertionError("dummy loading dequantized a tensor")

    monkeypatch.setattr(gguf_module, "_dequantize", no_data)
    loaded = load_model(tiny_gguf, "fp32", load_format="dummy")
    assert loaded.hf_config["hidden_size"] == 128 and loaded.tokenizer is None
    assert torch.isfinite(forward_logits(loaded.model, list(range(12)))).all()


# ---- generation_config.json ------------------------------------------------------------------------------------

def test_generation_config_eos_and_sampling_defaults(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tiny_hf_config("llama"))
    hf.generation_config = tf.GenerationConfig(eos_token_id=[7, 9], temperature=0.6, top_p=0.9, do_sample=True)
    hf.save_pretrained(str(tmp_path))
    assert (tmp_path / "generation_config.json").is_file()
    loaded = load_model(str(tmp_path), "fp32")
    assert loaded.generation_config["eos_token_id"] == [7, 9]
    assert default_sampling(loaded.generation_config) == {"temperature": 0.6, "top_p": 0.9}

    (tmp_path / "generation_config.json").unlink()
    assert load_model(str(tmp_path), "fp32").generation_config == {}


def test_default_sampling_maps_names_and_keeps_only_present_keys():
    from engine.request import SamplingParams

    gen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
           "max_new_tokens": 512, "do_sample": True, "max_length": 4096, "eos_token_id": 2, "top_a": None}
    defaults = default_sampling(gen)
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                        "max_tokens": 512}
    assert isinstance(defaults["top_k"], int) and isinstance(defaults["max_tokens"], int)
    SamplingParams(**defaults).validate()
    assert default_sampling({}) == default_sampling(None) == {}
    assert default_sampling({"temperature": 1, "top_p": None}) == {"temperature": 1.0}


@pytest.mark.parametrize("content,field", [('{"top_p": 0}', "top_p"), ('{"temperature": "hot"}', "temperature"),
                                           ('{"eos_token_id": "x"}', "eos_token_id"), ("[1]", "JSON object"),
                                           ("{oops", "JSON")])
def test_bad_generation_config_is_one_line_naming_file_and_field(tiny_checkpoints, tmp_path, content, field):
    folder, _ = tiny_checkpoints("llama")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(folder, ckpt)
    (ckpt / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError) as e:
        load_model(str(ckpt), "fp32")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(ckpt / "generation_config.json")) and field in msg


# ---- load_format="dummy" ---------------------------------------------------------------------------------------

def forward_logits(model, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    """One prefill of `ids` through a fresh paged cache: [len(ids), vocab] fp32 logits."""
    n, bs = len(ids), 16
    nb = -(-n // bs)
    caches = [torch.zeros(model.kv_cache_shape(i, nb, bs), dtype=dtype) for i in range(model.num_layers)]
    meta = build_metadata(list(range(n)), list(range(n)), [n], [n], [list(range(nb))], bs)
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(ids), meta, caches)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_dummy_weights_from_config_alone(tmp_path, family):
    tiny_hf_config(family).save_pretrained(str(tmp_path))  # config.json only: no weights, no tokenizer
    assert os.listdir(tmp_path) == ["config.json"]
    loaded = load_model(str(tmp_path), "fp32", load_format="dummy")
    model = loaded.model
    assert loaded.tokenizer is None and loaded.generation_config == {}
    logits = forward_logits(model, list(range(1, 20)))
    assert logits.shape == (19, 1000) and torch.isfinite(logits).all() and logits.std() > 0
    params = dict(model.named_parameters())
    assert torch.equal(params["norm.weight"], torch.ones_like(params["norm.weight"]))
    assert abs(params["embed_tokens.weight"].std().item() - 0.02) < 0.002
    for name, p in params.items():
        if name.endswith("bias"):
            assert not p.any(), name
    again = load_model(str(tmp_path), "fp32", load_format="dummy").model
    for name, p in again.named_parameters():
        assert torch.equal(p, params[name]), name  # same seed, same weights


def test_dummy_seed_dtype_and_fp32_router(tmp_path):
    tiny_hf_config("deepseek_v3").save_pretrained(str(tmp_path))
    cfg = read_config(str(tmp_path))
    a = build_model(cfg, None, str(tmp_path), torch.bfloat16, "cpu", seed=0)
    b = build_model(cfg, None, str(tmp_path), torch.bfloat16, "cpu", seed=1)
    assert not torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    assert a.embed_tokens.weight.dtype == torch.bfloat16
    gate = a.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert torch.isfinite(forward_logits(a, list(range(10)), torch.bfloat16)).all()


def test_dummy_qwen3_8b_shape_builds_on_meta():
    """The benchmark shape: a Qwen3-8B config.json alone gives the 8.19B-parameter model (counted on meta)."""
    from engine.model.qwen3 import Qwen3ForCausalLM

    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
           "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
           "tie_word_embeddings": False}
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 8.19


def test_unknown_load_format_is_refused(tiny_checkpoints):
    folder, _ = tiny_checkpoints("llama")
    with pytest.raises(ValueError, match="load_format 'pt'"):
        load_model(folder, "fp32", load_format="pt")


# ---- logs ------------------------------------------------------------------------------------------------------

def test_load_logs_throughput_and_summary(tiny_checkpoints, caplog):
    folder, _ = tiny_checkpoints("llama")
    with caplog.at_level(logging.INFO, logger="ddtree.engine"):
        load_model(folder, "fp32")
    messages = [r.getMessage() for r in caplog.records if r.name == "ddtree.engine"]
    assert any(m.startswith("read 21 tensors, ") and "GB/s" in m for m in messages), messages
    summary = [m for m in messages if m.startswith(f"loaded {folder} (")]
    assert len(summary) == 1 and "(LlamaForCausalLM, " in summary[0] and " params, float32, cpu) in " in summary[0]
    assert summary[0].endswith(" s")


def test_gguf_load_logs_dequantization(tiny_gguf, caplog):
    with caplog.at_level(logging.INFO, logger="ddtree.engine"):
        load_model(tiny_gguf, "bf16")
    messages = [r.getMessage() for r in caplog.records if r.name == "ddtree.engine"]
    assert any(m.startswith("dequantized 21 GGUF tensors") and "to bfloat16" in m for m in messages), messages
    assert any(m.startswith(f"loaded {tiny_gguf} (LlamaForCausalLM, ") for m in messages), messages
